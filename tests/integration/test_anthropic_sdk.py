"""``POST /v1/messages`` with the real ``anthropic`` SDK, through the router, to a sim worker over
loopback HTTP (the sim answers forced tool calls: infera/engine/sim/tool_calls.py)."""
from __future__ import annotations

import json

import aiohttp
import anthropic
import pytest
from aiohttp import web

from infera.discovery.record import BUILTIN_TOKENIZER, WorkerRecord
from infera.engine.sim.server import SimServer, parse_args
from tests.integration.conftest import LoopbackEngine, wait_workers
from tests.integration.sim_recording import EngineBodies

pytestmark = pytest.mark.integration

MODEL = "sim-model"
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"days": {"type": "integer"}, "city": {"type": "string"}},
                            "required": ["city"]}}
FIXED = {"ignore_eos": True}  # exact lengths: the sim never stops early


@pytest.fixture
async def sim():
    server = SimServer(parse_args(["--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--speedup", "1000"]))
    server.bodies = EngineBodies()  # what the engine received
    server.app.middlewares.append(server.bodies.record)  # (after the sim's own tool-call middleware)
    async with server:
        yield server


@pytest.fixture
async def router(fed_server, sim):
    """A kv-aware router (it keeps the model's tokenizer: count_tokens) fronting the sim."""
    server, base = await fed_server("--router-policy", "kv-aware")
    server.fleet.upsert(WorkerRecord(worker_id="sim-0", url=sim.url, model_name=MODEL, tokenizer=BUILTIN_TOKENIZER))
    return server, base


@pytest.fixture
async def client(router):
    c = anthropic.AsyncAnthropic(base_url=router[1], api_key="unused", max_retries=0)
    yield c
    await c.close()


async def test_create_non_streaming(client):
    msg = await client.messages.create(model=MODEL, max_tokens=7, system="You are terse.",
                                       messages=[{"role": "user", "content": "Say something"}], extra_body=FIXED)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and len(msg.content[0].text.split()) == 7
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.output_tokens == 7 and msg.usage.input_tokens > 0


async def test_prompt_cache_read_tokens(client):
    long = "the shared prefix of a long conversation " * 40
    first = await client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": long}])
    second = await client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": long}])
    assert first.usage.cache_read_input_tokens == 0
    cached = second.usage.cache_read_input_tokens
    assert cached > 0 and second.usage.input_tokens + cached == first.usage.input_tokens


async def test_stream_helper_events_and_final_message(client):
    async with client.messages.stream(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "Stream"}],
                                      extra_body=FIXED) as stream:
        kinds = []
        texts = []
        async for event in stream:
            kinds.append(event.type)
            if event.type == "text":
                texts.append(event.text)
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == 1 and kinds.count("content_block_stop") == 1
    assert "message_delta" in kinds
    assert final.content[0].type == "text" and final.content[0].text == "".join(texts)
    assert len(final.content[0].text.split()) == 6
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6 and final.usage.input_tokens > 0


async def test_raw_stream_wire_order(router):
    """The events' order on the wire, ping included, as Anthropic sends them."""
    body = {"model": MODEL, "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "hi"}], **FIXED}
    async with aiohttp.ClientSession() as http:
        async with http.post(router[1] + "/v1/messages", json=body,
                             headers={"anthropic-version": "2023-06-01"}) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
            text = await resp.text()
    kinds = [line[7:] for line in text.splitlines() if line.startswith("event: ")]
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_delta", "content_block_stop", "message_delta", "message_stop"]


@pytest.mark.parametrize("stream", [False, True])
async def test_forced_tool_call(client, stream):
    # No ignore_eos: the sim's natural stop (8 to 256 tokens) ends the call, not max_tokens.
    kwargs = dict(model=MODEL, max_tokens=300, tools=[WEATHER], tool_choice={"type": "any"},
                  messages=[{"role": "user", "content": "Weather in Paris?"}])
    if stream:
        async with client.messages.stream(**kwargs) as s:
            partial = [e.partial_json async for e in s if e.type == "input_json"]
            msg = await s.get_final_message()
        assert len(partial) > 2  # the arguments arrived in fragments
    else:
        msg = await client.messages.create(**kwargs)
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
    call = msg.content[0]
    assert call.name == "get_weather" and call.id
    assert call.input["days"] == 0 and len(call.input["city"].split()) == msg.usage.output_tokens

    # The tool's result goes back as a tool_result: the next turn is served.
    follow = await client.messages.create(
        model=MODEL, max_tokens=3, tools=[WEATHER], extra_body=FIXED,
        messages=[{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}])
    assert follow.stop_reason == "max_tokens" and follow.content[0].type == "text"
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens > msg.usage.input_tokens


async def test_named_tool_choice(client):
    other = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
    msg = await client.messages.create(model=MODEL, max_tokens=300, tools=[WEATHER, other],
                                       tool_choice={"type": "tool", "name": "get_time"},
                                       messages=[{"role": "user", "content": "time?"}])
    assert msg.stop_reason == "tool_use" and msg.content[0].name == "get_time" and msg.content[0].input == {}


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_sequences(client, stream):
    base = await client.messages.create(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "words"}],
                                        extra_body=FIXED)
    text = base.content[0].text
    stop = " " + text.split()[4]
    kwargs = dict(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": "words"}],
                  stop_sequences=["never-there", stop], extra_body=FIXED)
    if stream:
        async with client.messages.stream(**kwargs) as s:
            msg = await s.get_final_message()
    else:
        msg = await client.messages.create(**kwargs)
    assert msg.content[0].text == text[: text.index(stop)]
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop


async def test_count_tokens_matches_the_engine(client):
    messages = [{"role": "user", "content": "How many tokens is this prompt, exactly?"}]
    counted = await client.messages.count_tokens(model=MODEL, system="Be exact.", messages=messages)
    served = await client.messages.create(model=MODEL, max_tokens=1, system="Be exact.", messages=messages)
    assert counted.input_tokens == served.usage.input_tokens + served.usage.cache_read_input_tokens > 0
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.count_tokens(model="nope", messages=messages)


async def test_count_tokens_needs_the_router_tokenizer(fed_server, sim):
    server, base = await fed_server()  # round-robin: no router tokenizer
    server.fleet.upsert(WorkerRecord(worker_id="sim-0", url=sim.url, model_name=MODEL))
    async with anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0) as c:
        with pytest.raises(anthropic.InternalServerError) as info:
            await c.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 501 and "kv-aware" in info.value.body["error"]["message"]


async def test_errors_in_anthropic_shape(client, router):
    with pytest.raises(anthropic.NotFoundError) as info:
        await client.messages.create(model="nope", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "not_found_error"
    assert "nope" in info.value.body["error"]["message"]

    with pytest.raises(anthropic.BadRequestError) as info:  # document blocks are refused, by name
        await client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])
    assert info.value.body["error"] == {"type": "invalid_request_error", "message": info.value.body["error"]["message"]}
    assert "document" in info.value.body["error"]["message"]

    with pytest.raises(anthropic.BadRequestError) as info:  # the engine's own 400, in Anthropic's shape
        await client.messages.create(model=MODEL, max_tokens=9000, messages=[{"role": "user", "content": "x"}])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in info.value.body["error"]["message"]

    async with aiohttp.ClientSession() as http:
        async with http.post(router[1] + "/v1/messages", data=b"{not json") as resp:
            assert resp.status == 400 and resp.headers["X-Infera-Request-Id"]
            body = await resp.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        async with http.post(router[1] + "/v1/messages", data=b"x" * (router[0].args.max_request_bytes + 1)) as resp:
            assert resp.status == 413 and (await resp.json())["error"]["type"] == "request_too_large"


async def test_no_worker_is_overloaded(fed_server):
    server, base = await fed_server()
    async with anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0) as c:
        with pytest.raises(anthropic.APIStatusError) as info:
            await c.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 503
    assert info.value.body["error"]["type"] == "overloaded_error"
    assert info.value.response.headers["Retry-After"] == "1"


async def test_image_blocks_reach_the_engine_as_image_parts(client, sim):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    msg = await client.messages.create(model=MODEL, max_tokens=2, extra_body=FIXED, messages=[
        {"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}])
    assert msg.usage.output_tokens == 2
    assert sim.bodies.bodies[-1]["messages"] == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "text", "text": "What is this?"}]}]


async def test_engine_receives_the_translated_body(client, sim):
    # (this SDK release takes temperature/top_k only as extras; the wire fields are the same)
    await client.messages.create(model=MODEL, max_tokens=3, metadata={"user_id": "u9"},
                                 system=[{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
                                 messages=[{"role": "user", "content": "hi"}],
                                 extra_body={**FIXED, "temperature": 0.2, "top_k": 4})
    sent = sim.bodies.bodies[-1]
    assert sent == {"model": MODEL, "max_tokens": 3, "temperature": 0.2, "top_k": 4, "user": "u9",
                    "prompt_cache_retention": "5m", "ignore_eos": True,
                    "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]}

class DiesMidStream(LoopbackEngine):
    """Streams one token, then drops the connection: the router's mid-stream error frame follows."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"}}]}\n\n')
        request.transport.abort()
        return resp


async def test_midstream_failure_is_an_error_event(fed_server):
    engine = await DiesMidStream().start()
    try:
        server, base = await fed_server()
        server.fleet.upsert(WorkerRecord(worker_id="dying", url=f"http://127.0.0.1:{engine.port}", model_name=MODEL))
        async with anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0) as c:
            texts = []
            with pytest.raises(anthropic.APIStatusError) as info:
                async with c.messages.stream(model=MODEL, max_tokens=5,
                                             messages=[{"role": "user", "content": "hi"}]) as s:
                    async for event in s:
                        if event.type == "text":
                            texts.append(event.text)
        assert texts == ["Hel"]
        assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "api_error"
        assert "mid-stream" in info.value.body["error"]["message"]
    finally:
        await engine.stop()


async def test_prefill_decode_pair(make_server, spawn_worker):
    """The translated body takes the chat route's PD path: prefill leg, KV handoff, decode leg."""
    nixl = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
    server = await make_server("--router-policy", "round-robin")
    p = await spawn_worker("--kv-transfer-config", json.dumps({**nixl, "kv_role": "kv_producer"}), model="pd")
    d = await spawn_worker("--kv-transfer-config", json.dumps({**nixl, "kv_role": "kv_consumer"}), model="pd")
    await wait_workers(server, {p.worker_id, d.worker_id})
    system = "You are a meticulous assistant who answers in one sentence. " * 20
    async with anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="x", max_retries=0) as c:
        msg = await c.messages.create(model="pd", max_tokens=6, system=system, extra_body=FIXED,
                                      messages=[{"role": "user", "content": "What is a router?"}])
        async with c.messages.stream(model="pd", max_tokens=6, system=system + "!", extra_body=FIXED,
                                     messages=[{"role": "user", "content": "What is a router?"}]) as s:
            streamed = await s.get_final_message()
    for m in (msg, streamed):
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 6 and len(m.content[0].text.split()) == 6
        # the decode worker computed none of the prompt's full blocks: they came over the transfer
        assert m.usage.cache_read_input_tokens >= m.usage.input_tokens + m.usage.cache_read_input_tokens - 16
