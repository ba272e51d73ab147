"""The router's lean HTTP/1.1 client against raw asyncio servers over loopback."""
from __future__ import annotations

import asyncio

import pytest

from infera.transport.http import HttpTransport, UpstreamError, split_http_url
from tests.conftest import free_port, wait_for


class RawServer:
    """Answers each request with ``reply(request_bytes, writer)``; counts connections."""

    def __init__(self, reply) -> None:
        self.reply = reply
        self.connections = 0
        self.closed_by_peer = 0
        self.requests: list[bytes] = []
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(l.split(b":")[1] for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")))
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                outcome = await self.reply(head + body, writer, reader)
                if outcome == "eof":  # the reply waited until the client closed
                    self.closed_by_peer += 1
                    return
                if outcome == "close":
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_peer += 1
        finally:
            writer.close()

    async def __aenter__(self) -> "RawServer":
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()


async def ok_json(req: bytes, w: asyncio.StreamWriter, r=None):
    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\":true}")
    await w.drain()


async def sse_chunked(req: bytes, w: asyncio.StreamWriter, r=None):
    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    for frame in (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"):
        w.write(b"%x\r\n%s\r\n" % (len(frame), frame))
        await w.drain()
    w.write(b"0\r\n\r\n")
    await w.drain()


@pytest.fixture
async def transport():
    t = HttpTransport(connect_timeout=2)
    await t.start()
    yield t
    await t.close()


async def test_keep_alive_reuses_one_connection(transport):
    async with RawServer(ok_json) as srv:
        for _ in range(5):
            resp = await transport.post("127.0.0.1", srv.port, "/v1/completions", b'{"a":1}', (("X-Request-Id", "r1"),))
            assert resp.status == 200 and resp.content_type == "application/json"
            assert await resp.read() == b'{"ok":true}'
            resp.release()
        assert srv.connections == 1
    req = srv.requests[0]
    assert req.startswith(b"POST /v1/completions HTTP/1.1\r\n") and b"X-Request-Id: r1\r\n" in req
    assert req.endswith(b'\r\n\r\n{"a":1}')


async def test_chunked_stream_is_relayed_unchanged(transport):
    async with RawServer(sse_chunked) as srv:
        resp = await transport.post("127.0.0.1", srv.port, "/v1/chat/completions", b"{}")
        assert resp.content_type == "text/event-stream"
        body = await resp.read()
        resp.release()
    assert body == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"


async def test_refused_is_an_upstream_error_before_response(transport):
    with pytest.raises(UpstreamError) as info:
        await transport.post("127.0.0.1", free_port(), "/x", b"{}")
    assert info.value.before_response and "cannot connect" in str(info.value)


async def test_reply_broken_mid_body(transport):
    async def broken(req, w, r):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"9\r\ndata: 1\n\n\r\n")
        await w.drain()
        return "close"

    async with RawServer(broken) as srv:
        resp = await transport.post("127.0.0.1", srv.port, "/x", b"{}")
        assert await resp.next_chunk() == b"data: 1\n\n"
        with pytest.raises(UpstreamError, match="closed"):
            await resp.next_chunk()
        resp.release()


async def test_stale_idle_connection_is_retried_once_on_a_fresh_one(transport):
    async def answer_then_close(req, w, r):
        await ok_json(req, w)
        return "close"  # the worker drops the keep-alive connection after replying

    async with RawServer(answer_then_close) as srv:
        for _ in range(3):
            resp = await transport.post("127.0.0.1", srv.port, "/x", b"{}")
            assert await resp.read() == b'{"ok":true}'
            resp.release()
            await asyncio.sleep(0)  # let the close reach us sometimes, not always
        assert srv.connections == 3


async def test_releasing_an_unfinished_reply_closes_the_connection(transport):
    async def endless(req, w, r):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await w.drain()
        await r.read()  # blocks until the client closes
        return "eof"

    async with RawServer(endless) as srv:
        resp = await transport.post("127.0.0.1", srv.port, "/x", b"{}")
        assert await resp.next_chunk() == b"hello"
        resp.release()  # the client went away: the engine must see the connection close
        await wait_for(lambda: srv.closed_by_peer == 1, 5, message="server saw the close")


async def test_cancel_while_waiting_for_headers_closes(transport):
    async def never(req, w, r):
        await r.read()  # never answers; returns when the client closes
        return "eof"

    async with RawServer(never) as srv:
        task = asyncio.ensure_future(transport.post("127.0.0.1", srv.port, "/x", b"{}"))
        await wait_for(lambda: len(srv.requests) == 1, 5, message="request received")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: srv.closed_by_peer == 1, 5, message="server saw the close")


async def test_malformed_reply(transport):
    async def garbage(req, w, r):
        w.write(b"NOT HTTP AT ALL\r\n\r\n")
        await w.drain()

    async with RawServer(garbage) as srv:
        with pytest.raises(UpstreamError, match="malformed"):
            await transport.post("127.0.0.1", srv.port, "/x", b"{}")


async def test_slow_consumer_pauses_reading(transport):
    payload = b"x" * (1024 * 1024)

    async def big(req, w, r):
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
        await w.drain()

    async with RawServer(big) as srv:
        resp = await transport.post("127.0.0.1", srv.port, "/x", b"{}")
        await wait_for(lambda: resp._conn._paused, 5, message="reading paused at the high-water mark")
        assert await resp.read() == payload
        resp.release()


@pytest.mark.parametrize("url, addr", [("http://h:1", ("h", 1)), ("http://10.0.0.1", ("10.0.0.1", 80)),
                                       ("http://[::1]:8000", ("::1", 8000))])
def test_split_http_url(url, addr):
    assert split_http_url(url) == addr


@pytest.mark.parametrize("url", ["https://h:1", "h:1", "http://"])
def test_split_http_url_rejects(url):
    with pytest.raises(ValueError):
        split_http_url(url)
