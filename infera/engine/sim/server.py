"""Simulated vLLM engine: vLLM's OpenAI-compatible HTTP API over a timing-model "GPU".

This module owns the engine's command line (``build_arg_parser``, ``parse_args``), its hosting
(:class:`SimServer`, ``serve``, ``run_until_signalled``) and its ``python -m`` entry point; the parts
it puts together live beside it: the engine and its loop in ``engine.py`` (with ``scheduler.py``),
the HTTP handlers and ``build_app`` in ``handlers.py``, the request schemas in ``schemas.py``, the
``/metrics`` collectors in ``metrics.py`` and stop strings in ``stop_strings.py``; their public
names are importable from here too.

Run ``python -m infera.engine.sim.server --model NAME [--port 8000 --speedup 10 ...]``.

In-process use (tests, launchers)::

    args = parse_args(["--model", "m", "--port", "0", "--speedup", "100"])
    async with SimServer(args) as server:      # or: await server.start() / await server.stop()
        ...  # server.url == "http://127.0.0.1:<port>"

``--kv-events-config`` (vLLM's JSON schema) publishes the cache's real KV events over ZMQ in vLLM's
wire format, with vLLM's replay socket (see ``kv_events.py``).

``--kv-transfer-config`` (vLLM's JSON, ``NixlConnector``) makes the engine a prefill
(``kv_producer``), decode (``kv_consumer``) or either (``kv_both``) of vLLM's NIXL P/D protocol,
with a modelled transfer (``--kv-transfer-bandwidth``, ``--kv-bytes-per-token``); see ``pd.py``.

``build_app(args)`` returns the bare ``aiohttp`` application if you want to host it yourself;
run it with ``web.AppRunner(app, handler_cancellation=True)`` so a client disconnect cancels the
handler (which aborts the sequence and frees its KV blocks).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Awaitable, Callable, Iterable

from aiohttp import web

# The engine, its metrics, its handlers and its stop strings live in their own modules (see each
# one's header); their names stay importable from here, where the tests and stand-ins find them.
from .engine import OFFLOAD_TOKENIZE_BYTES, SimEngine
from .handlers import SIM_VERSION, build_app
from .kv_events import parse_kv_events_config
from .lora import add_lora_flags, check_lora_flags
from .metrics import METRICS_FLAVORS
from .pooling import add_pooling_flags, pooling_task
from .pd import (DEFAULT_KV_BYTES_PER_TOKEN, DEFAULT_KV_TRANSFER_BANDWIDTH_GBPS, VLLM_KV_HOLD_TIMEOUT_S,
                 VLLM_KV_TRANSFER_TIMEOUT_S, parse_kv_transfer_config)
from .schemas import ENGINE_KEY, ApiError
from .stop_strings import StopStringMatcher
from infera.config import non_negative_float, positive_float
from infera.runtime import install_event_loop, wait_for_shutdown_signal

__all__ = ["METRICS_FLAVORS", "OFFLOAD_TOKENIZE_BYTES", "SIM_VERSION", "ApiError", "SimEngine", "SimServer",
           "StopStringMatcher", "build_app", "build_arg_parser", "main", "parse_args", "run_until_signalled",
           "serve"]

log = logging.getLogger("infera.engine.sim.server")


# ============================================================================ CLI


def _int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def conv(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from None
        if n < lo or (hi is not None and n > hi):
            bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"must be {bound}: {value!r}")
        return n

    conv.__name__ = "int"
    return conv


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m infera.engine.sim.server",
        description="Simulated vLLM engine: vLLM's OpenAI-compatible API with a modelled GPU.",
    )
    p.add_argument("--model", required=True,
                   help="model name, or a directory with tokenizer.json [+ tokenizer_config.json]")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names the API accepts; the first is reported (default: --model)")
    p.add_argument("--host", default="0.0.0.0", help="bind address")
    p.add_argument("--port", type=_int_in(0, 65535), default=8000, help="0 picks a free port")
    p.add_argument("--block-size", type=_int_in(1), default=16, help="tokens per KV block")
    p.add_argument("--num-gpu-blocks", type=_int_in(1), default=4096, help="KV blocks in the cache")
    p.add_argument("--max-num-seqs", type=_int_in(1), default=256, help="max running sequences")
    p.add_argument("--max-num-batched-tokens", type=_int_in(1), default=8192,
                   help="uncached prompt tokens prefilled per step")
    p.add_argument("--max-model-len", type=_int_in(1), default=8192, help="prompt + output token limit")
    p.add_argument("--speedup", type=positive_float, default=1.0, help="simulated time is divided by this")
    p.add_argument("--seed", type=int, default=0, help="seed of the deterministic output")
    p.add_argument("--kv-events-config", type=parse_kv_events_config, default=None,
                   help="vLLM's KV-events config (JSON): enable_kv_cache_events, publisher (zmq), endpoint, "
                        "replay_endpoint, buffer_steps, topic")
    p.add_argument("--kv-transfer-config", type=parse_kv_transfer_config, default=None,
                   help="vLLM's KV-transfer config (JSON) for P/D: kv_connector (NixlConnector), kv_role "
                        "(kv_producer | kv_consumer | kv_both), engine_id, kv_connector_extra_config, "
                        "kv_load_failure_policy (recompute | fail)")
    p.add_argument("--kv-transfer-bandwidth", type=positive_float, default=DEFAULT_KV_TRANSFER_BANDWIDTH_GBPS,
                   help="GB/s of the simulated KV transfer between P and D")
    p.add_argument("--kv-bytes-per-token", type=_int_in(1), default=DEFAULT_KV_BYTES_PER_TOKEN,
                   help="KV bytes per token moved by a transfer (default: an 8B Llama in bf16)")
    p.add_argument("--kv-hold-timeout", type=positive_float, default=VLLM_KV_HOLD_TIMEOUT_S,
                   help="seconds a prefill holds a prompt's KV for its decode (VLLM_NIXL_ABORT_REQUEST_TIMEOUT)")
    p.add_argument("--kv-transfer-timeout", type=positive_float, default=VLLM_KV_TRANSFER_TIMEOUT_S,
                   help="seconds a decode waits for the prefill's KV before giving up")
    # -- a host KV tier (vLLM CPU offloading, SGLang HiCache, kvd behind a connector; cache.py) --
    p.add_argument("--kv-offload-blocks", type=_int_in(0), default=0,
                   help="blocks of a host-memory KV tier that keeps what the GPU cache evicts (published as KV "
                        "events with medium CPU; CPU_PINNED as SGLang); a prompt that goes on there after its GPU "
                        "hit loads those blocks instead of computing them. 0: no host tier")
    p.add_argument("--kv-offload-load-ms-per-block", type=non_negative_float, default=None,
                   help="milliseconds to load one block back from the host tier, divided by --speedup like all "
                        "modelled time (default: 5%% of prefilling a block's tokens)")
    add_pooling_flags(p)  # vLLM's --runner / --convert: a pooling model (pooling.py)
    add_lora_flags(p)  # vLLM's --enable-lora, --lora-modules, --max-loras (lora.py)
    p.add_argument("--serve-anthropic", action="store_true",
                   help="serve Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) as vLLM 0.32 "
                        "does, so the router passes such requests through instead of translating them")
    return p


def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    """Parse and validate flags; exits 2 with a message on unknown/invalid flags (like vLLM)."""
    parser = build_arg_parser()
    args = parser.parse_args(None if argv is None else list(argv))
    capacity = args.num_gpu_blocks * args.block_size
    if args.max_model_len > capacity:
        parser.error(
            f"--max-model-len ({args.max_model_len}) is larger than the maximum number of tokens that "
            f"can be stored in KV cache ({capacity} = --num-gpu-blocks x --block-size)")
    try:
        pooling_task(args)
    except ValueError as exc:
        parser.error(str(exc))
    check_lora_flags(parser, args)
    return args



# ======================================================================== hosting


class SimServer:
    """Host the app on ``args.host:args.port`` (port 0 picks a free one); ``url`` once started."""

    def __init__(self, args: argparse.Namespace, engine: SimEngine | None = None) -> None:
        self.args = args
        self.app = build_app(args, engine)
        self.engine = self.app[ENGINE_KEY]
        self.host: str = args.host
        self.port: int = args.port
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        # handler_cancellation: a client disconnect cancels its handler -> sequence aborted.
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
        try:
            # setup() runs the app's startup (the KV-event sockets bind there): a failure in it must
            # still close what startup opened before it.
            await runner.setup()
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = runner.addresses[0][1]

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> "SimServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def serve(args: argparse.Namespace) -> None:
    """Run until SIGTERM/SIGINT, then shut down gracefully."""
    server = SimServer(args)
    await server.start()
    log.info("sim engine for %s serving %s on %s:%d (speedup %g)", args.model, server.engine.model_name,
             args.host, server.port, args.speedup)
    try:
        await wait_for_shutdown_signal()
        log.info("shutting down")
    finally:
        await server.stop()


def run_until_signalled(main: Callable[[], Awaitable[None]]) -> int:
    """A simulated engine's process: serve until SIGTERM/SIGINT; 1 if it cannot bind."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    log.info("started server process [%d]", os.getpid())
    install_event_loop()
    try:
        asyncio.run(main())
    except OSError as exc:  # e.g. port in use
        log.error("cannot serve: %s", exc)
        return 1
    return 0


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    return run_until_signalled(lambda: serve(args))


if __name__ == "__main__":
    # Run as ``python -m infera.engine.sim.server`` (the launcher does) this file is ``__main__``, a
    # second copy beside the ``infera.engine.sim.server`` that other modules import (the stand-ins):
    # its classes would not be theirs. Serve from the one module everything else imports.
    from infera.engine.sim.server import main as _main

    sys.exit(_main())
