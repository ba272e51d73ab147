#!/usr/bin/env python3
"""What does the router cost? The same workers hit directly vs through ``python -m infera.server``.

Starts, as subprocesses: an embedded etcd, two workers (``--worker sim``: real
``python -m infera.engine.sim`` launchers at a high ``--speedup``; ``--worker fake``: a minimal
aiohttp worker that answers at once, ``bench/_fake_worker.py``), both registered in etcd, and
``python -m infera.server`` (round-robin) on a free port. A load generator in its own process
(``bench/_loadgen.py``) then runs closed loops at fixed concurrency against

* ``direct``: the worker URLs themselves, alternating round-robin in the client, and
* ``router``: the server's URL,

for each (concurrency, streaming) cell, ``--runs`` times, interleaving direct and router runs
(alternating which goes first) so drift on a shared box hits both alike. Each run is a warm-up
followed by a measured window bounded by ``--requests`` and ``--duration``. The table reports
the MEDIAN over runs of each metric, router−direct p50 latency and router/direct throughput,
then two acceptance checks. Every run and the medians go to ``--out`` as JSON.

    python bench/router_overhead.py                 # sim workers, full run (~3 min on 2 cores)
    python bench/router_overhead.py --worker fake   # the HTTP path alone
    python bench/router_overhead.py --quick         # smoke run (~10 s)

Exit status: 0 when every acceptance check passes and no request failed; 1 otherwise; 2 when the
fleet could not be started; 130 on Ctrl-C; 143 on SIGTERM. Everything started is stopped on the
way out, errors included.
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import ctypes
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from infera.discovery.embedded_etcd import EmbeddedEtcd  # noqa: E402

DEFAULT_OUT = os.path.join(BENCH_DIR, "results", "router_overhead.json")
MODES = ("direct", "router")
# Acceptance thresholds.
CHECK1_CONCURRENCY, CHECK1_MAX_DELTA_MS = 16, 1.5
CHECK2_CONCURRENCY, CHECK2_MIN_RATIO = 64, 0.5
MEDIAN_METRICS = ("rps", "lat_mean_ms", "lat_p50_ms", "lat_p90_ms", "lat_p99_ms", "ttft_p50_ms", "ttft_p99_ms",
                  "itl_p50_ms", "itl_p99_ms")
PROMPTS = [
    "Hello!", "Say something short.", "What is a router?", "Count to three.",
    "Name a colour.", "Tell me a fact.", "Why is the sky blue?", "Summarise: benchmarks are useful.",
]


# ------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/router_overhead.py", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--worker", choices=("sim", "fake"), default="sim",
                   help="sim: infera.engine.sim workers via their launcher; fake: bench/_fake_worker.py")
    p.add_argument("--workers", type=int, default=2, help="number of workers")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64], help="closed-loop concurrencies")
    p.add_argument("--stream", choices=("both", "only", "none"), default="both",
                   help="both: streaming and not; only: streaming only; none: non-streaming only")
    p.add_argument("--runs", type=int, default=None, help="runs per (mode, concurrency, stream) cell [3; --quick: 1]")
    p.add_argument("--requests", type=int, default=None,
                   help="max measured requests per run [50000; --quick: 300]")
    p.add_argument("--duration", type=float, default=None, help="max measured seconds per run [4; --quick: 1]")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds before each run [1; --quick: 0.3]")
    p.add_argument("--max-tokens", type=int, default=16, help="max_tokens per request (ignore_eos is set)")
    p.add_argument("--speedup", type=float, default=1000.0, help="sim engine --speedup")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sim engine --max-num-seqs")
    p.add_argument("--ready-timeout", type=float, default=90.0, help="seconds to wait for the fleet")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON results file (its folder is created)")
    p.add_argument("--quick", action="store_true", help="small counts for a smoke run")
    return p


def resolve_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    q = args.quick
    args.runs = args.runs if args.runs is not None else (1 if q else 3)
    args.requests = args.requests if args.requests is not None else (300 if q else 50000)
    args.duration = args.duration if args.duration is not None else (1.0 if q else 4.0)
    args.warmup = args.warmup if args.warmup is not None else (0.3 if q else 1.0)
    if args.runs < 1 or args.requests < 1 or args.duration <= 0 or args.warmup < 0 or args.workers < 1:
        raise SystemExit("--runs, --requests, --workers must be >= 1, --duration > 0, --warmup >= 0")
    if any(c < 1 for c in args.concurrency):
        raise SystemExit("--concurrency values must be >= 1")
    args.concurrency = sorted(set(args.concurrency))
    args.streams = {"both": [False, True], "only": [True], "none": [False]}[args.stream]
    args.model = f"bench-{args.worker}"
    return args


# ------------------------------------------------------------------------------------- processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pdeathsig() -> None:  # in the child between fork and exec: die (SIGTERM) with the benchmark
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu_seconds(roles: dict[int, str]) -> dict[str, float] | None:
    """user+system CPU seconds consumed so far by each process in ``roles`` (``{pid: role}``) and
    all its live descendants (a sim launcher's engine runs in its own session), summed per role,
    from /proc; None without /proc (not Linux)."""
    if not os.path.isdir("/proc/self"):
        return None
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        pid = int(entry)  # fields after the name: state ppid pgrp ... utime(11) stime(12)
        parent[pid] = int(fields[1])
        cpu[pid] = (int(fields[11]) + int(fields[12])) / _CLK_TCK
    totals = {role: 0.0 for role in roles.values()}
    for pid, used in cpu.items():
        p, hops = pid, 0
        while p not in roles and p > 1 and hops < 16:
            p, hops = parent.get(p, 0), hops + 1
        if p in roles:
            totals[roles[p]] += used
    return totals


_LIVE: list["Proc"] = []  # safety net: SIGKILL whatever is left at interpreter exit


@atexit.register
def _kill_leftovers() -> None:
    for proc in _LIVE:
        if proc.proc is not None and proc.proc.returncode is None:
            proc.signal_group(signal.SIGKILL)


@dataclass
class Proc:
    name: str
    cmd: list[str]
    log_path: str
    proc: asyncio.subprocess.Process | None = None
    _log: Any = field(default=None, repr=False)

    async def start(self, **kwargs: Any) -> None:
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self._log = open(self.log_path, "wb")
        kwargs.setdefault("stdout", self._log)  # the load generator talks over stdout: only stderr is logged
        kwargs.setdefault("stderr", self._log)
        # Own session: a Ctrl-C at the terminal reaches only us, and we stop children in order.
        self.proc = await asyncio.create_subprocess_exec(*self.cmd, cwd=REPO, env=env, start_new_session=True,
                                                         preexec_fn=_pdeathsig, stdin=kwargs.pop("stdin", subprocess.DEVNULL),
                                                         **kwargs)
        _LIVE.append(self)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # start_new_session made it the group leader
        except (ProcessLookupError, PermissionError):
            pass

    async def stop(self, grace: float) -> None:
        try:
            if self.alive:
                self.signal_group(signal.SIGTERM)
                try:
                    await asyncio.wait_for(self.proc.wait(), grace)
                except asyncio.TimeoutError:
                    print(f"  {self.name} ignored SIGTERM for {grace:.0f}s; killing it", flush=True)
            if self.proc is not None:
                self.signal_group(signal.SIGKILL)  # anything left in its group (e.g. the sim engine)
                if self.proc.returncode is None:
                    await self.proc.wait()
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None

    def log_tail(self, limit: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-limit:].decode("utf-8", "replace")
        except OSError:
            return ""


class FleetError(RuntimeError):
    pass


class Bench:
    def __init__(self, args: argparse.Namespace, logs_dir: str) -> None:
        self.args = args
        self.logs_dir = logs_dir
        self.etcd: EmbeddedEtcd | None = None
        self.server: Proc | None = None
        self.workers: list[Proc] = []
        self.loadgen: Proc | None = None
        self.router_url = ""
        self.worker_urls: list[str] = []

    # -- fleet ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        a = self.args
        py = sys.executable
        self.etcd = EmbeddedEtcd(unsafe_no_fsync=True)
        await self.etcd.start()
        server_port = _free_port()
        self.router_url = f"http://127.0.0.1:{server_port}"
        self.server = Proc("server", [py, "-m", "infera.server", "--host", "127.0.0.1", "--port", str(server_port),
                                      "--etcd-endpoint", self.etcd.url, "--router-policy", "round-robin",
                                      "--log-level", "warning"], os.path.join(self.logs_dir, "server.log"))
        await self.server.start()
        for i in range(a.workers):
            port = _free_port()
            if a.worker == "sim":
                cmd = [py, "-m", "infera.engine.sim", "--etcd-endpoint", self.etcd.url, "--log-level", "warning",
                       "--drain-timeout", "3", "--drain-settle", "0.2", "--engine-stop-timeout", "5",
                       "--model", a.model, "--port", str(port), "--host", "127.0.0.1",
                       "--speedup", repr(a.speedup), "--max-num-seqs", str(a.max_num_seqs)]
            else:
                cmd = [py, os.path.join(BENCH_DIR, "_fake_worker.py"), "--etcd-endpoint", self.etcd.url,
                       "--model", a.model, "--port", str(port), "--host", "127.0.0.1", "--tokens", str(a.max_tokens)]
            worker = Proc(f"worker{i}", cmd, os.path.join(self.logs_dir, f"worker{i}.log"))
            await worker.start()
            self.workers.append(worker)
        self.loadgen = Proc("loadgen", [py, os.path.join(BENCH_DIR, "_loadgen.py")],
                            os.path.join(self.logs_dir, "loadgen.log"))
        await self.loadgen.start(stdin=subprocess.PIPE, stdout=subprocess.PIPE, limit=64 * 1024 * 1024)

    def check_alive(self) -> None:
        for p in [self.server, *self.workers, self.loadgen]:
            if p is not None and not p.alive:
                code = p.proc.returncode if p.proc else None
                raise FleetError(f"{p.name} exited (code {code}); log {p.log_path}:\n{p.log_tail()}")
        if self.etcd is not None and not self.etcd.running:
            raise FleetError(f"etcd exited; log {self.etcd.log_path}")

    async def wait_ready(self, session: aiohttp.ClientSession) -> list[dict]:
        a = self.args
        deadline = time.monotonic() + a.ready_timeout
        seen: list[dict] = []
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                async with session.get(self.router_url + "/v1/workers", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    seen = (await r.json())["workers"]
                active = [w for w in seen if w["status"] == "active" and w["model_name"] == a.model]
                if len(active) >= a.workers:
                    return active
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, KeyError):
                pass
            await asyncio.sleep(0.2)
        raise FleetError(f"/v1/workers did not list {a.workers} active {a.model} workers within "
                         f"{a.ready_timeout:.0f}s (last seen: {seen})")

    async def preflight(self, session: aiohttp.ClientSession) -> None:
        """One request of each kind to the router and to every worker: fail fast, with a message."""
        for url in [self.router_url, *self.worker_urls]:
            for stream in self.args.streams:
                body = request_bodies(self.args, stream)[0]
                async with session.post(url + "/v1/chat/completions", data=body,
                                        headers={"Content-Type": "application/json"},
                                        timeout=aiohttp.ClientTimeout(total=30)) as r:
                    text = await r.read()
                    if r.status != 200 or (stream and b"data: [DONE]" not in text):
                        raise FleetError(f"preflight {'stream' if stream else 'unary'} request to {url} failed: "
                                         f"HTTP {r.status} {text[:300]!r}")

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
        await asyncio.gather(*(w.stop(15) for w in self.workers))  # workers first: they deregister
        if self.server is not None:
            await self.server.stop(10)
        if self.etcd is not None:
            await self.etcd.stop()

    # -- load ----------------------------------------------------------------------------------------
    async def run_window(self, mode: str, concurrency: int, stream: bool) -> dict:
        a = self.args
        assert self.loadgen is not None and self.loadgen.proc is not None
        base = [self.router_url] if mode == "router" else self.worker_urls
        job = {"cmd": "run", "urls": [u + "/v1/chat/completions" for u in base], "concurrency": concurrency,
               "stream": stream, "requests": a.requests, "duration": a.duration, "warmup": a.warmup,
               "bodies": [b.decode() for b in request_bodies(a, stream)]}
        proc = self.loadgen.proc
        cpu_before = tree_cpu_seconds(self.roles())
        wall_before = time.perf_counter()
        proc.stdin.write((json.dumps(job) + "\n").encode())
        await proc.stdin.drain()
        # The window is bounded by warm-up + duration, plus the slowest request's tail.
        line = await asyncio.wait_for(proc.stdout.readline(), a.warmup + a.duration + 120)
        if not line:
            raise FleetError(f"the load generator exited; log {self.loadgen.log_path}:\n{self.loadgen.log_tail()}")
        result = json.loads(line)
        if "fatal" in result:
            raise FleetError(f"the load generator failed: {result['fatal']}")
        cpu_after = tree_cpu_seconds(self.roles())
        wall = time.perf_counter() - wall_before
        if cpu_before is not None and cpu_after is not None:
            # The whole window (warm-up included) over every request it completed.
            n = result["completed"] + result["warmup_requests"]
            used = {role: cpu_after[role] - cpu_before[role] for role in cpu_before}
            if mode == "direct":
                used.pop("server", None)  # idle during direct runs; not part of that path
            used["total"] = sum(used.values())
            result["cpu_s"] = {k: round(v, 3) for k, v in used.items()}
            result["cpu_cores"] = {k: round(v / wall, 3) for k, v in used.items()}
            result["cpu_us_per_req"] = {k: round(v / n * 1e6, 1) if n else None for k, v in used.items()}
        return result

    def roles(self) -> dict[int, str]:
        """``{pid: role}`` of the processes we started (their descendants count for them)."""
        groups: dict[int, str] = {}
        for role, procs in (("loadgen", [self.loadgen]), ("workers", self.workers), ("server", [self.server])):
            for p in procs:
                if p is not None and p.proc is not None:
                    groups[p.proc.pid] = role
        return groups

    async def wait_loadgen_ready(self) -> None:
        assert self.loadgen is not None and self.loadgen.proc is not None
        line = await asyncio.wait_for(self.loadgen.proc.stdout.readline(), 30)
        if not line or not json.loads(line).get("ready"):
            raise FleetError(f"the load generator did not start; log:\n{self.loadgen.log_tail()}")


_BODIES: dict[tuple, list[bytes]] = {}


def request_bodies(args: argparse.Namespace, stream: bool) -> list[bytes]:
    key = (args.model, args.max_tokens, stream)
    if key not in _BODIES:
        bodies = []
        for prompt in PROMPTS:
            body: dict[str, Any] = {"model": args.model, "messages": [{"role": "user", "content": prompt}],
                                    "max_tokens": args.max_tokens, "ignore_eos": True, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            bodies.append(json.dumps(body, separators=(",", ":")).encode())
        _BODIES[key] = bodies
    return _BODIES[key]


# ----------------------------------------------------------------------------------------- report
def _median(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 4) if vals else None


def summarize(args: argparse.Namespace, runs: list[dict]) -> list[dict]:
    cells = []
    for c in args.concurrency:
        for stream in args.streams:
            cell: dict[str, Any] = {"concurrency": c, "stream": stream}
            by_mode = {m: [r for r in runs if r["mode"] == m and r["concurrency"] == c and r["stream"] == stream]
                       for m in MODES}
            if not all(by_mode.values()):
                continue
            for m, rs in by_mode.items():
                med = {k: _median([r[k] for r in rs]) for k in MEDIAN_METRICS}
                for key in ("cpu_us_per_req", "cpu_cores"):
                    roles = sorted({role for r in rs for role in (r.get(key) or {})})
                    if roles:
                        med[key] = {role: _median([(r.get(key) or {}).get(role) for r in rs]) for role in roles}
                med["runs"] = len(rs)
                med["completed"] = sum(r["completed"] for r in rs)
                med["errors"] = sum(r["errors"] for r in rs)
                cell[m] = med
            d, r = cell["direct"], cell["router"]
            cell["delta_p50_ms"] = _round(_sub(r["lat_p50_ms"], d["lat_p50_ms"]))
            cell["delta_p99_ms"] = _round(_sub(r["lat_p99_ms"], d["lat_p99_ms"]))
            cell["rps_ratio"] = _round(r["rps"] / d["rps"] if d["rps"] else None)
            # The same, paired run by run (direct and router of run i ran back to back).
            pairs = list(zip(sorted(by_mode["direct"], key=lambda x: x["run"]),
                             sorted(by_mode["router"], key=lambda x: x["run"])))
            cell["delta_p50_ms_paired_median"] = _median([_sub(rr["lat_p50_ms"], dr["lat_p50_ms"]) for dr, rr in pairs])
            cell["rps_ratio_paired_median"] = _median([rr["rps"] / dr["rps"] if dr["rps"] else None for dr, rr in pairs])
            cells.append(cell)
    return cells


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _round(v: float | None, n: int = 4) -> float | None:
    return None if v is None else round(v, n)


def _f(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def render_table(cells: list[dict]) -> str:
    head1 = (f"{'':>4} {'':>6} | {'direct':^42} | {'router':^42} | {'router vs direct':^17} | {'errors':^9}")
    head2 = (f"{'c':>4} {'stream':>6} | " + "{:>8} {:>7} {:>7} {:>8} {:>7} | ".format(
        "req/s", "p50 ms", "p99 ms", "TTFT p50", "ITL p50") * 2 + f"{'Δp50 ms':>8} {'thr r/d':>8} | {'d':>4} {'r':>4}")
    lines = [head1, head2, "-" * len(head2)]
    for cell in cells:
        row = f"{cell['concurrency']:>4} {'yes' if cell['stream'] else 'no':>6} | "
        for m in MODES:
            x = cell[m]
            row += (f"{_f(x['rps'], '.1f'):>8} {_f(x['lat_p50_ms']):>7} {_f(x['lat_p99_ms']):>7} "
                    f"{_f(x['ttft_p50_ms']):>8} {_f(x['itl_p50_ms'], '.3f'):>7} | ")
        row += (f"{_f(cell['delta_p50_ms'], '+.2f'):>8} {_f(cell['rps_ratio'], '.2f'):>8} | "
                f"{cell['direct']['errors']:>4} {cell['router']['errors']:>4}")
        lines.append(row)
    return "\n".join(lines)


def render_cpu_table(cells: list[dict]) -> str | None:
    """CPU time per request by role, and the cores each role kept busy (medians of runs)."""
    if not any("cpu_us_per_req" in c["direct"] for c in cells):
        return None
    head = (f"{'c':>4} {'stream':>6} | {'direct: loadgen':>15} {'workers':>8} {'total':>7} | "
            f"{'router: loadgen':>15} {'workers':>8} {'server':>7} {'total':>7} | {'server cores':>12}")
    lines = [head, "-" * len(head)]
    for cell in cells:
        d = cell["direct"].get("cpu_us_per_req") or {}
        r = cell["router"].get("cpu_us_per_req") or {}
        cores = (cell["router"].get("cpu_cores") or {}).get("server")
        lines.append(f"{cell['concurrency']:>4} {'yes' if cell['stream'] else 'no':>6} | "
                     f"{_f(d.get('loadgen'), '.0f'):>15} {_f(d.get('workers'), '.0f'):>8} {_f(d.get('total'), '.0f'):>7} | "
                     f"{_f(r.get('loadgen'), '.0f'):>15} {_f(r.get('workers'), '.0f'):>8} {_f(r.get('server'), '.0f'):>7} "
                     f"{_f(r.get('total'), '.0f'):>7} | {_f(cores, '.2f'):>12}")
    return "\n".join(lines)


def acceptance_checks(cells: list[dict]) -> list[dict]:
    def find(c: int, stream: bool) -> dict | None:
        return next((x for x in cells if x["concurrency"] == c and x["stream"] == stream), None)

    checks = []
    cell = find(CHECK1_CONCURRENCY, False)
    name = f"router p50 latency <= direct + {CHECK1_MAX_DELTA_MS} ms at c={CHECK1_CONCURRENCY}, non-streaming"
    checks.append(_check(name, cell, "delta_p50_ms", lambda v: v <= CHECK1_MAX_DELTA_MS,
                         lambda v: f"Δp50 = {v:+.3f} ms (limit +{CHECK1_MAX_DELTA_MS} ms)"))
    for stream in (False, True):
        cell = find(CHECK2_CONCURRENCY, stream)
        name = (f"router throughput >= {CHECK2_MIN_RATIO:.0%} of direct at c={CHECK2_CONCURRENCY}, "
                f"{'streaming' if stream else 'non-streaming'}")
        checks.append(_check(name, cell, "rps_ratio", lambda v: v >= CHECK2_MIN_RATIO,
                             lambda v: f"router/direct = {v:.3f} (min {CHECK2_MIN_RATIO})"))
    return checks


def _check(name: str, cell: dict | None, key: str, ok, describe) -> dict:
    if cell is None or cell.get(key) is None:
        return {"check": name, "status": "SKIP", "detail": "cell not measured in this run"}
    value = cell[key]
    errors = cell["direct"]["errors"] + cell["router"]["errors"]
    status = "PASS" if ok(value) and errors == 0 else "FAIL"
    detail = describe(value) + (f"; {errors} request errors in this cell" if errors else "")
    return {"check": name, "status": status, "value": value, "detail": detail}


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# ------------------------------------------------------------------------------------------- main
async def run(args: argparse.Namespace) -> int:
    out_path = os.path.abspath(args.out)
    out_dir = os.path.dirname(out_path)
    logs_dir = os.path.splitext(out_path)[0] + "_logs"
    os.makedirs(logs_dir, exist_ok=True)
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)  # SIGINT: asyncio.run cancels us already

    n_windows = args.runs * len(args.concurrency) * len(args.streams) * len(MODES)
    print(f"router_overhead: worker={args.worker} x{args.workers}, concurrency={args.concurrency}, "
          f"stream={args.stream}, runs={args.runs}, requests<={args.requests}, duration<={args.duration}s, "
          f"warm-up {args.warmup}s" + (f", speedup={args.speedup:g}" if args.worker == "sim" else ""), flush=True)
    print(f"  {n_windows} windows, at most ~{n_windows * (args.warmup + args.duration + 0.3):.0f}s of load; "
          f"cpus={os.cpu_count()}, loadavg={os.getloadavg()[0]:.2f}; logs in {logs_dir}", flush=True)

    bench = Bench(args, logs_dir)
    runs: list[dict] = []
    started = time.time()
    load_before = os.getloadavg()
    try:
        try:
            await bench.start()
            async with aiohttp.ClientSession() as session:
                workers = await bench.wait_ready(session)
                bench.worker_urls = [w["url"] for w in workers]
                await bench.preflight(session)
            await bench.wait_loadgen_ready()
        except (FleetError, RuntimeError, OSError, asyncio.TimeoutError) as exc:
            print(f"router_overhead: could not start the fleet: {exc}", file=sys.stderr)
            return 2
        print(f"  fleet up in {time.time() - started:.1f}s: server {bench.router_url} (pid {bench.server.proc.pid}), "
              f"workers {', '.join(bench.worker_urls)} (launcher pids "
              f"{', '.join(str(w.proc.pid) for w in bench.workers)}), loadgen pid {bench.loadgen.proc.pid}", flush=True)

        k = 0
        for run_i in range(args.runs):
            for c in args.concurrency:
                for stream in args.streams:
                    order = MODES if k % 2 == 0 else MODES[::-1]  # alternate who goes first
                    k += 1
                    for mode in order:
                        bench.check_alive()
                        result = await bench.run_window(mode, c, stream)
                        result.update(run=run_i, mode=mode, order=list(order), wall_time=round(time.time(), 3))
                        runs.append(result)
                        err = f"  ERRORS {result['errors']}: {result['error_samples'][:1]}" if result["errors"] else ""
                        extra = (f" ttft50 {_f(result['ttft_p50_ms'])} itl50 {_f(result['itl_p50_ms'], '.3f')}"
                                 if stream else "")
                        print(f"  run {run_i + 1}/{args.runs} c={c:<3} {'stream' if stream else 'unary ':<6} "
                              f"{mode:<6} {result['rps']:>8.1f} req/s  p50 {_f(result['lat_p50_ms']):>7} ms  "
                              f"p99 {_f(result['lat_p99_ms']):>7} ms{extra}  n={result['completed']}{err}", flush=True)
    except FleetError as exc:
        print(f"router_overhead: aborted: {exc}", file=sys.stderr)
        return 2
    finally:
        print("  stopping the fleet…", flush=True)
        await bench.stop()

    cells = summarize(args, runs)
    checks = acceptance_checks(cells)
    total_errors = sum(r["errors"] for r in runs)
    print()
    print(f"Router overhead — worker={args.worker}, medians of {args.runs} run(s) per cell "
          f"(latencies in ms; thr r/d = router req/s ÷ direct req/s)")
    print(render_table(cells))
    cpu_table = render_cpu_table(cells)
    if cpu_table:
        print(f"\nCPU µs per request by process role (user+sys, warm-up included; medians; {os.cpu_count()} cores in all)")
        print(cpu_table)
    print()
    for chk in checks:
        print(f"[{chk['status']}] {chk['check']}: {chk['detail']}")
    if total_errors:
        print(f"\n!! {total_errors} request error(s); samples:")
        for r in runs:
            for s in r["error_samples"]:
                print(f"   {r['mode']} c={r['concurrency']} stream={r['stream']}: {s}")

    report = {
        "meta": {
            "benchmark": "router_overhead", "worker": args.worker, "workers": args.workers, "model": args.model,
            "concurrency": args.concurrency, "stream": args.stream, "runs": args.runs, "requests": args.requests,
            "duration_s": args.duration, "warmup_s": args.warmup, "max_tokens": args.max_tokens,
            "speedup": args.speedup if args.worker == "sim" else None,
            "max_num_seqs": args.max_num_seqs if args.worker == "sim" else None, "quick": args.quick,
            "router_url": bench.router_url, "worker_urls": bench.worker_urls,
            "started_at": started, "wall_s": round(time.time() - started, 2),
            "cpu_count": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "python": sys.version.split()[0], "aiohttp": aiohttp.__version__, "platform": platform.platform(),
            "git_commit": _git_commit(), "argv": sys.argv,
        },
        "runs": runs,
        "cells": cells,
        "checks": checks,
        "errors_total": total_errors,
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nresults: {out_path}  (wall {report['meta']['wall_s']:.0f}s)")
    failed = any(c["status"] == "FAIL" for c in checks) or total_errors > 0
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> None:
    args = resolve_args(argv)
    try:
        code = asyncio.run(run(args))
    except KeyboardInterrupt:
        print("router_overhead: interrupted; fleet stopped", file=sys.stderr)
        code = 130
    except asyncio.CancelledError:  # SIGTERM
        code = 143
    sys.exit(code)


if __name__ == "__main__":
    main()
