"""The /v1/fleet document built from real server state objects (fleet, metrics, breaker), with a
hand-driven clock so windows and rates are exact."""
from __future__ import annotations

import asyncio

import pytest

from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.router.breaker import CircuitBreaker
from infera.server.fleet_view import TTFT_RING, FleetView, RecentWorkerStats
from infera.server.metrics import ServerMetrics
from tests.conftest import wait_for

ROUTE = "/v1/chat/completions"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rec(worker_id: str, model: str = "m", mode: str = "mixed", protocol: str | None = None, engine: str = "sim",
        **kw) -> WorkerRecord:
    meta = {"protocol": protocol} if protocol else {}
    return WorkerRecord(worker_id=worker_id, url=f"http://{worker_id}", model_name=model, engine=engine,
                        disagg_mode=mode, disagg_meta=meta, **kw)


@pytest.fixture
def parts():
    clock = Clock()
    fleet = Fleet()
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=5, clock=clock,
                             is_member=lambda w: fleet.get(w) is not None)
    metrics = ServerMetrics(fleet, breaker=breaker)
    recent = RecentWorkerStats(fleet, clock=clock)
    view = FleetView(fleet, metrics, recent, breaker=breaker, wall_clock=lambda: 1.7e9)
    return clock, fleet, breaker, metrics, recent, view


def workers_of(doc: dict) -> dict[str, dict]:
    return {w["worker_id"]: w for m in doc["models"] for role in m["workers"].values() for w in role}


def model(doc: dict, name: str) -> dict:
    return next(m for m in doc["models"] if m["model"] == name)


def test_grouping_health_and_in_flight(parts):
    clock, fleet, breaker, metrics, recent, view = parts
    fleet.upsert(rec("a"))
    fleet.upsert(rec("b"))
    fleet.upsert(rec("c", status="draining"))
    metrics.inflight_gauge("a").inc()
    metrics.inflight_gauge("a").inc()
    breaker.record_failure("b")
    breaker.record_failure("b")  # threshold 2: open
    doc = view.build()
    ws = workers_of(doc)
    assert (ws["a"]["health"], ws["b"]["health"], ws["c"]["health"]) == ("healthy", "breaker_open", "draining")
    assert ws["a"]["in_flight"] == 2 and ws["b"]["in_flight"] == 0
    assert ws["b"]["breaker"] == {"state": "open", "enabled": True, "trips": 1, "consecutive_failures": 2}
    assert doc["server"]["in_flight"] == 2 and doc["server"]["workers"] == 3
    assert doc["server"]["active_workers"] == 2  # c drains
    assert doc["server"]["health"] == {"healthy": 1, "breaker_open": 1, "draining": 1}
    assert [w["worker_id"] for w in model(doc, "m")["workers"]["mixed"]] == ["a", "b", "c"]
    assert ws["a"]["kv"] is None and doc["server"]["policy"] == "round-robin"
    clock.now += 6  # past the cooldown the breaker admits a probe: half-open
    assert breaker.allows("b")
    assert workers_of(view.build())["b"]["health"] == "breaker_half_open"


def test_unroutable_worker_says_why():
    fleet = Fleet(unroutable=lambda r: "serves over NATS only" if r.request_transport == "nats" else None)
    metrics = ServerMetrics(fleet)
    view = FleetView(fleet, metrics, RecentWorkerStats(fleet))
    fleet.upsert(rec("n", request_transport="nats"))
    w = workers_of(view.build())["n"]
    assert w["health"] == "unroutable" and w["unroutable_reason"] == "it serves over NATS only"
    assert w["breaker"]["enabled"] is False


def test_request_rate_is_over_the_window_and_forgets_a_departed_worker(parts):
    clock, fleet, _, metrics, recent, view = parts
    fleet.upsert(rec("a"))
    assert workers_of(view.build())["a"]["requests_per_s"] is None  # one sample: no rate yet
    for _ in range(20):
        metrics.count_request(ROUTE, 200, "a")
    metrics.count_request(ROUTE, 503, "a")
    clock.now += 2.0
    w = workers_of(view.build())["a"]
    assert w["requests_per_s"] == pytest.approx(21 / 2.0)
    assert (w["requests_total"], w["errors_5xx_total"], w["rate_source"]) == (21, 1, "replies")
    # nothing more for longer than the window: the rate falls to 0 (the old samples leave the ring)
    for _ in range(30):
        clock.now += 0.5
        view.build()
    assert workers_of(view.build())["a"]["requests_per_s"] == 0
    assert len(recent.rates["a"].samples) <= 10.0 / 0.25 + 2
    fleet.remove("a")
    assert "a" not in recent.rates and view.build()["models"] == []


def test_ttft_p50_and_ewma_are_per_worker_and_windowed(parts):
    clock, fleet, _, _, recent, view = parts
    fleet.upsert(rec("a"))
    fleet.upsert(rec("b"))
    for s in (0.1, 0.3, 0.2):
        recent.observe_ttft("a", s)
    recent.observe_ttft("gone", 1.0)  # a reply from a worker that already left: not kept
    assert "gone" not in recent.ttft
    ws = workers_of(view.build())
    assert ws["a"]["ttft_p50_ms"] == 200.0 and ws["a"]["ttft_samples"] == 3
    assert ws["a"]["ttft_ewma_ms"] == pytest.approx(1000 * (0.1 + 0.2 * (0.3 - 0.1) + 0.2 * (0.2 - 0.14)), abs=0.1)
    assert ws["b"]["ttft_p50_ms"] is None and ws["b"]["ttft_samples"] == 0
    clock.now += 11  # out of the window: no p50, the EWMA stays
    ws = workers_of(view.build())
    assert ws["a"]["ttft_p50_ms"] is None and ws["a"]["ttft_ewma_ms"] is not None
    for i in range(TTFT_RING + 50):
        recent.observe_ttft("a", 0.001 * i)
    assert len(recent.ttft["a"].recent) == TTFT_RING


def test_pd_topology_pairs_by_kind_and_lone_prefills(parts):
    _, fleet, breaker, _, _, view = parts
    for wid, mode, proto, engine in (("p1", "prefill", "nixl", "vllm"), ("p2", "prefill", "nixl", "vllm"),
                                     ("d1", "decode", "nixl", "vllm"), ("p3", "prefill", "mooncake", "sglang")):
        fleet.upsert(rec(wid, model="pd", mode=mode, protocol=proto, engine=engine))
    fleet.upsert(rec("only-p", model="half", mode="prefill", protocol="nixl"))
    fleet.upsert(rec("mx", model="both", mode="mixed"))
    fleet.upsert(rec("dx", model="both", mode="decode", protocol="nixl"))
    doc = view.build()
    pd = model(doc, "pd")
    assert pd["topology"] == "disaggregated"
    assert pd["pd_pairs"] == [{"engine": "vllm", "protocol": "nixl", "prefill": ["p1", "p2"], "decode": ["d1"],
                               "pairs": 2}]
    assert pd["unpaired_prefill"] == ["p3"]  # no sglang/mooncake decode: it would get a 500
    assert workers_of(doc)["p1"]["pd_protocol"] == "nixl"
    assert workers_of(doc)["p1"]["rate_source"] is None  # round-robin: no prefill picks to count
    assert model(doc, "half")["topology"] == "missing_decode"
    assert model(doc, "both")["topology"] == "mixed"  # a lone decode pool beside mixed workers: served mixed
    fleet.upsert(rec("d1", model="pd", mode="decode", protocol="nixl", engine="vllm", status="draining"))
    pd = model(view.build(), "pd")
    assert pd["topology"] == "missing_decode" and pd["pd_pairs"] == []


async def test_the_sampler_gives_a_first_look_a_rate_and_runs_until_cancelled(parts):
    clock, fleet, _, metrics, recent, view = parts
    fleet.upsert(rec("a"))
    view.sample()  # what the app's background sampler does every second
    for _ in range(5):
        metrics.count_request(ROUTE, 200, "a")
    metrics.count_request(ROUTE, 503, "none")  # rejected before any pick
    clock.now += 1.0
    doc = view.build()  # the first document anyone asked for: already a rate
    assert workers_of(doc)["a"]["requests_per_s"] == 5.0
    assert doc["server"]["requests_per_s"] == 5.0 and doc["server"]["rejected_per_s"] == 1.0
    assert doc["server"]["requests_total"] == 6

    task = asyncio.create_task(view.run_sampler(interval=0.001))

    def sampled() -> bool:
        clock.now += 0.3
        return len(recent.rates["a"].samples) >= 5

    try:
        await wait_for(sampled, 5, interval=0.01, message="the sampler feeding the ring")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()
