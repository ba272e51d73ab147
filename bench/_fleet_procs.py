"""The processes of ``bench/fleet_scale.py``: the engines' publisher processes, their JetStream
relays (``--mode nats``), the server under test (its readiness, CPU, memory and KV-event
metrics). See ``fleet_scale.py`` for what is measured with them."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
import time
from typing import Any

import aiohttp

from _fleet_report import parse_kv_metrics, percentile
from infera.discovery.record import WorkerRecord, encode_record
from server_workers import Proc, children_of, cpu_ns, free_port, pin

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
PREFIX = "/infera/bench-fleet-scale/"  # the fleet's records


class Publishers:
    """The publisher processes; engine ``e`` lives in process ``e % count``."""

    def __init__(self, args: argparse.Namespace, sharing: float, log_dir: str) -> None:
        self.count = min(args.publishers, max(args.engines))
        self.procs = [Proc(f"publisher{i}-s{sharing:g}",
                           [sys.executable, os.path.join(BENCH_DIR, "_fleet_publisher.py"), "--count",
                            str(max(args.engines)), "--procs", str(self.count), "--index", str(i),
                            "--seed", str(args.seed), "--pool", str(args.pool), "--sharing", str(sharing)], log_dir)
                      for i in range(self.count)]
        self.endpoints: dict[int, tuple[str, str]] = {}
        self.pids: list[int] = []
        self.info: list[dict] = []

    async def start(self, timeout: float) -> None:
        await asyncio.gather(*(p.start(stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
                               for p in self.procs))
        for p in self.procs:
            line = await asyncio.wait_for(p.proc.stdout.readline(), timeout)
            if not line:
                raise RuntimeError(f"{p.name} did not start: {p.log_tail()}")
            hello = json.loads(line)
            self.info.append({k: v for k, v in hello.items() if k != "engines"})
            self.endpoints.update({int(e): tuple(eps) for e, eps in hello["engines"].items()})
        self.pids = [p.pid for p in self.procs]

    async def _ask(self, i: int, cmd: dict) -> dict:
        p = self.procs[i].proc
        p.stdin.write((json.dumps(cmd) + "\n").encode())
        await p.stdin.drain()
        line = await p.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.procs[i].name} exited: {self.procs[i].log_tail()}")
        return json.loads(line)

    async def command(self, cmd: str, engines: list[int], rate: float = 0.0, **kw: Any) -> list[dict]:
        """``cmd`` to every process for its share of ``engines``; ``rate`` split by engine count."""
        parts = [[e for e in engines if e % self.count == i] for i in range(self.count)]
        return list(await asyncio.gather(*(
            self._ask(i, {"cmd": cmd, "engines": part, "rate": rate * len(part) / len(engines), **kw})
            for i, part in enumerate(parts) if part)))

    async def stop(self) -> None:
        for p in self.procs:
            try:
                if p.proc is not None and p.proc.returncode is None:
                    p.proc.stdin.write(b'{"cmd": "quit"}\n')
            except (BrokenPipeError, ConnectionResetError):
                pass
        await asyncio.gather(*(p.stop(10) for p in self.procs))


class Relays:
    """``--mode nats``: the relay processes, one per publisher process, with the same engines."""

    def __init__(self, count: int, nats_url: str, log_dir: str) -> None:
        self.count = count
        self.procs = [Proc(f"relay{i}", [sys.executable, os.path.join(BENCH_DIR, "_fleet_relay.py"),
                                         "--nats-server", nats_url], log_dir) for i in range(count)]
        self.pids: list[int] = []

    async def start(self, timeout: float) -> None:
        await asyncio.gather(*(p.start(stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
                               for p in self.procs))
        for p in self.procs:
            line = await asyncio.wait_for(p.proc.stdout.readline(), timeout)
            if not line or not json.loads(line).get("ready"):
                raise RuntimeError(f"{p.name} did not start: {line!r} {p.log_tail()}")
        self.pids = [p.pid for p in self.procs]

    async def _ask(self, i: int, cmd: dict) -> dict:
        p = self.procs[i]
        p.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        await p.proc.stdin.drain()
        line = await p.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{p.name} exited: {p.log_tail()}")
        out = json.loads(line)
        if not out.get("ok"):
            raise RuntimeError(f"{p.name}: {out}")
        return out

    async def relay(self, records: dict[int, WorkerRecord]) -> None:
        parts = [[encode_record(r).decode() for e, r in records.items() if e % self.count == i]
                 for i in range(self.count)]
        await asyncio.gather(*(self._ask(i, {"cmd": "start", "records": part}) for i, part in enumerate(parts) if part))

    async def stop_relaying(self) -> None:
        await asyncio.gather(*(self._ask(i, {"cmd": "stop"}) for i in range(self.count)))

    async def stop(self) -> None:
        for p in self.procs:
            try:
                if p.proc is not None and p.proc.returncode is None:
                    p.proc.stdin.write(b'{"cmd": "quit"}\n')
            except (BrokenPipeError, ConnectionResetError):
                pass
        await asyncio.gather(*(p.stop(15) for p in self.procs))


def memory(pids: list[int]) -> tuple[int, int]:
    """(PSS, RSS) in bytes, summed over ``pids``."""
    pss = rss = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
                    elif line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
        except OSError:
            pass
    return pss, rss


class Server:
    def __init__(self, args: argparse.Namespace, etcd_url: str, workers: int, log_dir: str, tag: str,
                 nats_url: str | None = None) -> None:
        self.port = free_port()
        self.workers = workers
        self.proc = Proc(f"server-{tag}", [sys.executable, "-m", "infera.server", "--host", "127.0.0.1", "--port",
                                          str(self.port), "--etcd-endpoint", etcd_url, "--etcd-prefix", PREFIX,
                                          "--workers", str(workers), "--router-policy", "kv-aware",
                                          "--engine-scrape-interval", "0", "--log-level", "warning",
                                          *(["--kv-event-transport", "nats", "--nats-server", nats_url]
                                            if nats_url else [])], log_dir)
        self.pids: list[int] = []
        self.url = f"http://127.0.0.1:{self.port}"
        self.scrape_cpu_s = 0.0
        self.scrapes = 0
        # /v1/admin/cache-view needs an admin token (which then guards /metrics too); in the env, not argv
        self.token = secrets.token_urlsafe(24)
        self.auth = {"Authorization": f"Bearer {self.token}"}

    async def start(self, fleet: int, timeout: float, cores: list[int] | None) -> None:
        await self.proc.start(env={**os.environ, "INFERA_ADMIN_TOKEN": self.token})
        if cores:
            pin([self.proc.pid], cores)  # before its children exist: they inherit it
        serving = await self.wait_ready(fleet, timeout)
        self.pids = sorted({self.proc.pid, *serving, *children_of(self.proc.pid)})
        if cores:
            pin(self.pids, cores)

    async def wait_ready(self, fleet: int, timeout: float) -> list[int]:
        """Until every process answers /health with the whole fleet active (the detailed /health,
        with the token: it names the process); returns the pids serving."""
        deadline = time.monotonic() + timeout
        seen: dict[int, int] = {}
        while time.monotonic() < deadline:
            if self.proc.proc.returncode is not None:
                raise RuntimeError(f"{self.proc.name} exited: {self.proc.log_tail()}")
            serving = children_of(self.proc.pid) if self.workers > 1 else [self.proc.pid]
            try:
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                    for _ in range(4 * self.workers):
                        async with s.get(f"{self.url}/health", headers=self.auth) as r:
                            body = await r.json()
                        seen[body.get("process", {}).get("pid", self.proc.pid)] = body["active_workers"]
            except (aiohttp.ClientError, OSError, KeyError, ValueError):
                pass
            if len(serving) == self.workers and all(seen.get(p, 0) >= fleet for p in serving):
                return serving
            await asyncio.sleep(0.2)
        raise RuntimeError(f"{self.proc.name}: not every process saw the fleet in {timeout:.0f}s")

    def cpu_s(self) -> float:
        return cpu_ns(self.pids) / 1e9

    async def kv(self, session: aiohttp.ClientSession) -> dict:
        self.scrapes += 1
        async with session.get(f"{self.url}/metrics", headers=self.auth) as r:
            r.raise_for_status()
            return parse_kv_metrics(await r.text())

    async def measure_scrape_cpu(self, session: aiohttp.ClientSession, n: int = 3) -> None:
        c0 = self.cpu_s()
        for _ in range(n):
            await self.kv(session)
        self.scrape_cpu_s = (self.cpu_s() - c0) / n

    async def scrape_stall(self, session: aiohttp.ClientSession, scrapes: int = 6, gap_s: float = 0.5,
                           probe_s: float = 0.005) -> dict:
        """What a scrape holds the server's event loop for: ``GET /health`` every ``probe_s``, each on
        a new connection (so a --workers N server's processes all answer some), for 2 s alone and then
        while /metrics is read ``scrapes`` times ``gap_s`` apart."""
        async def probe(stop: asyncio.Event, waits: list[float]) -> None:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as fresh:
                while not stop.is_set():
                    t = time.perf_counter()
                    async with fresh.get(f"{self.url}/health") as r:
                        await r.read()
                    waits.append(1000 * (time.perf_counter() - t))
                    await asyncio.sleep(probe_s)

        idle: list[float] = []
        stop = asyncio.Event()
        prober = asyncio.ensure_future(probe(stop, idle))
        await asyncio.sleep(2.0)
        stop.set()
        await prober
        during: list[float] = []
        walls = []
        stop = asyncio.Event()
        prober = asyncio.ensure_future(probe(stop, during))
        for _ in range(scrapes):
            t = time.perf_counter()
            await self.kv(session)
            walls.append(1000 * (time.perf_counter() - t))
            await asyncio.sleep(gap_s)
        stop.set()
        await prober
        return {"health_idle_p99_ms": percentile(idle, 99), "health_scrape_p50_ms": percentile(during, 50),
                "health_scrape_p99_ms": percentile(during, 99), "health_scrape_max_ms": max(during),
                "scrape_wall_ms": statistics.median(walls)}
