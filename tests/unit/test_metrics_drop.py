"""A worker that leaves the fleet takes its per-worker state and every metric series labelled with
it along — including what its requests still in flight at the leave do afterwards."""
from __future__ import annotations

import asyncio
import json
from array import array

from infera.api.requests import parse_request
from infera.discovery.record import WorkerRecord
from infera.kv.hashing import block_hashes
from infera.router.breaker import CircuitBreaker
from infera.router.kv_aware import LANDED_TTL_S, KvAwarePolicy
from infera.router.policy import RoutedRequest
from infera.router.round_robin import COUNTERS_CAP, RoundRobinPolicy
from infera.server.cli import parse_args
from infera.server.main import InferaServer
from infera.server.metrics import drop_worker_keys, holds_worker
from tests.integration.conftest import NoDiscovery

CHAT = "/v1/chat/completions"


def chat_request(text: str = "hello there") -> RoutedRequest:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()
    return RoutedRequest(route=CHAT, body=body, parsed=parse_request(CHAT, body), model="m", stream=False,
                         request_id="r")


def record(wid: str, **kw) -> WorkerRecord:
    return WorkerRecord(worker_id=wid, url=f"http://{wid}", model_name="m", kv_block_size=4, **kw)


def series_of(text: str, worker_id: str) -> list[str]:
    return [line for line in text.splitlines()
            if not line.startswith("#") and (f'worker_id="{worker_id}"' in line or f'worker_id="{worker_id}#dp' in line)]


def test_removed_worker_series_are_gone_from_metrics():
    server = InferaServer(parse_args(["--etcd-endpoint", "x:1", "--breaker-failure-threshold", "1"], environ={}),
                          discovery=NoDiscovery())
    metrics, fleet, policy = server.metrics, server.fleet, server.policy
    gone, kept = record("gone", dp_size=2), record("kept")
    fleet.upsert(gone)
    fleet.upsert(kept)

    # Traffic on both: picks (kv-aware), requests, a broken stream, in flight, a breaker trip.
    for w in (gone, kept):
        req = chat_request()
        asyncio.run(policy.prepare(req))
        policy.pick([w], req)
        metrics.count_request(CHAT, 200, w.worker_id)
        metrics.count_midstream_failure(w.worker_id)
        metrics.inflight_gauge(w.worker_id).inc()
        server.breaker.record_failure(w.worker_id)
    text = metrics.render().decode()
    assert len(series_of(text, "gone")) >= 6 and series_of(text, "kept")

    fleet.remove("gone")
    text = metrics.render().decode()
    assert series_of(text, "gone") == [], series_of(text, "gone")
    assert any("infera_router_picks_total" in s for s in series_of(text, "kept"))
    assert any("infera_requests_total" in s for s in series_of(text, "kept"))

    # Its requests still in flight finish (or fail) after the leave: nothing comes back.
    metrics.count_request(CHAT, 200, "gone")
    metrics.count_midstream_failure("gone")
    metrics.inflight_gauge("gone").dec()  # a PD leg looks its gauge up again to release it
    server.breaker.record_failure("gone")
    assert series_of(metrics.render().decode(), "gone") == []
    assert server.breaker.entry("gone") is None

    # The same id registering again is counted again.
    fleet.upsert(record("gone"))
    metrics.count_request(CHAT, 200, "gone")
    assert series_of(metrics.render().decode(), "gone")


def test_breaker_keeps_no_entry_for_a_worker_that_left():
    members = {"a"}
    breaker = CircuitBreaker(failure_threshold=1, is_member=members.__contains__)
    breaker.record_failure("a")
    breaker.record_failure("b")  # left before its request failed
    assert breaker.entry("a") is not None and breaker.entry("b") is None
    breaker.forget("a")
    members.clear()
    breaker.record_failure("a")
    assert breaker.entry("a") is None


class _NoIndex:
    events_made_until = None

    def match(self, hashes, keys):
        return [0] * len(keys)


def test_kv_policy_state_of_a_departed_worker_does_not_linger():
    now = [100.0]
    prompts = type("P", (), {"tokens": None})()

    async def token_ids(route, parsed):
        return array("I", range(100, 132))

    prompts.token_ids = token_ids
    policy = KvAwarePolicy(_NoIndex(), prompts, clock=lambda: now[0])
    w, other = record("w"), record("o")
    req = chat_request()
    asyncio.run(policy.prepare(req))
    policy.pick([w], req)
    policy.on_started(w, req)
    req.state["served"] = True
    policy.forget("w")  # it left with the request in flight...
    policy.on_finished(w, req)  # ...which finishes afterwards
    assert "w" not in policy.active  # counted in, counted out: nothing left
    assert "w" in policy.landed  # (a claim, expiring)
    now[0] += LANDED_TTL_S + 0.1
    other_req = chat_request("x")
    asyncio.run(policy.prepare(other_req))
    policy.pick([other], other_req)  # picks sweep expired claims, whoever they belonged to
    assert "w" not in policy.landed and policy.landed.keys() <= {"o"}
    assert list(req.state["blocks"]) == block_hashes(list(range(100, 132)), 4)


def test_round_robin_counters_are_bounded():
    rr = RoundRobinPolicy()
    workers = [record(f"w{i}") for i in range(16)]
    for i in range(COUNTERS_CAP + 50):
        pool = [workers[j] for j in range(16) if (i >> j) & 1] or workers
        rr.pick(pool if len(pool) > 1 else workers, chat_request())
    assert len(rr._counters) <= COUNTERS_CAP


def test_holds_worker_and_drop_worker_keys():
    assert holds_worker("w", "w") and holds_worker("w#dp3", "w")
    assert not holds_worker("w2", "w") and not holds_worker("w#dpx", "ww") and not holds_worker("ww#dp1", "w")
    table = {("mixed", "w"): 1, ("decode", "w#dp1"): 2, ("mixed", "w2"): 3}
    assert drop_worker_keys(table, "w", 1) == 2 and table == {("mixed", "w2"): 3}
