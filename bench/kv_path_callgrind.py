#!/usr/bin/env python3
"""Instructions per request of the kv-aware hot path, counted by callgrind: repeatable on a noisy box.

The same per-request calls as the server makes them (``dispatch.py``), in-process, no I/O: parse
the body, ``prepare_cached``/``prepare``, ``pick`` (with the server's pick metrics) + ``on_started``
+ ``on_finished``, the self-check (``reported_cached_tokens`` + ``observe_usage``); and round-robin's
``pick``/``on_started``/``on_finished`` for comparison. Each step's figure is the difference of
cumulative runs (steps 0..k), each run under ``valgrind --tool=callgrind`` for N and 2N requests
(start-up cancels out), ``PYTHONHASHSEED=0``. Workloads: ``short`` (router_overhead.py's eight
short chat prompts, no full block) and ``system`` (the same behind an 80-word system prompt: 6-7
blocks of 16).

    python bench/kv_path_callgrind.py                      # ~3 min; needs valgrind (Debian: valgrind)
    git archive <commit> infera bench | tar -x -C /tmp/old
    python bench/kv_path_callgrind.py --code /tmp/old      # the same against other code

Instruction counts are not times (a dict lookup and an integer add are one instruction each here
and differ 10x in cycles), but they move with the work done, and not with the other processes on
the machine: what changed between two commits shows, where a timed run on this box swings ±20 %.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
# Cumulative runs: 0 parses only, 1 adds prepare, 3 adds pick + on_started + on_finished, 4 the
# self-check. (A run that picks without finishing would let in-flight state grow, unlike the server.)
STEPS = {"parse": 0, "prepare": 1, "pick+started+finished": 3, "self-check": 4}

_PROGRAM = r'''
import sys, asyncio, json
code, workload, upto, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sys.path[:0] = [code + "/bench", code]
import kv_path as kp
from infera.api.requests import parse_request
from infera.router.dispatch import reported_cached_tokens
from infera.router.round_robin import RoundRobinPolicy
REPLY = (b'{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":"hello there"},'
         b'"finish_reason":"length"}],"usage":{"prompt_tokens":12,"completion_tokens":16,"total_tokens":28,'
         b'"prompt_tokens_details":{"cached_tokens":0}}}')
async def main():
    ws, index, bridge, policy, _ = kp.kv_fleet(2)
    rr = RoundRobinPolicy()
    system = [{"role": "system", "content": " ".join(f"word{i}" for i in range(80))}] if workload == "system" else []
    bodies = [json.dumps({"model": "m", "messages": system + [{"role": "user", "content": p}],
                          "max_tokens": 16}).encode() for p in kp.SHORT_PROMPTS]
    prepare_cached = getattr(policy, "prepare_cached", None)
    for i in range(n):
        b = bodies[i % len(bodies)]
        r = kp.chat_request(i, b, parse_request(kp.CHAT, b))
        if upto < 0:  # round-robin
            w = rr.pick(ws, r)
            rr.on_started(w, r)
            rr.on_finished(w, r)
            continue
        if upto >= 1 and (prepare_cached is None or not prepare_cached(r)):
            await policy.prepare(r)
        if upto >= 3:
            w = policy.pick(ws, r)
            policy.on_started(w, r)
            r.state["served"] = True
            policy.on_finished(w, r)
        if upto >= 4:
            bridge.observe_usage(w, r, reported_cached_tokens(REPLY))
asyncio.run(main())
'''


def instructions(code: str, workload: str, upto: int, n: int, program: str) -> int:
    env = dict(os.environ, PYTHONHASHSEED="0")
    out = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, program,
                          code, workload, str(upto), str(n)], capture_output=True, text=True, env=env, timeout=1800)
    m = re.search(r"refs:\s+([\d,]+)", out.stderr)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"callgrind run failed (rc {out.returncode}): {out.stderr[-800:]}")
    return int(m.group(1).replace(",", ""))


def per_request(code: str, workload: str, upto: int, n: int, program: str) -> int:
    return (instructions(code, workload, upto, 2 * n, program) - instructions(code, workload, upto, n, program)) // n


def main() -> None:
    p = argparse.ArgumentParser(prog="python bench/kv_path_callgrind.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--code", default=REPO, help="a folder holding the infera package (and bench/) to count")
    p.add_argument("--workloads", nargs="+", choices=("short", "system"), default=["short", "system"])
    p.add_argument("--requests", type=int, default=2000, help="N: runs of N and 2N requests are compared")
    p.add_argument("--out", default=os.path.join(BENCH_DIR, "results", "kv_path_callgrind.json"))
    a = p.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (Debian: apt-get install valgrind)")
    code = os.path.abspath(a.code)
    report: dict = {"code": code, "requests": a.requests, "workloads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        program = os.path.join(tmp, "steps.py")
        with open(program, "w") as f:
            f.write(_PROGRAM)
        for workload in a.workloads:
            cumulative = [per_request(code, workload, upto, a.requests, program) for upto in STEPS.values()]
            names = list(STEPS)
            steps = {names[0]: cumulative[0]}
            steps.update({names[k]: cumulative[k] - cumulative[k - 1] for k in range(1, len(names))})
            rr = per_request(code, workload, -1, a.requests, program) - cumulative[0]
            kv = cumulative[-1] - cumulative[0]
            report["workloads"][workload] = {"steps": steps, "kv_aware": kv, "round_robin": rr}
            print(f"[{workload}] instructions per request: "
                  + "  ".join(f"{k} {v:,}" for k, v in steps.items())
                  + f"\n  kv-aware (after parse) {kv:,}  round-robin {rr:,}  (x{kv / max(rr, 1):.1f})", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"results: {a.out}")


if __name__ == "__main__":
    main()
