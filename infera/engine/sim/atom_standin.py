"""A stand-in for ``python -m atom.entrypoints.openai_server`` on machines where ATOM cannot run.

It accepts the ATOM flags the Infera launcher reads or injects and serves the simulated engine
(OpenAI API, ``/health``, ``/v1/models``) on ``--server-port``; ``--port`` (ATOM's internal torch
MASTER_PORT) is accepted and unused. Any other flag exits 2. Use it through the launcher's
documented override::

    python -m infera.engine.atom --etcd-endpoint 127.0.0.1:2379 \\
        --engine-entrypoint "python -m infera.engine.sim.atom_standin" \\
        --model my-model --server-port 8001

``/metrics`` keeps the simulator's vLLM names. The ATOM launcher never reads them (ATOM has no
drain), so a test can tell a drain skipped by design from one skipped for want of a metric.
``--kv-transfer-config`` with ``"kv_connector": "mooncake"`` speaks ATOM v0.1.5's Mooncake PD on
``/v1/completions`` and ``/v1/chat/completions`` alike (``atom_pd.py``): a ``kv_producer`` serves
each ``do_remote_decode`` request's KV on its ``handshake_port`` (6301; 0 picks a free one) and
answers with ATOM's handoff, a consumer takes the KV for ``do_remote_prefill`` requests from the
address in it. Requests without ``kv_transfer_params`` are served whole, as by a mixed engine.

KV events come from the environment, as ATOM v0.1.5 reads it (``atom/utils/envs.py``,
``KVEventsConfig.from_env``): ``ATOM_KV_EVENTS_ENABLE=1`` with the ``zmq`` publisher
(``ATOM_KV_EVENTS_PUBLISHER``) binds ``ATOM_KV_EVENTS_ENDPOINT`` (default
``tcp://127.0.0.1:5557``) and publishes ATOM's array-form events as ``[topic, payload]``
(``ATOM_KV_EVENTS_TOPIC``, default empty: then the payload alone), ``ATOM_KV_EVENTS_HWM`` (0: no
limit) on the socket; see ``kv_events.py``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Iterable, Mapping

from infera.config import json_object, positive_int

from infera.runtime import wait_for_shutdown_signal

from . import server as sim
from .atom_pd import AtomKvTransferConfig, AtomMooncakeDisaggregation
from .kv_events import KvEventsConfig
from .pd import KvLink
from .sglang_standin import add_sim_knobs, sim_args

log = logging.getLogger("infera.engine.sim.atom_standin")

ATOM_READY_LINE = "ATOM stand-in serving on http://{host}:{port}"


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infera.engine.sim.atom_standin", allow_abbrev=False,
                                description="Stand-in for atom.entrypoints.openai_server over the simulated engine.")
    p.add_argument("--model", required=True, help="model name, or a directory with tokenizer.json")
    p.add_argument("--served-model-name", default=None, help="name the API accepts and reports (default: --model)")
    p.add_argument("--host", default="0.0.0.0", help="bind address (ATOM's --host)")
    p.add_argument("--server-port", type=int, default=8000, help="HTTP port (ATOM's --server-port)")
    p.add_argument("-tp", "--tensor-parallel-size", dest="tp", type=positive_int, default=1,
                   help="ATOM's tensor parallelism: recorded in the PD parameters; no effect on the sim")
    p.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV block")
    p.add_argument("--kv-transfer-config", type=json_object, default=None,
                   help="ATOM's KV-transfer config (JSON): its kv_role makes the stand-in a PD prefill or decode")
    p.add_argument("--port", type=int, default=None, help="ATOM's internal torch MASTER_PORT (unused here)")
    add_sim_knobs(p)
    return p


def atom_kv_events_config(environ: Mapping[str, str]) -> KvEventsConfig | None:
    """ATOM's KV-event settings from its environment; None when it would publish nothing.
    ValueError for a value ATOM would fail on (a non-integer HWM or buffer size)."""
    if environ.get("ATOM_KV_EVENTS_ENABLE", "0") != "1":
        return None
    publisher = environ.get("ATOM_KV_EVENTS_PUBLISHER", "zmq")
    if publisher == "null":
        return None
    if publisher != "zmq":
        raise ValueError(f"ATOM_KV_EVENTS_PUBLISHER={publisher!r}: ATOM knows only 'zmq' and 'null'")
    try:
        hwm = int(environ.get("ATOM_KV_EVENTS_HWM", "0") or "0")
        buffer_steps = int(environ.get("ATOM_KV_EVENTS_BUFFER_STEPS", "10000") or "10000")
    except ValueError as exc:
        raise ValueError(f"ATOM_KV_EVENTS_HWM / ATOM_KV_EVENTS_BUFFER_STEPS: {exc}") from None
    if hwm < 0 or buffer_steps < 1:
        raise ValueError("ATOM_KV_EVENTS_HWM must be >= 0 and ATOM_KV_EVENTS_BUFFER_STEPS >= 1")
    return KvEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                          endpoint=environ.get("ATOM_KV_EVENTS_ENDPOINT", "tcp://127.0.0.1:5557"),
                          topic=environ.get("ATOM_KV_EVENTS_TOPIC", ""), hwm=hwm, buffer_steps=buffer_steps)


def parse_standin_args(argv: Iterable[str] | None = None, environ: Mapping[str, str] | None = None
                       ) -> tuple[argparse.Namespace, AtomKvTransferConfig | None, int]:
    """(the simulator's arguments, the Mooncake PD config or None, the TP size) for a stand-in
    command line; exits 2 if invalid. In-process use (tests)::

        args, pd_config, tp = parse_standin_args([...])
        engine = atom_engine(args, pd_config, tp)
        async with sim.SimServer(args, engine) as server: ...  # engine.disagg.handshake_port once started
    """
    parser = build_arg_parser()
    a = parser.parse_args(None if argv is None else list(argv))
    args = sim_args(a.model, a.served_model_name, a.host, a.server_port, a.block_size, a.speedup, a.seed)
    try:
        args.kv_events_config = atom_kv_events_config(os.environ if environ is None else environ)
    except ValueError as exc:
        parser.error(str(exc))
    pd_config = None
    if a.kv_transfer_config is not None:
        try:
            pd_config = AtomKvTransferConfig.from_dict(a.kv_transfer_config)
        except ValueError as exc:
            parser.error(f"argument --kv-transfer-config: {exc}")
    return args, pd_config, a.tp


def atom_engine(args: argparse.Namespace, pd_config: AtomKvTransferConfig | None, tp_size: int = 1) -> sim.SimEngine:
    """The simulated engine as ATOM: vLLM metric names, ATOM's KV-event layout and Mooncake PD."""
    engine = sim.SimEngine(args, metrics_flavor="vllm", kv_events_format="atom")
    if pd_config is not None:
        link = KvLink(bandwidth_gbps=args.kv_transfer_bandwidth, bytes_per_token=args.kv_bytes_per_token,
                      speedup=args.speedup, hold_timeout_s=args.kv_hold_timeout,
                      transfer_timeout_s=args.kv_transfer_timeout)
        flush = engine.kv_events.flush if engine.kv_events is not None else None
        engine.disagg = AtomMooncakeDisaggregation(pd_config, engine.cache, link, args.host, tp_size, flush)
    return engine


async def _serve(args: argparse.Namespace, pd_config: AtomKvTransferConfig | None, tp_size: int) -> None:
    engine = atom_engine(args, pd_config, tp_size)
    server = sim.SimServer(args, engine)
    await server.start()
    log.info(ATOM_READY_LINE.format(host=args.host, port=server.port))
    try:
        await wait_for_shutdown_signal()
        log.info("shutting down")
    finally:
        await server.stop()


def main(argv: Iterable[str] | None = None) -> int:
    args, pd_config, tp_size = parse_standin_args(argv)
    return sim.run_until_signalled(lambda: _serve(args, pd_config, tp_size))


if __name__ == "__main__":
    sys.exit(main())
