"""The circuit breaker through a real server, against fake engines over loopback HTTP.

Small cooldown flags keep the tests short; every wait is on a condition with a deadline.
"""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from infera.engine.base.prom import sample_sum
from tests.conftest import wait_for
from tests.integration.test_pd_router import FakeEngine, chat, post
from tests.integration.test_router_errors import CHAT, FakeWorker

CLOSED, HALF_OPEN, OPEN = 0, 1, 2
# A serial protocol (the prefill's reply shapes the decode) and a concurrent one (both legs at once).
PROTOCOL_META = {
    "vllm-nixl": {role: {"protocol": "vllm-nixl", "params": {"engine_id": "e"}} for role in ("prefill", "decode")},
    "sglang-bootstrap": {"prefill": {"protocol": "sglang-bootstrap", "params": {"bootstrap_addr": "127.0.0.1:8998"}},
                         "decode": {"protocol": "sglang-bootstrap", "params": {}}},
}


class SwitchableWorker(FakeWorker):
    """FakeWorker plus a ``hang`` mode (never answers; counts the router aborting it) and an event
    set whenever a request arrives."""

    def __init__(self, mode: str = "ok") -> None:
        super().__init__(mode)
        self.arrived = asyncio.Event()
        self.cancelled = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.arrived.set()
        if self.mode != "hang":
            return await super().handle(request)
        self.hits += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        raise AssertionError("unreachable")


@pytest.fixture
async def env(fed_server):
    started: list = []

    async def worker(mode: str = "ok") -> SwitchableWorker:
        w = await SwitchableWorker(mode).start()
        started.append(w)
        return w

    async def engine(name: str, mode: str, protocol: str = "vllm-nixl", **kw) -> FakeEngine:
        e = await FakeEngine(name, mode, PROTOCOL_META[protocol][mode], **kw).start()
        started.append(e)
        return e

    async with aiohttp.ClientSession() as session:
        yield fed_server, worker, engine, session
    for w in started:
        await w.stop()


async def breaker_metrics(session: aiohttp.ClientSession, base: str, worker_id: str) -> tuple[float, float]:
    async with session.get(base + "/metrics") as r:
        text = await r.text()
    label = f'worker_id="{worker_id}"'
    return sample_sum(text, "infera_router_worker_breaker_state", label), sample_sum(text, "infera_router_worker_breaker_trips_total", label)


async def chat_ok(session: aiohttp.ClientSession, base: str, stream: bool) -> None:
    async with session.post(base + "/v1/chat/completions", json={**CHAT, "stream": stream}) as r:
        body = await r.read()
        assert r.status == 200, body
        assert (b"[DONE]" in body) if stream else (b'"ok"' in body)


@pytest.mark.parametrize("stream", [False, True])
async def test_failing_worker_is_opened_skipped_then_probed_back(env, stream):
    server, worker, _, s = env
    # The cooldown must outlast the few loopback requests of the "skipped" phase below.
    srv, base = await server("--breaker-failure-threshold", "2", "--breaker-cooldown-s", "2",
                             "--breaker-max-cooldown-s", "2", "--request-max-retries", "1")
    bad, good = await worker("500"), await worker()
    bad_id = bad.record().worker_id
    srv.fleet.upsert(bad.record())
    srv.fleet.upsert(good.record())
    for _ in range(10):  # round-robin: the bad worker is tried every other request; retries hide it
        await chat_ok(s, base, stream)
        if bad.hits == 2:
            break
    assert bad.hits == 2
    assert await breaker_metrics(s, base, bad_id) == (OPEN, 1)
    assert await breaker_metrics(s, base, good.record().worker_id) == (CLOSED, 0)

    good_before = good.hits
    for _ in range(6):
        await chat_ok(s, base, stream)
    assert bad.hits == 2 and good.hits == good_before + 6  # open: the healthy worker gets all of them

    bad.mode = "ok"  # recovered: the probe after the cooldown succeeds

    async def probed() -> bool:
        await chat_ok(s, base, stream)
        return bad.hits > 2

    await wait_for(probed, timeout=15, message="a probe request on the recovered worker")
    assert bad.hits == 3
    assert await breaker_metrics(s, base, bad_id) == (CLOSED, 1)
    for _ in range(4):  # closed again: back in the rotation
        await chat_ok(s, base, stream)
    assert bad.hits == 5


@pytest.mark.parametrize("stream", [False, True])
async def test_4xx_never_opens(env, stream):
    server, worker, engine, s = env
    srv, base = await server("--breaker-failure-threshold", "1", "--request-max-retries", "2")
    w400, good = await worker("400"), await worker()
    srv.fleet.upsert(w400.record())
    srv.fleet.upsert(good.record())
    statuses = []
    for _ in range(6):
        async with s.post(base + "/v1/chat/completions", json={**CHAT, "stream": stream}) as r:
            statuses.append(r.status)
    assert sorted(statuses) == [200] * 3 + [400] * 3 and w400.hits == 3  # still in the rotation
    assert await breaker_metrics(s, base, w400.record().worker_id) == (CLOSED, 0)


async def test_pd_4xx_from_either_leg_never_opens(env):
    server, _, engine, s = env
    srv, base = await server("--breaker-failure-threshold", "1")
    p = await engine("p0", "prefill", behaviour="400")
    p_ok, d = await engine("p1", "prefill"), await engine("d0", "decode", behaviour="400")
    srv.fleet.replace_all([p.record(), p_ok.record(), d.record()])
    for _ in range(4):
        status, _ = await post(s, base + "/v1/chat/completions", chat())
        assert status == 400
    assert len(p.bodies) == len(p_ok.bodies) == 2 and len(d.bodies) == 2  # every worker still picked
    for wid in ("p0", "p1", "d0"):
        assert await breaker_metrics(s, base, wid) == (CLOSED, 0), wid


# Threshold 1: a single misplaced failure on the partner would open it. Threshold 2: the partner's
# successes in between do not reset the failing worker's count (each leg is its own worker's).
@pytest.mark.parametrize("threshold", [1, 2])
# (A concurrent pair's failing prefill is left out: the decode may answer first, and the prefill's
# failure is then scored after the reply, racing the next request's pick.)
@pytest.mark.parametrize("protocol, failing, behaviour", [
    ("vllm-nixl", "decode", "500"), ("vllm-nixl", "prefill", "500"), ("vllm-nixl", "prefill", "no-handoff"),
    ("sglang-bootstrap", "decode", "500")])
async def test_pd_failing_worker_is_avoided_and_its_partner_not_blamed(env, protocol, failing, behaviour, threshold):
    server, _, engine, s = env
    srv, base = await server("--breaker-failure-threshold", str(threshold), "--request-max-retries", "1")
    other_role = "prefill" if failing == "decode" else "decode"
    bad = await engine(f"{failing}-bad", failing, protocol, behaviour=behaviour)
    good = await engine(f"{failing}-good", failing, protocol)
    partner = await engine(f"{other_role}-only", other_role, protocol)
    srv.fleet.replace_all([bad.record(), good.record(), partner.record()])
    for _ in range(8):
        status, reply = await post(s, base + "/v1/chat/completions", chat())
        assert status == 200, reply
    assert len(bad.bodies) == threshold and len(good.bodies) == 8  # opened at the threshold, then avoided
    assert await breaker_metrics(s, base, f"{failing}-bad") == (OPEN, 1)
    # Each leg is scored on its own worker: the partner served every attempt and is not blamed.
    assert await breaker_metrics(s, base, f"{other_role}-only") == (CLOSED, 0)
    assert await breaker_metrics(s, base, f"{failing}-good") == (CLOSED, 0)


async def test_client_leaving_during_the_probe_frees_the_probe_slot(env):
    server, worker, _, s = env
    # Probe timeout is 60 s: only the neutral verdict on the cancelled probe lets a second probe
    # through within the deadline below.
    srv, base = await server("--breaker-failure-threshold", "1", "--breaker-cooldown-s", "0.2",
                             "--breaker-max-cooldown-s", "0.2", "--request-max-retries", "1")
    bad, good = await worker("500"), await worker()
    bad_id = bad.record().worker_id
    srv.fleet.upsert(bad.record())
    srv.fleet.upsert(good.record())
    for _ in range(4):
        await chat_ok(s, base, False)
        if bad.hits:
            break
    assert await breaker_metrics(s, base, bad_id) == (OPEN, 1)

    bad.mode, bad.hits = "hang", 0
    bad.arrived.clear()
    deadline = asyncio.get_running_loop().time() + 15
    while not bad.arrived.is_set():  # requests go to the healthy worker until the cooldown ends
        request = asyncio.create_task(chat_ok(s, base, False))
        arrival = asyncio.create_task(bad.arrived.wait())
        await asyncio.wait((request, arrival), timeout=max(0.0, deadline - asyncio.get_running_loop().time()),
                           return_when=asyncio.FIRST_COMPLETED)
        arrival.cancel()
        if request.done():
            request.result()
        else:
            request.cancel()  # the probe hangs: the client gives up before the first byte
            await asyncio.gather(request, return_exceptions=True)
        assert asyncio.get_running_loop().time() < deadline, "no probe reached the opened worker"
    await wait_for(lambda: bad.cancelled == 1, timeout=10, message="the router aborting the probe")
    assert await breaker_metrics(s, base, bad_id) == (HALF_OPEN, 1)  # no blame for the client leaving

    bad.mode = "ok"
    hits = bad.hits

    async def probed() -> bool:
        await chat_ok(s, base, False)
        return bad.hits > hits

    await wait_for(probed, timeout=10, message="a second probe on the freed slot")
    assert await breaker_metrics(s, base, bad_id) == (CLOSED, 1)
