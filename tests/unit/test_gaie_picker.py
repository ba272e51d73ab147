"""The endpoint picker picks exactly what the server dispatches: both go through the routing stack
``infera.server`` builds (RoutingStack), the EPP through ``AutoRouter.pick``, the server through
``AutoRouter.dispatch``; PD-preferred topology; the GAIE headers."""
from __future__ import annotations

import json
import random

import pytest

from infera.api.errors import ApiError
from infera.discovery.record import WorkerRecord
from infera.gaie.cli import parse_args
from infera.gaie.picker import EndpointPicker, destination
from infera.router import dispatch as dispatch_module
from infera.router.policy import RoutedRequest
from infera.router.upstream import Opened
from infera.api.requests import parse_request
from infera.server.routing_stack import RoutingStack

BS = 16


class NoDiscovery:
    async def start(self, fleet) -> None:
        pass

    async def stop(self) -> None:
        pass


def epp_args(*extra: str):
    return parse_args(["--etcd-endpoint", "unused:1", "--no-secure-serving", "--engine-scrape-interval", "0",
                       *extra], environ={})


def worker(wid: str, mode: str = "mixed", port: int = 30000, **kw) -> WorkerRecord:
    meta = {"protocol": "mooncake"} if mode != "mixed" else {}
    return WorkerRecord(worker_id=wid, url=f"http://10.0.0.{wid[-1]}:{port}", model_name="m", kv_block_size=BS,
                        disagg_mode=mode, disagg_meta=meta, **kw)


def stack_with(workers, *extra: str) -> RoutingStack:
    stack = RoutingStack(epp_args(*extra), NoDiscovery())
    for w in workers:
        stack.fleet.upsert(w)
    return stack


def routed(body: dict, route: str = "/v1/completions") -> RoutedRequest:
    raw = json.dumps(body).encode()
    parsed = parse_request(route, raw)
    return RoutedRequest(route=route, body=raw, parsed=parsed, model=parsed.model, stream=bool(parsed.stream),
                         request_id="r")


def workload(n: int, seed: int = 7) -> list[dict]:
    """Token-id prompts over a few shared prefixes (conversations), so kv-aware picks matter."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 30000) for _ in range(BS * rng.randint(2, 6))] for _ in range(5)]
    return [{"model": "m", "prompt": rng.choice(prefixes) + [rng.randrange(1000, 30000) for _ in range(BS)],
             "max_tokens": 4} for _ in range(n)]


async def test_the_epp_picks_what_the_server_dispatches_on_the_same_state(monkeypatch):
    workers = [worker(f"w{i}") for i in range(1, 4)]
    server, epp = stack_with(workers), stack_with(workers)
    sent: list[str] = []

    async def fake_open(transport, w, route, body, headers, stream, role="mixed"):
        sent.append(w.worker_id)
        return Opened(200, "application/json", body=b'{"usage":{"prompt_tokens":1}}')

    monkeypatch.setattr(dispatch_module, "open_upstream", fake_open)
    picks: list[str] = []
    hits = 0
    for body in workload(60):
        await server.router.dispatch(routed(body))
        req = routed(body)
        picked = await epp.router.pick(req)
        picks.append(picked.worker.worker_id)
        hits += req.state.get("predicted_hit_blocks", 0) > 0
        picked.finish(200)
    assert picks == sent
    assert hits > 30  # kv-aware at work: served prefixes pull their conversations back
    assert len(set(picks)) > 1  # the workload spreads: equal lists are not one worker twice
    # every charge returned on both sides
    for w in workers:
        assert server.metrics.inflight_gauge(w.worker_id).value == 0
        assert epp.metrics.inflight_gauge(w.worker_id).value == 0


async def test_in_flight_charges_steer_the_next_pick_until_finished():
    epp = stack_with([worker("w1"), worker("w2")], "--router-policy", "round-robin")
    body = {"model": "m", "prompt": "x", "max_tokens": 1}
    first = await epp.router.pick(routed(body))
    assert epp.metrics.inflight_gauge(first.worker.worker_id).value == 1
    first.finish(None)
    first.finish(200)  # a second call changes nothing
    assert epp.metrics.inflight_gauge(first.worker.worker_id).value == 0
    assert first.finished


async def test_pd_preferred_decode_primary_with_its_prefill():
    stack = stack_with([worker("w1"), worker("p2", "prefill"), worker("d3", "decode")])
    picked = await stack.router.pick(routed({"model": "m", "prompt": "hello", "max_tokens": 1}))
    assert (picked.worker.worker_id, picked.prefill.worker_id) == ("d3", "p2")
    assert stack.metrics.inflight_gauge("d3").value == 1
    assert stack.metrics.inflight_gauge("p2").value == 1
    picked.finish(200)
    assert stack.metrics.inflight_gauge("d3").value == 0
    assert stack.metrics.inflight_gauge("p2").value == 0


async def test_one_pd_pool_alone_is_the_servers_503():
    stack = stack_with([worker("p2", "prefill")])
    with pytest.raises(ApiError) as err:
        await stack.router.pick(routed({"model": "m", "prompt": "hello"}))
    assert err.value.status == 503 and err.value.code == "no_decode_worker"


async def test_endpoint_picker_headers_mixed_and_pd():
    mixed = stack_with([worker("w1")])
    picker = EndpointPicker(mixed.router, destination_port=8000)
    pick = await picker.pick("/v1/chat/completions?x=1",
                             json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode(),
                             {"x-request-id": "abc"})
    assert pick.set_headers == {"x-gateway-destination-endpoint": "10.0.0.1:8000", "x-worker-instance-id": "w1"}
    assert "x-prefill-instance-id" in pick.remove_headers  # a client's own pin never reaches the sidecar
    assert pick.request.request_id == "abc"
    pick.finish(200)

    pd = stack_with([worker("p2", "prefill"), worker("d3", "decode")])
    own_port = EndpointPicker(pd.router, destination_port=0)
    pick = await own_port.pick("/v1/completions", b'{"model": "m", "prompt": "hi"}', {})
    assert pick.set_headers["x-gateway-destination-endpoint"] == "10.0.0.3:30000"
    assert pick.set_headers["x-worker-instance-id"] == "d3"
    assert pick.set_headers["x-prefill-instance-id"] == "p2"
    pick.finish(None)


@pytest.mark.parametrize("path, body, status", [
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/completions", b'{"prompt": "no model"}', 400),
    ("/v1/models", b'{"model": "m"}', 404),
    ("/v1/completions", b'{"model": "other", "prompt": "x"}', 404),
])
async def test_refused_picks_are_api_errors(path, body, status):
    picker = EndpointPicker(stack_with([worker("w1")]).router, destination_port=8000)
    with pytest.raises(ApiError) as err:
        await picker.pick(path, body, {})
    assert err.value.status == status


def test_destination_formats():
    assert destination(worker("w1"), 8000) == "10.0.0.1:8000"
    assert destination(worker("w1"), 0) == "10.0.0.1:30000"
    v6 = WorkerRecord(worker_id="v6", url="http://[fd00::5]:31000", model_name="m")
    assert destination(v6, 0) == "[fd00::5]:31000"


async def test_a_rank_multiplexed_worker_gets_the_chosen_rank_header():
    stack = stack_with([worker("w1", dp_size=2)])
    picker = EndpointPicker(stack.router, destination_port=8000)
    ranks = set()
    picks = []
    for i in range(4):  # in flight together: the load spreads over both ranks
        pick = await picker.pick("/v1/completions", json.dumps({"model": "m", "prompt": [i] * 40}).encode(), {})
        ranks.add(pick.set_headers["x-data-parallel-rank"])
        assert "x-data-parallel-rank" not in pick.remove_headers
        picks.append(pick)
    assert ranks == {"0", "1"}
    for pick in picks:
        pick.finish(200)
    plain = await EndpointPicker(stack_with([worker("w2")]).router, destination_port=8000).pick(
        "/v1/completions", b'{"model": "m", "prompt": "x"}', {"x-data-parallel-rank": "1"})
    assert "x-data-parallel-rank" in plain.remove_headers  # a client's rank never reaches a worker unasked


@pytest.mark.parametrize("extra, salt", [
    ({"cache_salt": "user-7"}, "user-7"),  # the engine folds it into its hashes: the pick must too
    ({}, None),
    ({"cache_salt": None}, None),  # present but null: nothing to fold (the engine's own rule for a bad one)
    ({"cache_salt": ""}, None),
])
async def test_the_picker_hashes_under_the_clients_cache_salt(extra, salt):
    picker = EndpointPicker(stack_with([worker("w1")]).router, destination_port=8000)
    body = {"model": "m", "prompt": list(range(1000, 1000 + 3 * BS)), "max_tokens": 2, **extra}
    pick = await picker.pick("/v1/completions", json.dumps(body).encode(), {})
    assert pick.request.state.get("cache_salt") == salt
    pick.finish(200)
