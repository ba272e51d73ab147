"""The OpenAI Responses API (issue 32 item 1) with the real ``openai`` SDK's ``client.responses``, on
sims serving ``/v1/responses`` in vLLM's shapes behind the router: plain and streamed (vLLM's event
order), a three-turn conversation by ``previous_response_id`` whose first engine is stopped before
the third turn (the router keeps the conversation and sends the follow-up expanded), GET and DELETE
served from the router's store (404 in OpenAI's shape), ``store: false`` not kept, and kv-aware
routing following the conversation to the worker that holds its prefix."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest
from aiohttp import web

from infera.discovery.record import BUILTIN_TOKENIZER, WorkerRecord
from infera.engine.sim.server import SimServer, parse_args
from tests.conftest import wait_for
from tests.integration.conftest import wait_workers
from tests.integration.test_kv_routing import ADMIN_TOKEN, system_prompt

pytestmark = pytest.mark.integration

MODEL = "sim-model"
FIXED = {"ignore_eos": True}  # exact lengths: the sim never stops early
VLLM_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


class Requests:
    """A middleware on a sim's app: (path, JSON body) of every POST it got, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []

    @web.middleware
    async def record(self, request: web.Request, handler):
        if request.method == "POST" and request.path.startswith("/v1/"):
            self.seen.append((request.path, json.loads(await request.read())))
        return await handler(request)

    def responses(self) -> list[dict]:
        """The /v1/responses bodies (the sim's own loopback chat requests left out)."""
        return [body for path, body in self.seen if path == "/v1/responses"]


async def _sim(*flags: str) -> SimServer:
    server = SimServer(
        parse_args(["--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--speedup", "1000", *flags])
    )
    server.requests = Requests()
    server.app.middlewares.append(server.requests.record)
    return server


@pytest.fixture
async def sims():
    a, b = await _sim(), await _sim()
    async with a, b:
        yield {"a": a, "b": b}


async def _router(fed_server, sims, *flags: str):
    server, base = await fed_server("--router-mode", "direct", *flags)
    for wid, sim in sims.items():
        server.fleet.upsert(WorkerRecord(worker_id=wid, url=sim.url, model_name=MODEL, tokenizer=BUILTIN_TOKENIZER))
    return server, base


def _client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
async def test_plain_and_streamed_in_vllms_shapes(fed_server, sims, stream):
    _server, base = await _router(fed_server, sims)
    async with _client(base) as client:
        if stream:
            kinds, final = [], None
            async for event in await client.responses.create(
                model=MODEL,
                input="Say something",
                stream=True,
                instructions="You are terse.",
                max_output_tokens=5,
                extra_body=FIXED,
            ):
                kinds.append(event.type)
                if event.type == "response.completed":
                    final = event.response
            deltas = kinds.count("response.output_text.delta")
            assert deltas >= 1 and kinds == VLLM_EVENTS[:4] + ["response.output_text.delta"] * deltas + VLLM_EVENTS[5:]
            resp = final
        else:
            resp = await client.responses.create(
                model=MODEL, input="Say something", instructions="You are terse.", max_output_tokens=5, extra_body=FIXED
            )
        assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == MODEL
        assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
        assert len(resp.output_text.split()) == 5 and resp.output[0].type == "message"
        assert resp.usage.output_tokens == 5 and resp.usage.input_tokens > 0
        assert resp.usage.total_tokens == resp.usage.input_tokens + 5
        # the engine got the Responses body itself (not a chat translation), told not to keep it
        ((_path, sent),) = [r for sim in sims.values() for r in sim.requests.seen if r[0] == "/v1/responses"]
        assert sent["instructions"] == "You are terse." and sent["input"] == "Say something"
        assert sent["store"] is False and sent.get("stream", False) is stream
        # GET from the router's store: the same response
        got = await client.responses.retrieve(resp.id)
        assert got.id == resp.id and got.output_text == resp.output_text


async def test_three_turns_survive_the_first_engine(fed_server, sims):
    _server, base = await _router(fed_server, sims, "--router-policy", "round-robin")
    async with _client(base) as client:
        first = await client.responses.create(
            model=MODEL, input="Turn one", instructions="Be brief.", max_output_tokens=3, extra_body=FIXED
        )
        second = await client.responses.create(
            model=MODEL,
            input="Turn two",
            previous_response_id=first.id,
            max_output_tokens=3,
            extra_body=FIXED,
            stream=False,
        )
        # the first engine goes away; the third turn is still served, by whichever worker is left
        gone = next(
            w
            for w, sim in sims.items()
            if sim.requests.responses()[:1] and sim.requests.responses()[0]["input"] == "Turn one"
        )
        await sims[gone].__aexit__(None, None, None)  # still listed: the router fails over from it
        kinds = []
        async for event in await client.responses.create(
            model=MODEL,
            input="Turn three",
            stream=True,
            previous_response_id=second.id,
            max_output_tokens=3,
            extra_body=FIXED,
        ):
            kinds.append(event.type)
            if event.type == "response.completed":
                third = event.response
        assert kinds[-1] == "response.completed" and third.status == "incomplete"
        # each names its previous response, as the engine would have (streamed, unary and stored)
        assert third.previous_response_id == second.id and second.previous_response_id == first.id
        assert (await client.responses.retrieve(third.id)).previous_response_id == second.id
        assert first.previous_response_id is None
    left = next(w for w in sims if w != gone)
    sent = sims[left].requests.responses()[-1]
    assert "previous_response_id" not in sent
    # the conversation, expanded: turn one, its answer, turn two, its answer, turn three (no instructions)
    roles = [(item.get("role"), item.get("type")) for item in sent["input"]]
    assert roles == [("user", None), ("assistant", "message"), ("user", None), ("assistant", "message"), ("user", None)]
    assert [sent["input"][i]["content"] for i in (0, 2, 4)] == ["Turn one", "Turn two", "Turn three"]
    assert sent["input"][1]["content"][0]["text"] == first.output_text
    assert sent["input"][3]["content"][0]["text"] == second.output_text
    assert "instructions" not in sent
    # the third turn's prompt holds the conversation: its input is longer than the second's
    assert third.usage.input_tokens > second.usage.input_tokens > first.usage.input_tokens


async def test_get_delete_unknown_and_store_false(fed_server, sims):
    _server, base = await _router(fed_server, sims)
    async with _client(base) as client:
        with pytest.raises(openai.NotFoundError) as err:
            await client.responses.retrieve("resp_nope")
        assert err.value.body["message"] == "Response with id 'resp_nope' not found."
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
        unkept = await client.responses.create(
            model=MODEL, input="x", store=False, max_output_tokens=2, extra_body=FIXED
        )
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unkept.id)
        kept = await client.responses.create(model=MODEL, input="x", max_output_tokens=2, extra_body=FIXED)
        assert (await client.responses.retrieve(kept.id)).id == kept.id
        await client.responses.delete(kept.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(kept.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(kept.id)
    # the route's requests are counted like chat's
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        text = await r.text()
    assert 'route="/v1/responses"' in text


async def test_kv_aware_follows_the_conversation(make_server, spawn_worker):
    """Launched sims publishing KV events: every turn of a conversation goes where its prefix is
    cached, and the router's predicted hit is exactly the engine's cached_tokens (the router hashes
    the prompt the engine renders from the expanded input)."""
    server = await make_server("--admin-token", ADMIN_TOKEN)  # kv-aware is the default policy
    workers = [await spawn_worker("--num-gpu-blocks", "2048") for _ in range(2)]
    ids = {w.worker_id for w in workers}
    await wait_workers(server, ids)
    for wid in ids:
        await wait_for(lambda: server.kv.stats(wid).get("connected"), 10, message="KV events subscribed")
    base = f"http://127.0.0.1:{server.port}"
    follow, holder, cached = None, None, []
    async with _client(base) as client:
        for turn in range(4):
            before = {wid: server.kv.hit_totals(wid)[0] for wid in ids}
            follow = await client.responses.create(
                model=MODEL,
                input=system_prompt(3) if turn == 0 else f"and then {turn}",
                instructions="Be brief.",
                max_output_tokens=4,
                previous_response_id=follow.id if follow else None,
                extra_body=FIXED,
            )
            predicted = {wid: server.kv.hit_totals(wid)[0] - before[wid] for wid in ids}
            reported = follow.usage.input_tokens_details.cached_tokens
            cached.append(reported)
            assert sum(predicted.values()) == reported  # exact, turn after turn
            if holder is not None:
                assert predicted[holder] == reported  # the conversation's holder was picked
            tokens = follow.usage.input_tokens
            await wait_for(
                lambda: max(server.kv.index.block_count(w) for w in ids) >= tokens // 16,
                10,
                message="the turn's blocks in the view",
            )
            holder = holder or max(ids, key=server.kv.index.block_count)
    assert cached[0] == 0 and all(c >= 16 * 10 for c in cached[1:])  # every follow-up hit the conversation


async def test_conversations_shared_between_replicas_over_nats(fed_server, sims, own_nats_server):
    """Two server replicas on one NATS: a response stored through one is read, continued and
    deleted through the other (a NATS KV bucket with the store's bounds), and the delete is seen
    by the first, though it kept its own copy."""
    nats = ("--kv-event-transport", "nats", "--nats-server", own_nats_server.url, "--responses-store-ttl", "600")
    (one, base_one), (_two, base_two) = [await _router(fed_server, sims, *nats) for _ in range(2)]
    async with _client(base_one) as c1, _client(base_two) as c2:
        first = await c1.responses.create(model=MODEL, input="Turn one", max_output_tokens=3, extra_body=FIXED)
        assert (await c2.responses.retrieve(first.id)).output_text == first.output_text
        second = await c2.responses.create(
            model=MODEL, input="Turn two", previous_response_id=first.id, max_output_tokens=3, extra_body=FIXED
        )
        assert second.usage.input_tokens > first.usage.input_tokens  # expanded from the shared entry
        await c2.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await c1.responses.retrieve(first.id)  # its own copy is not served after the delete
        assert (await c1.responses.retrieve(second.id)).id == second.id
    info = await one.nats.js.stream_info("KV_infera_responses")
    assert info.config.max_age == 600 and info.config.discard == "old"
    assert info.config.max_bytes == 64 * 1024 * 1024


async def test_api_keys_guard_responses_and_tenants_keep_their_own(fed_server, sims, tmp_path):
    """Under --api-keys-file: no key is a 401 on every Responses route, a key without the model a 403,
    and a tenant neither sees, continues nor deletes another tenant's stored response (404)."""
    import hashlib

    path = tmp_path / "keys.yaml"
    path.write_text(
        "keys:\n"
        + "".join(
            f'  - sha256: {hashlib.sha256(k.encode()).hexdigest()}\n    tenant: {t}\n    models: ["{m}"]\n'
            for k, t, m in (("sk-a", "a", MODEL), ("sk-b", "b", MODEL), ("sk-c", "c", "other"))
        )
    )
    _server, base = await _router(fed_server, sims, "--api-keys-file", str(path))

    def client(key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0)

    async with client("sk-a") as a, client("sk-b") as b, client("sk-c") as c, client("nope") as nobody:
        mine = await a.responses.create(model=MODEL, input="secret", max_output_tokens=2, extra_body=FIXED)
        assert (await a.responses.retrieve(mine.id)).id == mine.id
        with pytest.raises(openai.AuthenticationError):
            await nobody.responses.retrieve(mine.id)
        with pytest.raises(openai.AuthenticationError):
            await nobody.responses.create(model=MODEL, input="x")
        with pytest.raises(openai.PermissionDeniedError):
            await c.responses.create(model=MODEL, input="x")
        with pytest.raises(openai.NotFoundError):
            await b.responses.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            await b.responses.create(model=MODEL, input="more", previous_response_id=mine.id)
        with pytest.raises(openai.NotFoundError):
            await b.responses.delete(mine.id)
        assert (await a.responses.retrieve(mine.id)).id == mine.id  # still there for its owner


async def test_the_sims_own_store_as_vllms(sims, monkeypatch):
    """The sim keeps responses only with VLLM_ENABLE_RESPONSES_API_STORE, as vLLM: without it a
    previous_response_id is a 404 (why the router keeps conversations); with it the engine expands a
    follow-up from its own store, rendering the same prompt the router's expansion gives."""
    url = sims["a"].url + "/v1/responses"
    ask = {"model": MODEL, "input": "Turn one", "instructions": "Be brief.", "max_output_tokens": 3, **FIXED}
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=ask) as r:
            first = await r.json()
        async with s.post(url, json={**ask, "input": "Turn two", "previous_response_id": first["id"]}) as r:
            assert (
                r.status == 404
                and (await r.json())["error"]["message"] == f"Response with id '{first['id']}' not found."
            )
        monkeypatch.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")
        async with s.post(url, json=ask) as r:
            first = await r.json()
        async with s.get(f"{url}/{first['id']}") as r:
            assert (await r.json())["id"] == first["id"]
        follow = {**ask, "input": "Turn two", "previous_response_id": first["id"]}
        async with s.post(url, json=follow) as r:
            by_engine = await r.json()
        expanded = {
            **ask,
            "input": [
                {"role": "user", "content": "Turn one"},
                *first["output"],
                {"role": "user", "content": "Turn two"},
            ],
        }
        async with s.post(url, json=expanded) as r:
            by_router = await r.json()
    assert by_engine["usage"]["input_tokens"] == by_router["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    assert by_engine["previous_response_id"] == first["id"]


class DiesOnResponses:
    """A fake engine serving /v1/responses: its first events, one text delta, then the connection drops."""

    def __init__(self) -> None:
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        head = {
            "id": "resp_x",
            "object": "response",
            "created_at": 0,
            "model": MODEL,
            "output": [],
            "status": "in_progress",
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
        }
        events = [
            ("response.created", {"response": head}),
            ("response.in_progress", {"response": head}),
            (
                "response.output_item.added",
                {
                    "output_index": 0,
                    "item": {
                        "id": "msg_x",
                        "type": "message",
                        "role": "assistant",
                        "content": [],
                        "status": "in_progress",
                    },
                },
            ),
            (
                "response.output_text.delta",
                {"content_index": 0, "output_index": 0, "item_id": "msg_x", "delta": "Hel", "logprobs": []},
            ),
        ]
        for seq, (kind, fields) in enumerate(events):
            await resp.write(
                f"event: {kind}\ndata: ".encode()
                + json.dumps({"type": kind, "sequence_number": seq, **fields}).encode()
                + b"\n\n"
            )
        request.transport.abort()
        return resp

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/responses", self.handle)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]


async def test_midstream_failure_is_a_responses_error_event(fed_server):
    engine = DiesOnResponses()
    await engine.start()
    try:
        server, base = await fed_server()
        server.fleet.upsert(WorkerRecord(worker_id="dying", url=f"http://127.0.0.1:{engine.port}", model_name=MODEL))
        async with _client(base) as client:
            events = [e async for e in await client.responses.create(model=MODEL, input="hi", stream=True)]
        assert [e.type for e in events] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.output_text.delta",
            "error",
        ]
        assert events[-1].sequence_number == 4 and events[-1].message and events[-1].code
        # nothing completed, nothing stored
        async with _client(base) as client:
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve("resp_x")
    finally:
        await engine.runner.cleanup()
