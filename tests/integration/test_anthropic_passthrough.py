"""Anthropic passthrough (issue 32 item 4) with the real ``anthropic`` SDK, on sims: a worker whose
engine serves ``/v1/messages`` itself (``--serve-anthropic``, vLLM's format) is sent the client's
own request and its answer is relayed unchanged (its ids are the engine's, ``chatcmpl-…``); a worker
without it in the same fleet is sent the translated chat request (ids ``msg_…``). Streaming and not,
pinned and by load, the launcher's probe marking the record, kv-aware predictions exact both ways,
and errors in Anthropic's shape."""
from __future__ import annotations

import hashlib
import json

import aiohttp
import anthropic
import pytest
from aiohttp import web

from infera.discovery.record import BUILTIN_TOKENIZER, WorkerRecord
from infera.engine.base.anthropic_probe import serves_anthropic_messages
from infera.engine.sim.server import SimServer, parse_args
from tests.conftest import free_port, wait_for
from tests.integration.conftest import wait_workers
from tests.integration.test_kv_routing import ADMIN_TOKEN, cache_view, system_prompt

pytestmark = pytest.mark.integration

MODEL = "sim-model"
FIXED = {"ignore_eos": True}  # exact lengths: the sim never stops early
SPEAKS, PLAIN = "speaks", "plain"


class Requests:
    """A middleware on a sim's app: (path, JSON body) of every POST it got, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []

    @web.middleware
    async def record(self, request: web.Request, handler):
        if request.method == "POST" and request.path.startswith("/v1/"):
            self.seen.append((request.path, json.loads(await request.read())))
        return await handler(request)

    def paths(self) -> list[str]:
        return [p for p, _ in self.seen]


async def _sim(*flags: str):
    server = SimServer(parse_args(["--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--speedup", "1000",
                                   *flags]))
    server.requests = Requests()
    server.app.middlewares.append(server.requests.record)
    return server


@pytest.fixture
async def sims():
    """Two sims, one serving Anthropic's Messages API itself."""
    speaks, plain = await _sim("--serve-anthropic"), await _sim()
    async with speaks, plain:
        yield {SPEAKS: speaks, PLAIN: plain}


async def _router(fed_server, sims, *flags: str):
    server, base = await fed_server("--router-mode", "direct", *flags)
    for wid, sim in sims.items():
        server.fleet.upsert(WorkerRecord(worker_id=wid, url=sim.url, model_name=MODEL, tokenizer=BUILTIN_TOKENIZER,
                                         anthropic_messages=wid == SPEAKS))
    return server, base


def _pin(worker: str) -> dict:
    return {"x-worker-instance-id": worker}


async def _metric(base: str, mode: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(f'infera_anthropic_messages_total{{mode="{mode}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("stream", [False, True])
async def test_passthrough_and_translation_in_one_fleet(fed_server, sims, stream):
    server, base = await _router(fed_server, sims)
    ask = {"model": MODEL, "max_tokens": 5, "system": "You are terse.",
           "messages": [{"role": "user", "content": "Say something"}], "extra_body": FIXED}
    async with anthropic.AsyncAnthropic(base_url=base, api_key="unused", max_retries=0) as client:
        messages = {}
        for wid in (SPEAKS, PLAIN):
            if stream:
                async with client.messages.stream(**ask, extra_headers=_pin(wid)) as s:
                    kinds = [event.type async for event in s]
                    messages[wid] = await s.get_final_message()
                assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
            else:
                messages[wid] = await client.messages.create(**ask, extra_headers=_pin(wid))
    passed, translated = messages[SPEAKS], messages[PLAIN]
    assert passed.id.startswith("chatcmpl-") and translated.id.startswith("msg_")  # whose message it is
    for msg in (passed, translated):
        assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
        assert [b.type for b in msg.content] == ["text"] and len(msg.content[0].text.split()) == 5
        assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 5 and msg.usage.input_tokens > 0
    assert passed.content[0].text == translated.content[0].text  # the same engine model, either way
    # the engine that speaks Anthropic got the client's own request; the other the chat translation
    path, sent = sims[SPEAKS].requests.seen[0]
    assert path == "/v1/messages" and sent["system"] == "You are terse." and sent["max_tokens"] == 5
    assert sent.get("stream", False) is stream and sent["ignore_eos"] is True
    assert sims[PLAIN].requests.paths() == ["/v1/chat/completions"]
    assert sims[PLAIN].requests.seen[0][1]["messages"][0] == {"role": "system", "content": "You are terse."}
    assert await _metric(base, "passthrough") == 1 and await _metric(base, "translated") == 1


async def test_by_load_each_reply_in_its_workers_mode(fed_server, sims):
    server, base = await _router(fed_server, sims, "--router-policy", "round-robin")
    async with anthropic.AsyncAnthropic(base_url=base, api_key="unused", max_retries=0) as client:
        ids = [(await client.messages.create(model=MODEL, max_tokens=2, extra_body=FIXED,
                                             messages=[{"role": "user", "content": f"q{i}"}])).id for i in range(4)]
        async with client.messages.stream(model=MODEL, max_tokens=2, extra_body=FIXED,
                                          messages=[{"role": "user", "content": "s"}]) as s:
            ids.append((await s.get_final_message()).id)
    passed = sum(i.startswith("chatcmpl-") for i in ids)
    assert passed == sims[SPEAKS].requests.paths().count("/v1/messages") and 2 <= passed <= 3
    assert len(ids) - passed == sims[PLAIN].requests.paths().count("/v1/chat/completions")
    assert all(i.startswith(("chatcmpl-", "msg_")) for i in ids)
    assert await _metric(base, "passthrough") == passed and await _metric(base, "translated") == len(ids) - passed


async def test_engine_errors_relayed_in_anthropic_shape(fed_server, sims):
    server, base = await _router(fed_server, sims)
    async with anthropic.AsyncAnthropic(base_url=base, api_key="unused", max_retries=0) as client:
        with pytest.raises(anthropic.BadRequestError) as info:  # the engine's own 400, as it wrote it
            await client.messages.create(model=MODEL, max_tokens=9000, extra_headers=_pin(SPEAKS),
                                         messages=[{"role": "user", "content": "x"}])
    assert info.value.body["type"] == "error" and "max_tokens" in info.value.body["error"]["message"]
    assert sims[SPEAKS].requests.paths()[0] == "/v1/messages"


class DiesOnMessages:
    """A fake engine that speaks Anthropic (/v1/messages only): one text delta, then the connection drops."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.paths.append(request.path)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'event: message_start\ndata: {"type":"message_start","message":{"id":"chatcmpl-x",'
                         b'"type":"message","role":"assistant","content":[],"model":"sim-model","stop_reason":null,'
                         b'"stop_sequence":null,"usage":{"input_tokens":1,"output_tokens":0}}}\n\n'
                         b'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
                         b'"content_block":{"type":"text","text":""}}\n\n'
                         b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
                         b'"delta":{"type":"text_delta","text":"Hel"}}\n\n')
        request.transport.abort()
        return resp

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/messages", self.handle)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()


async def test_midstream_failure_is_an_anthropic_error_event(fed_server):
    engine = DiesOnMessages()
    await engine.start()
    try:
        server, base = await fed_server()
        server.fleet.upsert(WorkerRecord(worker_id="dying", url=f"http://127.0.0.1:{engine.port}", model_name=MODEL,
                                         anthropic_messages=True))
        async with anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0) as c:
            texts = []
            with pytest.raises(anthropic.APIStatusError) as info:
                async with c.messages.stream(model=MODEL, max_tokens=5,
                                             messages=[{"role": "user", "content": "hi"}]) as s:
                    async for event in s:
                        if event.type == "text":
                            texts.append(event.text)
        assert texts == ["Hel"] and engine.paths == ["/v1/messages"]
        assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "api_error"
        assert "mid-stream" in info.value.body["error"]["message"]
    finally:
        await engine.stop()


async def test_launcher_probe_marks_the_record_and_kv_predictions_stay_exact(make_server, spawn_worker):
    """Launched sims: the probe marks only the one serving /v1/messages. The same long prompt twice
    to each (a model each, so the kv-aware policy picks it): the second hits its cache, the router
    predicts exactly what the engine reports (Anthropic's cache_read_input_tokens on the
    passthrough), and the self-check agrees."""
    server = await make_server("--admin-token", ADMIN_TOKEN)  # kv-aware is the default policy
    speaks = await spawn_worker("--serve-anthropic", "--num-gpu-blocks", "2048", model="sim-a")
    plain = await spawn_worker("--num-gpu-blocks", "2048", model="sim-b")
    await wait_workers(server, {speaks.worker_id, plain.worker_id})
    marks = {r.worker_id: r.anthropic_messages for r in server.fleet.all()}
    assert marks == {speaks.worker_id: True, plain.worker_id: False}
    base = f"http://127.0.0.1:{server.port}"
    prompt = system_prompt(3)
    async with aiohttp.ClientSession() as s, \
            anthropic.AsyncAnthropic(base_url=base, api_key="unused", max_retries=0) as client:
        for worker, model, prefix in ((speaks, "sim-a", "chatcmpl-"), (plain, "sim-b", "msg_")):
            wid = worker.worker_id
            await wait_for(lambda: server.kv.stats(wid).get("connected"), 10, message="KV events subscribed")
            results = []
            for _ in range(2):
                before = server.kv.hit_totals(wid)[0]
                msg = await client.messages.create(model=model, max_tokens=2, extra_body=FIXED, system=prompt,
                                                   messages=[{"role": "user", "content": "the question"}])
                assert msg.id.startswith(prefix)
                results.append((msg.usage.cache_read_input_tokens, server.kv.hit_totals(wid)[0] - before))
                prompt_tokens = msg.usage.input_tokens + msg.usage.cache_read_input_tokens
                await wait_for(lambda: server.kv.index.block_count(wid) >= prompt_tokens // 16, 10,
                               message="the prompt's blocks in the view")
            (cold, cold_predicted), (warm, warm_predicted) = results
            assert cold == cold_predicted == 0
            assert warm >= 16 * (prompt_tokens // 16 - 1) and warm_predicted == warm
            view = await cache_view(s, base, wid)
            assert view["prediction"]["observations"] == 2 and view["prediction"]["exact"] == 2



async def test_sim_serves_the_messages_api_as_vllm_and_the_probe_tells(sims):
    speaks, plain = sims[SPEAKS].url, sims[PLAIN].url
    async with aiohttp.ClientSession() as s:
        assert await serves_anthropic_messages(s, speaks, MODEL) is True
        assert await serves_anthropic_messages(s, plain, MODEL) is False  # 404: no such route
        assert await serves_anthropic_messages(s, f"http://127.0.0.1:{free_port()}", MODEL, timeout=2) is False
        count = {"model": MODEL, "system": "be brief", "messages": [{"role": "user", "content": "count these words"}]}
        async with s.post(speaks + "/v1/messages/count_tokens", json=count) as r:
            counted = (await r.json())["input_tokens"]
        engine = sims[SPEAKS].engine
        assert counted == len(engine.tokenizer.encode_chat([{"role": "system", "content": "be brief"},
                                                            {"role": "user", "content": "count these words"}]))
        async with s.post(speaks + "/v1/messages", json={**count, "model": "nope", "max_tokens": 2}) as r:
            assert r.status == 404
            assert await r.json() == {"type": "error", "error": {"type": "NotFoundError",
                                                                  "message": "The model `nope` does not exist."}}
        async with s.post(speaks + "/v1/messages", json={**count, "max_tokens": 2, "stream": True}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            text = await r.text()
        events = [line[len("event: "):] for line in text.splitlines() if line.startswith("event: ")]
        assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
        delta = json.loads([line for line in text.splitlines() if '"message_delta"' in line][0][len("data: "):])
        assert delta["usage"]["output_tokens"] == 2 and "cache_read_input_tokens" in delta["usage"]
        async with s.post(plain + "/v1/messages", json={**count, "max_tokens": 2}) as r:
            assert r.status == 404 and await r.json() == {"detail": "Not Found"}  # FastAPI's, as vLLM without it


async def test_a_pd_pair_keeps_the_translation(make_server, spawn_worker):
    """Both halves of a PD pair serve /v1/messages themselves (marked by the probe), yet the request
    takes the chat route's PD path, translated: the disaggregated router builds its legs from the
    chat body (the prefill leg's max_tokens 1 and kv_transfer_params), which a passthrough would not."""
    nixl = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
    server = await make_server("--router-policy", "round-robin")
    p = await spawn_worker("--serve-anthropic", "--kv-transfer-config",
                           json.dumps({**nixl, "kv_role": "kv_producer"}), model="pd")
    d = await spawn_worker("--serve-anthropic", "--kv-transfer-config",
                           json.dumps({**nixl, "kv_role": "kv_consumer"}), model="pd")
    await wait_workers(server, {p.worker_id, d.worker_id})
    assert all(r.anthropic_messages for r in server.fleet.all())
    base = f"http://127.0.0.1:{server.port}"
    system = "You are a meticulous assistant who answers in one sentence. " * 20
    async with anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0) as c:
        msg = await c.messages.create(model="pd", max_tokens=6, system=system, extra_body=FIXED,
                                      messages=[{"role": "user", "content": "What is a router?"}])
    assert msg.id.startswith("msg_") and msg.usage.output_tokens == 6 and msg.stop_reason == "max_tokens"
    assert msg.usage.cache_read_input_tokens > 0  # the decode worker got the prompt's blocks over the transfer
    assert await _metric(base, "translated") == 1 and await _metric(base, "passthrough") == 0


async def test_tenant_tokens_counted_from_the_engines_anthropic_usage(fed_server, sims, tmp_path):
    """A tokens/min limit counts a passed-through reply's tokens from Anthropic's usage (every input
    token, cached or not, and the output), unary and streamed."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"keys:\n  - sha256: {hashlib.sha256(b'sk-a').hexdigest()}\n    tenant: team-a\n"
                    "    tokens_per_minute: 100000\n")
    server, base = await _router(fed_server, sims, "--api-keys-file", str(keys))
    counted = []
    async with anthropic.AsyncAnthropic(base_url=base, api_key="sk-a", max_retries=0) as client:
        msg = await client.messages.create(model=MODEL, max_tokens=4, extra_headers=_pin(SPEAKS),
                                           system=system_prompt(5), messages=[{"role": "user", "content": "count me"}])
        counted.append(server.limiter._own["team-a"].tokens.total)
        async with client.messages.stream(model=MODEL, max_tokens=3, extra_headers=_pin(SPEAKS), system=system_prompt(5),
                                          messages=[{"role": "user", "content": "count me"}]) as s:
            streamed = await s.get_final_message()
        await wait_for(lambda: server.limiter._own["team-a"].tokens.total > counted[0], 5,
                       message="the stream's tokens counted")
        counted.append(server.limiter._own["team-a"].tokens.total)
    assert msg.id.startswith("chatcmpl-") and streamed.id.startswith("chatcmpl-")

    def total(m) -> int:
        return m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) + m.usage.output_tokens

    assert counted == [total(msg), total(msg) + total(streamed)]
    assert streamed.usage.cache_read_input_tokens  # the second: its prompt cached, and counted all the same


class FailsOnMessages:
    """A fake engine that speaks Anthropic but answers /v1/messages with a 500."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.paths.append(request.path)
        return web.json_response({"type": "error", "error": {"type": "InternalServerError", "message": "boom"}},
                                 status=500)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/messages", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        if self.runner:
            await self.runner.cleanup()


@pytest.mark.parametrize("stream", [False, True])
async def test_failover_from_a_passthrough_worker_to_a_translating_one(fed_server, sims, stream):
    """The first pick's engine fails (500) on the client's own request; the retry on a worker
    without the Messages API sends the translation, and the reply is read as one."""
    failing = FailsOnMessages()
    await failing.start()
    try:
        server, base = await fed_server("--router-policy", "round-robin")
        server.fleet.upsert(WorkerRecord(worker_id="a-fails", url=failing.url, model_name=MODEL,
                                         anthropic_messages=True))
        server.fleet.upsert(WorkerRecord(worker_id="b-plain", url=sims[PLAIN].url, model_name=MODEL))
        async with anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0) as client:
            for i in range(2):  # round-robin: one of the two starts on the failing worker
                ask = {"model": MODEL, "max_tokens": 3, "extra_body": FIXED,
                       "messages": [{"role": "user", "content": f"q{i}"}]}
                if stream:
                    async with client.messages.stream(**ask) as s:
                        msg = await s.get_final_message()
                else:
                    msg = await client.messages.create(**ask)
                assert msg.id.startswith("msg_") and msg.usage.output_tokens == 3
        assert failing.paths == ["/v1/messages"]
        assert sims[PLAIN].requests.paths() == ["/v1/chat/completions"] * 2
        assert await _metric(base, "translated") == 2 and await _metric(base, "passthrough") == 0
    finally:
        await failing.stop()


async def test_count_tokens_by_the_engine_where_the_router_cannot_count(fed_server, sims):
    """A round-robin server keeps no tokenizer: count_tokens goes to a worker whose engine serves the
    Messages API itself, and its count comes back (without such a worker: the 501, as before)."""
    server, base = await fed_server()  # round-robin
    server.fleet.upsert(WorkerRecord(worker_id=PLAIN, url=sims[PLAIN].url, model_name=MODEL))
    ask = {"model": MODEL, "system": "be brief", "messages": [{"role": "user", "content": "count these words"}]}
    async with anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0) as client:
        with pytest.raises(anthropic.InternalServerError) as info:
            await client.messages.count_tokens(**ask)
        assert info.value.status_code == 501
        server.fleet.upsert(WorkerRecord(worker_id=SPEAKS, url=sims[SPEAKS].url, model_name=MODEL,
                                         anthropic_messages=True))
        counted = await client.messages.count_tokens(**ask)
        with pytest.raises(anthropic.NotFoundError):  # the router's own 404, before any engine
            await client.messages.count_tokens(**{**ask, "model": "nope"})
    expected = len(sims[SPEAKS].engine.tokenizer.encode_chat([{"role": "system", "content": "be brief"},
                                                              {"role": "user", "content": "count these words"}]))
    assert counted.input_tokens == expected
    assert sims[SPEAKS].requests.paths() == ["/v1/messages/count_tokens"] and not sims[PLAIN].requests.seen


async def test_count_tokens_tries_another_engine_when_one_is_unreachable(fed_server, sims):
    server, base = await fed_server()  # round-robin
    server.fleet.upsert(WorkerRecord(worker_id="dead", url=f"http://127.0.0.1:{free_port()}", model_name=MODEL,
                                     anthropic_messages=True))
    server.fleet.upsert(WorkerRecord(worker_id=SPEAKS, url=sims[SPEAKS].url, model_name=MODEL,
                                     anthropic_messages=True))
    async with anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0) as client:
        counts = {(await client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}]))
                  .input_tokens for _ in range(6)}  # the dead one is picked first about half the time
    assert len(counts) == 1 and sims[SPEAKS].requests.paths() == ["/v1/messages/count_tokens"] * 6
