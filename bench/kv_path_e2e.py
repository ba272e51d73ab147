#!/usr/bin/env python3
"""kv-aware against round-robin end to end: the same sim workers, one server at a time, interleaved.

One embedded etcd, ``--workers`` sim workers (``--speedup 1000``, router_overhead.py's short chat
prompts), the ``_loadgen.py`` load generator, and per window a fresh
``python -m infera.server --router-policy <policy>`` (one server at a time: the kv-aware server's
KV-event work never lands in a round-robin window). The windows of a cell alternate which policy
goes first. Reported per (c, stream): medians over runs of req/s, latency p50 and the server's
CPU µs per request (its process tree, warm-up included), kv-aware − round-robin p50 and
kv-aware ÷ round-robin req/s, also paired per run (the two windows of one run, back to back).

``--code DIR``: the servers run the ``infera`` package found in DIR (e.g. an older commit,
``git archive <commit> infera | tar -x -C DIR``); the workers and this script use this checkout's.
``--profile DIR``: ``py-spy record -f raw`` of every server window (``SPY_ARGS`` overrides
``--nonblocking``, e.g. ``--native``).

    python bench/kv_path_e2e.py                          # c=16 and 64, unary, 3 runs: ~2 min
    python bench/kv_path_e2e.py --server-args "--workers 1" --out bench/results/kv_path_e2e.json

Exit status 0 when both goals hold (kv-aware adds <= 0.3 ms p50 at c=16 and keeps >= 0.9x
round-robin's req/s at c=64, medians), 1 otherwise, 2 when the fleet could not start.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import signal
import subprocess
import sys
import time
from typing import Any

import aiohttp

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
for p in (REPO, BENCH_DIR):
    if p not in sys.path:
        sys.path.insert(0, p)

from infera.discovery.embedded_etcd import EmbeddedEtcd  # noqa: E402
from router_overhead import FleetError, Proc, _free_port, tree_cpu_seconds  # noqa: E402

MODEL = "infera-sim"
PROMPTS = [
    "Hello!", "Say something short.", "What is a router?", "Count to three.",
    "Name a colour.", "Tell me a fact.", "Why is the sky blue?", "Summarise: benchmarks are useful.",
]


def bodies(stream: bool, max_tokens: int) -> list[str]:
    out = []
    for prompt in PROMPTS:
        body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                                "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        out.append(json.dumps(body, separators=(",", ":")))
    return out


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name of ``pid`` (Linux /proc)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        name = raw[raw.index(b"(") + 1:raw.rindex(b")")].decode(errors="replace")
        fields = raw.rsplit(b")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


async def kv_event_totals(url: str) -> dict[str, float]:
    """The server's KV-event batches, block events and their CPU seconds, summed over targets
    (a round-robin server subscribes to none: zeros)."""
    want = {"infera_kv_event_batches_total": "batches", "infera_kv_block_events_total": "block_events",
            "infera_kv_event_cpu_seconds_total": "cpu_s"}
    out = dict.fromkeys(want.values(), 0.0)
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            text = await r.text()
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in want:
            out[want[name]] += float(line.rsplit(" ", 1)[1])
    return out


class E2E:
    def __init__(self, a: argparse.Namespace, logs: str) -> None:
        self.a = a
        self.logs = logs
        self.etcd: EmbeddedEtcd | None = None
        self.workers: list[Proc] = []
        self.loadgen: Proc | None = None
        self.py = sys.executable

    async def start(self) -> None:
        self.etcd = EmbeddedEtcd(unsafe_no_fsync=True)
        await self.etcd.start()
        for i in range(self.a.workers):
            port = _free_port()
            cmd = [self.py, "-m", "infera.engine.sim", "--etcd-endpoint", self.etcd.url, "--log-level", "warning",
                   "--drain-timeout", "3", "--drain-settle", "0.2", "--engine-stop-timeout", "5",
                   "--model", MODEL, "--port", str(port), "--host", "127.0.0.1",
                   "--speedup", "1000", "--max-num-seqs", "256"]
            w = Proc(f"worker{i}", cmd, os.path.join(self.logs, f"worker{i}.log"))
            await w.start()
            self.workers.append(w)
        self.loadgen = Proc("loadgen", [self.py, os.path.join(BENCH_DIR, "_loadgen.py")],
                            os.path.join(self.logs, "loadgen.log"))
        await self.loadgen.start(stdin=subprocess.PIPE, stdout=subprocess.PIPE, limit=64 * 1024 * 1024)
        line = await asyncio.wait_for(self.loadgen.proc.stdout.readline(), 30)
        if not line or not json.loads(line).get("ready"):
            raise FleetError("the load generator did not start")

    async def server(self, policy: str, tag: str) -> tuple[Proc, str]:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        launch = ["-m", "infera.server"]
        if self.a.code:  # another infera package for the server only
            launch = ["-c", f"import runpy, sys; sys.path.insert(0, {os.path.abspath(self.a.code)!r}); "
                            "runpy.run_module('infera.server', run_name='__main__', alter_sys=True)"]
        # One process (the default is one per core): this measures a server, not a supervisor. Older
        # code given by --code has no --workers flag and is one process anyway.
        single = [] if self.a.code else ["--workers", "1"]
        proc = Proc(f"server-{tag}", [self.py, *launch, *single, "--host", "127.0.0.1", "--port", str(port),
                                      "--etcd-endpoint", self.etcd.url, "--router-policy", policy,
                                      "--log-level", "warning", *self.a.server_args.split()],
                    os.path.join(self.logs, f"server-{tag}.log"))
        await proc.start()
        deadline = time.monotonic() + 60
        async with aiohttp.ClientSession() as s:
            while True:
                if not proc.alive:
                    raise FleetError(f"server exited: {proc.log_tail()}")
                try:
                    async with s.get(url + "/v1/workers", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        ws = (await r.json())["workers"]
                    if sum(1 for w in ws if w["status"] == "active") >= self.a.workers:
                        break
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, KeyError):
                    pass
                if time.monotonic() > deadline:
                    raise FleetError("server did not list the workers")
                await asyncio.sleep(0.1)
            for body in bodies(False, 4)[:2]:  # preflight
                async with s.post(url + "/v1/chat/completions", data=body,
                                  headers={"Content-Type": "application/json"}) as r:
                    if r.status != 200:
                        raise FleetError(f"preflight: HTTP {r.status} {await r.text()}")
        await asyncio.sleep(0.5)  # let KV-event subscriptions settle
        return proc, url

    async def window(self, policy: str, c: int, stream: bool, tag: str) -> dict:
        a = self.a
        proc, url = await self.server(policy, tag)
        spy = None
        try:
            if a.profile:
                spy_out = os.path.join(a.profile, f"{tag}.raw")
                spy = subprocess.Popen([os.path.join(os.path.dirname(self.py), "py-spy"), "record", "-r", "500",
                                        "-f", "raw", "-o", spy_out, "-p", str(proc.proc.pid), *os.environ.get("SPY_ARGS", "--nonblocking").split()],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            roles = {proc.proc.pid: "server", self.loadgen.proc.pid: "loadgen"}
            for i, w in enumerate(self.workers):
                roles[w.proc.pid] = "workers"
            job = {"cmd": "run", "urls": [url + "/v1/chat/completions"], "concurrency": c, "stream": stream,
                   "requests": a.requests, "duration": a.duration, "warmup": a.warmup,
                   "bodies": bodies(stream, a.max_tokens)}
            before = tree_cpu_seconds(roles)
            threads_before = thread_cpu(proc.proc.pid)
            self.loadgen.proc.stdin.write((json.dumps(job) + "\n").encode())
            await self.loadgen.proc.stdin.drain()
            line = await asyncio.wait_for(self.loadgen.proc.stdout.readline(), a.warmup + a.duration + 120)
            after = tree_cpu_seconds(roles)
            threads_after = thread_cpu(proc.proc.pid)
            res = json.loads(line)
            res["kv_events"] = await kv_event_totals(url)
            res["server_threads_s"] = {k: round(v - threads_before.get(k, 0.0), 3) for k, v in threads_after.items()}
            n = res["completed"] + res["warmup_requests"]
            if before and after and n:
                res["cpu_us_per_req"] = {k: round((after[k] - before[k]) / n * 1e6, 1) for k in before}
        finally:
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                try:
                    spy.wait(10)
                except subprocess.TimeoutExpired:
                    spy.kill()
            await proc.stop(10)
        return res

    async def stop(self) -> None:
        if self.loadgen is not None and self.loadgen.alive:
            try:
                self.loadgen.proc.stdin.write(b'{"cmd": "quit"}\n')
                await self.loadgen.proc.stdin.drain()
            except (OSError, ConnectionError):
                pass
            await self.loadgen.stop(3)
        await asyncio.gather(*(w.stop(15) for w in self.workers))
        if self.etcd is not None:
            await self.etcd.stop()


def _med(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 3) if vals else None


async def run(a: argparse.Namespace) -> dict:
    logs = os.path.splitext(os.path.abspath(a.out))[0] + "_logs"
    os.makedirs(logs, exist_ok=True)
    if a.profile:
        os.makedirs(a.profile, exist_ok=True)
    e = E2E(a, logs)
    rows: list[dict] = []
    policies = ("round-robin", "kv-aware")
    try:
        await e.start()
        k = 0
        for run_i in range(a.runs):
            for c in a.concurrency:
                for stream in a.streams:
                    order = policies if k % 2 == 0 else policies[::-1]
                    k += 1
                    for policy in order:
                        tag = f"{policy}-c{c}-{'s' if stream else 'u'}-r{run_i}"
                        res = await e.window(policy, c, stream, tag)
                        res.update(policy=policy, concurrency=c, stream=stream, run=run_i)
                        rows.append(res)
                        ev, n = res["kv_events"], max(1, res["completed"] + res["warmup_requests"])
                        print(f"  run {run_i + 1} c={c:<3} {'stream' if stream else 'unary ':<6} {policy:<12} "
                              f"{res['rps']:>8.1f} req/s p50 {res['lat_p50_ms']:.2f} ms  server "
                              f"{res.get('cpu_us_per_req', {}).get('server')} µs/req  errors {res['errors']}  "
                              f"kv events/req {ev['batches'] / n:.2f} batches {ev['block_events'] / n:.2f} blocks "
                              f"{ev['cpu_s'] / n * 1e6:.1f} µs",
                              flush=True)
    finally:
        await e.stop()
    cells = []
    for c in a.concurrency:
        for stream in a.streams:
            cell: dict[str, Any] = {"concurrency": c, "stream": stream}
            for policy in policies:
                rs = [r for r in rows if r["policy"] == policy and r["concurrency"] == c and r["stream"] == stream]
                cell[policy] = {"rps": _med([r["rps"] for r in rs]), "p50_ms": _med([r["lat_p50_ms"] for r in rs]),
                                "p99_ms": _med([r["lat_p99_ms"] for r in rs]),
                                "server_us_per_req": _med([r.get("cpu_us_per_req", {}).get("server") for r in rs]),
                                "errors": sum(r["errors"] for r in rs)}
            kv, rr = cell["kv-aware"], cell["round-robin"]
            cell["delta_p50_ms"] = round(kv["p50_ms"] - rr["p50_ms"], 3) if kv["p50_ms"] and rr["p50_ms"] else None
            cell["rps_ratio"] = round(kv["rps"] / rr["rps"], 3) if kv["rps"] and rr["rps"] else None
            # paired per run: the same run's two windows, back to back
            pairs = []
            for run_i in range(a.runs):
                x = [r for r in rows if r["run"] == run_i and r["concurrency"] == c and r["stream"] == stream]
                byp = {r["policy"]: r for r in x}
                if len(byp) == 2:
                    pairs.append((byp["kv-aware"]["lat_p50_ms"] - byp["round-robin"]["lat_p50_ms"],
                                  byp["kv-aware"]["rps"] / byp["round-robin"]["rps"]))
            cell["paired_delta_p50_ms"] = _med([p[0] for p in pairs])
            cell["paired_rps_ratio"] = _med([p[1] for p in pairs])
            cells.append(cell)
    return {"rows": rows, "cells": cells}


def render(cells: list[dict]) -> str:
    lines = ["   c stream |  rr req/s  rr p50 | kv req/s  kv p50 | Δp50 ms  kv/rr | paired Δp50  kv/rr "
             "| server µs/req rr   kv"]
    for cell in cells:
        rr, kv = cell["round-robin"], cell["kv-aware"]
        lines.append(f"{cell['concurrency']:>4} {'yes' if cell['stream'] else 'no':>6} | {rr['rps']:>8.1f} "
                     f"{rr['p50_ms']:>7.2f} | {kv['rps']:>8.1f} {kv['p50_ms']:>7.2f} | {cell['delta_p50_ms']:>+7.2f} "
                     f"{cell['rps_ratio']:>6.3f} | {cell['paired_delta_p50_ms']:>+11.2f} {cell['paired_rps_ratio']:>6.3f} "
                     f"| {rr['server_us_per_req']!s:>16} {kv['server_us_per_req']!s:>6}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/kv_path_e2e.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="sim workers")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--stream", choices=("no", "yes", "both"), default="no")
    p.add_argument("--requests", type=int, default=50000, help="cap per measured window")
    p.add_argument("--duration", type=float, default=4.0, help="measured seconds per window")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--server-args", default="", help="more server flags, e.g. \"--workers 1\"")
    p.add_argument("--code", default=None, help="a folder holding the infera package the servers run")
    p.add_argument("--profile", default=None, help="py-spy raw profiles of the server windows go here")
    p.add_argument("--out", default=os.path.join(BENCH_DIR, "results", "kv_path_e2e.json"))
    a = p.parse_args(argv)
    a.streams = {"no": [False], "yes": [True], "both": [False, True]}[a.stream]
    print(f"kv_path_e2e: {a.workers} sim workers, c={a.concurrency}, stream={a.stream}, {a.runs} runs, "
          f"server args {a.server_args!r}, code {a.code or 'this checkout'}; loadavg {os.getloadavg()[0]:.2f}",
          flush=True)
    try:
        result = asyncio.run(run(a))
    except FleetError as exc:
        print(f"kv_path_e2e: {exc}", file=sys.stderr)
        return 2
    print(render(result["cells"]))
    result["meta"] = {"argv": sys.argv, "code": a.code, "server_args": a.server_args, "loadavg": os.getloadavg(),
                      "cpu_count": os.cpu_count()}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    ok = True
    for cell in result["cells"]:
        if cell["concurrency"] == 16 and not cell["stream"]:
            good = cell["delta_p50_ms"] is not None and cell["delta_p50_ms"] <= 0.3
            ok &= good
            print(f"[{'PASS' if good else 'FAIL'}] c=16 kv-aware − round-robin p50 {cell['delta_p50_ms']} ms <= 0.3")
        if cell["concurrency"] == 64 and not cell["stream"]:
            good = cell["rps_ratio"] is not None and cell["rps_ratio"] >= 0.9
            ok &= good
            print(f"[{'PASS' if good else 'FAIL'}] c=64 kv-aware ÷ round-robin req/s {cell['rps_ratio']} >= 0.9")
    print(f"results: {a.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
