"""The reference's metric names through a real server (issue 34 item 3): PD and mixed requests against
loopback fake engines, then /metrics read back. The router's request duration carries both label
sets, the in-flight gauge returns to zero once replies and streams end, PD legs are timed per worker,
PD failures are counted by reason, and a kv-aware pick counts the cache hints it saw (a real sim
engine behind it)."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from infera.discovery.record import WorkerRecord
from infera.engine.sim.server import SimServer, parse_args
from tests.integration.test_pd_router import chat, pd  # noqa: F401  (pd: the fixture)

pytestmark = pytest.mark.integration

ROUTE = "/v1/chat/completions"


async def scrape(session: aiohttp.ClientSession, base: str, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """``name``'s samples on /metrics, by their labels."""
    async with session.get(base + "/metrics") as r:
        text = await r.text()
    return {
        frozenset(s.labels.items()): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    }


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with session.post(url, json=body) as r:
        return r.status, await r.json()


def key(**labels: str) -> frozenset[tuple[str, str]]:
    return frozenset(labels.items())


async def test_pd_and_mixed_requests_under_the_reference_names(pd: Any) -> None:
    server, engine, s = pd
    srv, base = await server()
    p, d = await engine("p0", "prefill"), await engine("d0", "decode")
    mixed = await engine("m0", "mixed", {}, model="other")
    srv.fleet.replace_all([p.record(), d.record(), mixed.record()])
    assert (await post(s, base + ROUTE, chat()))[0] == 200
    async with s.post(base + ROUTE, json=chat(stream=True)) as r:
        assert r.status == 200
        assert (await r.read()).endswith(b"data: [DONE]\n\n")
    assert (await post(s, base + ROUTE, chat(model="other")))[0] == 200

    durations = await scrape(s, base, "infera_request_duration_seconds_count")
    assert durations == {
        key(route=ROUTE, stream="false", router="disagg", outcome="ok"): 1.0,
        key(route=ROUTE, stream="true", router="disagg", outcome="ok"): 1.0,
        key(route=ROUTE, stream="false", router="mixed", outcome="ok"): 1.0,
    }
    # Both replies and the stream have ended: nothing is left in flight.
    assert set((await scrape(s, base, "infera_request_inflight")).values()) == {0.0}
    # The prefill leg both times; the decode leg only when it was not streamed.
    assert await scrape(s, base, "infera_pd_dispatch_duration_seconds_count") == {
        key(leg="prefill", worker_id="p0"): 2.0,
        key(leg="decode", worker_id="d0"): 1.0,
    }
    assert await scrape(s, base, "infera_active_workers") == {
        key(disagg_mode="mixed"): 1.0,
        key(disagg_mode="prefill"): 1.0,
        key(disagg_mode="decode"): 1.0,
    }
    assert await scrape(s, base, "infera_pd_bootstrap_failures_total") == {}
    # Our own views are still there beside them.
    assert (await scrape(s, base, "infera_http_request_duration_seconds_count"))[key(route=ROUTE, stream="true")] == 1
    assert (await scrape(s, base, "infera_workers"))[key(status="active", disagg_mode="prefill")] == 1


@pytest.mark.parametrize(
    "behaviour, reason, status, outcome",
    [("500", "prefill_5xx", 500, "5xx"), ("no-handoff", "handoff_extract_failed", 502, "502")],
)
async def test_pd_failures_are_counted_by_reason(
    pd: Any,
    behaviour: str,
    reason: str,
    status: int,
    outcome: str,
) -> None:
    server, engine, s = pd
    srv, base = await server()
    p, d = await engine("p0", "prefill", behaviour=behaviour), await engine("d0", "decode")
    srv.fleet.replace_all([p.record(), d.record()])
    assert (await post(s, base + ROUTE, chat()))[0] == status
    assert await scrape(s, base, "infera_pd_bootstrap_failures_total") == {key(reason=reason): 1.0}
    assert await scrape(s, base, "infera_request_duration_seconds_count") == {
        key(route=ROUTE, stream="false", router="disagg", outcome=outcome): 1.0
    }
    assert await scrape(s, base, "infera_request_inflight") == {key(router="disagg"): 0.0}


async def test_a_sim_worker_behind_kv_aware_routing(fed_server: Any) -> None:
    srv, base = await fed_server("--router-policy", "kv-aware")
    args = parse_args(["--model", "m", "--host", "127.0.0.1", "--port", "0", "--speedup", "1000"])
    async with SimServer(args) as sim, aiohttp.ClientSession() as s:
        srv.fleet.replace_all([WorkerRecord(worker_id="s0", url=sim.url, model_name="m", engine="vllm")])
        async with s.post(base + ROUTE, json=chat(stream=True, prompt_cache_retention="24h")) as r:
            assert r.status == 200
            assert (await r.read()).endswith(b"data: [DONE]\n\n")
        assert (await post(s, base + ROUTE, chat()))[0] == 200
        assert await scrape(s, base, "infera_request_duration_seconds_count") == {
            key(route=ROUTE, stream="true", router="mixed", outcome="ok"): 1.0,
            key(route=ROUTE, stream="false", router="mixed", outcome="ok"): 1.0,
        }
        assert await scrape(s, base, "infera_request_inflight") == {key(router="mixed"): 0.0}
        assert await scrape(s, base, "infera_cache_control_seen_total") == {
            key(retention="long"): 1.0,
            key(retention="none"): 1.0,
        }
        assert await scrape(s, base, "infera_cache_locality_skipped_total") == {}
        assert (await scrape(s, base, "infera_active_workers"))[key(disagg_mode="mixed")] == 1.0
