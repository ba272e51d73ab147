"""The NATS request wire format (golden headers) and the router-side reply state machine."""
from __future__ import annotations

import asyncio

import pytest

from infera.transport.http import UpstreamError
from infera.transport.nats_conn import subject_token, token_to_worker_id
from infera.transport.nats_frames import (forwarded_headers, reply_headers, request_headers, request_subject,
                                          split_payload)
from infera.transport.nats_request import AdmissionRefused, NatsResponse, UpstreamTimeout


def test_subject_token_is_one_reversible_token():
    for wid in ("10.0.0.7:8000", "host.example:1", "[::1]:80", "a"):
        token = subject_token(wid)
        assert "." not in token and "=" not in token and " " not in token and ">" not in token and "*" not in token
        assert token_to_worker_id(token) == wid
    assert request_subject(subject_token("127.0.0.1:8000")) == "infera.req.MTI3LjAuMC4xOjgwMDA"


def test_request_headers_golden():
    h = request_headers("/v1/chat/completions", True, (("X-Request-Id", "r1"), ("X-Data-Parallel-Rank", "3")), 30.0)
    assert h == {"Infera-Path": "/v1/chat/completions", "Infera-Stream": "1", "Infera-Max-Duration": "30",
                 "Infera-H-X-Request-Id": "r1", "Infera-H-X-Data-Parallel-Rank": "3"}
    assert forwarded_headers(h) == [("X-Request-Id", "r1"), ("X-Data-Parallel-Rank", "3")]
    assert "Infera-Max-Duration" not in request_headers("/v1/completions", False, ())


@pytest.mark.parametrize("kwargs,expected", [
    ({"seq": 0, "frame": "head", "status": 200, "content_type": "text/event-stream"},
     {"Infera-Seq": "0", "Infera-Frame": "head", "Infera-Status": "200", "Infera-Content-Type": "text/event-stream"}),
    ({"seq": 4, "frame": "data", "end": True}, {"Infera-Seq": "4", "Infera-Frame": "data", "Infera-End": "1"}),
    ({"seq": 0, "frame": "busy", "status": 429}, {"Infera-Seq": "0", "Infera-Frame": "busy", "Infera-Status": "429"}),
])
def test_reply_headers_golden(kwargs, expected):
    seq, frame = kwargs.pop("seq"), kwargs.pop("frame")
    assert reply_headers(seq, frame, **kwargs) == expected


@pytest.mark.parametrize("size,limit,pieces", [(0, 4096, 1), (100, 4096, 1), (3072, 4096, 1), (3073, 4096, 2),
                                               (10_000, 4096, 4)])
def test_split_payload(size, limit, pieces):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    out = split_payload(data, limit)
    assert len(out) == pieces and b"".join(out) == data


class _Msg:
    def __init__(self, headers, data=b"", subject="_INBOX.x.1"):
        self.headers, self.data, self.subject = headers, data, subject


class _Client:
    def __init__(self):
        self.done, self.cancelled = [], []

    def _done(self, resp):
        self.done.append(resp)

    def _cancel(self, resp):
        self.cancelled.append(resp)


def _response(idle=5.0, deadline=None):
    client = _Client()
    return NatsResponse(client, "w1", "dzE", "_INBOX.x.1", idle, deadline), client


async def test_unary_reply_in_one_frame():
    resp, client = _response()
    resp._on_frame(_Msg(reply_headers(0, "head", end=True, status=200, content_type="application/json"), b'{"a":1}'))
    await resp.wait_headers()
    assert (resp.status, resp.content_type) == (200, "application/json")
    assert await resp.read() == b'{"a":1}'
    resp.release()
    assert client.cancelled == []  # finished: nothing to cancel


async def test_stream_frames_in_order():
    resp, _ = _response()
    resp._on_frame(_Msg(reply_headers(0, "head", status=200, content_type="text/event-stream"), b"data: 1\n\n"))
    resp._on_frame(_Msg(reply_headers(1, "data"), b"data: 2\n\n"))
    resp._on_frame(_Msg(reply_headers(2, "data", end=True), b""))
    await resp.wait_headers()
    assert await resp.read() == b"data: 1\n\ndata: 2\n\n"


@pytest.mark.parametrize("frames,error,before", [
    # a lost frame: never silently skipped
    ([(reply_headers(0, "head", status=200), b"x"), (reply_headers(2, "data"), b"z")], "lost", False),
    # the broker saying nobody serves the subject
    ([({"Status": "503"}, b"")], "no responders", True),
    ([(reply_headers(0, "busy", status=429), b"")], "backlog", True),
    ([(reply_headers(0, "error", status=502), b"engine request failed: boom")], "boom", True),
    ([(reply_headers(0, "head", status=200), b"x"), (reply_headers(1, "error"), b"cut")], "cut", False),
    ([(reply_headers(0, "data"), b"x")], "malformed", True),  # data before head
])
async def test_failures(frames, error, before):
    resp, client = _response()
    for h, d in frames:
        resp._on_frame(_Msg(h, d))
    if before:
        with pytest.raises(UpstreamError, match=error) as exc:
            await resp.wait_headers()
        assert exc.value.before_response
        if "backlog" in error:
            assert isinstance(exc.value, AdmissionRefused)
    else:
        await resp.wait_headers()
        with pytest.raises(UpstreamError, match=error):
            while await resp.next_chunk():
                pass
    assert client.done  # accounting released on failure


async def test_idle_timeout_cancels_and_raises_504():
    resp, client = _response(idle=0.05)
    with pytest.raises(UpstreamTimeout, match="idle timeout") as exc:
        await resp.wait_headers()
    assert exc.value.status == 504 and exc.value.before_response
    assert client.cancelled == [resp]


async def test_total_cap_bounds_every_wait():
    loop = asyncio.get_running_loop()
    import time

    resp, client = _response(idle=60, deadline=time.monotonic() + 0.05)
    resp._on_frame(_Msg(reply_headers(0, "head", status=200), b"x"))
    await resp.wait_headers()
    assert await resp.next_chunk() == b"x"
    started = loop.time()
    with pytest.raises(UpstreamTimeout, match="total time cap"):
        await resp.next_chunk()
    assert loop.time() - started < 1
    assert client.cancelled == [resp]


async def test_release_before_the_end_cancels_once():
    resp, client = _response()
    resp._on_frame(_Msg(reply_headers(0, "head", status=200), b"x"))
    resp.release()
    resp.release()
    assert client.cancelled == [resp]
