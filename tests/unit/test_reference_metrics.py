"""The reference's metric names (issue 34 item 3) on /metrics, with its types and labels, recorded
where the router decides: a request's duration and in-flight count per router and outcome, PD leg
durations and bootstrap failures, and the cache hints each pick saw."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from prometheus_client.parser import text_string_to_metric_families

from infera.api.cache_hints import LONG, CacheHints
from infera.api.errors import ApiError
from infera.discovery.fleet import Fleet
from infera.discovery.record import DisaggMode, Status, WorkerRecord
from infera.router.dispatch import Reply, RequestAccount, count_hints, outcome_of
from infera.router.pd_legs import bootstrap_failure_reason
from infera.router.policy import RoutedRequest
from infera.router.upstream import LegFailure, Opened, Relay
from infera.server.metrics import ServerMetrics
from infera.transport.http import UpstreamError
from infera.transport.request import UpstreamReply

ROUTE = "/v1/chat/completions"


def worker(worker_id: str, mode: DisaggMode = "mixed", status: Status = "active") -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        url="http://w:1",
        model_name="m",
        disagg_mode=mode,
        status=status,
    )


def families(metrics: ServerMetrics) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def samples(metrics: ServerMetrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """``name``'s samples (a histogram's ``_count``), by their sorted labels."""
    out = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def request(stream: bool = False, hints: CacheHints | None = None) -> RoutedRequest:
    req = RoutedRequest(route=ROUTE, body=b"{}", parsed=None, model="m", stream=stream, request_id="r")
    if hints is not None:
        req.state["hints"] = hints
    return req


def test_reference_families_have_the_reference_types_and_labels() -> None:
    m = ServerMetrics(Fleet())
    m.observe_request("disagg", "ok", ROUTE, True, 0.2)
    m.request_inflight_gauge("mixed").inc()
    m.observe_pd_dispatch("prefill", "p0", 0.05)
    m.count_pd_bootstrap_failure("prefill_5xx")
    m.count_cache_control("long")
    m.count_cache_locality_skipped("multimodal")
    fams = families(m)
    expected = {
        "infera_request_duration_seconds": ("histogram", {"route", "stream", "router", "outcome"}),
        "infera_request_inflight": ("gauge", {"router"}),
        "infera_pd_dispatch_duration_seconds": ("histogram", {"leg", "worker_id"}),
        "infera_pd_bootstrap_failures": ("counter", {"reason"}),
        "infera_cache_control_seen": ("counter", {"retention"}),
        "infera_cache_locality_skipped": ("counter", {"reason"}),
        "infera_active_workers": ("gauge", {"disagg_mode"}),
    }
    for name, (kind, labels) in expected.items():
        assert fams[name].type == kind, name
        got = {k for s in fams[name].samples for k in s.labels if k != "le"}
        assert got == labels, (name, got)
    text = m.render().decode()
    for line in (
        'infera_pd_bootstrap_failures_total{reason="prefill_5xx"} 1.0',
        'infera_cache_control_seen_total{retention="long"} 1.0',
        'infera_cache_locality_skipped_total{reason="multimodal"} 1.0',
        'infera_request_inflight{router="mixed"} 1.0',
        'infera_pd_dispatch_duration_seconds_bucket{le="0.05",leg="prefill",worker_id="p0"} 1.0',
        'infera_pd_dispatch_duration_seconds_bucket{le="0.025",leg="prefill",worker_id="p0"} 0.0',
    ):
        assert line in text, line


def test_our_http_view_keeps_its_route_and_stream_labels() -> None:
    m = ServerMetrics(Fleet())
    m.observe_e2e("/v1/messages", False, 0.3)
    assert samples(m, "infera_http_request_duration_seconds_count") == {
        (("route", "/v1/messages"), ("stream", "false")): 1.0
    }
    assert samples(m, "infera_request_duration_seconds_count") == {}  # the router's view is its own


def test_active_workers_counts_active_ones_per_mode_every_scrape() -> None:
    fleet = Fleet()
    m = ServerMetrics(fleet)
    assert set(samples(m, "infera_active_workers").values()) == {0.0}
    for w in (worker("a"), worker("b"), worker("c", status="draining"), worker("p", "prefill"), worker("d", "decode")):
        fleet.upsert(w)
    assert samples(m, "infera_active_workers") == {
        (("disagg_mode", "mixed"),): 2.0,
        (("disagg_mode", "prefill"),): 1.0,
        (("disagg_mode", "decode"),): 1.0,
    }
    fleet.remove("a")
    assert samples(m, "infera_active_workers")[(("disagg_mode", "mixed"),)] == 1.0


def test_a_departed_workers_leg_series_go_with_it() -> None:
    fleet = Fleet()
    fleet.upsert(worker("p0", "prefill"))
    fleet.upsert(worker("p1", "prefill"))
    m = ServerMetrics(fleet)
    m.observe_pd_dispatch("prefill", "p0", 0.1)
    m.observe_pd_dispatch("prefill", "p1", 0.1)
    fleet.remove("p0")
    m.observe_pd_dispatch("prefill", "p0", 0.1)  # a leg still finishing after the leave
    workers = {dict(k)["worker_id"] for k in samples(m, "infera_pd_dispatch_duration_seconds_count")}
    assert workers == {"p1"}


@pytest.mark.parametrize(
    "status, outcome",
    [
        (200, "ok"),
        (204, "ok"),
        (302, "ok"),
        (400, "4xx"),
        (404, "4xx"),
        (413, "4xx"),
        (429, "429"),
        (500, "5xx"),
        (502, "502"),
        (503, "503"),
        (504, "5xx"),
    ],
)
def test_outcome_of_a_status(status: int, outcome: str) -> None:
    assert outcome_of(status) == outcome


@pytest.mark.parametrize(
    "role, status, reason, expected",
    [
        ("prefill", 500, "http_500", "prefill_5xx"),
        ("decode", 503, "http_503", "decode_5xx"),
        ("decode", 400, "http_400", "decode_4xx"),
        ("prefill", 502, "unreachable", "prefill_unreachable"),
        ("decode", 502, "empty_stream", "decode_unreachable"),
        ("decode", 504, "timeout", "decode_timeout"),
        ("prefill", 429, "admission", "prefill_busy"),
        ("prefill", 413, "body_too_large", "prefill_too_large"),
        ("prefill", 504, "prefill_timeout", "prefill_timeout"),
        ("prefill", 502, "bad_prefill_reply", "handoff_extract_failed"),
        ("prefill", 502, "handoff_missing", "handoff_extract_failed"),
    ],
)
def test_bootstrap_failure_reason(role: str, status: int, reason: str, expected: str) -> None:
    assert bootstrap_failure_reason(LegFailure("w", status, "m", reason, role=role)) == expected


def inflight(m: ServerMetrics, router: str) -> int:
    return m.request_inflight_gauge(router).value


def test_a_unary_reply_ends_the_request_at_once() -> None:
    m = ServerMetrics(Fleet())
    account = RequestAccount(m, "mixed", request())
    assert inflight(m, "mixed") == 1
    account.replied(Reply(400, "application/json", "w", body=b"{}"))
    assert inflight(m, "mixed") == 0
    account.end("ok")  # once only
    assert samples(m, "infera_request_duration_seconds_count") == {
        (("outcome", "4xx"), ("route", ROUTE), ("router", "mixed"), ("stream", "false")): 1.0
    }


@pytest.mark.parametrize(
    "exc, outcome",
    [
        (ApiError(503, "none", "no_active_worker"), "503"),
        (ApiError(404, "no model", "model_not_found"), "4xx"),
        (asyncio.CancelledError(), "client_gone"),
        (RuntimeError("bug"), "error"),
    ],
)
def test_a_failed_dispatch_ends_the_request(exc: BaseException, outcome: str) -> None:
    m = ServerMetrics(Fleet())
    RequestAccount(m, "disagg", request(stream=True)).failed(exc)
    assert inflight(m, "disagg") == 0
    assert samples(m, "infera_request_duration_seconds_count") == {
        (("outcome", outcome), ("route", ROUTE), ("router", "disagg"), ("stream", "true")): 1.0
    }


class FakeResponse:
    def __init__(self, chunks: list[bytes], fail: bool = False) -> None:
        self.chunks, self.fail = chunks, fail

    async def next_chunk(self) -> bytes:
        if not self.chunks and self.fail:
            raise UpstreamError("reset")
        return self.chunks.pop(0) if self.chunks else b""

    def release(self) -> None:
        pass


@pytest.mark.parametrize(
    "fail, read, outcome", [(False, True, "ok"), (True, True, "error"), (False, False, "client_gone")]
)
def test_a_streamed_reply_ends_the_request_when_closed(fail: bool, read: bool, outcome: str) -> None:
    m = ServerMetrics(Fleet())
    wrk = worker("w")
    resp = FakeResponse([b"data: 2\n\n", b"data: [DONE]\n\n"], fail=fail)
    relay = Relay(
        Opened(200, "text/event-stream", resp=cast(UpstreamReply, resp), first=b"data: 1\n\n"),
        wrk,
        m,
        lambda: None,
    )
    account = RequestAccount(m, "direct", request(stream=True))
    account.replied(Reply(200, "text/event-stream", "w", stream=relay))

    async def main() -> None:
        if read:
            chunks = [c async for c in relay]
            assert (b"worker_failed_midstream" in chunks[-1]) == fail
        else:
            await relay.__aiter__().__anext__()  # the first chunk only: the client leaves
        assert inflight(m, "direct") == 1  # until the relay is closed
        await relay.aclose()

    asyncio.run(main())
    assert inflight(m, "direct") == 0
    assert samples(m, "infera_request_duration_seconds_count") == {
        (("outcome", outcome), ("route", ROUTE), ("router", "direct"), ("stream", "true")): 1.0
    }


def test_a_relay_judged_by_its_tracker() -> None:
    m = ServerMetrics(Fleet())
    relay = Relay(
        Opened(200, "text/event-stream", resp=cast(UpstreamReply, FakeResponse([])), first=b"data: 1\n\n"),
        worker("w"),
        m,
        lambda: None,
    )
    relay.judge_by(lambda: False)  # e.g. a migrating stream whose generation never finished
    outcomes: list[str] = []
    relay.on_end(outcomes.append)

    async def main() -> None:
        assert [c async for c in relay] == [b"data: 1\n\n"]
        await relay.aclose()
        await relay.aclose()

    asyncio.run(main())
    assert outcomes == ["error"]


@pytest.mark.parametrize(
    "hints, seen, skipped",
    [
        (None, {}, {}),
        (CacheHints(), {"none": 1.0}, {}),
        (CacheHints(retention=LONG, explicit=True), {"long": 1.0}, {}),
        (CacheHints(multimodal=True), {"none": 1.0}, {"multimodal": 1.0}),
    ],
)
def test_each_pick_counts_the_hints_it_saw(
    hints: CacheHints | None, seen: dict[str, float], skipped: dict[str, float]
) -> None:
    m = ServerMetrics(Fleet())
    count_hints(m, request(hints=hints))
    assert {dict(k)["retention"]: v for k, v in samples(m, "infera_cache_control_seen_total").items()} == seen
    assert {dict(k)["reason"]: v for k, v in samples(m, "infera_cache_locality_skipped_total").items()} == skipped
