"""Issue 27, a client against the fleet: a request that crashes every engine, a client's own queue
priority, duplicate keys. Real routers, simulated engines (in process, recording what they receive;
or a real ``python -m infera.engine.sim`` worker where the process layout matters)."""
from __future__ import annotations

import contextlib
import json

import aiohttp
import pytest
from aiohttp import web

from infera.engine.base.prom import sample_sum
from infera.engine.sim.server import SimServer, parse_args
from tests.integration.conftest import wait_workers
from tests.integration.test_cache_hints_engine import FIXED, MODEL, record, sims  # noqa: F401 (a fixture)

pytestmark = pytest.mark.integration

POISON = "poison-pill"  # a request naming it crashes the engine, as a real engine bug would, on every worker
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **FIXED}


@pytest.fixture
async def crashing_sims():
    """``await start(always=False)``: a sim (vLLM's API) whose engine answers 500, in vLLM's error
    shape, to every request naming ``POISON`` (as a real engine bug would), or to every request;
    ``.crashed`` counts them."""
    async with contextlib.AsyncExitStack() as stack:
        async def start(always: bool = False) -> SimServer:
            sim = SimServer(parse_args(["--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--speedup", "1000"]))
            sim.crashed = 0

            @web.middleware
            async def crash(request: web.Request, handler):
                if request.method == "POST" and (always or POISON.encode() in await request.read()):
                    sim.crashed += 1
                    return web.json_response({"error": {"message": "EngineCore hit KeyError: 'poison-pill'",
                                                        "type": "InternalServerError", "code": 500}}, status=500)
                return await handler(request)

            sim.app.middlewares.insert(0, crash)
            return await stack.enter_async_context(sim)

        yield start


async def breaker_states(s: aiohttp.ClientSession, base: str, ids: list[str]) -> list[tuple[float, float]]:
    async with s.get(base + "/metrics") as r:
        text = await r.text()
    return [(sample_sum(text, "infera_router_worker_breaker_state", f'worker_id="{i}"'),
             sample_sum(text, "infera_router_worker_breaker_trips_total", f'worker_id="{i}"')) for i in ids]


# -- a request every engine fails on ----------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_every_engine_fails_on_is_returned_and_opens_no_breaker(fed_server, crashing_sims, stream):
    sims_ = [await crashing_sims() for _ in range(3)]
    server, base = await fed_server("--breaker-failure-threshold", "2", "--request-max-retries", "3")
    ids = [f"w{i}" for i in range(3)]
    for wid, sim in zip(ids, sims_):
        server.fleet.upsert(record(wid, sim, "sim"))
    async with aiohttp.ClientSession() as s:
        for n in range(1, 5):  # twice the threshold per worker, were each 5xx a vote
            async with s.post(base + "/v1/chat/completions", json={**CHAT, "stream": stream, "user": POISON}) as r:
                assert r.status == 500
                err = (await r.json())["error"]
            assert sum(sim.crashed for sim in sims_) == 2 * n  # two workers, not the whole fleet
            assert err["code"] == "engine_error" and err["type"] == "server_error"
            assert "KeyError: 'poison-pill'" in err["message"]  # the engine's own words
        assert await breaker_states(s, base, ids) == [(0, 0)] * 3
        for _ in range(3):  # every worker still serves
            async with s.post(base + "/v1/chat/completions", json={**CHAT, "stream": stream}) as r:
                assert r.status == 200, await r.text()


async def test_a_request_every_pd_engine_fails_on_is_returned_and_opens_no_breaker(fed_server, crashing_sims):
    """The same rule on a prefill/decode fleet, per role: the prefill engines of two workers answer
    5xx, the request goes back to the client and no breaker of either pool counts it."""
    nixl = {"protocol": "vllm-nixl", "params": {"engine_id": "e"}}
    sims_ = [await crashing_sims() for _ in range(4)]
    server, base = await fed_server("--breaker-failure-threshold", "2", "--request-max-retries", "3")
    ids = ["p0", "p1", "d0", "d1"]
    for wid, sim in zip(ids, sims_):
        server.fleet.upsert(record(wid, sim, "vllm", disagg_mode="prefill" if wid[0] == "p" else "decode",
                                   disagg_meta=nixl))
    async with aiohttp.ClientSession() as s:
        for n in range(1, 5):  # twice the threshold per prefill worker, were each 5xx a vote
            async with s.post(base + "/v1/chat/completions", json={**CHAT, "user": POISON}) as r:
                assert r.status == 500
                err = (await r.json())["error"]
            assert err["code"] == "engine_error" and "KeyError: 'poison-pill'" in err["message"]
            assert sims_[0].crashed + sims_[1].crashed == 2 * n  # both prefills once each, no more
            assert sims_[2].crashed + sims_[3].crashed == 0  # a serial pair never reached a decode
        assert await breaker_states(s, base, ids) == [(0, 0)] * 4


async def test_a_worker_failing_every_request_is_still_opened(fed_server, crashing_sims):
    """The other half of the rule: a 5xx that another worker then serves is the first worker's, and
    counts; the broken worker opens at the threshold as before."""
    broken, good = await crashing_sims(always=True), await crashing_sims()
    server, base = await fed_server("--breaker-failure-threshold", "2", "--request-max-retries", "1")
    server.fleet.upsert(record("broken", broken, "sim"))
    server.fleet.upsert(record("good", good, "sim"))
    async with aiohttp.ClientSession() as s:
        for _ in range(6):
            async with s.post(base + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200, await r.text()
        assert broken.crashed == 2
        assert await breaker_states(s, base, ["broken", "good"]) == [(2, 1), (0, 0)]


async def test_sim_answers_required_tool_choice(make_server, spawn_worker):
    """``tool_choice: "required"`` through a real sim worker process: a tool call, not a 500 (the
    engine ran as ``__main__`` beside a second copy of its module, and the tool path's app key was
    the other copy's: KeyError)."""
    srv = await make_server()
    w = await spawn_worker()
    await wait_workers(srv, {w.worker_id})
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    async with aiohttp.ClientSession() as s:
        for stream in (False, True):
            body = {**CHAT, "model": "sim-model", "tools": tools, "tool_choice": "required", "stream": stream}
            async with s.post(f"http://127.0.0.1:{srv.port}/v1/chat/completions", json=body) as r:
                text = await r.text()
                assert r.status == 200, text
            if stream:
                assert '"tool_calls"' in text and '"name":"weather"' in text and text.endswith("data: [DONE]\n\n")
            else:
                (call,) = json.loads(text)["choices"][0]["message"]["tool_calls"]
                assert call["function"]["name"] == "weather" and "city" in json.loads(call["function"]["arguments"])


# -- a client's priority ------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, sent, sglang, vllm", [
    ((), 2147483647, 100, None),  # dropped: SGLang gets the router's own (long retention: 100), vLLM none
    ((), 0, 100, None),
    (("--allow-client-priority",), 2147483647, 100, 100),  # allowed: clamped to 0-100
    (("--allow-client-priority",), -7, 0, 0),
    (("--allow-client-priority",), 42, 42, 42),
    (("--allow-client-priority",), "42", 100, None),  # not an integer: dropped
])
async def test_client_priority_reaching_the_engine(fed_server, sims, flags, sent, sglang, vllm):  # noqa: F811
    sg, vl = await sims("sglang"), await sims("vllm")
    server, base = await fed_server(*flags)
    server.fleet.upsert(record("a-sglang", sg, "sglang"))
    server.fleet.upsert(record("b-vllm", vl, "vllm"))
    async with aiohttp.ClientSession() as s:
        for _ in range(2):  # round-robin: one each
            async with s.post(base + "/v1/chat/completions", json={**CHAT, "priority": sent}) as r:
                assert r.status == 200, await r.text()
    (got_sg,), (got_vl,) = sg.bodies.bodies, vl.bodies.bodies
    assert got_sg.get("priority") == sglang and got_vl.get("priority") == vllm


# -- duplicate keys -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tail, key", [
    (b'"kv_transfer_params":{"remote_host":"10.9.9.9","remote_port":1},"kv_transfer_params":null',
     "kv_transfer_params"),
    (b'"priority":2147483647,"priority":0', "priority"),
    (b'"stream":true,"stream":false', "stream"),
    (b'"\\u0070riority":2147483647', "priority"),
])
async def test_duplicate_keys_are_refused_and_never_forwarded(fed_server, sims, tail, key):  # noqa: F811
    sim = await sims("vllm")
    server, base = await fed_server()
    server.fleet.upsert(record("w", sim, "vllm"))
    raw = json.dumps(CHAT).encode()[:-1] + b"," + tail + b"}"
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
            err = (await r.json())["error"]
        assert (err["code"], err["param"], err["type"]) == ("duplicate_key", key, "invalid_request_error")
        async with s.post(base + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
    assert len(sim.bodies.bodies) == 1  # only the clean request reached the engine
