#!/usr/bin/env python3
"""What does the JSON structure check at the door cost? ``infera.api.requests.json_structure_problem``
(nesting depth and container count, issue 11) timed on the bodies it meets. No processes, no I/O.

* ``normal``: a 730-byte streamed chat request (system + user message);
* ``long-chat``: a ~45 KB 100-message conversation full of brackets and escaped quotes in its text;
* worst cases a client can send well within the default 32 MiB body cap: ``deep`` (8 Mi ``[`` then
  8 Mi ``]``), ``many-nested`` (60 000 arrays 60 deep) and ``strings`` (2 Mi strings holding a
  ``[``). They must cost about what decoding them costs (a linear pass or a few), never seconds per
  level: their ns per byte should stay within a small factor of each other.

Each case is called ``calls`` times per run (the big bodies once); every figure is the MEDIAN over
``--runs`` runs of the mean per call (wall clock and CPU time both: the box is shared), and the
worst run is shown beside it. The goals are the bounds the unit tests used to assert (they now only
check the answers): ``normal`` ≤ 20 µs, ``long-chat`` ≤ 2 ms, each worst case ≤ 2 s.

    python bench/request_limits.py            # 5 runs, ~2 s on 2 cores
    python bench/request_limits.py --quick    # 2 runs, a tenth of the calls (smoke, < 1 s)

Writes ``--out`` (default ``bench/results/request_limits.json``). Exit status 0 when every goal
holds (median wall clock), else 1.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from infera.api.requests import MAX_JSON_CONTAINERS, MAX_JSON_DEPTH, json_structure_problem  # noqa: E402


def bodies() -> dict[str, tuple[bytes, int, float, str | None]]:
    """name → (body, calls per run, goal in seconds per call, the answer the check must give)."""
    normal = json.dumps({"model": "m", "stream": True, "max_tokens": 64,
                         "messages": [{"role": "system", "content": "You are helpful. " * 20},
                                      {"role": "user", "content": "Hello there, how are you? " * 10}]}).encode()
    long_chat = json.dumps({"model": "m", "messages": [
        {"role": "user", "content": "def f(x):\n    return {'a': [x]}  # \"q\" " * 10} for _ in range(100)]}).encode()
    too_many = f"JSON holds more than {MAX_JSON_CONTAINERS} arrays/objects"
    return {
        "normal": (normal, 20_000, 20e-6, None),
        "long-chat": (long_chat, 2_000, 2e-3, None),
        "deep": (b"[" * (8 << 20) + b"]" * (8 << 20), 1, 2.0, too_many),
        "many-nested": (b"[" + b",".join([b"[" * 60 + b"]" * 60] * 60000) + b"]", 1, 2.0, too_many),
        "strings": (b"[" + b'"[",' * (2 << 20) + b'""]', 1, 2.0, None),
    }


def timed(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """Mean wall-clock and CPU seconds per call over ``calls`` calls."""
    gc.collect()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - wall0) / calls, (time.process_time() - cpu0) / calls


def human(seconds: float) -> str:
    if seconds >= 0.1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.2f} µs"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 runs, a tenth of the calls")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "request_limits.json"))
    args = ap.parse_args()
    if args.quick:
        args.runs = 2
    cases = bodies()
    for name, (body, _, _, answer) in cases.items():  # a wrong answer makes every timing moot
        got = json_structure_problem(body)
        if got != answer:
            print(f"{name}: json_structure_problem answered {got!r}, expected {answer!r}", file=sys.stderr)
            return 1

    runs: list[dict[str, dict[str, float]]] = []
    for run in range(args.runs):
        r: dict[str, dict[str, float]] = {}
        for name, (body, calls, _, _) in cases.items():
            n = max(1, calls // 10) if args.quick else calls
            wall, cpu = timed(lambda body=body: json_structure_problem(body), n)
            r[name] = {"calls": n, "wall_s": wall, "cpu_s": cpu}
        runs.append(r)
        print(f"run {run}: " + ", ".join(f"{k} {human(v['wall_s'])}" for k, v in r.items()), flush=True)

    rows, checks, summary = [], {}, {}
    for name, (body, _, goal, _) in cases.items():
        wall = statistics.median(r[name]["wall_s"] for r in runs)
        cpu = statistics.median(r[name]["cpu_s"] for r in runs)
        worst = max(r[name]["wall_s"] for r in runs)
        ok = wall <= goal
        summary[name] = {"bytes": len(body), "wall_s": wall, "cpu_s": cpu, "worst_wall_s": worst,
                         "ns_per_byte": wall / len(body) * 1e9}
        checks[name] = {"goal_s": goal, "value_s": wall, "ok": ok}
        rows.append((name, f"{len(body):,}", human(wall), human(cpu), human(worst),
                     f"{wall / len(body) * 1e9:.2f}", f"≤ {human(goal)}", "PASS" if ok else "FAIL"))

    head = ("body", "bytes", "wall / call", "CPU / call", "worst run", "ns / byte", "goal", "")
    widths = [max(len(str(row[i])) for row in rows + [head]) for i in range(len(head))]
    print(f"\njson_structure_problem (depth ≤ {MAX_JSON_DEPTH}, ≤ {MAX_JSON_CONTAINERS:,} containers) — "
          f"median of {args.runs} runs")
    for row in [head, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())

    result = {
        "meta": {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
                 "loadavg_1m_at_end": os.getloadavg()[0], "args": vars(args),
                 "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
        "runs": runs, "median": summary, "checks": checks,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0 if all(c["ok"] for c in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
