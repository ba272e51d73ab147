"""Fuzzing the front door (issue 11, item 8; ``/v1/messages``: issue 26, item 5): arbitrary JSON,
bytes and headers against the real server over loopback, with a fake engine behind that records
what reaches it.

Asserted for every example: no 5xx of our making (a pinned worker that does not exist is a 503 by
design), an answer within a bounded wait (no hang), the OpenAI error shape on every 4xx, and that
the engine never receives a request the door should have refused (its body fails
``parse_request``, or its X-Request-Id is not a plain token).

The Anthropic endpoint (``/v1/messages``, ``/v1/messages/count_tokens``) is held to the same, in
Anthropic's error shape (``{"type":"error","error":{"type","message"}}``, its type the one the
status names), and to the shape of its answers whatever the engine replies (odd usage, tool calls,
finish reasons, SSE frames): a message or Anthropic's event sequence, never a 500.

The server runs on its own event loop in a thread, so hypothesis drives it with plain blocking
HTTP calls (http.client, 10 s timeout each). Under CI=1 the examples are derandomized.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import random
import re
import threading
import urllib.parse

import pytest
from aiohttp import web
from hypothesis import given, settings, strategies as st

from infera.api.anthropic import anthropic_error_type
from infera.api.errors import ApiError
from infera.api.requests import parse_request
from infera.discovery.record import WorkerRecord
from infera.server.cli import parse_args
from infera.server.main import InferaServer
from tests.integration.conftest import LoopbackEngine, NoDiscovery


CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MESSAGES, COUNT_TOKENS = "/v1/messages", "/v1/messages/count_tokens"
TOKEN = "fuzz-admin-token-0123456789"
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
TIMEOUT = 10.0  # no request may take longer: a hang fails the test


class RecordingEngine(LoopbackEngine):
    """Answers every request 200 (unary JSON or a short SSE stream) and keeps what it received."""

    def __init__(self) -> None:
        self.received: list[tuple[str, bytes, str | None]] = []
        # (status, content type, body chunks): the next answers instead of the usual ones
        self.script: tuple[int, str, list[bytes]] | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.received.append((request.path, body, request.headers.get("X-Request-Id")))
        if self.script is not None:
            status, content_type, chunks = self.script
            resp = web.StreamResponse(status=status, headers={"Content-Type": content_type})
            await resp.prepare(request)
            for chunk in chunks:
                await resp.write(chunk)
            return resp
        try:
            stream = bool(json.loads(body).get("stream"))
        except (ValueError, AttributeError):
            stream = False
        if not stream:
            return web.json_response({"id": "x", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":"ok"}}]}\n\ndata: [DONE]\n\n')
        return resp


class Door:
    """Two servers and one engine on a loop of their own: kv-aware/auto, and round-robin/direct with
    admin endpoints on (a mixed worker, a decode worker, both the same fake engine)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-door", daemon=True)
        self.engine = RecordingEngine()
        self.servers: list[InferaServer] = []
        self.lock = threading.Lock()

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        await self.engine.start()
        url = f"http://127.0.0.1:{self.engine.port}"
        for flags in ([], ["--router-policy", "round-robin", "--router-mode", "direct", "--admin-token", TOKEN]):
            server = InferaServer(parse_args(["--port", "0", "--host", "127.0.0.1", "--etcd-endpoint", "unused:1",
                                              *flags], environ={}), discovery=NoDiscovery())
            await server.start()
            server.fleet.upsert(WorkerRecord(worker_id="w-mixed", url=url, model_name="m"))
            if "direct" in flags:
                server.fleet.upsert(WorkerRecord(worker_id="w-dec", url=url, model_name="m", disagg_mode="decode"))
            self.servers.append(server)
        self.auto_port, self.direct_port = (s.port for s in self.servers)

    async def _stop(self) -> None:
        for s in self.servers:
            await s.stop()
        await self.engine.stop()

    def start(self) -> "Door":
        self.thread.start()
        self.call(self._start())
        return self

    def stop(self) -> None:
        try:
            self.call(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()

    def send(self, port: int, method: str, path: str, body: bytes | None = None,
             headers: dict[str, bytes | str] | None = None) -> tuple[int, bytes, dict[str, str]]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        try:
            conn.putrequest(method, path, skip_accept_encoding=True)
            for name, value in (headers or {}).items():
                conn.putheader(name, value)
            if body is not None:
                conn.putheader("Content-Type", "application/json")
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            resp = conn.getresponse()
            return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
        finally:
            conn.close()

    def exchange(self, port: int, path: str, body: bytes, headers: dict | None = None):
        """Send one request; check the reply and what the engine got for it."""
        with self.lock:
            before = len(self.engine.received)
            status, data, reply_headers = self.send(port, "POST", path, body, headers)
            got = self.engine.received[before:]
        check_reply(status, data, reply_headers)
        for route, forwarded, request_id in got:
            assert_valid_for_engine(route, forwarded, request_id)
        if status == 200:
            assert len(got) == 1 and got[0][1] == body  # forwarded verbatim, once
        return status, data

    def anthropic(self, port: int, path: str, body: bytes, headers: dict | None = None,
                  script: tuple[int, str, list[bytes]] | None = None) -> tuple[int, bytes, dict[str, str]]:
        """One Anthropic request (the engine answering ``script`` if given); the reply and what the
        engine got are checked. Returns the reply."""
        with self.lock:
            before = len(self.engine.received)
            self.engine.script = script
            try:
                status, data, reply_headers = self.send(port, "POST", path, body, headers)
            finally:
                self.engine.script = None
            got = self.engine.received[before:]
        check_anthropic_reply(status, data, reply_headers, path, worker_at_fault=script is not None)
        for route, forwarded, request_id in got:
            assert route == CHAT  # the translation goes to the chat route
            assert_valid_for_engine(route, forwarded, request_id)
        if path == COUNT_TOKENS:
            assert not got  # counted by the router, never sent
        elif status == 200:
            assert len(got) == 1
        return status, data, reply_headers


def check_anthropic_reply(status: int, data: bytes, headers: dict[str, str], path: str,
                          worker_at_fault: bool = False) -> None:
    # By design: count_tokens' 501 (no tokenizer for the model here) and 503 (still loading); a 502
    # where the engine answered nonsense (an empty stream, a body that is no JSON)
    assert (status < 500 or (path == COUNT_TOKENS and status in (501, 503))
            or (worker_at_fault and status == 502)), (status, data[:300])
    assert REQUEST_ID.fullmatch(headers.get("x-infera-request-id", "")), headers
    if status >= 400:
        doc = json.loads(data)
        assert doc["type"] == "error" and set(doc) == {"type", "error"}, doc
        assert doc["error"]["type"] == anthropic_error_type(status) and doc["error"]["message"], doc


def check_reply(status: int, data: bytes, headers: dict[str, str]) -> None:
    assert status < 500 or status == 503, (status, data[:300])
    assert REQUEST_ID.fullmatch(headers.get("x-infera-request-id", "")), headers
    if status >= 400:
        err = json.loads(data)["error"]
        assert set(err) >= {"message", "type", "code"} and err["message"], err
        if status == 503:
            assert err["code"] == "worker_not_found", err  # only a pinned worker that does not exist


def assert_valid_for_engine(route: str, body: bytes, request_id: str | None) -> None:
    try:
        parse_request(route, body)
    except ApiError as exc:  # pragma: no cover - the failure this test exists for
        pytest.fail(f"the engine received a request the door must refuse ({exc.message}): {body[:300]!r}")
    assert request_id is not None and REQUEST_ID.fullmatch(request_id), request_id


@pytest.fixture(scope="module")
def door():
    d = Door().start()
    yield d
    d.stop()


# -- strategies ----------------------------------------------------------------------------------------
scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"])},
                                          optional={"content": st.text(max_size=40) | json_values}),
                    max_size=3) | json_values
FIELDS = {"model": st.sampled_from(["m", "other"]) | json_values, "messages": messages,
          "prompt": st.text(max_size=30) | st.lists(st.integers(0, 1000), max_size=5) | json_values,
          "stream": st.booleans() | json_values, "n": st.integers(-2, 3) | json_values,
          "max_tokens": st.integers(-2, 50) | json_values, "max_completion_tokens": st.integers(-1, 5) | json_values,
          "temperature": st.floats(allow_nan=False) | json_values, "stop": json_values,
          "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}) | json_values,
          "kv_transfer_params": st.none() | json_values, "images": json_values, "vendor_extra": json_values}
BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}  # valid for both routes
requests = (st.fixed_dictionaries({}, optional=FIELDS).map(lambda fields: {**BASE, **fields})
            .map(json.dumps).map(str.encode))
nested = st.integers(1, 3000).map(lambda d: (b'{"model":"m","messages":[{"role":"user"}],"prompt":"x","v":'
                                             + b"[" * d + b"]" * d + b"}"))
raw_bodies = (st.binary(max_size=200) | requests.map(lambda b: b[: len(b) // 2])  # cut short
              | st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")))
# Valid HTTP field values: any text but control characters (tab aside). A control character makes
# the request invalid HTTP, refused by aiohttp's parser before the app (test_invalid_http_is_400).
header_text = st.text(st.characters(blacklist_categories=("Cs", "Cc"), whitelist_characters="\t"), max_size=150)


# -- the fuzz --------------------------------------------------------------------------------------------
@settings(max_examples=150)
@given(path=st.sampled_from([CHAT, COMP]), body=requests | nested)
def test_json_requests(door, path, body):
    status, data = door.exchange(door.auto_port, path, body)
    if status == 400:
        assert json.loads(data)["error"]["type"] == "invalid_request_error"


@settings(max_examples=100)
@given(path=st.sampled_from([CHAT, COMP]), body=raw_bodies)
def test_raw_bytes(door, path, body):
    door.exchange(door.auto_port, path, body)


@settings(max_examples=100)
@given(request_id=header_text, extra=st.dictionaries(st.sampled_from(["x-worker-instance-id", "x-prefill-instance-id",
                                                                      "Authorization", "X-Data-Parallel-Rank"]),
                                                     header_text | st.sampled_from(["w-mixed", "w-dec"]), max_size=3),
       port=st.sampled_from(["auto", "direct"]))
def test_headers(door, request_id, extra, port):
    headers = {"X-Infera-Request-Id": request_id.encode("utf-8"),
               **{k: v.encode("utf-8") for k, v in extra.items()}}
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    status, data = door.exchange(door.auto_port if port == "auto" else door.direct_port, CHAT, body, headers)
    sent = request_id.strip(" \t")  # HTTP drops a field value's surrounding blanks
    if sent and not REQUEST_ID.fullmatch(sent):
        assert status == 400 and json.loads(data)["error"]["code"] == "invalid_request_id"


@settings(max_examples=60)
@given(path=st.text(max_size=20).map(lambda p: urllib.parse.quote(p.encode("utf-8", "surrogatepass"), safe="/.")),
       auth=header_text)
def test_admin_paths(door, path, auth):
    for port in (door.auto_port, door.direct_port):
        status, data, headers = door.send(port, "GET", "/v1/admin/" + path.lstrip("/"),
                                          headers={"Authorization": auth.encode("utf-8")})
        check_reply(status, data, headers)
        assert status in (401, 403), (status, data[:200])  # never served without the token


# -- /v1/messages (Anthropic) ------------------------------------------------------------------------------
cache_control = st.fixed_dictionaries({"type": st.sampled_from(["ephemeral", "other"])},
                                      optional={"ttl": st.sampled_from(["5m", "1h", " 1H ", "x"]) | json_values})
text_block = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20) | json_values},
                                   optional={"cache_control": cache_control | json_values})
blocks = st.one_of(
    text_block,
    st.fixed_dictionaries({"type": st.just("image"), "source": st.fixed_dictionaries(
        {"type": st.sampled_from(["base64", "url", "file"]) | json_values},
        optional={"media_type": st.just("image/png") | json_values, "data": st.text(max_size=8) | json_values,
                  "url": st.text(max_size=12) | json_values}) | json_values}),
    st.fixed_dictionaries({"type": st.just("tool_use")}, optional={
        "name": st.text(max_size=6) | json_values, "id": st.text(max_size=6) | json_values, "input": json_values}),
    st.fixed_dictionaries({"type": st.just("tool_result")}, optional={
        "tool_use_id": st.text(max_size=6) | json_values,
        "content": st.none() | st.text(max_size=10) | st.lists(text_block, max_size=2) | json_values}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "redacted_thinking", "document", "audio",
                                                    "server_tool_use", "x"]) | json_values}),
    json_values)
anthropic_messages = (st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]) | json_values},
    optional={"content": st.text(max_size=30) | st.lists(blocks, max_size=3) | json_values}), min_size=1, max_size=3)
    | json_values)
tools = st.lists(st.fixed_dictionaries({"name": st.text(max_size=6) | json_values}, optional={
    "type": st.sampled_from(["custom", "web_search_20250305"]) | json_values,
    "description": st.text(max_size=10) | json_values, "input_schema": st.just({"type": "object"}) | json_values,
    "cache_control": cache_control}), max_size=2) | json_values
ANTHROPIC_FIELDS = {
    "model": st.sampled_from(["m", "other", ""]) | json_values, "max_tokens": st.integers(-1, 50) | json_values,
    "messages": anthropic_messages, "system": st.text(max_size=20) | st.lists(text_block, max_size=2) | json_values,
    "stop_sequences": st.lists(st.text(max_size=5), max_size=2) | json_values, "stream": st.booleans() | json_values,
    "temperature": st.floats(allow_nan=False) | json_values, "top_p": st.floats(0, 1) | json_values,
    "top_k": st.integers(-1, 50) | json_values, "metadata": st.fixed_dictionaries({"user_id": st.text(max_size=8)})
    | json_values, "tools": tools,
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
                                         optional={"name": st.text(max_size=6) | json_values,
                                                   "disable_parallel_tool_use": st.booleans()}) | json_values,
    "thinking": json_values, "anthropic_version": json_values,
    # engine extras (forwarded as the client's own choice, then checked as any chat request is)
    "n": st.integers(-1, 3) | json_values, "kv_transfer_params": st.none() | json_values,
    "stream_options": json_values, "max_completion_tokens": json_values, "vendor_extra": json_values}
ANTHROPIC_BASE = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
anthropic_requests = (st.fixed_dictionaries({}, optional=ANTHROPIC_FIELDS)
                      .map(lambda fields: {**ANTHROPIC_BASE, **fields}).map(json.dumps).map(str.encode))
# Well-typed requests only (every block kind, tools, streams): the paths that reach the engine.
good_text = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)},
                                  optional={"cache_control": st.fixed_dictionaries(
                                      {"type": st.just("ephemeral")}, optional={"ttl": st.sampled_from(["5m", "1h"])})})
good_blocks = st.one_of(
    good_text,
    st.fixed_dictionaries({"type": st.just("image"), "source": st.sampled_from([
        {"type": "base64", "media_type": "image/png", "data": "aGk="}, {"type": "url", "url": "http://x/y.png"}])}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.just("t1"),
                           "content": st.text(max_size=8) | st.lists(good_text, max_size=2)}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": st.text(max_size=5)}))
good_turns = st.lists(st.tuples(
    st.text(max_size=20) | st.lists(good_blocks, min_size=1, max_size=3),
    st.text(max_size=20) | st.lists(good_text | st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": st.just("t1"), "name": st.just("f"), "input": st.just({"a": 1})}),
        min_size=1, max_size=2)), min_size=1, max_size=2).map(
    lambda turns: [m for user, assistant in turns for m in ({"role": "user", "content": user},
                                                            {"role": "assistant", "content": assistant})][:-1])
anthropic_valid = st.fixed_dictionaries({"model": st.just("m"), "max_tokens": st.integers(1, 50),
                                         "messages": good_turns}, optional={
    "system": st.text(max_size=20) | st.lists(good_text, max_size=2), "stream": st.booleans(),
    "stop_sequences": st.lists(st.text(min_size=1, max_size=5), max_size=2), "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1), "top_k": st.integers(1, 50), "metadata": st.just({"user_id": "u"}),
    "tools": st.just([{"name": "f", "description": "d", "input_schema": {"type": "object"}}]),
    "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "f"},
                                    {"type": "none"}])}).map(json.dumps).map(str.encode)
anthropic_raw = (st.binary(max_size=200) | anthropic_requests.map(lambda b: b[: len(b) // 2])
                 | st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")))
anthropic_nested = st.integers(1, 3000).map(lambda d: b'{"model":"m","max_tokens":5,"messages":[{"role":"user",'
                                            b'"content":"x"}],"v":' + b"[" * d + b"]" * d + b"}")
anthropic_headers = st.fixed_dictionaries({}, optional={
    "anthropic-version": header_text | st.just("2023-06-01"), "X-Infera-Request-Id": header_text,
    "x-api-key": header_text, "anthropic-beta": header_text})


@settings(max_examples=150)
@given(body=anthropic_requests | anthropic_valid | anthropic_nested, headers=anthropic_headers,
       port=st.sampled_from(["auto", "direct"]))
def test_messages_requests(door, body, headers, port):
    status, data, reply_headers = door.anthropic(door.auto_port if port == "auto" else door.direct_port, MESSAGES,
                                                 body, {k: v.encode("utf-8") for k, v in headers.items()})
    if status == 200 and reply_headers["content-type"].startswith("application/json"):
        message = json.loads(data)
        assert message["type"] == "message" and message["role"] == "assistant" and message["content"], message
    elif status == 200:
        assert data.startswith(b"event: message_start\n") and data.endswith(b"event: message_stop\n"
                                                                           b'data: {"type":"message_stop"}\n\n'), data


@settings(max_examples=60)
@given(body=anthropic_raw)
def test_messages_raw_bytes(door, body):
    door.anthropic(door.auto_port, MESSAGES, body)


@settings(max_examples=40)
@given(body=anthropic_requests | anthropic_valid | anthropic_raw)
def test_count_tokens_requests(door, body):
    door.anthropic(door.auto_port, COUNT_TOKENS, body)


# What an engine may answer, odd values anywhere: the router translates whatever it got. Each field
# is right four times in five (the weights from a seeded Random: hypothesis favours the last branch
# of a one_of, which made nearly every answer odd at its top and left the fields untried).
odd_json = st.sampled_from(["5", "", [1], {"a": 1}, -3, 1.5, True, None, ["stop"], "\u00b2"]) | json_values


@st.composite
def engine_chunk(draw, stream: bool) -> dict:
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))

    def field(good):
        return draw(odd_json) if rnd.random() < 0.2 else draw(good)

    def maybe(d: dict, key: str, good, p: float = 0.7) -> None:
        if rnd.random() < p:
            d[key] = field(good)

    calls = []
    for i in range(rnd.choice([0, 0, 1, 2])):
        call: dict = {}
        maybe(call, "index", st.just(i))
        maybe(call, "id", st.text(min_size=1, max_size=6))
        function: dict = {}
        maybe(function, "name", st.text(min_size=1, max_size=6))
        maybe(function, "arguments", st.sampled_from(['{"a": 1}', '{"a', "[1]", "", '"x"']))
        call["function"] = function if rnd.random() < 0.9 else draw(odd_json)
        calls.append(call)
    inner: dict = {}
    maybe(inner, "content", st.none() | st.text(max_size=10), 0.8)
    if calls or rnd.random() < 0.1:
        inner["tool_calls"] = calls if rnd.random() < 0.9 else draw(odd_json)
    choice: dict = {}
    maybe(choice, "index", st.just(0), 0.5)
    choice["delta" if stream else "message"] = inner if rnd.random() < 0.9 else draw(odd_json)
    maybe(choice, "finish_reason", st.none() | st.sampled_from(["stop", "length", "tool_calls", "abort", "x"]), 0.5)
    maybe(choice, "stop_reason", st.none() | st.just("x"), 0.2)
    maybe(choice, "matched_stop", st.just("x"), 0.1)
    chunk: dict = {"choices": [choice] if rnd.random() < 0.9 else draw(odd_json)}
    if rnd.random() < 0.5:
        usage: dict = {}
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            maybe(usage, key, st.integers(0, 100))
        if rnd.random() < 0.5:
            details: dict = {}
            maybe(details, "cached_tokens", st.integers(0, 100))
            usage["prompt_tokens_details"] = field(st.just(details))
        chunk["usage"] = field(st.just(usage))
    if stream and rnd.random() < 0.1:
        error: dict = {}
        maybe(error, "message", st.text(max_size=8))
        maybe(error, "code", st.sampled_from(["504", "400", "x", ""]) | st.integers(-1, 600))
        chunk["error"] = field(st.just(error))
    return chunk


unary_reply = engine_chunk(False)


@st.composite
def sse_frames(draw) -> list[bytes]:
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    frames = []
    for _ in range(rnd.randrange(6)):
        r = rnd.random()
        if r < 0.8:
            frames.append(b"data: " + json.dumps(draw(engine_chunk(True))).encode() + b"\n\n")
        elif r < 0.95:
            frames.append(rnd.choice([b"data: [DONE]\n\n", b": keep-alive\n\n", b"data: {not json\n\n"]))
        else:
            frames.append(draw(st.binary(max_size=10)))
    return frames


@settings(max_examples=150)
@given(stream=st.booleans(), reply=unary_reply, frames=sse_frames(),
       status=st.sampled_from([200] * 6 + [400, 404, 422]),
       error_body=st.binary(max_size=30) | json_values.map(lambda v: json.dumps(v).encode()))
def test_messages_translate_any_engine_answer(door, stream, reply, frames, status, error_body):
    """Whatever the engine answers (it is another process on the network), /v1/messages answers a
    message, Anthropic's event stream, or an Anthropic error: never a 500."""
    body = json.dumps({**ANTHROPIC_BASE, "stream": stream, "stop_sequences": ["x"],
                       "tools": [{"name": "f", "input_schema": {"type": "object"}}]}).encode()
    if status != 200:
        script = (status, "application/json", [error_body])
    elif stream:
        script = (200, "text/event-stream", frames)
    else:
        script = (200, "application/json", [json.dumps(reply).encode()])
    got, data, headers = door.anthropic(door.auto_port, MESSAGES, body, script=script)
    if status != 200:
        assert got == status  # the engine's refusal, in Anthropic's shape (checked)
    elif got == 502:
        pass  # the engine's nonsense, said so (an empty stream: closed before the first byte)
    elif not stream:
        message = json.loads(data)
        assert message["type"] == "message" and message["content"], message
        assert all(block["type"] in ("text", "tool_use") for block in message["content"]), message
        assert all(type(v) is int and v >= 0 for v in message["usage"].values()), message
    else:
        assert got == 200 and headers["content-type"].startswith("text/event-stream")
        events = [e for e in data.split(b"\n\n") if e]
        kinds = []
        for event in events:
            head, _, payload = event.partition(b"\n")
            assert head.startswith(b"event: ") and payload.startswith(b"data: "), event
            kinds.append(head[7:].decode())
            assert json.loads(payload[6:])["type"] == kinds[-1]
        if kinds and kinds != ["error"]:
            assert kinds[0] == "message_start" and kinds[-1] in ("message_stop", "error"), kinds


@pytest.mark.parametrize("reply", [
    {"choices": [{"message": {"content": "ok"}, "finish_reason": ["stop"]}]},  # once: unhashable finish reason
    {"choices": [{"message": {"content": "ok"}}], "usage": {"prompt_tokens": "5",  # once: str < int
                                                           "prompt_tokens_details": {"cached_tokens": 3}}},
])
def test_odd_engine_answers_that_were_500s(door, reply):
    status, _, _ = door.anthropic(door.auto_port, MESSAGES, json.dumps(ANTHROPIC_BASE).encode(),
                                  script=(200, "application/json", [json.dumps(reply).encode()]))
    assert status == 200


def test_an_engine_answer_nested_past_the_recursion_limit_is_a_502(door):
    """msgspec refuses JSON nested this deep with RecursionError, not DecodeError: it was a plain-text 500."""
    status, data, _ = door.anthropic(door.auto_port, MESSAGES, json.dumps(ANTHROPIC_BASE).encode(),
                                     script=(200, "application/json", [b"[" * 5000 + b"]" * 5000]))
    assert status == 502 and json.loads(data)["type"] == "error", data[:200]


@pytest.mark.parametrize("frame", [
    b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":[1],"function":{"name":"f"}}]}}]}\n\n',
    b'data: {"error":{"message":"m","code":"\xc2\xb2"}}\n\n',  # "\u00b2".isdigit(), but no int
    b"data: " + b"[" * 5000 + b"\n\n",  # past the recursion limit
], ids=["list-tool-index", "superscript-code", "deep"])
def test_odd_engine_stream_frames_that_broke_the_stream(door, frame):
    body = json.dumps({**ANTHROPIC_BASE, "stream": True}).encode()
    status, data, _ = door.anthropic(door.auto_port, MESSAGES, body, script=(200, "text/event-stream", [frame]))
    assert status == 200 and b"Traceback" not in data


# -- the cases the fuzz is about, pinned ---------------------------------------------------------------
@pytest.mark.parametrize("body, code", [
    (b'{"model":"m","messages":[{"role":"user"}],"v":' + b"[" * 1000 + b"]" * 1000 + b"}", "json_too_complex"),
    (b'{"model":"m","messages":[{"role":"user"}],"v":' + b"[" * 500 + b"]" * 500 + b"}", "json_too_complex"),
    (b'{"model":"m","messages":[{"role":"user"}],"kv_transfer_params":{"remote_host":"10.0.0.9"}}',
     "kv_transfer_params_not_allowed"),
])
def test_known_attacks_are_400(door, body, code):
    status, data = door.exchange(door.auto_port, CHAT, body)
    assert status == 400 and json.loads(data)["error"]["code"] == code


@pytest.mark.parametrize("request_id", ["é-non-latin", "ok id with spaces", "x" * 129, "a\tb", "🙂"])
def test_bad_request_ids_are_400_never_500(door, request_id):
    status, data = door.exchange(door.auto_port, CHAT, b'{"model":"m","messages":[{"role":"user"}]}',
                                 {"X-Infera-Request-Id": request_id.encode("utf-8")})
    assert status == 400 and json.loads(data)["error"]["code"] == "invalid_request_id"


def test_invalid_http_is_400(door):
    """A control character in a header is not HTTP: aiohttp's parser answers 400 (plain text, before
    any handler runs); the app never sees it."""
    with door.lock:
        before = len(door.engine.received)
        status, _, _ = door.send(door.auto_port, "POST", CHAT, b'{"model":"m","messages":[{"role":"user"}]}',
                                 {"X-Infera-Request-Id": b"a\x01b"})
        assert status == 400 and len(door.engine.received) == before


def test_good_request_id_is_echoed_and_forwarded(door):
    with door.lock:
        status, _, headers = door.send(door.auto_port, "POST", CHAT, b'{"model":"m","messages":[{"role":"user"}]}',
                                       {"X-Infera-Request-Id": "client-42.a:b_c"})
        forwarded = door.engine.received[-1][2]
    assert status == 200 and headers["x-infera-request-id"] == "client-42.a:b_c" == forwarded


def test_direct_mode_refuses_a_lone_decode_worker(door):
    status, data = door.exchange(door.direct_port, CHAT, b'{"model":"m","messages":[{"role":"user"}]}',
                                 {"x-worker-instance-id": "w-dec"})
    assert status == 400 and json.loads(data)["error"]["code"] == "worker_role_mismatch"
    status, _ = door.exchange(door.direct_port, CHAT, b'{"model":"m","messages":[{"role":"user"}]}',
                              {"x-worker-instance-id": "w-mixed"})
    assert status == 200
