"""The fair queue's reserve (--queue-reserve-per-worker, infera/server/admission.py): slots kept for
tenants under their fair share, so a light tenant's request is admitted at once while a heavy tenant
overloads the model, and a tenant alone never fills them."""
from __future__ import annotations

import asyncio

import pytest

from infera.api.errors import ApiError
from infera.server.admission import AdmissionQueue, may_take_reserved, reserved_slots


@pytest.mark.parametrize("capacity, share, expected", [
    (8, 0.0, 0),
    (8, 0.25, 2),        # 2 of 8 per worker, one worker
    (24, 2 / 8, 6),      # three workers: 2 each, whatever the float error of 2/8 * 24
    (30, 1 / 3, 10),     # 1 of 3 per worker, ten workers: 30 * (1/3) is 9.999... in floats
    (3, 0.5, 1),
    (0, 0.5, 0),         # no worker
])
def test_reserved_slots(capacity, share, expected):
    assert reserved_slots(capacity, share) == expected


@pytest.mark.parametrize("held, capacity, active, expected", [
    (0, 8, 1, False),   # alone: the reserve is kept for tenants that come, whatever it holds
    (7, 8, 1, False),
    (0, 8, 2, True),    # the light tenant next to a heavy one
    (3, 8, 2, True),    # 3 < 8 / 2
    (4, 8, 2, False),   # at its share
    (6, 8, 2, False),   # the heavy one
    (2, 12, 4, True),   # 2 < 12 / 4
    (3, 12, 4, False),
    (0, 1, 2, True),    # one slot, two tenants: the one holding none is under its half
])
def test_may_take_reserved(held, capacity, active, expected):
    assert may_take_reserved(held, capacity, active) is expected


def test_a_reserve_of_every_slot_is_refused():
    with pytest.raises(ValueError, match="--queue-reserve-per-worker"):
        AdmissionQueue(lambda model: 4, reserved_share=1.0)


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def reserve_queue(capacity: int = 4, reserved: int = 1) -> AdmissionQueue:
    return AdmissionQueue(lambda model: capacity if model == "m" else 0, reserved_share=reserved / capacity)


async def test_a_tenant_alone_leaves_the_reserve_free_and_a_light_one_takes_it_at_once():
    q = reserve_queue(4, 1)
    heavy = [await q.enter("m", "heavy") for _ in range(3)]
    waiting = asyncio.ensure_future(q.enter("m", "heavy"))
    await settle()
    assert not waiting.done() and q.snapshot()["m"] == {"inflight": 3, "waiting": 1, "capacity": 4}
    light = await asyncio.wait_for(q.enter("m", "light"), 1)  # the reserved slot, ahead of the heavy backlog
    assert q.snapshot()["m"] == {"inflight": 4, "waiting": 1, "capacity": 4}
    light.leave()
    await settle()
    assert not waiting.done()  # the slot goes back to the reserve, not to the heavy tenant's backlog
    heavy[0].leave()
    ticket = await asyncio.wait_for(waiting, 1)  # an open slot freed: the heavy tenant gets it
    for t in (ticket, *heavy[1:]):
        t.leave()
    assert q.snapshot()["m"]["inflight"] == 0


async def test_a_light_tenant_over_its_share_waits_like_anyone():
    q = reserve_queue(4, 2)  # 2 open slots, 2 reserved
    heavy = [await q.enter("m", "heavy") for _ in range(2)]
    light = [await q.enter("m", "light") for _ in range(2)]  # 0 and 1 < its share, 4 / 2
    late = asyncio.ensure_future(q.enter("m", "light"))  # holds 2 = its share: it waits
    await settle()
    assert not late.done() and q.snapshot()["m"] == {"inflight": 4, "waiting": 1, "capacity": 4}
    light[0].leave()
    light[0] = await asyncio.wait_for(late, 1)  # under its share again: the reserve takes it
    for t in (*heavy, *light):
        t.leave()
    assert q.snapshot()["m"]["inflight"] == 0


async def test_a_freed_reserved_slot_goes_to_a_waiting_tenant_under_its_share_not_to_the_oldest():
    q = reserve_queue(3, 1)
    heavy = [await q.enter("m", "heavy") for _ in range(2)]
    a = await q.enter("m", "a")  # the reserve: 0 < 2 / 2
    heavy_waits = asyncio.ensure_future(q.enter("m", "heavy"))
    await settle()
    b_waits = asyncio.ensure_future(q.enter("m", "b"))  # full: it waits, behind the heavy request
    await settle()
    assert q.snapshot()["m"] == {"inflight": 3, "waiting": 2, "capacity": 3}
    a.leave()  # the reserved slot frees: heavy (2 held) is over its share (3 / 2 tenants), b (0) is not
    b = await asyncio.wait_for(b_waits, 1)
    await settle()
    assert not heavy_waits.done()
    heavy[0].leave()  # 2 in flight = the open slots, but heavy holds 1 < 3 / 2 now: the reserve is its
    last = await asyncio.wait_for(heavy_waits, 1)
    for t in (b, heavy[1], last):
        t.leave()
    assert q.snapshot()["m"] == {"inflight": 0, "waiting": 0, "capacity": 3}


async def test_a_lone_tenant_at_its_share_times_out_rather_than_fill_the_reserve():
    q = AdmissionQueue(lambda model: 4, reserved_share=0.5, timeout_s=0.05)  # 2 open, 2 reserved
    light = await q.enter("m", "light")
    light2 = await q.enter("m", "light")  # the open slots; light holds 2 = its share alone
    with pytest.raises(ApiError) as late:
        await q.enter("m", "light")  # alone at its share: the reserve is not its, it times out
    assert late.value.status == 429 and "Retry-After" in late.value.headers
    heavy = await q.enter("m", "heavy")  # 0 < 2 / 2: the reserve
    for t in (light, light2, heavy):
        t.leave()
    assert q.snapshot()["m"] == {"inflight": 0, "waiting": 0, "capacity": 4}


@pytest.mark.parametrize("reserved", [0, 1])
async def test_without_a_reserve_or_with_one_tenant_nothing_waits_below_the_open_slots(reserved):
    q = reserve_queue(4, reserved)
    tickets = [await asyncio.wait_for(q.enter("m", ""), 1) for _ in range(4 - reserved)]
    blocked = asyncio.ensure_future(q.enter("m", ""))
    await settle()
    assert not blocked.done()
    tickets[0].leave()
    tickets[0] = await asyncio.wait_for(blocked, 1)
    for t in tickets:
        t.leave()
    assert q.snapshot()["m"]["inflight"] == 0


async def test_between_tenants_served_alike_the_one_holding_fewer_slots_goes_first():
    q = AdmissionQueue(lambda model: 2)  # no reserve: the work-conserving order alone
    held = [await q.enter("m", "heavy") for _ in range(2)]
    order: list[str] = []

    async def request(tenant: str) -> None:
        ticket = await q.enter("m", tenant)
        order.append(tenant)
        ticket.leave()

    tasks = [asyncio.ensure_future(request("heavy")) for _ in range(3)]
    await settle()
    tasks.append(asyncio.ensure_future(request("light")))  # joins served like heavy (no banked credit)
    await settle()
    held[0].leave()  # heavy, older and served alike, holds a slot still; light holds none
    await asyncio.wait_for(asyncio.gather(*tasks[3:]), 1)
    assert order[0] == "light"  # (its slot, given back at once, went on to the heavy backlog)
    held[1].leave()
    await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert q.snapshot()["m"]["inflight"] == 0


@pytest.mark.parametrize("argv, environ, expected", [
    ([], {}, 0),                                                       # default: off
    ([], {"INFERA_QUEUE_RESERVE_PER_WORKER": "2"}, 2),                 # env
    (["--queue-reserve-per-worker", "1"], {"INFERA_QUEUE_RESERVE_PER_WORKER": "2"}, 1),  # flag over env
])
def test_the_reserve_flag_then_env_then_default(argv, environ, expected):
    from infera.server.cli import parse_args

    args = parse_args(["--etcd-endpoint", "unused:1", "--max-inflight-per-worker", "4", *argv], environ=environ)
    assert args.queue_reserve_per_worker == expected


@pytest.mark.parametrize("argv", [
    ["--max-inflight-per-worker", "4", "--queue-reserve-per-worker", "-1"],
    ["--max-inflight-per-worker", "2", "--queue-reserve-per-worker", "2"],  # no slot left open to all
    ["--queue-reserve-per-worker", "1"],  # no per-worker bound to reserve from
])
def test_a_reserve_that_cannot_work_is_refused_at_start(argv, capsys):
    from infera.server.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--etcd-endpoint", "unused:1", *argv], environ={})
    assert "--queue-reserve-per-worker" in capsys.readouterr().err


@pytest.mark.parametrize("held, capacity, active, weight, total, expected", [
    (4, 8, 2, 3.0, 4.0, True),    # weight 3 of 4: its share is 6 slots
    (5, 8, 2, 3.0, 4.0, True),
    (6, 8, 2, 3.0, 4.0, False),   # at its share
    (1, 8, 2, 1.0, 4.0, True),    # the weight-1 tenant beside it: a share of 2
    (2, 8, 2, 1.0, 4.0, False),
    (0, 8, 1, 5.0, 5.0, False),   # alone, whatever its weight
    (3, 8, 2, 1.0, None, True),   # no weights given: equal shares, as above
])
def test_may_take_reserved_by_weight(held, capacity, active, weight, total, expected):
    assert may_take_reserved(held, capacity, active, weight, total) is expected


async def test_the_reserve_holds_a_weighted_share_for_a_heavier_tenant():
    """Capacity 8, 2 reserved: tenant 'big' (weight 3) beside 'small' (weight 1) holding one slot may
    take reserved slots up to its share of 6; with equal weights it would stop at 4."""
    q = reserve_queue(8, 2)
    small = await q.enter("m", "small", weight=1.0)
    big = [await q.enter("m", "big", weight=3.0) for _ in range(5)]  # 6 in flight: the open slots
    assert q.snapshot()["m"]["inflight"] == 6
    big.append(await asyncio.wait_for(q.enter("m", "big", weight=3.0), 1))  # reserved: 5 < 6
    waiting = asyncio.ensure_future(q.enter("m", "big", weight=3.0))  # 6 held: at its share
    await settle()
    assert not waiting.done() and q.snapshot()["m"]["inflight"] == 7
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    for t in (small, *big):
        t.leave()
    assert q.snapshot()["m"] == {"inflight": 0, "waiting": 0, "capacity": 8}
    assert not q._models["m"].weights  # idle tenants' weights are not kept
