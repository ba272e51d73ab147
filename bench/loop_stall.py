#!/usr/bin/env python3
"""Does a huge prompt stall the server's event loop? ``/health`` and small chat requests timed
while 1 MiB chat prompts are routed continuously, against the same without them.

Starts, as subprocesses (the helpers of ``bench/router_overhead.py``): an embedded etcd,
``--workers`` sim workers and ``python -m infera.server`` with the kv-aware policy (which
tokenizes every prompt: the part that used to run on the event loop). Then, per run:

* ``idle``: for ``--duration`` s, this process probes ``GET /health`` every ``--probe-interval``
  and sends small chat requests one after another (a closed loop of one), timing each;
* ``1MiB``: the same probes while the load generator (``bench/_loadgen.py``, a process of its
  own, so building and sending 1 MiB bodies costs this process nothing) keeps ``--big-concurrency``
  1 MiB chat prompts in flight. The prompts are distinct and the server's token cache is off
  (``--router-tokenizer-cache-bytes 0``), so every one is tokenized: the worst case. The sim
  workers refuse them (400: longer than their context) after tokenizing them too; the router has
  routed them all the same, which is what is measured.

The table shows, per phase, the median over ``--runs`` runs of each percentile; the goal is a
``/health`` p99 of at most 50 ms under the 1 MiB load (and the small requests' p99 likewise,
though theirs includes the sim engine, which tokenizes the 1 MiB prompts on the same 2 cores).
Every run and the medians go to ``--out`` as JSON.

    python bench/loop_stall.py                    # 3 runs × (idle, 1MiB) × 10 s, ~1.5 min
    python bench/loop_stall.py --quick            # 1 run, 3 s windows
    python bench/loop_stall.py --router-tokenizer-path /tmp/tiny-llama   # a HF tokenizer in the router

Exit status: 0 when the /health goal is met and nothing failed; 1 otherwise; 2 when the fleet
could not be started.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import string
import subprocess
import sys
import time
from typing import Any

import aiohttp

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
for path in (REPO, BENCH_DIR):
    if path not in sys.path:
        sys.path.insert(0, path)

from _loadgen import percentile  # noqa: E402
from router_overhead import FleetError, Proc, _free_port, _git_commit, tree_cpu_seconds  # noqa: E402

from infera.discovery.embedded_etcd import EmbeddedEtcd  # noqa: E402

DEFAULT_OUT = os.path.join(BENCH_DIR, "results", "loop_stall.json")
MODEL = "bench-loop-stall"
GOAL_P99_MS = 50.0
PHASES = ("idle", "1MiB")
SMALL_PROMPTS = ["Hello!", "Say something short.", "What is a router?", "Count to three."]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/loop_stall.py", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workers", type=int, default=2, help="sim workers")
    p.add_argument("--runs", type=int, default=None, help="runs of (idle, 1MiB) [3; --quick: 1]")
    p.add_argument("--duration", type=float, default=None, help="seconds per phase and run [10; --quick: 3]")
    p.add_argument("--prompt-bytes", type=int, default=1 << 20, help="size of the big prompts' content")
    p.add_argument("--big-concurrency", type=int, default=2, help="big prompts in flight at once")
    p.add_argument("--probe-interval", type=float, default=0.01, help="seconds between /health probes")
    p.add_argument("--speedup", type=float, default=100.0, help="sim engine --speedup")
    p.add_argument("--router-tokenizer-path", default=None,
                   help="server --router-tokenizer-path (default: the built-in tokenizer, as the sim workers use)")
    p.add_argument("--router-prefix-chars", type=int, default=None,
                   help="server --router-prefix-chars (default: the server's default)")
    p.add_argument("--cache-bytes", type=int, default=0,
                   help="server --router-tokenizer-cache-bytes (0: every prompt tokenized; -1: the server's default)")
    p.add_argument("--ready-timeout", type=float, default=90.0)
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON results (its folder is created)")
    p.add_argument("--quick", action="store_true", help="1 run, 3 s phases")
    return p


def resolve_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.runs = args.runs if args.runs is not None else (1 if args.quick else 3)
    args.duration = args.duration if args.duration is not None else (3.0 if args.quick else 10.0)
    if args.runs < 1 or args.duration <= 0 or args.workers < 1 or args.big_concurrency < 1:
        raise SystemExit("--runs, --workers, --big-concurrency must be >= 1 and --duration > 0")
    return args


def big_bodies(args: argparse.Namespace, n: int) -> list[str]:
    """``n`` distinct chat bodies whose user message is ``--prompt-bytes`` of word-like text."""
    rng = random.Random(0)
    bodies = []
    for i in range(n):
        words, size = [f"document {i}:"], 0
        while size < args.prompt_bytes:
            w = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
            words.append(w)
            size += len(w) + 1
        content = " ".join(words)[: args.prompt_bytes]
        bodies.append(json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}],
                                  "max_tokens": 4}))
    return bodies


def summary_ms(values: list[float]) -> dict[str, Any]:
    s = sorted(values)
    ms = lambda v: None if v is None else round(v * 1000, 3)  # noqa: E731
    return {"n": len(s), "p50_ms": ms(percentile(s, 50)), "p90_ms": ms(percentile(s, 90)),
            "p99_ms": ms(percentile(s, 99)), "max_ms": ms(s[-1] if s else None)}


class Fleet:
    def __init__(self, args: argparse.Namespace, logs_dir: str) -> None:
        self.args = args
        self.logs_dir = logs_dir
        self.etcd: EmbeddedEtcd | None = None
        self.server: Proc | None = None
        self.workers: list[Proc] = []
        self.loadgen: Proc | None = None
        self.url = ""

    async def start(self) -> None:
        a, py = self.args, sys.executable
        self.etcd = EmbeddedEtcd(unsafe_no_fsync=True)
        await self.etcd.start()
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [py, "-m", "infera.server", "--workers", "1", "--host", "127.0.0.1", "--port", str(port), "--etcd-endpoint",
               self.etcd.url, "--router-policy", "kv-aware", "--log-level", "warning"]
        if a.router_tokenizer_path:
            cmd += ["--router-tokenizer-path", a.router_tokenizer_path]
        if a.router_prefix_chars is not None:
            cmd += ["--router-prefix-chars", str(a.router_prefix_chars)]
        if a.cache_bytes >= 0:
            cmd += ["--router-tokenizer-cache-bytes", str(a.cache_bytes)]
        self.server = Proc("server", cmd, os.path.join(self.logs_dir, "server.log"))
        await self.server.start()
        for i in range(a.workers):
            wport = _free_port()
            worker = Proc(f"worker{i}", [py, "-m", "infera.engine.sim", "--etcd-endpoint", self.etcd.url,
                                         "--log-level", "warning", "--drain-timeout", "3", "--drain-settle", "0.2",
                                         "--engine-stop-timeout", "5", "--model", MODEL, "--port", str(wport),
                                         "--host", "127.0.0.1", "--speedup", repr(a.speedup)],
                          os.path.join(self.logs_dir, f"worker{i}.log"))
            await worker.start()
            self.workers.append(worker)
        self.loadgen = Proc("loadgen", [py, os.path.join(BENCH_DIR, "_loadgen.py")],
                            os.path.join(self.logs_dir, "loadgen.log"))
        await self.loadgen.start(stdin=subprocess.PIPE, stdout=subprocess.PIPE, limit=64 * 1024 * 1024)
        line = await asyncio.wait_for(self.loadgen.proc.stdout.readline(), 30)
        if not line or not json.loads(line).get("ready"):
            raise FleetError(f"the load generator did not start; log:\n{self.loadgen.log_tail()}")

    def check_alive(self) -> None:
        for p in [self.server, *self.workers, self.loadgen]:
            if p is not None and not p.alive:
                raise FleetError(f"{p.name} exited (code {p.proc.returncode}); log {p.log_path}:\n{p.log_tail()}")

    async def wait_ready(self, session: aiohttp.ClientSession) -> None:
        deadline = time.monotonic() + self.args.ready_timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                async with session.get(self.url + "/v1/workers", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    workers = (await r.json())["workers"]
                if sum(w["status"] == "active" and w["model_name"] == MODEL for w in workers) >= self.args.workers:
                    return
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, KeyError):
                pass
            await asyncio.sleep(0.2)
        raise FleetError(f"{self.url} did not list {self.args.workers} active workers in {self.args.ready_timeout}s")

    async def stop(self) -> None:
        if self.loadgen is not None and self.loadgen.alive and self.loadgen.proc.stdin is not None:
            try:
                self.loadgen.proc.stdin.write(b'{"cmd": "quit"}\n')
                await self.loadgen.proc.stdin.drain()
                self.loadgen.proc.stdin.close()
                await asyncio.wait_for(self.loadgen.proc.wait(), 3)
            except (OSError, asyncio.TimeoutError, ConnectionError):
                pass
        if self.loadgen is not None:
            await self.loadgen.stop(3)
        await asyncio.gather(*(w.stop(15) for w in self.workers))
        if self.server is not None:
            await self.server.stop(10)
        if self.etcd is not None:
            await self.etcd.stop()

    def roles(self) -> dict[int, str]:
        out = {}
        for role, procs in (("server", [self.server]), ("workers", self.workers), ("loadgen", [self.loadgen])):
            for p in procs:
                if p is not None and p.proc is not None:
                    out[p.proc.pid] = role
        return out


async def probe(session: aiohttp.ClientSession, url: str, args: argparse.Namespace, until: float) -> dict:
    """/health every ``--probe-interval`` and small chats back to back, until ``until``."""
    health: list[float] = []
    small: list[float] = []
    errors: list[str] = []
    clock = time.perf_counter

    async def health_loop() -> None:
        next_at = clock()
        while clock() < until:
            start = clock()
            try:
                async with session.get(url + "/health") as r:
                    await r.read()
                    if r.status != 200:
                        errors.append(f"/health {r.status}")
            except Exception as exc:  # counted, reported
                errors.append(f"/health {type(exc).__name__}: {exc}")
            health.append(clock() - start)
            next_at += args.probe_interval
            await asyncio.sleep(max(0.0, next_at - clock()))

    async def small_loop() -> None:
        i = 0
        while clock() < until:
            body = {"model": MODEL, "messages": [{"role": "user", "content": SMALL_PROMPTS[i % len(SMALL_PROMPTS)]}],
                    "max_tokens": 4}
            i += 1
            start = clock()
            try:
                async with session.post(url + "/v1/chat/completions", json=body) as r:
                    await r.read()
                    if r.status != 200:
                        errors.append(f"small chat {r.status}")
                        continue
            except Exception as exc:
                errors.append(f"small chat {type(exc).__name__}: {exc}")
                continue
            small.append(clock() - start)

    await asyncio.gather(health_loop(), small_loop())
    return {"health": summary_ms(health), "small": summary_ms(small), "errors": len(errors),
            "error_samples": errors[:5]}


async def run_phase(fleet: Fleet, session: aiohttp.ClientSession, phase: str, bodies: list[str]) -> dict:
    a = fleet.args
    roles = fleet.roles()
    cpu_before, wall_before = tree_cpu_seconds(roles), time.perf_counter()
    big: dict | None = None
    if phase == "1MiB":
        proc = fleet.loadgen.proc
        job = {"cmd": "run", "urls": [fleet.url + "/v1/chat/completions"], "concurrency": a.big_concurrency,
               "stream": False, "requests": 10 ** 9, "duration": a.duration + 0.5, "warmup": 0.5,
               "bodies": bodies, "request_timeout": 120}
        proc.stdin.write((json.dumps(job) + "\n").encode())
        await proc.stdin.drain()
        await asyncio.sleep(1.0)  # the warm-up: the first big prompts are in flight before probing
    result = await probe(session, fleet.url, a, time.perf_counter() + a.duration)
    if phase == "1MiB":
        line = await asyncio.wait_for(fleet.loadgen.proc.stdout.readline(), a.duration + 180)
        if not line:
            raise FleetError(f"the load generator exited; log:\n{fleet.loadgen.log_tail()}")
        lg = json.loads(line)
        if "fatal" in lg:
            raise FleetError(f"the load generator failed: {lg['fatal']}")
        # The sim workers refuse 1 MiB prompts (longer than their context): a 400 after routing.
        samples = lg.get("error_samples") or []
        routed = lg["completed"] + lg["errors_measured"]
        unexpected = [s for s in samples if "HTTP 400" not in s]
        big = {"routed": routed, "routed_per_s": round(routed / lg["elapsed_s"], 2) if lg["elapsed_s"] else None,
               "unexpected_error_samples": unexpected}
        result["big"] = big
    cpu_after = tree_cpu_seconds(roles)
    if cpu_before is not None and cpu_after is not None:
        wall = time.perf_counter() - wall_before
        result["cpu_cores"] = {k: round((cpu_after[k] - cpu_before[k]) / wall, 3) for k in cpu_before}
    result["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return result


def median_of(runs: list[dict], *path: str) -> float | None:
    vals = []
    for r in runs:
        v: Any = r
        for p in path:
            v = (v or {}).get(p)
        if v is not None:
            vals.append(v)
    return round(statistics.median(vals), 3) if vals else None


def render(cells: dict[str, dict]) -> str:
    head = (f"{'phase':>6} | {'/health p50':>11} {'p99':>8} {'max':>8} | {'small p50':>9} {'p99':>8} {'max':>8} | "
            f"{'1MiB routed/s':>13} | {'server cores':>12} | {'errors':>6}")
    lines = [head, "-" * len(head)]
    f = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
    for phase, c in cells.items():
        lines.append(f"{phase:>6} | {f(c['health_p50_ms']):>11} {f(c['health_p99_ms']):>8} "
                     f"{f(c['health_max_ms']):>8} | {f(c['small_p50_ms']):>9} {f(c['small_p99_ms']):>8} {f(c['small_max_ms']):>8} | "
                     f"{f(c.get('big_routed_per_s')):>13} | {f(c.get('server_cores')):>12} | {c['errors']:>6}")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> int:
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    logs_dir = os.path.splitext(os.path.abspath(args.out))[0] + "_logs"
    os.makedirs(logs_dir, exist_ok=True)
    fleet = Fleet(args, logs_dir)
    bodies = big_bodies(args, 4)
    runs: list[dict] = []
    meta = {"args": {k: v for k, v in vars(args).items()}, "cpus": os.cpu_count(), "python": platform.python_version(),
            "commit": _git_commit(), "loadavg_before": os.getloadavg()}
    try:
        await fleet.start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            await fleet.wait_ready(session)
            print(f"fleet up: server {fleet.url} (pid {fleet.server.proc.pid}), {args.workers} sim workers", flush=True)
            for i in range(args.runs):
                for phase in PHASES:
                    fleet.check_alive()
                    r = await run_phase(fleet, session, phase, bodies)
                    r.update(run=i, phase=phase)
                    runs.append(r)
                    big = r.get("big") or {}
                    print(f"run {i} {phase:>5}: /health p50 {r['health']['p50_ms']} p99 {r['health']['p99_ms']} ms, "
                          f"small p50 {r['small']['p50_ms']} p99 {r['small']['p99_ms']} ms"
                          + (f", 1MiB routed {big.get('routed')}" if big else ""), flush=True)
    except FleetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        await fleet.stop()
    cells: dict[str, dict] = {}
    for phase in PHASES:
        rs = [r for r in runs if r["phase"] == phase]
        cells[phase] = {
            **{f"{what}_{q}_ms": median_of(rs, what, f"{q}_ms") for what in ("health", "small")
               for q in ("p50", "p90", "p99", "max")},
            "big_routed_per_s": median_of(rs, "big", "routed_per_s"),
            "server_cores": median_of(rs, "cpu_cores", "server"),
            "errors": sum(r["errors"] for r in rs),
            "unexpected_big_errors": sum(len((r.get("big") or {}).get("unexpected_error_samples") or []) for r in rs),
            "runs": len(rs)}
    loaded = cells["1MiB"]
    ok = (loaded["health_p99_ms"] is not None and loaded["health_p99_ms"] <= GOAL_P99_MS
          and not any(c["errors"] or c["unexpected_big_errors"] for c in cells.values()))
    print()
    print(f"medians over {args.runs} run(s), {args.duration:g} s per phase; big prompts: "
          f"{args.prompt_bytes} B × {args.big_concurrency} in flight")
    print(render(cells))
    small_ok = loaded["small_p99_ms"] is not None and loaded["small_p99_ms"] <= GOAL_P99_MS
    print(f"\n/health p99 under 1MiB prompts: {loaded['health_p99_ms']} ms (goal ≤ {GOAL_P99_MS:g}): "
          f"{'PASS' if ok else 'FAIL'}; small requests p99: {loaded['small_p99_ms']} ms "
          f"({'≤' if small_ok else '>'} {GOAL_P99_MS:g})")
    meta["loadavg_after"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "runs": runs, "cells": cells, "goal_p99_ms": GOAL_P99_MS, "pass": ok}, f, indent=1)
    print(f"results: {args.out}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> None:
    args = resolve_args(argv)
    loop = asyncio.new_event_loop()
    task = loop.create_task(run(args))
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        code = loop.run_until_complete(task)
    except asyncio.CancelledError:
        code = 130
    finally:
        loop.close()
    sys.exit(code)


if __name__ == "__main__":
    main()
