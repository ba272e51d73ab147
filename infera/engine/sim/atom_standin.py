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
"""
from __future__ import annotations

import argparse
import sys
from typing import Iterable

from infera.config import positive_int

from infera.config import json_object

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


def main(argv: Iterable[str] | None = None) -> int:
    a = build_arg_parser().parse_args(None if argv is None else list(argv))
    args = sim_args(a.model, a.served_model_name, a.host, a.server_port, a.block_size, a.speedup, a.seed)
    return run_standin(args, "vllm", f"ATOM stand-in serving on http://{a.host}:{a.server_port}")


if __name__ == "__main__":
    sys.exit(main())
