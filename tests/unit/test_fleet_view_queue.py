"""The fair queue's line in /v1/fleet (the dashboard's per-model queue badge): waiting, in flight,
slots and reserve, the oldest wait on the queue's own clock, refusals; absent without a queue."""
from __future__ import annotations

import asyncio

import pytest

from infera.api.errors import ApiError
from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.server.admission import AdmissionQueue
from infera.server.fleet_view import FleetView, RecentWorkerStats
from infera.server.metrics import ServerMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def view_of(admission: AdmissionQueue | None) -> tuple[Fleet, FleetView]:
    fleet = Fleet()
    fleet.upsert(WorkerRecord(worker_id="a", url="http://a", model_name="m", engine="sim"))
    fleet.upsert(WorkerRecord(worker_id="b", url="http://b", model_name="idle", engine="sim"))
    view = FleetView(fleet, ServerMetrics(fleet), RecentWorkerStats(fleet), wall_clock=lambda: 1.7e9,
                     admission=admission)
    return fleet, view


def queue_of(doc: dict, model: str) -> dict | None:
    return next(m for m in doc["models"] if m["model"] == model)["queue"]


def test_no_queue_means_no_queue_line():
    _, view = view_of(None)
    assert queue_of(view.build(), "m") is None


async def test_the_queue_line_shows_waiting_slots_reserve_oldest_wait_and_refusals():
    clock = Clock()
    q = AdmissionQueue(lambda model: 4, reserved_share=0.25, max_waiting=2, timeout_s=30, clock=clock)
    _, view = view_of(q)
    held = [await q.enter("m", "heavy") for _ in range(3)]  # the open slots; the reserve stays free
    first = asyncio.ensure_future(q.enter("m", "heavy"))
    await asyncio.sleep(0)
    clock.now += 1.5
    second = asyncio.ensure_future(q.enter("m", "heavy"))
    await asyncio.sleep(0)
    clock.now += 0.25
    with pytest.raises(ApiError):
        await q.enter("m", "heavy")  # two wait already: 503
    doc = view.build()
    assert queue_of(doc, "m") == {"waiting": 2, "in_flight": 3, "capacity": 4, "reserved": 1, "tenants_waiting": 1,
                                  "oldest_wait_s": 1.75, "timeouts_total": 0, "rejected_total": 1}
    assert queue_of(doc, "idle") is None  # no request came for it
    held[0].leave()
    held[0] = await asyncio.wait_for(first, 1)
    assert queue_of(view.build(), "m")["oldest_wait_s"] == 0.25  # the second one is the oldest now
    held[1].leave()
    held[1] = await asyncio.wait_for(second, 1)
    line = queue_of(view.build(), "m")
    assert line["waiting"] == 0 and line["oldest_wait_s"] is None and line["in_flight"] == 3
    for t in held:
        t.leave()
