"""A stand-in for ``python -m sglang.launch_server`` on machines where SGLang cannot run.

It accepts the launch_server flags the Infera launcher reads or injects, and serves the simulated
engine (OpenAI API, ``/health``, ``/v1/models``) with SGLang's metric names under
``--enable-metrics`` (no ``/metrics`` without it, as in SGLang), logging SGLang's readiness line
once it serves. Any other flag exits 2, so a launcher that passes something unexpected is caught.
Use it through the launcher's documented override::

    python -m infera.engine.sglang --etcd-endpoint 127.0.0.1:2379 \\
        --engine-entrypoint "python -m infera.engine.sim.sglang_standin" \\
        --model-path my-model --port 30001 --page-size 16

``--disaggregation-mode prefill|decode`` speaks SGLang's bootstrap-room P/D (see ``pd.py``): a
prefill starts a bootstrap server on ``--disaggregation-bootstrap-port`` and offers each request's
KV there; a decode fetches it (``--kv-transfer-timeout``) before decoding. Both need
``bootstrap_host``/``bootstrap_port``/``bootstrap_room`` in every request (else 400).
``--disaggregation-transfer-backend`` is validated and otherwise ignored; the transfer is modelled
by ``--kv-transfer-bandwidth`` and ``--kv-bytes-per-token``. ``--kv-events-config`` with a
``"zmq"`` publisher publishes the simulated cache's real KV events in SGLang 0.5.23's format (events
as ``"type"``-tagged maps, signed 64-bit block hashes, batch ``[ts, events, dp_rank]``; see
``kv_events.py``) on ``endpoint``. The stand-in runs one engine, so
with ``--dp-size N`` only rank 0 publishes (on the endpoint's port itself).
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Iterable, Sequence

from infera.config import json_object, positive_float, positive_int
from infera.runtime import wait_for_shutdown_signal

from . import server as sim
from .kv_events import KvEventsConfig
from .pd import (DEFAULT_KV_BYTES_PER_TOKEN, DEFAULT_KV_TRANSFER_BANDWIDTH_GBPS, SGLANG_DISAGGREGATION_MODES,
                 SGLANG_KV_HOLD_TIMEOUT_S, SGLANG_KV_TRANSFER_TIMEOUT_S, SGLANG_TRANSFER_BACKENDS,
                 SglangDisaggregationConfig)

log = logging.getLogger("infera.engine.sim.sglang_standin")

SGLANG_READY_LINE = "The server is fired up and ready to roll!"
# Tokens the simulated KV cache holds whatever the page size (SGLang sizes its pool in tokens).
KV_CAPACITY_TOKENS = 65536



def add_sim_knobs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speedup", type=positive_float, default=1.0, help="simulated time is divided by this")
    p.add_argument("--seed", type=int, default=0, help="seed of the deterministic output")


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infera.engine.sim.sglang_standin", allow_abbrev=False,
                                description="Stand-in for sglang.launch_server over the simulated engine.")
    p.add_argument("--model-path", "--model", dest="model_path", required=True,
                   help="model name, or a directory with tokenizer.json")
    p.add_argument("--served-model-name", default=None, help="name the API accepts and reports (default: --model-path)")
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, default=30000, help="HTTP port")
    p.add_argument("--page-size", type=positive_int, default=1, help="tokens per KV page (the sim's block size)")
    p.add_argument("--tp-size", "--tensor-parallel-size", "--tp", dest="tp_size", type=positive_int, default=1,
                   help="tensor parallelism: accepted as SGLang takes it; the sim has no devices to split over")
    p.add_argument("--dp-size", "--data-parallel-size", "--dp", dest="dp_size", type=positive_int, default=1,
                   help="data-parallel ranks: accepted as SGLang takes it; the stand-in serves one rank")
    p.add_argument("--enable-dp-attention", action="store_true",
                   help="DP attention: accepted as SGLang takes it; the stand-in serves one rank")
    p.add_argument("--disaggregation-mode", choices=SGLANG_DISAGGREGATION_MODES, default="null",
                   help="PD role: null (mixed), prefill or decode")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998, help="0 picks a free port")
    p.add_argument("--disaggregation-transfer-backend", choices=SGLANG_TRANSFER_BACKENDS, default="mooncake",
                   help="accepted for fidelity; the simulated transfer ignores it")
    p.add_argument("--kv-transfer-bandwidth", type=positive_float, default=DEFAULT_KV_TRANSFER_BANDWIDTH_GBPS,
                   help="GB/s of the simulated KV transfer between P and D")
    p.add_argument("--kv-bytes-per-token", type=positive_int, default=DEFAULT_KV_BYTES_PER_TOKEN,
                   help="KV bytes per token moved by a transfer")
    p.add_argument("--kv-hold-timeout", type=positive_float, default=SGLANG_KV_HOLD_TIMEOUT_S,
                   help="seconds a prefill holds a room's KV for its decode (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)")
    p.add_argument("--kv-transfer-timeout", type=positive_float, default=SGLANG_KV_TRANSFER_TIMEOUT_S,
                   help="seconds a decode waits for its room's KV (SGLANG_DISAGGREGATION_WAITING_TIMEOUT)")
    p.add_argument("--enable-metrics", action="store_true", help="serve /metrics under SGLang's names")
    p.add_argument("--kv-events-config", type=json_object, default=None,
                   help="SGLang's KV-events config (JSON): publisher, endpoint, topic")
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help="accepted as SGLang takes it (the launcher may pass it); the sim's pool is fixed")
    p.add_argument("--trust-remote-code", action="store_true", help="accepted as SGLang takes it; no code is loaded")
    # Flags the launcher adds or passes through (SGLang's own; the stand-in has one node, one cache
    # format and a radix cache on decode workers either way).
    p.add_argument("--disaggregation-decode-enable-radix-cache", action="store_true",
                   help="accepted as SGLang takes it; the stand-in's decode workers always keep a prefix cache")
    p.add_argument("--kv-cache-dtype", default="auto", help="accepted as SGLang takes it; the sim has one cache format")
    p.add_argument("--node-rank", type=int, default=0,
                   help="this node's rank in a multinode engine: accepted; the stand-in is one node")
    p.add_argument("--nnodes", type=positive_int, default=1,
                   help="nodes of a multinode engine: accepted; the stand-in is one node")
    # HiCache as SGLang 0.5.23 defines it (srt/arg_groups/fields/memory.py; --infera-kvd-socket adds
    # these): accepted and validated; the stand-in's simulated cache has no storage tier behind it.
    p.add_argument("--enable-hierarchical-cache", "--enable-hicache", dest="enable_hierarchical_cache",
                   action="store_true", help="HiCache: accepted and validated; no storage tier behind the sim")
    p.add_argument("--hicache-storage-backend", default=None,
                   help="HiCache storage backend: accepted and validated, not used",
                   choices=["file", "sim", "mooncake", "npu_memcache", "hf3fs", "nixl", "aibrix", "dynamic", "eic",
                            "simm", "mori", "shm", "tensorcast", "seaweedfs"])
    p.add_argument("--hicache-storage-backend-extra-config", type=str, default=None,
                   help="JSON, or @file (as SGLang; not read here)")
    add_sim_knobs(p)
    return p


def sim_args(model: str, served: str | None, host: str, port: int, block_size: int, speedup: float,
             seed: int, extra: Sequence[str] = ()) -> argparse.Namespace:
    """The simulator's own arguments (validated by its parser) for a stand-in's settings;
    ``extra``: more simulator flags."""
    argv = ["--model", model, "--host", host, "--port", str(port), "--block-size", str(block_size),
            "--num-gpu-blocks", str(max(1, KV_CAPACITY_TOKENS // block_size)), "--speedup", str(speedup),
            "--seed", str(seed), *extra]
    if served:
        argv += ["--served-model-name", served]
    return sim.parse_args(argv)


def parse_standin_args(argv: Iterable[str] | None = None) -> tuple[argparse.Namespace, str | None]:
    """(the simulator's arguments, its metrics flavor) for a stand-in command line; exits 2 if invalid.

    In-process use (tests)::

        args, flavor = parse_standin_args([...])
        engine = sim.SimEngine(args, metrics_flavor=flavor, kv_events_format="sglang")
        async with sim.SimServer(args, engine) as server: ...  # engine.disagg.bootstrap_port once started
    """
    parser = build_arg_parser()
    a = parser.parse_args(None if argv is None else list(argv))
    transfer = ["--kv-transfer-bandwidth", str(a.kv_transfer_bandwidth), "--kv-bytes-per-token",
                str(a.kv_bytes_per_token), "--kv-hold-timeout", str(a.kv_hold_timeout),
                "--kv-transfer-timeout", str(a.kv_transfer_timeout)]
    args = sim_args(a.model_path, a.served_model_name, a.host, a.port, a.page_size, a.speedup, a.seed, transfer)
    try:
        args.kv_events_config = sglang_kv_events_config(a.kv_events_config)
    except ValueError as exc:
        parser.error(f"argument --kv-events-config: {exc}")
    if a.disaggregation_mode != "null":
        if not 0 <= a.disaggregation_bootstrap_port <= 65535:
            parser.error(f"argument --disaggregation-bootstrap-port: not a port: {a.disaggregation_bootstrap_port}")
        args.sglang_disaggregation = SglangDisaggregationConfig(
            mode=a.disaggregation_mode, bootstrap_port=a.disaggregation_bootstrap_port,
            transfer_backend=a.disaggregation_transfer_backend)
    return args, "sglang" if a.enable_metrics else None


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
    return sim.run_until_signalled(lambda: _serve(args, metrics_flavor, ready_line, kv_events_format))


def main(argv: Iterable[str] | None = None) -> int:
    args, metrics_flavor = parse_standin_args(argv)
    return run_standin(args, metrics_flavor, SGLANG_READY_LINE, "sglang")


if __name__ == "__main__":
    sys.exit(main())
