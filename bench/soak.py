#!/usr/bin/env python3
"""Soak: does the server stay flat under hours-like load while workers crash and come back?

Starts, as subprocesses: an embedded etcd, ``--workers`` sim workers (``python -m
infera.engine.sim`` launchers), ``python -m infera.server`` (``--router-policy``, plus every
``--server-arg`` verbatim) and a load generator in its own process (``bench/_soak_loadgen.py``).
The load generator keeps ``--concurrency`` streamed chat completions in flight (closed loop; every
prompt new) for ``--duration`` seconds. Every ``--kill-every`` seconds one worker, round-robin, is
SIGKILLed: its launcher's process group and its engine's (the engine runs in its own session), so
it neither drains nor deregisters, as in a crash. A replacement starts right after, on a new port.

Every ``--sample-every`` seconds the server process is sampled: RSS (``VmRSS``), open fds, its
established TCP connections, CPU, and the requests that completed or failed in that interval.
Failures are attributed: a stream that was in flight on the killed worker and failed within
``--kill-window`` seconds of the kill is one the kill must cause; every other failure is
unexplained; a request still running after ``--hang-timeout`` is a hang. The table is printed as
the run goes, then a summary and PASS/FAIL lines against the goals: RSS growth after warm-up
< 5 %, flat fds, 0 unexplained errors, 0 hangs. All samples, kills and failures go to ``--out``.

    python bench/soak.py                 # 10 min, 200 streams, 3 workers, a kill a minute
    python bench/soak.py --quick         # ~1 min smoke form
    python bench/soak.py --server-arg=--request-max-retries=2

Exit status: 0 when every check passes; 1 otherwise; 2 when the fleet could not be started;
130 on Ctrl-C and 143 on SIGTERM (after stopping everything and writing what was measured).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
for p in (REPO, BENCH_DIR):
    if p not in sys.path:
        sys.path.insert(0, p)

from infera.discovery.embedded_etcd import EmbeddedEtcd  # noqa: E402

import _soak_report as report  # noqa: E402
from router_overhead import FleetError, Proc, _free_port, _git_commit  # noqa: E402

DEFAULT_OUT = os.path.join(BENCH_DIR, "results", "soak.json")
DEFAULT_OUT_QUICK = os.path.join(BENCH_DIR, "results", "soak_quick.json")
MODEL = "soak-sim"
# Prompts of ~30–60 tokens; each request appends its own number, so no two prompts are equal.
PROMPTS = [
    "You are a careful assistant. Summarise in two sentences why distributed systems need health checks "
    "and what happens when a node fails without warning.",
    "Write a short note to a colleague about the results of last week's load test, mentioning latency, "
    "throughput and the number of errors observed.",
    "Explain to a new engineer how a router picks a worker for a request, and why it matters that the "
    "worker list stays current.",
    "List three things to check when a service's memory grows slowly over a day, and say how you would "
    "tell a leak from a cache that is still warming up.",
    "Describe a rainy afternoon in a harbour town: the boats, the gulls, the smell of the fish market and "
    "the people hurrying home.",
    "Give a brief history of the printing press and its effect on how quickly ideas spread across Europe.",
    "What is the difference between a process and a thread, and when would you prefer one over the other?",
    "Plan a three-day walking trip in the mountains for two people, with distances, huts and what to pack.",
]
# Sim timing (bench/pd.py explains the model): a decode step costs 6–34 ms as the KV cache fills
# (with every prompt new it soon is full), divided by --speedup. At 0.6 and 24 tokens a stream
# lasts ~0.5–1.5 s on a loaded 2-core box (measured at 0.3 and 32 tokens, c=64: p50 ~1.7 s).
DEFAULT_SPEEDUP = 0.6
DEFAULT_MAX_TOKENS = 24


# ------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/soak.py", allow_abbrev=False,
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    q = "[%s; --quick %s]"
    p.add_argument("--duration", type=float, default=None, help="seconds of load " + q % (600, 60))
    p.add_argument("--concurrency", type=int, default=None, help="streams kept in flight " + q % (200, 64))
    p.add_argument("--workers", type=int, default=3, help="sim workers")
    p.add_argument("--kill-every", type=float, default=None,
                   help="seconds between worker kills (SIGKILL, round-robin, replaced at once); 0: none "
                        + q % (60, 15))
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds excluded from the RSS growth and fd figures " + q % (60, 15))
    p.add_argument("--sample-every", type=float, default=None, help="seconds between samples " + q % (5, 2))
    p.add_argument("--kill-window", type=float, default=5.0,
                   help="a stream in flight on a killed worker that fails within this many seconds of the "
                        "kill is kill-caused")
    p.add_argument("--hang-timeout", type=float, default=30.0,
                   help="a request still running after this many seconds is abandoned and counted as a hang")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="passed to python -m infera.server verbatim; repeatable. Use the = form for flags: "
                        "--server-arg=--request-max-retries=2")
    p.add_argument("--router-policy", choices=("kv-aware", "round-robin"), default="kv-aware",
                   help="the server's --router-policy")
    p.add_argument("--speedup", type=float, default=DEFAULT_SPEEDUP, help="sim engine --speedup")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="max_tokens per request (ignore_eos)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sim engine --max-num-seqs")
    p.add_argument("--ready-timeout", type=float, default=90.0, help="seconds to wait for the fleet, and for "
                   "each replacement worker")
    p.add_argument("--out", default=None, help="JSON results file (its folder is created; logs go to <out>_logs/) "
                   "[bench/results/soak.json; --quick …/soak_quick.json]")
    p.add_argument("--quick", action="store_true", help="~60 s smoke form")
    return p


def resolve_args(argv: list[str] | None = None) -> argparse.Namespace:
    a = build_parser().parse_args(argv)
    defaults = {"duration": (600.0, 60.0), "concurrency": (200, 64), "kill_every": (60.0, 15.0),
                "warmup": (60.0, 15.0), "sample_every": (5.0, 2.0)}
    for name, (full, quick) in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, quick if a.quick else full)
    if a.out is None:
        a.out = DEFAULT_OUT_QUICK if a.quick else DEFAULT_OUT
    problems = []
    if a.duration <= 0 or a.sample_every <= 0 or a.hang_timeout <= 0 or a.kill_window <= 0:
        problems.append("--duration, --sample-every, --hang-timeout and --kill-window must be > 0")
    if a.concurrency < 1 or a.workers < 1 or a.max_tokens < 1 or a.max_num_seqs < 1:
        problems.append("--concurrency, --workers, --max-tokens and --max-num-seqs must be >= 1")
    if a.kill_every < 0 or a.warmup < 0:
        problems.append("--kill-every and --warmup must be >= 0")
    if a.warmup + 2 * a.sample_every > a.duration:
        problems.append("--duration must leave at least two samples after --warmup")
    if a.kill_every and a.workers < 2:
        problems.append("kills need --workers >= 2 (one must stay up to fail over to)")
    if problems:
        raise SystemExit("; ".join(problems))
    return a


# ---------------------------------------------------------------------------------------- /proc
def _read_ticks_per_s() -> int:
    return os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


_CLK_TCK = _read_ticks_per_s()


def proc_sample(pid: int, listen_port: int) -> dict[str, Any]:
    """RSS, threads, open fds, established TCP connections (to ``listen_port``: clients; others:
    upstream) and CPU seconds of one process, from /proc. Runs in a thread."""
    out: dict[str, Any] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                out["rss_mib"] = round(int(line.split()[1]) / 1024.0, 2)
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    out["cpu_s"] = (int(fields[11]) + int(fields[12])) / _CLK_TCK
    inodes = set()
    fds = os.listdir(f"/proc/{pid}/fd")
    out["fds"] = len(fds)
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    client = upstream = 0
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) < 10 or cols[3] != "01" or int(cols[9]) not in inodes:  # 01: ESTABLISHED
                        continue
                    if int(cols[1].rsplit(":", 1)[1], 16) == listen_port:
                        client += 1
                    else:
                        upstream += 1
        except OSError:
            pass
    out.update(conns=client + upstream, conns_client=client, conns_upstream=upstream)
    return out


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024.0, 2)
    except OSError:
        pass
    return None


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (the sim engine runs in its own session under its launcher)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


# ------------------------------------------------------------------------------------------ fleet
@dataclass
class Slot:
    """One worker position; each kill starts a new generation of it on a new port."""
    index: int
    gen: int = 0
    port: int = 0
    proc: Proc | None = None
    worker_id: str | None = None

    @property
    def label(self) -> str:
        return f"w{self.index}" + "'" * self.gen


@dataclass
class Soak:
    args: argparse.Namespace
    logs_dir: str
    etcd: EmbeddedEtcd | None = None
    server: Proc | None = None
    server_port: int = 0
    loadgen: Proc | None = None
    slots: list[Slot] = field(default_factory=list)
    kills: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # for the next table row
    problems: list[str] = field(default_factory=list)
    t0: float = 0.0
    done: dict[str, Any] | None = None
    _ticks: asyncio.Queue | None = None
    _done_evt: asyncio.Event = field(default_factory=asyncio.Event)
    _watchers: list[asyncio.Task] = field(default_factory=list)

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    # -- start ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        a, py = self.args, sys.executable
        self.etcd = EmbeddedEtcd(unsafe_no_fsync=True)
        await self.etcd.start()
        self.server_port = _free_port()
        self.server = Proc("server", [py, "-m", "infera.server", "--workers", "1", "--host", "127.0.0.1", "--port", str(self.server_port),
                                      "--etcd-endpoint", self.etcd.url, "--router-policy", a.router_policy,
                                      "--log-level", "warning", *a.server_arg],
                           os.path.join(self.logs_dir, "server.log"))
        await self.server.start()
        for i in range(a.workers):
            slot = Slot(i)
            self.slots.append(slot)
            await self.start_worker(slot)
        self.loadgen = Proc("loadgen", [py, os.path.join(BENCH_DIR, "_soak_loadgen.py")],
                            os.path.join(self.logs_dir, "loadgen.log"))
        await self.loadgen.start(stdin=subprocess.PIPE, stdout=subprocess.PIPE, limit=64 * 1024 * 1024)

    async def start_worker(self, slot: Slot) -> None:
        a = self.args
        slot.port = _free_port()
        slot.worker_id = None
        cmd = [sys.executable, "-m", "infera.engine.sim", "--etcd-endpoint", self.etcd.url, "--log-level", "warning",
               "--drain-timeout", "3", "--drain-settle", "0.2", "--engine-stop-timeout", "5",
               *([] if a.router_policy == "kv-aware" else ["--no-enable-kv-events"]),
               "--model", MODEL, "--port", str(slot.port), "--host", "127.0.0.1",
               "--speedup", repr(a.speedup), "--max-num-seqs", str(a.max_num_seqs)]
        slot.proc = Proc(f"worker{slot.index}.{slot.gen}", cmd,
                         os.path.join(self.logs_dir, f"worker{slot.index}.{slot.gen}.log"))
        await slot.proc.start()

    async def workers_view(self, session: aiohttp.ClientSession) -> list[dict[str, Any]]:
        async with session.get(self.router_url + "/v1/workers", timeout=aiohttp.ClientTimeout(total=3)) as r:
            return (await r.json())["workers"]

    @staticmethod
    def _port_of(url: str) -> int | None:
        try:
            return int(url.rsplit(":", 1)[1].split("/")[0])
        except (IndexError, ValueError):
            return None

    def _active_by_port(self, view: list[dict[str, Any]]) -> dict[int, str]:
        return {self._port_of(w["url"]): w["worker_id"] for w in view
                if w.get("status") == "active" and w.get("routable", True) and w.get("model_name") == MODEL}

    async def wait_ready(self, session: aiohttp.ClientSession) -> None:
        deadline = time.monotonic() + self.args.ready_timeout
        seen: list[dict] = []
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                seen = await self.workers_view(session)
                active = self._active_by_port(seen)
                if all(s.port in active for s in self.slots):
                    for s in self.slots:
                        s.worker_id = active[s.port]
                    return
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, KeyError):
                pass
            await asyncio.sleep(0.2)
        raise FleetError(f"{self.router_url}/v1/workers did not list {len(self.slots)} active {MODEL} workers "
                         f"within {self.args.ready_timeout:.0f}s (last seen: {seen})")

    async def preflight(self, session: aiohttp.ClientSession) -> None:
        body = request_bodies(self.args)[0]
        async with session.post(self.router_url + "/v1/chat/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=30)) as r:
            text = await r.read()
            if r.status != 200 or b"data: [DONE]" not in text:
                raise FleetError(f"preflight request failed: HTTP {r.status} {text[:300]!r}")

    def check_alive(self) -> None:
        for p in [self.server, self.loadgen]:
            if p is not None and not p.alive:
                raise FleetError(f"{p.name} exited (code {p.proc.returncode if p.proc else None}); "
                                 f"log {p.log_path}:\n{p.log_tail()}")
        if self.etcd is not None and not self.etcd.running:
            raise FleetError(f"etcd exited; log {self.etcd.log_path}")

    # -- loadgen I/O ---------------------------------------------------------------------------------
    async def send(self, obj: dict[str, Any]) -> None:
        stdin = self.loadgen.proc.stdin
        stdin.write((json.dumps(obj) + "\n").encode())
        await stdin.drain()

    async def read_line(self, timeout: float) -> dict[str, Any]:
        line = await asyncio.wait_for(self.loadgen.proc.stdout.readline(), timeout)
        if not line:
            raise FleetError(f"the load generator exited; log {self.loadgen.log_path}:\n{self.loadgen.log_tail()}")
        return json.loads(line)

    async def reader(self) -> None:
        """Route the load generator's lines: tick replies to the sampler, ``done`` to the run."""
        while True:
            msg = await self.read_line(timeout=1e9)
            if "fatal" in msg:
                raise FleetError(f"the load generator failed: {msg['fatal']}")
            if msg.get("done"):
                self.done = msg
                self._done_evt.set()
            elif "tick" in msg:
                self._ticks.put_nowait(msg)

    async def tick(self) -> dict[str, Any]:
        await self.send({"cmd": "tick"})
        return await asyncio.wait_for(self._ticks.get(), 15)

    # -- the run -------------------------------------------------------------------------------------
    def elapsed(self, mono: float | None = None) -> float:
        return (time.monotonic() if mono is None else mono) - self.t0

    async def run_load(self, session: aiohttp.ClientSession) -> None:
        a = self.args
        self._ticks = asyncio.Queue()
        bodies = request_bodies(a)
        await self.send({"cmd": "start", "url": self.router_url + "/v1/chat/completions", "concurrency": a.concurrency,
                         "duration": a.duration, "bodies": bodies, "hang_s": a.hang_timeout, "max_tokens": a.max_tokens})
        started = await self.read_line(timeout=30)
        if "started" not in started:
            raise FleetError(f"the load generator did not start: {started}")
        self.t0 = started["started"]
        print(report.TABLE_HEAD, flush=True)
        print("-" * len(report.TABLE_HEAD), flush=True)
        reader = asyncio.create_task(self.reader())
        killer = asyncio.create_task(self.killer(session))
        sampler = asyncio.create_task(self.sampler(session))
        try:
            # The reader and the killer only end by failing; the sampler ends with the run.
            finished, _ = await asyncio.wait({reader, killer, sampler}, return_when=asyncio.FIRST_COMPLETED)
            for t in finished:
                if t.exception() is not None:
                    raise t.exception()
        finally:
            for t in (reader, killer, sampler, *self._watchers):
                t.cancel()
            await asyncio.gather(reader, killer, sampler, *self._watchers, return_exceptions=True)

    async def sampler(self, session: aiohttp.ClientSession) -> None:
        a = self.args
        prev_cpu: tuple[float, float] | None = None
        n = 0
        while True:
            n += 1
            target = self.t0 + n * a.sample_every
            final = target > self.t0 + a.duration
            if final:  # the last sample waits for the streams still in flight, then counts them
                await self._done_evt.wait()
            else:
                await asyncio.sleep(max(0.0, target - time.monotonic()))
            self.check_alive()
            tick = await self.tick()
            now = time.monotonic()
            try:
                sample = await asyncio.to_thread(proc_sample, self.server.proc.pid, self.server_port)
            except OSError as exc:
                raise FleetError(f"cannot read the server's /proc entry: {exc}") from exc
            t = self.elapsed(now)
            phase = "drain" if final else ("warmup" if t < a.warmup + 0.5 * a.sample_every else "measure")
            if prev_cpu is not None:
                sample["cpu_cores"] = round((sample["cpu_s"] - prev_cpu[1]) / max(1e-6, now - prev_cpu[0]), 3)
            prev_cpu = (now, sample["cpu_s"])
            try:
                sample["workers_active"] = len(self._active_by_port(await self.workers_view(session)))
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, KeyError):
                sample["workers_active"] = None
            classes = {"kill": 0, "other": 0, "hang": 0}
            for f in tick["failures"]:
                f["class"], f["kill"] = report.classify(f, self.kills, a.kill_window)
                f["t"] = round(self.elapsed(f["end"]), 3)
                classes[f["class"]] += 1
                self.failures.append(f)
            # Connections to a killed worker close and re-open elsewhere: fds dip and recover then.
            transient = any(now - max(a.kill_window, a.sample_every) <= k["t"] <= now for k in self.kills)
            sample.update(t=round(t, 2), phase=phase, kill_transient=transient, ok=tick["ok"],
                          failed_kill=classes["kill"], failed_other=classes["other"] + tick["failures_dropped"],
                          hangs=classes["hang"], failures_dropped=tick["failures_dropped"],
                          inflight=tick["inflight"], lat_p50_ms=tick["lat_p50_ms"], lat_p99_ms=tick["lat_p99_ms"],
                          ttft_p50_ms=tick["ttft_p50_ms"], loadgen_rss_mib=rss_mib(self.loadgen.proc.pid),
                          loadavg_1m=round(os.getloadavg()[0], 2), events=self.events)
            self.events = []
            self.samples.append(sample)
            print(report.table_row(sample), flush=True)
            if final:
                return

    async def killer(self, session: aiohttp.ClientSession) -> None:
        a = self.args
        if not a.kill_every:
            await asyncio.Event().wait()  # nothing to do; cancelled with the run
        k, victim = 0, 0
        while True:
            k += 1
            at = k * a.kill_every
            if at > a.duration - a.kill_window - 1:  # its window must end inside the run
                await asyncio.Event().wait()
            await asyncio.sleep(max(0.0, self.t0 + at - time.monotonic()))
            slot = self.slots[victim % len(self.slots)]
            victim += 1
            await self.kill_and_replace(session, slot)

    async def kill_and_replace(self, session: aiohttp.ClientSession, slot: Slot) -> None:
        proc = slot.proc
        assert proc is not None and proc.proc is not None
        worker_id = slot.worker_id or f"127.0.0.1:{slot.port}"
        pids = [proc.proc.pid] + descendants(proc.proc.pid)
        pgids: list[int] = []  # the engine's group (its own session) first, the launcher's last
        for pid in reversed(pids):
            try:
                pgid = os.getpgid(pid)
            except ProcessLookupError:
                continue
            if pgid not in pgids:
                pgids.append(pgid)
        t = time.monotonic()
        # Freeze first, then kill: a launcher that dies first sends its engine SIGTERM (PDEATHSIG),
        # and an engine that gets to handle it ends its streams cleanly ("abort" + [DONE]) -- a
        # graceful stop, not the crash this is meant to be.
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pgid in pgids:
                try:
                    os.killpg(pgid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        await proc.proc.wait()
        await proc.stop(0)  # only closes its log now
        old_label = slot.label
        kill = {"t": t, "at_s": round(self.elapsed(t), 3), "slot": slot.index, "worker": old_label,
                "worker_id": worker_id, "pids": pids, "pgids": pgids}
        self.kills.append(kill)
        slot.gen += 1
        await self.start_worker(slot)
        kill["replacement"] = slot.label
        kill["replacement_port"] = slot.port
        self.events.append(f"kill {old_label} ({worker_id}), start {slot.label}")
        self._watchers.append(asyncio.create_task(self.watch_replacement(session, slot, kill, pids)))

    async def watch_replacement(self, session: aiohttp.ClientSession, slot: Slot, kill: dict[str, Any],
                                pids: list[int]) -> None:
        """How long until the replacement is routable, and until the dead worker leaves the server's
        view (its lease expires: nobody deregistered it)."""
        deadline = kill["t"] + max(self.args.ready_timeout, 60.0)
        port, gen = slot.port, slot.gen
        await asyncio.sleep(1.0)
        kill["survivors"] = [p for p in pids if _alive(p)]  # should be none: the whole worker was SIGKILLed
        if kill["survivors"]:
            self.problems.append(f"kill of {kill['worker']}: pids {kill['survivors']} survived SIGKILL")
        while time.monotonic() < deadline and ("replacement_ready_s" not in kill or "dead_gone_s" not in kill):
            try:
                view = await self.workers_view(session)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, KeyError):
                view = None
            now = time.monotonic()
            if view is not None:
                active = self._active_by_port(view)
                if "replacement_ready_s" not in kill and port in active:
                    kill["replacement_ready_s"] = round(now - kill["t"], 2)
                    if slot.gen == gen:
                        slot.worker_id = active[port]
                    self.events.append(f"{kill['replacement']} up {kill['replacement_ready_s']:.1f}s")
                if "dead_gone_s" not in kill and not any(w["worker_id"] == kill["worker_id"] for w in view):
                    kill["dead_gone_s"] = round(now - kill["t"], 2)
                    self.events.append(f"{kill['worker']} gone {kill['dead_gone_s']:.1f}s")
            await asyncio.sleep(0.25)
        if "replacement_ready_s" not in kill:
            kill["replacement_ready_s"] = None
            self.problems.append(f"{kill['replacement']} not active within {deadline - kill['t']:.0f}s of the kill")

    # -- stop ----------------------------------------------------------------------------------------
    async def stop(self) -> None:
        if self.loadgen is not None and self.loadgen.alive and self.loadgen.proc.stdin is not None:
            try:
                await self.send({"cmd": "quit"})
                self.loadgen.proc.stdin.close()
                await asyncio.wait_for(self.loadgen.proc.wait(), 5)
            except (OSError, asyncio.TimeoutError, ConnectionError):
                pass
        if self.loadgen is not None:
            await self.loadgen.stop(3)
        # Workers first: they deregister while etcd is up.
        await asyncio.gather(*(s.proc.stop(15) for s in self.slots if s.proc is not None))
        if self.server is not None:
            await self.server.stop(10)
        if self.etcd is not None:
            await self.etcd.stop()


def request_bodies(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [{"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
             "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}} for prompt in PROMPTS]


# ------------------------------------------------------------------------------------------- main
def print_summary(summary: dict[str, Any], kills: list[dict[str, Any]], failures: list[dict[str, Any]],
                  done: dict[str, Any] | None) -> None:
    print()
    if done:
        print(f"requests: {done['ok']} ok, {done['failed']} failed of {done['sent']} sent; latency p50 "
              f"{done['lat_p50_ms']} ms, p99 {done['lat_p99_ms']} ms, max {done['lat_max_ms']} ms; TTFT p50 "
              f"{done['ttft_p50_ms']} ms")
    if summary.get("samples_after_warmup"):
        print(f"server after warm-up: RSS {summary['rss_first_mib']:.1f} → {summary['rss_last_mib']:.1f} MiB "
              f"({summary['rss_growth_pct']:+.2f} %, medians of the first/last {summary['edge_samples']} samples), "
              f"fds {summary['fds_min']}–{summary['fds_max']} (median of the first {summary['edge_samples']} "
              f"{summary['fds_first']:g}, highest outside kill windows {summary['fds_peak_steady']}), "
              f"TCP conns {summary['conns_min']}–{summary['conns_max']}")
    print(f"failures: {summary['failed_kill_caused']} kill-caused, {summary['failed_unexplained']} unexplained, "
          f"{summary['hangs']} hangs; by kind {summary['failures_by_kind'] or '{}'}")
    for i, k in enumerate(kills):
        caused = sum(1 for f in failures if f["kill"] == i)
        print(f"  kill at {k['at_s']:6.1f}s {k['worker']:<5} ({k['worker_id']}): {caused} kill-caused failure(s); "
              f"replacement {k.get('replacement')} active after {k.get('replacement_ready_s')} s; dead record gone "
              f"after {k.get('dead_gone_s')} s" + (f"; SURVIVORS {k['survivors']}" if k.get("survivors") else ""))
    others = [f for f in failures if f["class"] != "kill"][:10]
    if others:
        print("unexplained failures and hangs (first 10):")
        for f in others:
            print(f"  t={f['t']:.1f}s {f['class']} {f['kind']} {f.get('status') or ''} worker={f.get('worker')} "
                  f"first_byte={f['first_byte']} rid={f['rid']}: {f['msg'][:160]}")


async def run(args: argparse.Namespace) -> int:
    out_path = os.path.abspath(args.out)
    logs_dir = os.path.splitext(out_path)[0] + "_logs"
    os.makedirs(logs_dir, exist_ok=True)
    loop = asyncio.get_running_loop()
    measuring = asyncio.current_task()
    interrupted: list[int] = []

    def on_signal(sig: int) -> None:
        # First signal: stop the load, then stop the fleet and write what was measured.
        interrupted.append(128 + sig)
        measuring.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)

    print(f"soak: {args.workers} sim workers (speedup {args.speedup:g}), {args.concurrency} streams × "
          f"max_tokens {args.max_tokens}, {args.duration:g}s (warm-up {args.warmup:g}s), kill every "
          f"{args.kill_every:g}s, sample every {args.sample_every:g}s, policy {args.router_policy}"
          + (f", server args {args.server_arg}" if args.server_arg else "")
          + f"; cpus={os.cpu_count()}, loadavg={os.getloadavg()[0]:.2f}; logs in {logs_dir}", flush=True)
    soak = Soak(args, logs_dir)
    started = time.time()
    load_before = os.getloadavg()
    fatal: str | None = None
    try:
        async with aiohttp.ClientSession() as session:
            try:
                await soak.start()
                await soak.wait_ready(session)
                await soak.preflight(session)
                hello = await soak.read_line(timeout=30)
                if not hello.get("ready"):
                    raise FleetError(f"the load generator did not start: {hello}")
            except (FleetError, RuntimeError, OSError, asyncio.TimeoutError) as exc:
                print(f"soak: could not start the fleet: {exc}", file=sys.stderr)
                return 2
            print(f"  fleet up in {time.time() - started:.1f}s: server {soak.router_url} (pid {soak.server.proc.pid}), "
                  f"workers {', '.join(f'{s.label}={s.worker_id}' for s in soak.slots)}, loadgen pid "
                  f"{soak.loadgen.proc.pid}", flush=True)
            try:
                await soak.run_load(session)
            except FleetError as exc:
                fatal = str(exc)
                print(f"soak: aborted: {exc}", file=sys.stderr)
    except asyncio.CancelledError:
        if not interrupted:
            raise
        measuring.uncancel()  # handled: the teardown below must not look cancelled to asyncio.timeout
        print("soak: interrupted; stopping the fleet and writing what was measured", file=sys.stderr)
    finally:
        # A second signal during teardown kills us; atexit then SIGKILLs what is left.
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        print("  stopping the fleet…", flush=True)
        await soak.stop()

    summary = report.summarize(soak.samples, soak.kills, soak.failures, args.kill_every)
    checks = report.checks(summary)
    if fatal:
        checks.append({"check": "the run completed", "status": "FAIL", "detail": fatal})
    for problem in soak.problems:
        checks.append({"check": "fleet behaved", "status": "FAIL", "detail": problem})
    if interrupted:
        checks.append({"check": "the run completed", "status": "FAIL", "detail": "interrupted"})
    print_summary(summary, soak.kills, soak.failures, soak.done)
    print()
    for c in checks:
        print(f"[{c['status']}] {c['check']}: {c['detail']}")
    if args.quick:
        print("(--quick is a smoke run: 45 s after a 15 s warm-up is too short to judge RSS growth; the full run "
              "decides)")

    out = {
        "meta": {"benchmark": "soak", "model": MODEL, "workers": args.workers, "concurrency": args.concurrency,
                 "duration_s": args.duration, "warmup_s": args.warmup, "kill_every_s": args.kill_every,
                 "sample_every_s": args.sample_every, "kill_window_s": args.kill_window,
                 "hang_timeout_s": args.hang_timeout, "router_policy": args.router_policy,
                 "server_args": args.server_arg, "speedup": args.speedup, "max_tokens": args.max_tokens,
                 "max_num_seqs": args.max_num_seqs, "quick": args.quick, "router_url": soak.router_url,
                 "started_at": started, "wall_s": round(time.time() - started, 2), "cpu_count": os.cpu_count(),
                 "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "python": sys.version.split()[0],
                 "aiohttp": aiohttp.__version__, "platform": platform.platform(), "git_commit": _git_commit(),
                 "argv": sys.argv, "interrupted": bool(interrupted), "fatal": fatal},
        "summary": summary,
        "checks": checks,
        "loadgen": soak.done,
        "kills": [{k: v for k, v in kill.items() if k != "t"} for kill in soak.kills],
        "samples": soak.samples,
        "failures": soak.failures,
    }
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\nresults: {out_path}  (wall {out['meta']['wall_s']:.0f}s)")
    if interrupted:
        return interrupted[0]
    return 1 if any(c["status"] == "FAIL" for c in checks) else 0


def main(argv: list[str] | None = None) -> None:
    args = resolve_args(argv)
    try:
        code = asyncio.run(run(args))
    except KeyboardInterrupt:
        print("soak: interrupted", file=sys.stderr)
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
