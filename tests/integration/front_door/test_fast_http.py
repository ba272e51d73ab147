"""The front door's fast path (infera/server/fast_http.py) on a real server over loopback, against
a loopback engine: it answers what aiohttp's path answers (same status, body and headers, side by
side with ``--http-fast-path off``), hands everything else on a connection to aiohttp, answers
pipelined requests in order, cancels the engine's request when the client leaves, lets a stream in
progress finish on shutdown, and its idle connections are evicted past ``--max-connections``; on
the stock loop and on uvloop (``conftest.py``)."""
from __future__ import annotations

import asyncio
import hashlib
import json
import re

import pytest
from aiohttp import web

from infera.discovery.record import WorkerRecord
from infera.server.fast_http import FastConnection
from tests.conftest import wait_for
from tests.integration.conftest import LoopbackEngine

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


class Engine(LoopbackEngine):
    """Unary: a fixed completion. Stream: ``chunks`` SSE events ``delay`` s apart."""

    def __init__(self, chunks: int = 3, delay: float = 0.0) -> None:
        self.chunks, self.delay = chunks, delay
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.started.set()
        if not body.get("stream"):
            return web.json_response({"id": "c", "object": "chat.completion", "model": body["model"],
                                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
                                      "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(self.chunks):
                await resp.write(f'data: {{"id": "c", "choices": [{{"delta": {{"content": "{i}"}}}}]}}\n\n'.encode())
                await asyncio.sleep(self.delay)
            await resp.write(b"data: [DONE]\n\n")
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return resp


@pytest.fixture
async def engine():
    engines: list[Engine] = []

    async def factory(**kw) -> Engine:
        e = await Engine(**kw).start()
        engines.append(e)
        return e

    yield factory
    for e in engines:
        await e.stop()


async def served(fed_server, engine: Engine, *flags: str):
    server, base = await fed_server(*flags)
    server.fleet.upsert(WorkerRecord(worker_id="w", url=f"http://127.0.0.1:{engine.port}", model_name="m"))
    return server, base


def fast_connections(server) -> list:
    return [c for c in server.limits.connections if isinstance(c, FastConnection)]


async def raw(port: int, data: bytes, replies: int, timeout: float = 10,
              wire: list[int] | None = None) -> list[tuple[int, dict, bytes]]:
    """Write ``data`` on one connection; read ``replies`` HTTP/1.1 replies (Content-Length or chunked);
    each reply's size on the wire, head and framing included, is appended to ``wire``."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    out = []
    try:
        writer.write(data)
        for _ in range(replies):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
            size_on_wire = len(head)
            status_line, *lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
            headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines)}
            if headers.get("transfer-encoding") == "chunked":
                body = b""
                while True:
                    line = await asyncio.wait_for(reader.readuntil(b"\r\n"), timeout)
                    size = int(line.strip(), 16)
                    chunk = await asyncio.wait_for(reader.readexactly(size + 2), timeout)
                    size_on_wire += len(line) + len(chunk)
                    if size == 0:
                        break
                    body += chunk[:-2]
            else:
                body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", 0))), timeout)
                size_on_wire += len(body)
            if wire is not None:
                wire.append(size_on_wire)
            out.append((int(status_line.split()[1]), headers, body))
    finally:
        writer.close()
    return out


def post(path: str, body: bytes, *extra: bytes) -> bytes:
    return b"\r\n".join((b"POST %s HTTP/1.1" % path.encode(), b"Host: x", b"Content-Type: application/json",
                         b"Content-Length: %d" % len(body), *extra)) + b"\r\n\r\n" + body


REQUESTS = [  # (route, body, request-id header): what each path must answer alike
    ("/v1/chat/completions", json.dumps(CHAT).encode(), None),
    ("/v1/chat/completions", json.dumps({**CHAT, "stream": True}).encode(), "client-id.1"),
    ("/v1/completions", json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode(), None),
    ("/v1/chat/completions", b"{not json", None),  # 400 invalid JSON
    ("/v1/chat/completions", json.dumps({**CHAT, "model": "nope"}).encode(), None),  # 404 model
    ("/v1/chat/completions", json.dumps(CHAT).encode(), "bad id!"),  # 400 invalid_request_id
    ("/v1/chat/completions", b"", None),  # an empty body
    ("/v1/chat/completions", json.dumps({**CHAT, "max_tokens": "x"}).encode(), None),
]


async def test_the_fast_path_answers_what_aiohttps_path_answers(fed_server, engine):
    e = await engine()
    fast, fast_base = await served(fed_server, e)
    slow, slow_base = await served(fed_server, e, "--http-fast-path", "off")
    for route, body, rid in REQUESTS:
        extra = (b"X-Infera-Request-Id: %s" % rid.encode(),) if rid else ()
        (a,), (b,) = [await raw(s.port, post(route, body, *extra), 1) for s in (fast, slow)]
        assert a[0] == b[0], (route, body, a, b)
        assert a[1]["content-type"] == b[1]["content-type"]
        assert ("x-infera-request-id" in a[1]) and ("x-infera-request-id" in b[1])
        if rid and a[0] == 200:
            assert a[1]["x-infera-request-id"] == b[1]["x-infera-request-id"] == rid
        if a[0] != 200:  # the OpenAI error shape, the same message and code
            ea, eb = json.loads(a[2])["error"], json.loads(b[2])["error"]
            assert (ea["code"], ea["type"], ea["message"]) == (eb["code"], eb["type"], eb["message"])
        elif a[1]["content-type"] == "text/event-stream":
            assert a[2] == b[2] and a[2].endswith(b"data: [DONE]\n\n")
        else:
            assert json.loads(a[2]) == json.loads(b[2])
    assert fast.limits.fast_requests == len(REQUESTS) and fast.limits.handoffs == 0
    assert slow.limits.fast_requests == 0
    assert fast.limits.inflight_bytes == 0


async def test_other_requests_hand_the_connection_to_aiohttp(fed_server, engine):
    e = await engine()
    server, _ = await served(fed_server, e)
    body = json.dumps(CHAT).encode()
    replies = await raw(server.port, post("/v1/chat/completions", body)
                        + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                        + post("/v1/chat/completions", body), 3)
    assert [r[0] for r in replies] == [200, 200, 200]
    assert json.loads(replies[1][2])["status"] and json.loads(replies[2][2])["choices"]
    assert (server.limits.fast_requests, server.limits.handoffs) == (1, 1)
    # a chunked body, an Expect and HTTP/1.0 each go to aiohttp from their first byte
    chunked = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    (r,) = await raw(server.port, chunked, 1)
    assert r[0] == 200 and json.loads(r[2])["choices"]
    replies = await raw(server.port, post("/v1/chat/completions", body, b"Expect: 100-continue"), 2)
    assert [r[0] for r in replies] == [100, 200]
    (r,) = await raw(server.port, post("/v1/chat/completions", body).replace(b"HTTP/1.1", b"HTTP/1.0", 1), 1)
    assert r[0] == 200
    # smuggling's pair: aiohttp refuses it, the fast path never reads it as a Content-Length body
    (r,) = await raw(server.port, post("/v1/chat/completions", body, b"Transfer-Encoding: chunked"), 1)
    assert r[0] == 400
    # a head past aiohttp's line limit: aiohttp's 4xx, as without the fast path
    (r,) = await raw(server.port, post("/v1/chat/completions", body, b"X-Pad: " + b"p" * 9000), 1)
    assert 400 <= r[0] < 500
    assert server.limits.fast_requests == 1 and server.limits.handoffs == 6
    assert e.started.is_set()


async def test_pipelined_requests_are_answered_in_order(fed_server, engine):
    e = await engine()
    server, _ = await served(fed_server, e)
    stream = json.dumps({**CHAT, "stream": True}).encode()
    unary = json.dumps(CHAT).encode()
    data = (post("/v1/chat/completions", stream, b"X-Infera-Request-Id: p1")
            + post("/v1/chat/completions", unary, b"X-Infera-Request-Id: p2")
            + post("/v1/completions", b"{", b"X-Infera-Request-Id: p3"))
    replies = await raw(server.port, data, 3)
    assert [(r[0], r[1]["x-infera-request-id"]) for r in replies] == [(200, "p1"), (200, "p2"), (400, "p3")]
    assert replies[0][2].endswith(b"data: [DONE]\n\n")
    assert server.limits.fast_requests == 3 and server.limits.inflight_bytes == 0


async def test_connection_close_is_honoured(fed_server, engine):
    e = await engine()
    server, _ = await served(fed_server, e)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(post("/v1/chat/completions", json.dumps(CHAT).encode(), b"Connection: close"))
    data = await asyncio.wait_for(reader.read(), 10)  # to EOF: the server closes after its reply
    assert data.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nConnection: close\r\n" in data
    writer.close()


async def test_a_client_that_leaves_mid_stream_cancels_the_engines_request(fed_server, engine):
    e = await engine(chunks=200, delay=0.05)
    server, _ = await served(fed_server, e)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(post("/v1/chat/completions", json.dumps({**CHAT, "stream": True}).encode()))
    await asyncio.wait_for(reader.readuntil(b"data: "), 10)  # the stream is flowing
    assert server.limits.inflight_bytes > 0
    writer.transport.abort()
    await asyncio.wait_for(e.cancelled.wait(), 10)
    await wait_for(lambda: server.limits.inflight_bytes == 0 and not server.limits.connections, 10,
                   message="the request's bytes and connection are released")
    assert server.metrics.registry.get_sample_value("infera_client_disconnects_total",
                                                    {"route": "/v1/chat/completions"}) == 1


async def test_shutdown_lets_the_stream_in_progress_finish(fed_server, engine):
    e = await engine(chunks=10, delay=0.05)
    server, _ = await served(fed_server, e)
    reply = asyncio.create_task(raw(server.port, post("/v1/chat/completions",
                                                      json.dumps({**CHAT, "stream": True}).encode()), 1))
    await asyncio.wait_for(e.started.wait(), 10)
    await asyncio.wait_for(server.stop(), 30)
    ((status, _h, body),) = await reply
    assert status == 200 and body.count(b"data: ") == 11 and body.endswith(b"data: [DONE]\n\n")
    assert not e.cancelled.is_set()


async def test_idle_fast_connections_are_evicted_past_the_cap(fed_server, engine):
    e = await engine()
    server, _ = await served(fed_server, e, "--max-connections", "2")
    conns = []
    for _ in range(2):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(post("/v1/chat/completions", json.dumps(CHAT).encode()))
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        conns.append((reader, writer))
    assert len(fast_connections(server)) == 2
    (r,) = await raw(server.port, post("/v1/chat/completions", json.dumps(CHAT).encode()), 1)
    assert r[0] == 200
    # the oldest idle one made room: its reply's body, then EOF (a connection left open times out here)
    assert (await asyncio.wait_for(conns[0][0].read(), 10)).endswith(b"}")
    assert server.limits.evicted == 1 and not conns[1][0].at_eof()
    for _, writer in conns:
        writer.close()


async def test_keepalive_and_body_timeouts_close_fast_connections(fed_server, engine):
    e = await engine()
    server, _ = await served(fed_server, e, "--keepalive-timeout", "0.5", "--body-timeout", "0.5")
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(post("/v1/chat/completions", json.dumps(CHAT).encode()))
    await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    # the body, then EOF once the idle connection times out (one left open would time out here)
    assert (await asyncio.wait_for(reader.read(), 10)).endswith(b"}")
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(post("/v1/chat/completions", json.dumps(CHAT).encode())[:-5])  # the body never completes
    assert await asyncio.wait_for(reader.read(), 10) == b""
    assert server.limits.body_timeouts == 1 and server.limits.inflight_bytes == 0
    writer.close()


async def test_a_bug_is_a_500_in_the_openai_shape_and_a_failed_reply_cuts_the_connection(fed_server, engine,
                                                                                      monkeypatch):
    e = await engine()
    server, _ = await served(fed_server, e)

    async def boom(routed):
        raise RuntimeError("a bug")

    monkeypatch.setattr(server.router, "dispatch", boom)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(post("/v1/chat/completions", json.dumps(CHAT).encode()))
    data = await asyncio.wait_for(reader.read(), 10)  # the reply, then EOF: the connection closes after a 500
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 500 ") and b"\r\nConnection: close" in head
    assert json.loads(body)["error"]["code"] == "internal_error"
    writer.close()

    def unwritable(*args, **kwargs):
        raise ValueError("cannot write")

    monkeypatch.setattr("infera.server.fast_http.FastReplyWriter.unary", unwritable)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(post("/v1/chat/completions", json.dumps(CHAT).encode()))
    assert await asyncio.wait_for(reader.read(), 10) == b""  # cut, not left hanging
    assert server.limits.inflight_bytes == 0
    writer.close()


async def test_the_flag_off_keeps_aiohttps_path(fed_server, engine):
    e = await engine()
    server, _ = await served(fed_server, e, "--http-fast-path", "off")
    ((status, _h, body),) = await raw(server.port, post("/v1/chat/completions", json.dumps(CHAT).encode()), 1)
    assert status == 200 and json.loads(body)["choices"]
    assert server.limits.fast_requests == 0 and not fast_connections(server)


ACCESS_LINE = re.compile(r'^(\S+) \[[^]]+\] "([^"]*)" (\d+) (\d+) "([^"]*)" "([^"]*)"$')


async def test_the_access_log_writes_the_same_lines_on_both_paths(fed_server, engine, caplog):
    e = await engine()
    fast, _ = await served(fed_server, e, "--access-log")
    slow, _ = await served(fed_server, e, "--access-log", "--http-fast-path", "off")
    ua = b"User-Agent: probe/1.0"
    sent = [("/v1/chat/completions", json.dumps(CHAT).encode()),
            ("/v1/chat/completions", json.dumps({**CHAT, "stream": True}).encode()),
            ("/v1/completions", b"{not json")]
    lines, wire = {}, {}
    for server in (fast, slow):
        caplog.clear()
        wire[server] = []
        with caplog.at_level("INFO", logger="infera.access"):
            for route, body in sent:
                await raw(server.port, post(route, body, ua), 1, wire=wire[server])
            await wait_for(lambda: len([r for r in caplog.records if r.name == "infera.access"]) == len(sent), 5,
                           message="an access line per request")
        lines[server] = [ACCESS_LINE.match(r.getMessage()).groups() for r in caplog.records if r.name == "infera.access"]
    assert fast.limits.fast_requests == len(sent) and slow.limits.fast_requests == 0
    # remote, request line, status, Referer, User-Agent: field by field the same; the bytes are
    # what each path put on the wire (aiohttp's head carries a Server header the fast path does not)
    for server in (fast, slow):
        assert [int(line[3]) for line in lines[server]] == wire[server]
    assert [line[:3] + line[4:] for line in lines[fast]] == [line[:3] + line[4:] for line in lines[slow]]
    assert [(line[1], line[2]) for line in lines[fast]] == [("POST /v1/chat/completions HTTP/1.1", "200"),
                                                         ("POST /v1/chat/completions HTTP/1.1", "200"),
                                                         ("POST /v1/completions HTTP/1.1", "400")]
    assert lines[fast][0][5] == "probe/1.0"


def keys_yaml(tmp_path) -> str:
    """Two tenants: team-a may use model m, at most 1 request in flight; team-b may not use m."""
    path = tmp_path / "keys.yaml"
    path.write_text(
        f"keys:\n  - sha256: {hashlib.sha256(b'sk-a').hexdigest()}\n    tenant: team-a\n    max_concurrent: 1\n"
        f"  - sha256: {hashlib.sha256(b'sk-b').hexdigest()}\n    tenant: team-b\n    models: [other]\n")
    return str(path)


KEYED = [  # (the key header, the status both paths answer)
    (b"Authorization: Bearer sk-a", 200),
    (b"x-api-key: sk-a", 200),
    (None, 401),  # missing
    (b"Authorization: Bearer sk-nope", 401),  # invalid
    (b"Authorization: Bearer sk-b", 403),  # a key that may not use the model
    (b"Authorization: Bearer sk-a", 200),
]


async def test_api_keys_ride_the_fast_path_and_count_as_aiohttps_path_does(fed_server, engine, tmp_path):
    e = await engine()
    flags = ("--api-keys-file", keys_yaml(tmp_path))
    fast, _ = await served(fed_server, e, *flags)
    slow, _ = await served(fed_server, e, *flags, "--http-fast-path", "off")
    for header, status in KEYED:
        extra = (header,) if header else ()
        (a,), (b,) = [await raw(s.port, post("/v1/chat/completions", json.dumps(CHAT).encode(), *extra), 1)
                      for s in (fast, slow)]
        assert a[0] == b[0] == status, (header, a, b)
        if status != 200:
            ea, eb = json.loads(a[2])["error"], json.loads(b[2])["error"]
            assert (ea["code"], ea["message"]) == (eb["code"], eb["message"])
            assert a[1].get("www-authenticate") == b[1].get("www-authenticate")
    # A request without a valid key went to aiohttp (its 401 comes before the body is read); the
    # rest were the fast path's, and every count (per tenant, rejections) reads as on aiohttp's path.
    assert fast.limits.fast_requests == 4 and fast.limits.handoffs == 2
    assert fast.api_keys.requests == slow.api_keys.requests
    assert fast.api_keys.requests[("team-a", "2xx")] == 3 and fast.api_keys.requests[("team-b", "4xx")] == 1
    assert fast.api_keys.rejected == slow.api_keys.rejected
    # team-a's permit (max_concurrent: 1) was given back after each request, streamed ones too
    stream = json.dumps({**CHAT, "stream": True}).encode()
    ((status, _h, body),) = await raw(fast.port, post("/v1/chat/completions", stream, b"x-api-key: sk-a"), 1)
    assert status == 200 and body.endswith(b"data: [DONE]\n\n")
    assert fast.limiter._own["team-a"].inflight == 0


async def test_the_fair_queue_rides_the_fast_path_and_gives_its_slot_back(fed_server, engine):
    e = await engine(chunks=3, delay=0.05)
    server, _ = await served(fed_server, e, "--max-inflight-per-worker", "1")
    stream = json.dumps({**CHAT, "stream": True}).encode()
    replies = await asyncio.gather(*(raw(server.port, post("/v1/chat/completions", stream), 1) for _ in range(3)))
    assert [r[0][0] for r in replies] == [200, 200, 200]  # the queue let them through one at a time
    assert server.limits.fast_requests == 3
    assert server.admission.snapshot()["m"]["inflight"] == 0
