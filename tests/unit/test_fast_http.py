"""The fast path's own pieces (infera/server/fast_http.py): which heads it takes (anything else goes
to aiohttp's parser, so a wrong "yes" here is the only way it could accept what aiohttp refuses),
and the bytes its reply writer puts on the wire."""
from __future__ import annotations

import asyncio
import re

import httptools
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infera.server.fast_http import FastReplyWriter, HttpDate, parse_head

CHAT = b"POST /v1/chat/completions HTTP/1.1"
PLAIN = b"Host: x\r\nContent-Type: application/json\r\nContent-Length: 12"


def head(*lines: bytes, line: bytes = CHAT) -> bytes:
    return b"\r\n".join((line, *lines))


def test_a_plain_head_is_taken_with_its_headers():
    route, headers, length, keep_alive = parse_head(head(PLAIN, b"X-Infera-Request-Id:  abc \t"))
    assert (route, length, keep_alive) == ("/v1/chat/completions", 12, True)
    assert headers["x-infera-request-id"] == "abc"  # case-insensitive, whitespace around the value dropped
    assert headers.get("content-type") == "application/json"
    assert list(headers.keys())[:2] == ["Host", "Content-Type"]  # the client's spelling is kept


def test_completions_and_connection_close():
    route, _h, length, keep_alive = parse_head(head(b"Content-Length: 0", b"Connection: Close",
                                                    line=b"POST /v1/completions HTTP/1.1"))
    assert (route, length, keep_alive) == ("/v1/completions", 0, False)
    assert parse_head(head(b"Content-Length: 1", b"connection: keep-alive"))[3] is True


def test_values_keep_obs_text_and_inner_spaces():
    _r, headers, _l, _k = parse_head(head(b"Content-Length: 1", "X-Note: caf\u00e9 au lait".encode()))
    assert headers["X-Note"] == "caf\u00e9 au lait"
    _r, headers, _l, _k = parse_head(head(b"Content-Length: 1", b"X-Empty:"))
    assert headers["X-Empty"] == ""


@pytest.mark.parametrize("raw", [
    head(PLAIN, line=b"POST /v1/chat/completions?x=1 HTTP/1.1"),  # a query string
    head(PLAIN, line=b"GET /v1/chat/completions HTTP/1.1"),
    head(PLAIN, line=b"POST /v1/chat/completions HTTP/1.0"),  # 1.0's keep-alive rules are aiohttp's
    head(PLAIN, line=b"POST  /v1/chat/completions HTTP/1.1"),
    head(PLAIN, line=b"POST /v1/models HTTP/1.1"),
    head(PLAIN, line=b"post /v1/chat/completions HTTP/1.1"),
    head(b"Host: x"),  # no Content-Length
    head(b"Content-Length: 5", b"Content-Length: 5"),  # twice, even equal
    head(b"Content-Length: +5"),
    head(b"Content-Length: 5 5"),
    head(b"Content-Length: 0x5"),
    head(b"Content-Length: "),
    head(b"Content-Length: 1234567890123456"),  # 16 digits
    head(b"Content-Length: 5", b"Transfer-Encoding: chunked"),  # smuggling's classic pair
    head(b"Transfer-Encoding: chunked"),
    head(b"Content-Length: 5", b"Expect: 100-continue"),
    head(b"Content-Length: 5", b"Upgrade: websocket", b"Connection: Upgrade"),
    head(b"Content-Length: 5", b"Connection: keep-alive, Upgrade"),
    head(b"Content-Length: 5", b"TE: trailers"),
    head(b"Content-Length: 5", b"Host : x"),  # whitespace before the colon
    head(b"Content-Length: 5", b" folded"),  # obs-fold
    head(b"Content-Length: 5", b"Host: x", b"\tfolded"),
    head(b"Content-Length: 5", b"Host x"),  # no colon
    head(b"Content-Length: 5", b": novalue"),  # no name
    head(b"Content-Length: 5", b"X-A: a\x01b"),  # a control character
    head(b"Content-Length: 5", b"X-A: a\x7fb"),
    head(b"Content-Length: 5", b"X-A: a\nb"),  # a bare LF
    head(b"Content-Length: 5", b"X-A: a\rb"),
    head(b"Content-Length: 5", b"X(A): a"),  # not a token
    head(b"Content-Length: 5\nX-B: b"),
    head(b"Content-Length: 5", b""),  # an empty line inside the head
    CHAT,  # a request line and no header at all
    b"",
])
def test_anything_but_the_plain_case_goes_to_aiohttp(raw):
    assert parse_head(raw) is None


def test_the_date_is_an_http_date_and_formatted_once_a_second(monkeypatch):
    date = HttpDate()
    monkeypatch.setattr("infera.server.fast_http.time.time", lambda: 1_764_900_000.7)
    first = date.value()
    assert first == b"Fri, 05 Dec 2025 02:00:00 GMT"
    monkeypatch.setattr("infera.server.fast_http.formatdate", lambda *a, **k: pytest.fail("formatted again"))
    assert date.value() is first


class Transport:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data) -> None:
        self.data += data


class Conn:
    def __init__(self, closing: bool = False) -> None:
        self.transport = Transport()
        self._date = HttpDate()
        self._closing = closing
        self._write_paused = False
        self._drain = None
        self._loop = None


def split_reply(data: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    return status, dict(line.split(": ", 1) for line in lines), body


def test_a_unary_reply_is_one_write_with_its_length():
    conn = Conn()
    FastReplyWriter(conn).unary(404, b'{"error": {}}', {"X-Infera-Request-Id": "r1"}, "application/json")
    status, headers, body = split_reply(conn.transport.data)
    assert status == "HTTP/1.1 404 Not Found"
    assert headers["Content-Length"] == "13" and body == b'{"error": {}}'
    assert headers["Content-Type"] == "application/json" and headers["X-Infera-Request-Id"] == "r1"
    assert re.fullmatch(r"\w{3}, \d\d \w{3} \d{4} \d\d:\d\d:\d\d GMT", headers["Date"])
    assert "Connection" not in headers


def test_a_closing_connection_says_so():
    conn = Conn(closing=True)
    FastReplyWriter(conn).unary(200, None, {}, "application/json")
    status, headers, body = split_reply(conn.transport.data)
    assert (status, headers["Connection"], headers["Content-Length"], body) == ("HTTP/1.1 200 OK", "close", "0", b"")


def test_a_stream_is_chunked_and_ends_with_the_last_chunk():
    conn = Conn()
    writer = FastReplyWriter(conn)

    async def run() -> None:
        await writer.open_stream({"Content-Type": "text/event-stream"})
        assert writer.started
        await writer.write(b"data: 1\n\n")
        await writer.write(b"")  # nothing: not a last-chunk by mistake
        await writer.write(b"x" * 300)
        await writer.end_stream()

    asyncio.run(run())
    status, headers, body = split_reply(conn.transport.data)
    assert headers["Transfer-Encoding"] == "chunked" and "Content-Length" not in headers
    assert body == b"9\r\ndata: 1\n\n\r\n12c\r\n" + b"x" * 300 + b"\r\n0\r\n\r\n"


def test_a_header_value_with_a_line_break_is_refused_not_written():
    conn = Conn()
    with pytest.raises(ValueError, match="line break"):
        FastReplyWriter(conn).unary(200, b"", {"X-A": "a\r\nSet-Cookie: x"}, "application/json")
    with pytest.raises(ValueError, match="line break"):
        FastReplyWriter(conn).unary(200, b"", {}, "text/plain\nX: y")
    assert conn.transport.data == b""


@pytest.mark.parametrize("raw", [
    head(b"Content-Length: 5", b"X-A: a\rX-B: b"),  # a bare CR between two fields
    head(b"Content-Length: 5", b"junk X-A: b"),  # a field that starts mid-line
    head(b"Content-Length: 5", b"X-A: a\x00b"),
    head(b"Content-Length: 5", b"X-A:\x0bb"),
])
def test_a_line_is_a_field_whole_or_the_head_goes_to_aiohttp(raw):
    assert parse_head(raw) is None


class Oracle:
    """httptools (llhttp, the parser family aiohttp's own C parser comes from), collecting headers."""

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value.rstrip(b" \t")))  # llhttp keeps trailing whitespace; RFC 9110 drops it

    def on_headers_complete(self) -> None:
        self.done = True


_GOOD_NAME = [b"a", b"Z", b"-", b"0", b"!", b"~", b"X-Infera-Request-Id", b"Content-Type", b"Connection"]
_NAME = st.lists(st.sampled_from(_GOOD_NAME * 4 + [b" ", b"(", b"\x00", b"\xc3", b""]), max_size=4).map(b"".join)
_SEP = st.sampled_from([b":", b": ", b": ", b":\t", b":  ", b" :", b""])
_GOOD_VALUE = [b"v", b" ", b"\t", b"\xc3\xa9", b"1", b",", b"close", b"keep-alive", b"/", b"="]
_VALUE = st.lists(st.sampled_from(_GOOD_VALUE * 4 + [b"\x7f", b"\r", b"\n", b"\x00", b"\x01", b"\r\n"]),
                  max_size=6).map(b"".join)
_LINE = st.one_of(st.tuples(_NAME, _SEP, _VALUE).map(b"".join),
                  st.sampled_from([b"Transfer-Encoding: chunked", b"Content-Length: 3", b" folded", b"Expect: x"]))


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(_LINE, max_size=6))
def test_what_the_fast_path_takes_llhttp_parses_the_same(lines):
    raw = head(b"Content-Length: 3", *lines)
    taken = parse_head(raw)
    if taken is None:
        return
    oracle = Oracle()
    parser = httptools.HttpRequestParser(oracle)
    parser.feed_data(raw + b"\r\n\r\n")  # raises on anything llhttp refuses
    assert oracle.done and parser.get_method() == b"POST" and parser.get_http_version() == "1.1"
    _route, headers, length, keep_alive = taken
    assert [(k.encode(), v.encode("utf-8", "surrogateescape")) for k, v in headers.items()] == oracle.headers
    assert length == 3 and keep_alive == parser.should_keep_alive()
