"""Integration fixtures: a real etcd, in-process servers, real sim workers as subprocesses."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

import aiohttp
import pytest

from infera.server.cli import parse_args
from infera.server.main import InferaServer
from tests.conftest import free_port, wait_for


class EtcdProcess:
    """A real etcd for the test session (sync, so it outlives every test's event loop)."""

    def __init__(self) -> None:
        from infera.discovery.embedded_etcd import find_etcd_binary

        self.binary = find_etcd_binary()
        self.data_dir = tempfile.mkdtemp(prefix="infera-test-etcd-")
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, wipe: bool = False) -> None:
        if wipe:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            os.makedirs(self.data_dir)
        c, p = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        log = open(os.path.join(os.path.dirname(self.data_dir), os.path.basename(self.data_dir) + ".log"), "ab")
        self.proc = subprocess.Popen(
            [self.binary, "--name", "t", "--data-dir", self.data_dir, "--listen-client-urls", c,
             "--advertise-client-urls", c, "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
             "--initial-cluster", f"t={p}"], stdout=log, stderr=log)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(c + "/health", timeout=1) as r:
                    if b"true" in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("etcd did not become healthy")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def etcd():
    e = EtcdProcess()
    e.start()
    yield e
    e.cleanup()


@pytest.fixture
def prefix():
    """A key prefix of its own per test, so tests sharing one etcd never see each other's workers."""
    return f"/infera-test/{uuid.uuid4().hex[:8]}/"


@pytest.fixture
async def make_server(etcd, prefix):
    servers: list[InferaServer] = []

    async def factory(*extra: str, endpoint: str | None = None) -> InferaServer:
        args = parse_args(["--host", "127.0.0.1", "--port", "0", "--etcd-endpoint", endpoint or etcd.endpoint,
                           "--etcd-prefix", prefix, *extra], environ={})
        server = InferaServer(args)
        await server.start()
        servers.append(server)
        return server

    yield factory
    for s in servers:
        await s.stop()


class Worker:
    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc = proc
        self.port = port
        self.worker_id = f"127.0.0.1:{port}"
        self.url = f"http://127.0.0.1:{port}"

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    async def engine_metric(self, session: aiohttp.ClientSession, name: str) -> float:
        async with session.get(self.url + "/metrics") as r:
            text = await r.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.fixture
async def spawn_worker(etcd, prefix):
    workers: list[Worker] = []

    async def factory(*engine_args: str, model: str = "sim-model", lease_ttl: float = 2.0, speedup: float = 50.0,
                      launcher_args: tuple[str, ...] = (), endpoint: str | None = None) -> Worker:
        port = free_port()
        cmd = [sys.executable, "-m", "infera.engine.sim", "--etcd-endpoint", endpoint or etcd.endpoint,
               "--etcd-prefix", prefix, "--lease-ttl", str(lease_ttl), "--drain-settle", "0.3", *launcher_args,
               "--model", model, "--port", str(port), "--host", "127.0.0.1", "--speedup", str(speedup), *engine_args]
        proc = await asyncio.create_subprocess_exec(*cmd, start_new_session=True)
        w = Worker(proc, port)
        workers.append(w)
        return w

    yield factory
    for w in workers:
        if w.proc.returncode is None:
            try:
                os.killpg(w.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await w.proc.wait()
        try:  # the engine child is in the launcher's group; make sure nothing outlives the test
            os.killpg(w.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def fleet_ids(server: InferaServer) -> set[str]:
    return {r.worker_id for r in server.fleet.all()}


async def wait_workers(server: InferaServer, ids: set[str], timeout: float = 30) -> float:
    return await wait_for(lambda: {r.worker_id for r in server.fleet.active()} == ids, timeout,
                          message=f"fleet == {sorted(ids)}")
