"""A scrape that leaves the event loop its turns (infera/server/metrics.py, ``render_page``): a
collector that snapshots on the loop has its families built in a thread; the page is the one
``generate_latest`` makes, a :class:`KeyedFamily` written as text included, line for line; the KV
view's snapshot is a copy, so the loop may change the views while the thread builds from it."""
from __future__ import annotations

import asyncio
import math
import threading

import pytest

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.kv.index import KvIndex
from infera.server.keyed_family import Escapes, KeyedFamily
from infera.server.kv import KvEventsBridge
from infera.server.metrics import (
    LATENCY_LABELS,
    Histogram,
    MetricsRegistry,
    format_page,
    label_process,
    read_page,
    render_page,
)


class Plain:
    def collect(self):
        g = GaugeMetricFamily("infera_plain", "Collected whole on the loop")
        g.add_metric([], 1)
        yield g


class Gated:
    """Builds its families only when the test lets it, saying which thread built them."""

    def __init__(self) -> None:
        self.value = 0
        self.building = threading.Event()
        self.release = threading.Event()
        self.built_in: int | None = None

    def snapshot(self) -> int:
        return self.value

    def families(self, value: int):
        self.built_in = threading.get_ident()
        self.building.set()
        assert self.release.wait(10)
        yield CounterMetricFamily("infera_gated", "Built from a snapshot", value=value)

    def collect(self):
        yield from self.families(self.snapshot())


async def test_a_snapshotting_collector_is_built_off_the_loop_while_the_loop_runs():
    registry, gated = MetricsRegistry(), Gated()
    registry.register(Plain())
    registry.register(gated)
    gated.value = 3
    page = asyncio.ensure_future(render_page(registry))
    assert await asyncio.to_thread(gated.building.wait, 10)  # building, and this loop still turns
    gated.value = 9  # the loop changes the live state meanwhile: the page shows the snapshot
    assert not page.done()
    gated.release.set()
    text = (await asyncio.wait_for(page, 10)).decode()
    assert gated.built_in != threading.get_ident()
    assert "infera_gated_total 3.0" in text and "infera_plain 1.0" in text


def test_the_page_is_what_generate_latest_makes_in_registration_order():
    registry, gated = MetricsRegistry(), Gated()
    gated.release.set()
    registry.register(gated)
    registry.register(Plain())
    page = format_page(read_page(registry)).decode()
    assert page == generate_latest(registry).decode()
    assert page.index("infera_gated") < page.index("infera_plain")
    registry.unregister(gated)
    assert "infera_gated" not in format_page(read_page(registry)).decode()


def record(wid: str) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, url=f"http://{wid}:1", model_name="m", engine="vllm", kv_block_size=4,
                        kv_events_endpoint="tcp://127.0.0.1:5557")


def samples(families) -> dict[tuple[str, tuple], float]:
    metrics = [f.to_metric() if isinstance(f, KeyedFamily) else f for f in families]
    text = generate_latest(FamiliesOf(metrics)).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


class FamiliesOf:
    def __init__(self, families) -> None:
        self.families = list(families)

    def collect(self):
        return self.families


def test_the_kv_views_snapshot_is_a_copy_of_their_state():
    fleet = Fleet()
    bridge = KvEventsBridge(fleet, KvIndex())  # (never started: its collector reads its state)
    for wid in ("b", "a"):
        fleet.upsert(record(wid))
        bridge._on_fleet_change(wid, fleet.get(wid))
    state = bridge.targets["a"]
    state.batches, state.over = 2, 1
    state.delays = Histogram()  # (made at a target's first batch)
    state.delays.observe(0.002)
    bridge.picks[("mixed", "a")] = 4
    snap = bridge.snapshot()
    state.batches, state.over = 7, 5  # the loop goes on while a thread builds the page
    state.delays.observe(0.002)
    bridge.picks[("mixed", "a")] = 6
    bridge.picks[("mixed", "b")] = 1
    then, now = samples(bridge.families(snap)), samples(bridge.collect())
    a = (("worker_id", "a"),)
    assert then[("infera_kv_event_batches_total", a)] == 2 and now[("infera_kv_event_batches_total", a)] == 7
    assert then[("infera_kv_predictions_off_total", (("direction", "over"), ("worker_id", "a")))] == 1
    assert then[("infera_kv_event_delay_seconds_count", a)] == 1 and now[("infera_kv_event_delay_seconds_count", a)] == 2
    assert then[("infera_router_picks_total", (("role", "mixed"), ("worker_id", "a")))] == 4
    assert ("infera_router_picks_total", (("role", "mixed"), ("worker_id", "b"))) not in then
    # the same series either way, each target's in key order
    assert {k for k in then if k[0] != "infera_router_picks_total"} == {k for k in now if k[0] != "infera_router_picks_total"}
    batches = next(f for f in bridge.families(snap) if f.name == "infera_kv_event_batches")
    assert [values for values, _, _ in batches.rows] == [("a",), ("b",)]


ODD = ['plain', 'q"uote', "back\\slash", "new\nline", "ünïcode", "", "a#dp1"]
VALUES = [0, 1, 2.5, -3, 1234567.0, 123456789, 1e-9, math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("kind, labels", [
    ("counter", ["worker_id"]),
    ("gauge", ["worker_id"]),
    ("gauge", []),
    ("counter", ["worker_id", "direction"]),  # written in name order: direction first
    ("histogram", ["worker_id"]),  # le before worker_id
    ("histogram", ["direction", "a_role"]),  # both before le
    ("histogram", []),
    ("gauge", ["worker_id", "zone"]),
])
def test_a_keyed_family_writes_what_generate_latest_writes(kind, labels):
    fam = KeyedFamily("infera_x", kind, 'Doc with a back\\slash,\na newline and "quotes"', labels,
                      bounds=LATENCY_LABELS if kind == "histogram" else ())
    for i, odd in enumerate(ODD if labels else [""]):
        values = tuple(f"{odd}{j}" if j else odd for j in range(len(labels)))
        if kind == "histogram":
            fam.add(values, [(i + b) % 3 for b in range(len(LATENCY_LABELS) + 1)], VALUES[i % 7])
        else:
            fam.add(values, VALUES[i] if labels else math.nan)
    out: list[str] = []
    fam.write(out, Escapes())
    assert "".join(out) == generate_latest(FamiliesOf([fam.to_metric()])).decode()
    labelled: list[str] = []  # a --workers N child's page: its process label written with each sample
    fam.write(labelled, Escapes(), first='process="3"')
    assert "".join(labelled) == label_process("".join(out), "3")


def test_an_empty_keyed_family_still_says_what_it_is():
    fam = KeyedFamily("infera_none", "histogram", "Nothing yet", ["worker_id"], bounds=LATENCY_LABELS)
    out: list[str] = []
    fam.write(out, Escapes())
    assert "".join(out) == generate_latest(FamiliesOf([fam.to_metric()])).decode()
    assert "".join(out) == "# HELP infera_none Nothing yet\n# TYPE infera_none histogram\n"


def test_the_kv_views_page_is_what_generate_latest_makes_of_their_families():
    fleet = Fleet()
    bridge = KvEventsBridge(fleet, KvIndex(), clock=lambda: 100.0)  # (staleness: the same in both pages)
    registry = MetricsRegistry()
    registry.register(Plain())
    registry.register(bridge)
    for i, wid in enumerate(ODD[:5]):
        fleet.upsert(record(wid))
        bridge._on_fleet_change(wid, fleet.get(wid))
        if i % 2:  # the others have had no batch: no delay histogram, zero buckets on the page
            bridge.targets[wid].delays = Histogram()
            bridge.targets[wid].delays.observe(0.01)
        bridge.picks[("mixed", wid)] = 2
    page = format_page(read_page(registry)).decode()
    assert page == generate_latest(registry).decode()  # (collect(): the library's families)
    assert format_page(read_page(registry), "2").decode() == label_process(page, "2")
    parsed = {f.name: f for f in text_string_to_metric_families(page)}
    delays = parsed["infera_kv_event_delay_seconds"].samples
    assert {s.labels["worker_id"] for s in delays} == set(ODD[:5])
    counts = {s.labels["worker_id"]: s.value for s in delays if s.name.endswith("_count")}
    assert counts == {wid: float(i % 2) for i, wid in enumerate(ODD[:5])}
