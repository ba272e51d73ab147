"""A stand-in for ``python -m sglang.launch_server`` on machines where SGLang cannot run.

It accepts the launch_server flags the Infera launcher reads or injects, and serves the simulated
engine (OpenAI API, ``/health``, ``/v1/models``) with SGLang's metric names under
``--enable-metrics`` (no ``/metrics`` without it, as in SGLang), logging SGLang's readiness line
once it serves. Any other flag exits 2, so a launcher that passes something unexpected is caught.
Use it through the launcher's documented override::

    python -m infera.engine.sglang --etcd-endpoint 127.0.0.1:2379 \\
        --engine-entrypoint "python -m infera.engine.sim.sglang_standin" \\
        --model-path my-model --port 30001 --page-size 16

PD flags are accepted and validated, not acted on: a "prefill" or "decode" stand-in serves complete
requests like a mixed one (no bootstrap server, no KV transfer). ``--kv-events-config`` with a
``"zmq"`` publisher publishes the simulated cache's real KV events in SGLang's format (events as
tagged arrays, batch ``[ts, events, dp_rank]``) on ``endpoint``. The stand-in runs one engine, so
with ``--dp-size N`` only rank 0 publishes (on the endpoint's port itself).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from typing import Iterable

from infera.config import positive_float, positive_int
from infera.runtime import wait_for_shutdown_signal

from . import server as sim
from .kv_events import KvEventsConfig

log = logging.getLogger("infera.engine.sim.sglang_standin")

SGLANG_READY_LINE = "The server is fired up and ready to roll!"
# Tokens the simulated KV cache holds whatever the page size (SGLang sizes its pool in tokens).
KV_CAPACITY_TOKENS = 65536


def _json_object(value: str) -> dict:
    try:
        obj = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return obj


def add_sim_knobs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speedup", type=positive_float, default=1.0, help="simulated time is divided by this")
    p.add_argument("--seed", type=int, default=0, help="seed of the deterministic output")


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infera.engine.sim.sglang_standin", allow_abbrev=False,
                                description="Stand-in for sglang.launch_server over the simulated engine.")
    p.add_argument("--model-path", "--model", dest="model_path", required=True,
                   help="model name, or a directory with tokenizer.json")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--page-size", type=positive_int, default=1)
    p.add_argument("--tp-size", "--tensor-parallel-size", "--tp", dest="tp_size", type=positive_int, default=1)
    p.add_argument("--dp-size", "--data-parallel-size", "--dp", dest="dp_size", type=positive_int, default=1)
    p.add_argument("--enable-dp-attention", action="store_true")
    p.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default="null")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--kv-events-config", type=_json_object, default=None)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--trust-remote-code", action="store_true")
    add_sim_knobs(p)
    return p


def sim_args(model: str, served: str | None, host: str, port: int, block_size: int, speedup: float,
             seed: int) -> argparse.Namespace:
    """The simulator's own arguments (validated by its parser) for a stand-in's settings."""
    argv = ["--model", model, "--host", host, "--port", str(port), "--block-size", str(block_size),
            "--num-gpu-blocks", str(max(1, KV_CAPACITY_TOKENS // block_size)), "--speedup", str(speedup),
            "--seed", str(seed)]
    if served:
        argv += ["--served-model-name", served]
    return sim.parse_args(argv)


def sglang_kv_events_config(obj: dict | None) -> KvEventsConfig | None:
    """SGLang's ``--kv-events-config`` (a zmq publisher alone enables events); ValueError if invalid."""
    if obj is None:
        return None
    try:
        return KvEventsConfig.from_dict(obj, sglang=True)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


async def _serve(args: argparse.Namespace, metrics_flavor: str | None, ready_line: str,
                 kv_events_format: str = "vllm") -> None:
    engine = sim.SimEngine(args, metrics_flavor=metrics_flavor, kv_events_format=kv_events_format)
    server = sim.SimServer(args, engine)
    await server.start()
    log.info("serving %s on %s:%d", engine.model_name, args.host, server.port)
    log.info("%s", ready_line)
    try:
        await wait_for_shutdown_signal()
        log.info("shutting down")
    finally:
        await server.stop()


def run_standin(args: argparse.Namespace, metrics_flavor: str | None, ready_line: str,
                kv_events_format: str = "vllm") -> int:
    """Serve the simulated engine until SIGTERM/SIGINT; 1 if it cannot bind."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    log.info("started server process [%d]", os.getpid())
    try:
        import uvloop
    except ImportError:
        uvloop = None
    try:
        if uvloop is not None:
            uvloop.run(_serve(args, metrics_flavor, ready_line, kv_events_format))
        else:
            asyncio.run(_serve(args, metrics_flavor, ready_line, kv_events_format))
    except OSError as exc:  # e.g. port in use
        log.error("cannot serve: %s", exc)
        return 1
    return 0


def main(argv: Iterable[str] | None = None) -> int:
    parser = build_arg_parser()
    a = parser.parse_args(None if argv is None else list(argv))
    args = sim_args(a.model_path, a.served_model_name, a.host, a.port, a.page_size, a.speedup, a.seed)
    try:
        args.kv_events_config = sglang_kv_events_config(a.kv_events_config)
    except ValueError as exc:
        parser.error(f"argument --kv-events-config: {exc}")
    return run_standin(args, "sglang" if a.enable_metrics else None, SGLANG_READY_LINE, "sglang")


if __name__ == "__main__":
    sys.exit(main())
