"""PD dispatch through a real server against in-process fake engines over loopback HTTP.

The fakes check what each leg receives (the protocol's body and headers) and misbehave on demand;
the fleet is fed directly, so each test builds exactly the pools it needs. Simulated engines that
really hand KV over are exercised in test_sim_pd_fleet.py.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from aiohttp import web

from infera.discovery.record import WorkerRecord

from tests.integration.conftest import LoopbackEngine
from tests.integration.test_router_errors import assert_openai_error

SSE = [b'data: {"choices":[{"index":0,"delta":{"content":" a"}}]}\n\n',
       b'data: {"choices":[{"index":0,"delta":{"content":" b"}}]}\n\n', b"data: [DONE]\n\n"]
NIXL = {"protocol": "vllm-nixl", "params": {"engine_id": "e"}}


def chat(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8, **extra}


class FakeEngine(LoopbackEngine):
    """An engine leg: records bodies/headers; ``behaviour`` decides the answer."""

    def __init__(self, name: str, mode: str, meta: dict, behaviour: str = "ok", model: str = "m",
                 dp_size: int | None = None) -> None:
        self.name, self.mode, self.meta, self.behaviour, self.model = name, mode, meta, behaviour, model
        self.dp_size = dp_size
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.arrived = asyncio.Event()
        self.peer: FakeEngine | None = None  # concurrent protocols: wait for the other leg to arrive
        self.cancelled = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(request.headers.copy())  # case-insensitive lookups
        self.arrived.set()
        try:
            if self.peer is not None:  # both legs must be in flight at once
                await asyncio.wait_for(self.peer.arrived.wait(), 5)
            if self.behaviour == "500":
                return web.json_response({"error": {"message": "engine exploded"}}, status=500)
            if self.behaviour == "400":
                return web.json_response({"error": {"message": "bad params", "type": "BadRequestError",
                                                    "code": 400}}, status=400)
            if self.behaviour == "hang":
                await asyncio.sleep(3600)
            if self.behaviour == "no-handoff":
                return web.json_response({"id": "p", "choices": [{"text": "x"}]})
            if self.behaviour == "atom" and self.mode == "prefill":  # ATOM v0.1.5 request_finished
                return web.json_response({"id": "p", "choices": [{"message": {"content": "x"}}], "kv_transfer_params": {
                    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [3, 4],
                    "remote_engine_id": self.name, "remote_host": "127.0.0.1", "remote_port": 2,
                    "remote_handshake_port": 2, "tp_size": 1, "dp_rank": 0, "transfer_id": 77,
                    "first_token_id": 5, "draft_token_ids": [], "local_slot_index": -1}})
            if self.mode == "prefill":
                return web.json_response({"id": "p", "choices": [{"text": "x"}], "kv_transfer_params": {
                    "do_remote_prefill": True, "remote_engine_id": self.name, "remote_block_ids": [[1, 2]],
                    "remote_request_id": request.headers.get("X-Request-Id")}})
            if not body.get("stream"):
                return web.json_response({"id": "d", "choices": [{"message": {"content": "ok"}}], "by": self.name})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i, frame in enumerate(SSE):
                if self.behaviour == "midstream" and i == 1:
                    request.transport.abort()
                    return resp
                await resp.write(frame)
            return resp
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    def record(self) -> WorkerRecord:
        meta = json.loads(json.dumps(self.meta).replace("PORT", str(self.port)))
        return WorkerRecord(worker_id=self.name, url=f"http://127.0.0.1:{self.port}", model_name=self.model,
                            engine="sglang" if meta.get("protocol") == "sglang-bootstrap" else "vllm",
                            disagg_mode=self.mode, disagg_meta=meta, dp_size=self.dp_size)


@pytest.fixture
async def pd(fed_server):
    engines = []

    async def engine(name: str, mode: str, meta: dict = NIXL, **kw) -> FakeEngine:
        e = await FakeEngine(name, mode, meta, **kw).start()
        engines.append(e)
        return e

    async with aiohttp.ClientSession() as session:
        yield fed_server, engine, session
    for e in engines:
        await e.stop()


async def post(session, url, body, headers=None):
    async with session.post(url, json=body, headers=headers or {}) as r:
        return r.status, await r.json()


async def test_nixl_serial_flow_shapes_each_leg(pd):
    server, engine, s = pd
    srv, base = await server()
    p, d = await engine("p0", "prefill"), await engine("d0", "decode")
    srv.fleet.replace_all([p.record(), d.record()])
    status, reply = await post(s, base + "/v1/chat/completions", chat(stream_options=None))
    assert status == 200 and reply["by"] == "d0"
    (pb,), (db,) = p.bodies, d.bodies
    assert pb["max_tokens"] == 1 and pb["stream"] is False and pb["kv_transfer_params"]["do_remote_decode"] is True
    assert db["max_tokens"] == 8 and db["kv_transfer_params"]["remote_engine_id"] == "p0"
    # Both legs carry the same request id, and it is the one the prefill engine echoed in its handoff.
    rid = p.headers[0]["X-Request-Id"]
    assert d.headers[0]["X-Request-Id"] == rid == db["kv_transfer_params"]["remote_request_id"]


async def test_openai_client_streams_the_decode_leg(pd):
    server, engine, _ = pd
    srv, base = await server()
    p, d = await engine("p0", "prefill"), await engine("d0", "decode")
    srv.fleet.replace_all([p.record(), d.record()])
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == " a b"
    assert p.bodies[0]["stream"] is False and d.bodies[0]["stream"] is True
    await client.close()


async def test_sglang_bootstrap_legs_run_concurrently(pd):
    server, engine, s = pd
    srv, base = await server()
    meta_p = {"protocol": "sglang-bootstrap", "params": {"bootstrap_addr": "127.0.0.1:8998"}}
    p = await engine("p0", "prefill", meta_p)
    d = await engine("d0", "decode", {"protocol": "sglang-bootstrap", "params": {}})
    p.peer, d.peer = d, p  # each answers only once the other leg has arrived: serial dispatch would deadlock
    srv.fleet.replace_all([p.record(), d.record()])
    status, _ = await post(s, base + "/v1/chat/completions", chat())
    assert status == 200
    (pb,), (db,) = p.bodies, d.bodies
    assert (pb["bootstrap_host"], pb["bootstrap_port"]) == ("127.0.0.1", 8998)
    assert pb["bootstrap_room"] == db["bootstrap_room"] and pb["max_tokens"] == db["max_tokens"] == 8


@pytest.mark.parametrize("pools, expect", [(("prefill",), "no_decode_worker"), (("decode",), "no_prefill_worker")])
async def test_one_pool_alone_is_503_naming_the_missing_pool(pd, pools, expect):
    server, engine, s = pd
    srv, base = await server()
    srv.fleet.replace_all([(await engine(f"{m}0", m)).record() for m in pools])
    status, reply = await post(s, base + "/v1/chat/completions", chat())
    assert status == 503
    err = assert_openai_error(reply, expect)
    assert expect.split("_")[1] in err["message"]


async def test_mixed_and_pd_models_share_one_server(pd):
    server, engine, s = pd
    srv, base = await server()
    p, d = await engine("p0", "prefill"), await engine("d0", "decode")
    mixed = await engine("m0", "mixed", {}, model="other")
    srv.fleet.replace_all([p.record(), d.record(), mixed.record()])
    assert (await post(s, base + "/v1/chat/completions", chat()))[1]["by"] == "d0"
    assert (await post(s, base + "/v1/chat/completions", chat(model="other")))[1]["by"] == "m0"
    assert len(mixed.bodies) == 1 and "kv_transfer_params" not in mixed.bodies[0]


async def test_pools_rotate_independently_2p1d_and_1p2d(pd):
    server, engine, s = pd
    srv, base = await server()
    ps = [await engine(f"p{i}", "prefill") for i in range(2)]
    ds = [await engine(f"d{i}", "decode") for i in range(2)]
    srv.fleet.replace_all([w.record() for w in ps + ds])
    for _ in range(4):
        assert (await post(s, base + "/v1/chat/completions", chat()))[0] == 200
    assert [len(w.bodies) for w in ps + ds] == [2, 2, 2, 2]


@pytest.mark.parametrize("failing", ["prefill", "decode"])
async def test_leg_failure_before_first_byte_is_retried_on_another_pair(pd, failing):
    server, engine, s = pd
    srv, base = await server()
    bad = await engine(f"{failing[0]}-bad", failing, behaviour="500")
    good = await engine(f"{failing[0]}-good", failing)
    other = await engine("other", "decode" if failing == "prefill" else "prefill")
    srv.fleet.replace_all([bad.record(), good.record(), other.record()])
    for _ in range(3):  # whichever the rotation picks first, the client sees success
        status, reply = await post(s, base + "/v1/chat/completions", chat())
        assert status == 200, reply
    assert bad.bodies and good.bodies
    assert b"infera_request_retries" in (await (await s.get(base + "/metrics")).read())


@pytest.mark.parametrize("behaviour, status, code, says", [
    ("500", 500, "http_500", "prefill leg"),             # the prefill engine failed
    ("no-handoff", 502, "handoff_missing", "no kv_transfer_params"),  # it answered without a handoff
])
async def test_failed_serial_prefill_is_an_openai_error_and_never_reaches_the_decode(pd, behaviour, status, code,
                                                                                     says):
    server, engine, s = pd
    srv, base = await server("--request-max-retries", "0")
    p, d = await engine("p0", "prefill", behaviour=behaviour), await engine("d0", "decode")
    srv.fleet.replace_all([p.record(), d.record()])
    status_got, reply = await post(s, base + "/v1/chat/completions", chat())
    assert status_got == status
    assert says in assert_openai_error(reply, code)["message"]
    assert d.bodies == []  # a serial pair never reaches the decode when the prefill failed


async def test_prefill_4xx_is_the_clients_error_not_retried(pd):
    server, engine, s = pd
    srv, base = await server()
    p1, p2 = await engine("p1", "prefill", behaviour="400"), await engine("p2", "prefill", behaviour="400")
    d = await engine("d0", "decode")
    srv.fleet.replace_all([p1.record(), p2.record(), d.record()])
    status, reply = await post(s, base + "/v1/chat/completions", chat())
    assert status == 400 and reply["error"]["message"] == "bad params"
    assert len(p1.bodies) + len(p2.bodies) == 1


async def test_hung_prefill_is_bounded_and_aborted(pd):
    server, engine, s = pd
    srv, base = await server("--pd-prefill-timeout", "0.5", "--request-max-retries", "0")
    p, d = await engine("p0", "prefill", behaviour="hang"), await engine("d0", "decode")
    srv.fleet.replace_all([p.record(), d.record()])
    status, reply = await asyncio.wait_for(post(s, base + "/v1/chat/completions", chat()), 10)
    assert status == 504
    assert_openai_error(reply, "prefill_timeout")

    async def aborted():
        while not p.cancelled:  # the router closed the prefill connection: the engine drops the request
            await asyncio.sleep(0.02)
    await asyncio.wait_for(aborted(), 5)
    assert srv.metrics.inflight_gauge("p0").value == 0 and srv.metrics.inflight_gauge("d0").value == 0


async def test_concurrent_prefill_failure_aborts_the_waiting_decode(pd):
    server, engine, s = pd
    srv, base = await server("--request-max-retries", "0")
    meta_p = {"protocol": "sglang-bootstrap", "params": {"bootstrap_addr": "127.0.0.1:1"}}
    p = await engine("p0", "prefill", meta_p, behaviour="500")
    d = await engine("d0", "decode", {"protocol": "sglang-bootstrap", "params": {}}, behaviour="hang")
    srv.fleet.replace_all([p.record(), d.record()])
    status, reply = await asyncio.wait_for(post(s, base + "/v1/chat/completions", chat()), 10)
    assert status == 500

    async def aborted():
        while not d.cancelled:
            await asyncio.sleep(0.02)
    await asyncio.wait_for(aborted(), 5)


async def test_midstream_decode_failure_ends_with_an_error_event(pd):
    server, engine, s = pd
    srv, base = await server()
    p, d = await engine("p0", "prefill"), await engine("d0", "decode", behaviour="midstream")
    srv.fleet.replace_all([p.record(), d.record()])
    async with s.post(base + "/v1/chat/completions", json=chat(stream=True)) as r:
        assert r.status == 200
        events = [line async for line in r.content if line.startswith(b"data:")]
    assert events[0].strip() == SSE[0].strip()
    last = json.loads(events[-1][5:])
    assert last["error"]["code"] == "worker_failed_midstream"
    assert srv.metrics.inflight_gauge("d0").value == 0


async def test_pair_never_mixes_protocols(pd):
    server, engine, s = pd
    srv, base = await server()
    p = await engine("p0", "prefill")
    d = await engine("d0", "decode", {"protocol": "vllm-mooncake", "params": {}})
    srv.fleet.replace_all([p.record(), d.record()])
    status, reply = await post(s, base + "/v1/chat/completions", chat())
    assert status == 500
    assert "vllm-nixl" in assert_openai_error(reply, "pd_protocol_mismatch")["message"]
    assert p.bodies == d.bodies == []


@pytest.mark.parametrize("stream", [False, True])
async def test_atom_pair_serves_chat(pd, stream):
    """ATOM v0.1.5 serves PD on /v1/chat/completions (atom/entrypoints/openai/api_server.py
    chat_completions passes kv_transfer_params to the engine; tests/fixtures/pd/README.md)."""
    server, engine, s = pd
    srv, base = await server()
    meta = {"protocol": "atom-mooncake", "params": {"host": "127.0.0.1", "http_port": "PORT", "handshake_port": 2,
                                                    "tp_size": 1, "dp_size": 1}}
    p = await engine("p0", "prefill", meta, behaviour="atom")
    d = await engine("d0", "decode", meta, behaviour="atom")
    srv.fleet.replace_all([p.record(), d.record()])
    if stream:
        async with s.post(base + "/v1/chat/completions", json=chat(stream=True)) as r:
            assert r.status == 200
            text = await r.text()
        assert '" a"' in text and text.rstrip().endswith("data: [DONE]")
    else:
        status, reply = await post(s, base + "/v1/chat/completions", chat())
        assert status == 200 and reply["by"] == "d0"
    (pb,), (db,) = p.bodies, d.bodies
    assert pb["messages"] == db["messages"] == chat()["messages"]
    assert pb["max_tokens"] == 1 and pb["stream"] is False
    assert pb["kv_transfer_params"]["do_remote_decode"] is True
    assert (pb["kv_transfer_params"]["remote_port"], pb["kv_transfer_params"]["remote_handshake_port"]) == (d.port, 2)
    assert db["max_tokens"] == 8 and bool(db.get("stream")) is stream
    handoff = db["kv_transfer_params"]
    assert (handoff["transfer_id"], handoff["remote_engine_id"], handoff["remote_dp_rank"], handoff["tp_size"]) == \
        (77, "p0", 0, 1)


async def test_dp_rank_header_on_each_leg_and_room_aligned(pd):
    server, engine, s = pd
    srv, base = await server("--router-policy", "kv-aware")
    meta_p = {"protocol": "sglang-bootstrap", "params": {"bootstrap_addr": "127.0.0.1:8998"}}
    p = await engine("p0", "prefill", meta_p, dp_size=4)
    d = await engine("d0", "decode", {"protocol": "sglang-bootstrap", "params": {}}, dp_size=2)
    srv.fleet.replace_all([p.record(), d.record()])
    for _ in range(3):
        assert (await post(s, base + "/v1/chat/completions", chat()))[0] == 200
    for pb, ph, db, dh in zip(p.bodies, p.headers, d.bodies, d.headers):
        rank = int(ph["X-Data-Parallel-Rank"])
        assert pb["bootstrap_room"] % 4 == rank and db["disagg_prefill_dp_rank"] == rank
        assert dh["X-Data-Parallel-Rank"] in ("0", "1")


async def test_direct_mode_pins_the_named_pair(pd):
    server, engine, s = pd
    srv, base = await server("--router-mode", "direct")
    ps = [await engine(f"p{i}", "prefill") for i in range(2)]
    ds = [await engine(f"d{i}", "decode") for i in range(2)]
    srv.fleet.replace_all([w.record() for w in ps + ds])
    for _ in range(2):
        status, reply = await post(s, base + "/v1/chat/completions", chat(),
                                   {"x-prefill-instance-id": "p1", "x-worker-instance-id": "d0"})
        assert status == 200 and reply["by"] == "d0"
    assert (len(ps[0].bodies), len(ps[1].bodies)) == (0, 2)
    status, reply = await post(s, base + "/v1/chat/completions", chat(),
                               {"x-prefill-instance-id": "d1", "x-worker-instance-id": "d0"})
    assert status == 400
    assert_openai_error(reply, "worker_role_mismatch")
