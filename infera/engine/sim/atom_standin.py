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
``--kv-transfer-config`` is validated, not acted on: a prefill/decode stand-in serves complete
requests like a mixed one.

KV events come from the environment, as ATOM v0.1.5 reads it (``atom/utils/envs.py``,
``KVEventsConfig.from_env``): ``ATOM_KV_EVENTS_ENABLE=1`` with the ``zmq`` publisher
(``ATOM_KV_EVENTS_PUBLISHER``) binds ``ATOM_KV_EVENTS_ENDPOINT`` (default
``tcp://127.0.0.1:5557``) and publishes ATOM's array-form events as ``[topic, payload]``
(``ATOM_KV_EVENTS_TOPIC``, default empty: then the payload alone), ``ATOM_KV_EVENTS_HWM`` (0: no
limit) on the socket; see ``kv_events.py``.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Iterable, Mapping

from infera.config import json_object, positive_int

from .kv_events import KvEventsConfig
from .sglang_standin import add_sim_knobs, run_standin, sim_args


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infera.engine.sim.atom_standin", allow_abbrev=False,
                                description="Stand-in for atom.entrypoints.openai_server over the simulated engine.")
    p.add_argument("--model", required=True, help="model name, or a directory with tokenizer.json")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--server-port", type=int, default=8000)
    p.add_argument("-tp", "--tensor-parallel-size", dest="tp", type=positive_int, default=1)
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--kv-transfer-config", type=json_object, default=None)
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


def main(argv: Iterable[str] | None = None) -> int:
    parser = build_arg_parser()
    a = parser.parse_args(None if argv is None else list(argv))
    args = sim_args(a.model, a.served_model_name, a.host, a.server_port, a.block_size, a.speedup, a.seed)
    try:
        args.kv_events_config = atom_kv_events_config(os.environ)
    except ValueError as exc:
        parser.error(str(exc))
    return run_standin(args, "vllm", f"ATOM stand-in serving on http://{a.host}:{a.server_port}", "atom")


if __name__ == "__main__":
    sys.exit(main())
