"""The fair queue (infera/server/admission.py): admission up to capacity, fairness between a heavy
and a light tenant, priority classes first, the queue's bounds (timeout 429, full 503), a client
that leaves while waiting, capacity that grows with the fleet."""
from __future__ import annotations

import asyncio

import pytest

from infera.api.errors import ApiError
from infera.server.admission import AdmissionMetrics, AdmissionQueue


def queue(capacity: int = 2, **kw) -> tuple[AdmissionQueue, dict]:
    cap = {"m": capacity}
    return AdmissionQueue(lambda model: cap.get(model, 0), **kw), cap


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def test_admits_up_to_capacity_then_queues_and_hands_freed_slots_on():
    q, _ = queue(2)
    a, b = await q.enter("m", "t"), await q.enter("m", "t")
    third = asyncio.ensure_future(q.enter("m", "t"))
    await settle()
    assert not third.done() and q.snapshot()["m"] == {"inflight": 2, "waiting": 1, "capacity": 2}
    a.leave()
    a.leave()  # once only
    c = await asyncio.wait_for(third, 1)
    assert q.snapshot()["m"]["inflight"] == 2
    b.leave(), c.leave()
    assert q.snapshot()["m"]["inflight"] == 0


async def test_a_light_tenant_never_waits_behind_a_heavy_backlog():
    q, _ = queue(1)
    held = await q.enter("m", "heavy")
    order: list[str] = []

    async def request(tenant: str) -> None:
        ticket = await q.enter("m", tenant)
        order.append(tenant)
        await asyncio.sleep(0)
        ticket.leave()

    tasks = [asyncio.ensure_future(request("heavy")) for _ in range(6)]
    await settle()
    tasks.append(asyncio.ensure_future(request("light")))
    tasks.append(asyncio.ensure_future(request("light")))
    await settle()
    held.leave()
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    # the light tenant joins late, behind six heavy requests, yet it alternates with the heavy one
    assert order[:4] == ["heavy", "light", "heavy", "light"]
    assert order.count("heavy") == 6


async def test_higher_priority_classes_go_first():
    q, _ = queue(1)
    held = await q.enter("m", "a")
    order = []

    async def request(tenant, priority):
        t = await q.enter("m", tenant, priority)
        order.append(tenant)
        t.leave()

    tasks = [asyncio.ensure_future(request("low", 0)), asyncio.ensure_future(request("high", 5))]
    await settle()
    held.leave()
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert order == ["high", "low"]


async def test_the_wait_is_bounded_in_time_and_in_length():
    q, _ = queue(1, timeout_s=0.05, max_waiting=1)
    held = await q.enter("m", "t")
    waiting = asyncio.ensure_future(q.enter("m", "t"))
    await settle()
    with pytest.raises(ApiError) as full:
        await q.enter("m", "t")
    assert full.value.status == 503 and full.value.code == "queue_full" and full.value.headers["Retry-After"] == "1"
    with pytest.raises(ApiError) as late:
        await waiting
    assert late.value.status == 429 and late.value.code == "queue_timeout" and "Retry-After" in late.value.headers
    assert q.snapshot()["m"]["waiting"] == 0 and q.timeouts == {"m": 1} and q.rejected == {"m": 1}
    held.leave()
    assert q.snapshot()["m"]["inflight"] == 0


async def test_a_client_that_leaves_while_waiting_leaves_the_queue():
    q, _ = queue(1)
    held = await q.enter("m", "t")
    waiting = asyncio.ensure_future(q.enter("m", "t"))
    await settle()
    waiting.cancel()
    await settle()
    assert q.snapshot()["m"]["waiting"] == 0
    held.leave()
    assert q.snapshot()["m"]["inflight"] == 0  # no slot handed to the one that left


async def test_capacity_follows_the_fleet_and_no_worker_means_no_wait():
    q, cap = queue(0)
    ticket = await asyncio.wait_for(q.enter("m", "t"), 1)  # no worker: the router answers, not the queue
    ticket.leave()
    cap["m"] = 1
    held = await q.enter("m", "t")
    waiting = asyncio.ensure_future(q.enter("m", "t"))
    await settle()
    cap["m"] = 2  # a worker joined
    q.refresh()
    second = await asyncio.wait_for(waiting, 1)
    held.leave(), second.leave()
    families = {f.name: f for f in AdmissionMetrics(q).collect()}
    assert {"infera_queue_waiting", "infera_queue_admitted_inflight", "infera_queue_timeouts",
            "infera_queue_rejected", "infera_queue_wait_seconds"} <= set(families)


async def test_tenants_are_admitted_in_proportion_to_their_weights():
    """Two backlogged tenants, weights 3 and 1: of each four freed slots, three go to the heavier;
    with equal weights they would alternate (above)."""
    q, _ = queue(1)
    held = await q.enter("m", "a", weight=3.0)
    order: list[str] = []

    async def request(tenant: str, weight: float) -> None:
        ticket = await q.enter("m", tenant, weight=weight)
        order.append(tenant)
        await asyncio.sleep(0)
        ticket.leave()

    tasks = [asyncio.ensure_future(request("a", 3.0)) for _ in range(12)]
    tasks += [asyncio.ensure_future(request("b", 1.0)) for _ in range(12)]
    await settle()
    held.leave()
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    first = order[:16]  # both still waiting throughout
    assert first.count("a") == 12 and first.count("b") == 4, order
    for i in range(0, 16, 4):  # and evenly spread: no tenant waits out a run of the other's
        assert order[i:i + 4].count("a") == 3, order


async def test_a_weight_must_be_positive():
    q, _ = queue(1)
    with pytest.raises(ValueError):
        await q.enter("m", "t", weight=0.0)
