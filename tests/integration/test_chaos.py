"""Chaos under load (short forms, for CI): etcd killed and restarted, and a worker whose record
flaps every second. Neither may cost a request while the engines themselves live. (SIGKILL and
SIGSTOP of workers: test_migration.py and test_http_timeouts.py.)"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

import aiohttp

from infera.discovery.embedded_etcd import EmbeddedEtcd
from infera.discovery.etcd import EtcdRegistration
from infera.discovery.record import WorkerRecord
from infera.engine.sim.server import SimServer, parse_args as sim_args
from infera.engine.base.prom import sample_sum
from tests.conftest import wait_for
from tests.integration.conftest import wait_workers

MODEL = "sim-model"


async def became_true(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Whether ``predicate`` holds within ``timeout`` (polled); unlike ``wait_for``, not holding is
    an answer, not a failure."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(interval)
    return True


class Load:
    """``clients`` closed-loop clients alternating unary and streamed completions until stopped;
    every non-200 status, SSE error event, missing [DONE] or transport error is a failure."""

    def __init__(self, base_url: str, clients: int = 8) -> None:
        self.base_url = base_url
        self.clients = clients
        self.ok = 0
        self.failures: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> "Load":
        self._http = aiohttp.ClientSession(self.base_url, timeout=aiohttp.ClientTimeout(total=30))
        self._tasks = [asyncio.ensure_future(self._client(i)) for i in range(self.clients)]
        return self

    async def __aexit__(self, *exc) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), 60)
        await self._http.close()

    async def _client(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            stream = n % 2 == 0
            body = {"model": MODEL, "prompt": f"client {i} request {n}", "max_tokens": 8, "stream": stream}
            try:
                async with self._http.post("/v1/completions", json=body) as r:
                    text = await r.text()
                    if r.status != 200:
                        self.failures.append(f"{r.status}: {text[:200]}")
                    elif stream and ('"error"' in text or "data: [DONE]" not in text):
                        self.failures.append(f"broken stream: {text[-200:]}")
                    else:
                        self.ok += 1
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                self.failures.append(f"transport: {exc!r}")

    async def wait_ok(self, more: int, timeout: float = 20) -> None:
        target = self.ok + more
        await wait_for(lambda: self.ok >= target, timeout, message=f"{more} more successful requests")


async def test_etcd_killed_and_restarted_under_load_fails_no_request(make_server, spawn_worker):
    etcd = EmbeddedEtcd(unsafe_no_fsync=True)
    await etcd.start()
    try:
        workers = [await spawn_worker(endpoint=etcd.endpoint, lease_ttl=3) for _ in range(2)]
        server = await make_server("--router-policy", "round-robin", endpoint=etcd.endpoint)
        await wait_workers(server, {w.worker_id for w in workers})
        async with Load(f"http://127.0.0.1:{server.port}") as load:
            await load.wait_ok(50)
            await etcd.kill()
            # The outage outlasts the workers' 3 s leases: nobody may drop them meanwhile.
            outage_end = asyncio.get_running_loop().time() + 5
            while asyncio.get_running_loop().time() < outage_end:
                await load.wait_ok(20)
            assert {r.worker_id for r in server.fleet.active()} == {w.worker_id for w in workers}
            await etcd.restart()
            await load.wait_ok(100)
        assert not load.failures, load.failures[:5]
        # Converged again after the restart: both workers still registered and routed to.
        await wait_workers(server, {w.worker_id for w in workers})
    finally:
        await etcd.stop()


async def test_a_flapping_worker_costs_no_request(make_server, spawn_worker, etcd, prefix):
    steady = await spawn_worker()
    server = await make_server("--router-policy", "round-robin")
    await wait_workers(server, {steady.worker_id})
    flapper = SimServer(sim_args(["--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--speedup", "50"]))
    await flapper.start()
    record = WorkerRecord(worker_id=f"flapper-{flapper.url.rsplit(':', 1)[1]}", url=flapper.url, model_name=MODEL)
    flaps = 0
    seen_flaps = 0
    try:
        async with Load(f"http://127.0.0.1:{server.port}") as load:
            for _ in range(6):  # register for ~0.5 s, gone for ~0.5 s: every second, six times
                reg = EtcdRegistration(f"http://{etcd.endpoint}", prefix, ttl=2)
                await reg.register(record)
                # A flap the server does not see within 2 s is tolerated (the box is loaded); one
                # it sees must cost nothing, and it must see at least one (asserted below).
                seen_flaps += await became_true(lambda: server.fleet.get(record.worker_id) is not None, 2)
                await load.wait_ok(10)
                await reg.deregister()
                await reg.close()
                await wait_for(lambda: server.fleet.get(record.worker_id) is None, 5, message="flapper gone")
                await load.wait_ok(10)
                flaps += 1
        assert flaps == 6 and seen_flaps >= 1, f"the server saw {seen_flaps} of 6 registrations"
        assert not load.failures, load.failures[:5]
        async with aiohttp.ClientSession() as http, http.get(flapper.url + "/metrics") as r:
            served = sample_sum(await r.text(), "vllm:request_success_total")
        assert served > 0  # it really was routed to while registered
    finally:
        await flapper.stop()
