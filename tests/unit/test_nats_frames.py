"""The NATS request wire format (golden headers) and the router-side reply state machine."""
from __future__ import annotations

import asyncio

import pytest

from infera.transport.http import UpstreamError
from infera.transport.nats_conn import subject_token, token_to_worker_id
from infera.transport.nats_frames import (BUSY, DATA, ERROR, HEAD, FrameError, decode_frame, decode_request,
                                          encode_frame, encode_request, request_subject, split_payload)
from infera.transport.nats_request import AdmissionRefused, NatsResponse, UpstreamTimeout


def test_subject_token_is_one_reversible_token():
    for wid in ("10.0.0.7:8000", "host.example:1", "[::1]:80", "a"):
        token = subject_token(wid)
        assert "." not in token and "=" not in token and " " not in token and ">" not in token and "*" not in token
        assert token_to_worker_id(token) == wid
    assert request_subject(subject_token("127.0.0.1:8000")) == "infera.req.MTI3LjAuMC4xOjgwMDA"


def test_request_golden():
    payload = encode_request("/v1/chat/completions", True, (("X-Request-Id", "r1"), ("X-Data-Parallel-Rank", "3")),
                             b'{"model":"m"}', 30.0)
    # u32 meta length, msgpack [path, stream, max_duration, [[name, value]...]], then the body verbatim
    assert payload.hex() == (
        "0000004a" "94b42f76312f636861742f636f6d706c6574696f6e73c3cb403e000000000000"
        "9292ac582d526571756573742d4964a2723192b4582d446174612d506172616c6c656c2d52616e6ba133"
        + b'{"model":"m"}'.hex())
    assert decode_request(payload) == ("/v1/chat/completions", True, 30.0,
                                       [("X-Request-Id", "r1"), ("X-Data-Parallel-Rank", "3")], b'{"model":"m"}')
    assert decode_request(encode_request("/v1/completions", False, (), b"")) == ("/v1/completions", False, 0.0, [], b"")


@pytest.mark.parametrize("payload", [b"", b"\x00\x00", b"\x00\x00\x00\x09abc", b"\x00\x00\x00\x01\xc0"])
def test_malformed_requests(payload):
    with pytest.raises(FrameError):
        decode_request(payload)


@pytest.mark.parametrize("kind,kwargs,data,hexed,decoded", [
    (HEAD, {"seq": 0, "status": 200, "content_type": "text/event-stream"}, b"data: 1",
     "010000000000" "00c8" "11" + b"text/event-stream".hex() + b"data: 1".hex(),
     (HEAD, False, 0, 200, "text/event-stream", b"data: 1")),
    (HEAD, {"seq": 0, "status": 400, "content_type": "application/json", "end": True}, b"{}",
     "010100000000" "0190" "10" + b"application/json".hex() + b"{}".hex(),
     (HEAD, True, 0, 400, "application/json", b"{}")),
    (DATA, {"seq": 4, "end": True}, b"", "020100000004", (DATA, True, 4, None, None, b"")),
    (DATA, {"seq": 70000}, b"x", "020000011170" + b"x".hex(), (DATA, False, 70000, None, None, b"x")),
    (BUSY, {"seq": 0, "status": 429}, b"", "030000000000", (BUSY, False, 0, None, None, b"")),
    (ERROR, {"seq": 2, "status": 504}, b"slow", "040000000002" "01f8" + b"slow".hex(),
     (ERROR, False, 2, 504, None, b"slow")),
])
def test_reply_frames_golden(kind, kwargs, data, hexed, decoded):
    seq = kwargs.pop("seq")
    frame = encode_frame(kind, seq, data, **kwargs)
    assert frame.hex() == hexed
    assert decode_frame(frame) == decoded


@pytest.mark.parametrize("payload", [b"", b"\x01\x00\x00", b"\x01\x00\x00\x00\x00\x00", b"\x04\x00\x00\x00\x00\x00\x01",
                                     b"\x09\x00\x00\x00\x00\x00"])
def test_malformed_frames(payload):
    with pytest.raises(FrameError):
        decode_frame(payload)


@pytest.mark.parametrize("size,limit,pieces", [(0, 4096, 1), (100, 4096, 1), (3584, 4096, 1), (3585, 4096, 2),
                                               (10_000, 4096, 3)])
def test_split_payload(size, limit, pieces):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    out = split_payload(data, limit)
    assert len(out) == pieces and b"".join(out) == data


class _NoResponders:
    """The broker's own reply when nobody serves the subject: no payload, header status 503."""


class _Client:
    def __init__(self):
        self.done, self.cancelled = [], []

    def _done(self, resp):
        self.done.append(resp)

    def _cancel(self, resp):
        self.cancelled.append(resp)


def _response(idle=5.0, deadline=None):
    client = _Client()
    return NatsResponse(client, "w1", b"infera.cancel.dzE", b"_INBOX.x.1", idle, deadline), client


async def test_unary_reply_in_one_frame():
    resp, client = _response()
    resp._on_frame(encode_frame(HEAD, 0, b'{"a":1}', end=True, status=200, content_type="application/json"))
    await resp.wait_headers()
    assert (resp.status, resp.content_type) == (200, "application/json")
    assert await resp.read() == b'{"a":1}'
    resp.release()
    assert client.cancelled == []  # finished: nothing to cancel


async def test_stream_frames_in_order():
    resp, _ = _response()
    resp._on_frame(encode_frame(HEAD, 0, b"data: 1\n\n", status=200, content_type="text/event-stream"))
    resp._on_frame(encode_frame(DATA, 1, b"data: 2\n\n"))
    resp._on_frame(encode_frame(DATA, 2, end=True))
    await resp.wait_headers()
    assert await resp.read() == b"data: 1\n\ndata: 2\n\n"


@pytest.mark.parametrize("frames,error,before", [
    # a lost frame: never silently skipped
    ([encode_frame(HEAD, 0, b"x", status=200), encode_frame(DATA, 2, b"z")], "lost", False),
    # the broker saying nobody serves the subject
    ([_NoResponders], "no responders", True),
    ([encode_frame(BUSY, 0)], "backlog", True),
    ([encode_frame(ERROR, 0, b"engine request failed: boom", status=502)], "boom", True),
    ([encode_frame(HEAD, 0, b"x", status=200), encode_frame(ERROR, 1, b"cut")], "cut", False),
    ([encode_frame(DATA, 0, b"x")], "before the head", True),
    ([b"\x07garbage"], "malformed", True),
])
async def test_failures(frames, error, before):
    resp, client = _response()
    for f in frames:
        if f is _NoResponders:
            resp._on_frame(b"", 503)
        else:
            resp._on_frame(f)
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
    resp._on_frame(encode_frame(HEAD, 0, b"x", status=200))
    await resp.wait_headers()
    assert await resp.next_chunk() == b"x"
    started = loop.time()
    with pytest.raises(UpstreamTimeout, match="total time cap"):
        await resp.next_chunk()
    assert loop.time() - started < 1
    assert client.cancelled == [resp]


async def test_release_before_the_end_cancels_once():
    resp, client = _response()
    resp._on_frame(encode_frame(HEAD, 0, b"x", status=200))
    resp.release()
    resp.release()
    assert client.cancelled == [resp]
