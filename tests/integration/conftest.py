"""Integration fixtures: a real etcd, in-process servers, real sim workers as subprocesses."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid

import aiohttp
import pytest
from aiohttp import web

from infera.engine.base.prom import sample_sum
from infera.server.cli import parse_args
from infera.server.main import InferaServer
from tests.conftest import EtcdProcess, NatsProcess, free_port, wait_for


@pytest.fixture(scope="session")
def etcd():
    e = EtcdProcess()
    e.start()
    yield e
    e.cleanup()


@pytest.fixture(scope="session")
def nats_server():
    """A real nats-server with JetStream, shared by the session (subjects are per worker id, and
    worker ids carry free ports, so tests do not see each other's traffic)."""
    n = NatsProcess(max_payload=8 * 1024 * 1024)
    n.start()
    yield n
    n.cleanup()


@pytest.fixture
def own_nats_server():
    """A nats-server of the test's own, for tests that stop or restart the broker."""
    n = NatsProcess(max_payload=8 * 1024 * 1024)
    n.start()
    yield n
    n.cleanup()


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
        return sample_sum(text, name)


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


async def fleet_ids(server: InferaServer) -> set[str]:
    return {r.worker_id for r in server.fleet.all()}


async def wait_workers(server: InferaServer, ids: set[str], timeout: float = 30) -> float:
    return await wait_for(lambda: {r.worker_id for r in server.fleet.active()} == ids, timeout,
                          message=f"fleet == {sorted(ids)}")


# -- servers fed by the test itself, and fake engines on loopback ---------------------------------

class NoDiscovery:
    """The test feeds ``server.fleet`` directly: exactly the workers it needs, no etcd."""

    async def start(self, fleet) -> None:
        pass

    async def stop(self) -> None:
        pass


@pytest.fixture
async def fed_server():
    """``await fed_server(*flags) -> (server, base_url)``; round-robin unless the flags say otherwise
    (dispatch semantics, not policy, are what these tests look at)."""
    servers: list[InferaServer] = []

    async def factory(*flags: str) -> tuple[InferaServer, str]:
        policy = [] if "--router-policy" in flags else ["--router-policy", "round-robin"]
        server = InferaServer(parse_args(["--port", "0", "--host", "127.0.0.1", "--etcd-endpoint", "unused:1",
                                          *policy, *flags], environ={}), discovery=NoDiscovery())
        await server.start()
        servers.append(server)
        return server, f"http://127.0.0.1:{server.port}"

    yield factory
    for s in servers:
        await s.stop()


class LoopbackEngine:
    """A fake engine's HTTP side: ``handle`` serves both OpenAI routes on a free loopback port; a
    client disconnect cancels the handler, as it does in the engines."""

    runner: web.AppRunner | None = None
    port = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        raise NotImplementedError

    async def start(self):
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_post("/v1/completions", self.handle)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()
