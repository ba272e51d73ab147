"""Upstream bounds on the HTTP path, without sockets: the server flags and their wiring, how a
timeout or an oversized reply becomes a leg failure (retry, breaker, status), and the relay's error
event when a stream stalls. The same bounds over real loopback HTTP: tests/integration/test_http_timeouts.py."""
from __future__ import annotations

import asyncio
import json

import pytest

from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.router.upstream import LegFailure, Opened, Relay, open_upstream
from infera.server.cli import (DEFAULT_MAX_UPSTREAM_REPLY_BYTES, DEFAULT_REQUEST_FIRST_BYTE_TIMEOUT,
                               DEFAULT_REQUEST_IDLE_TIMEOUT, parse_args)
from infera.server.metrics import ServerMetrics
from infera.transport.http import ChunkedReply, ReplyTooLarge, UpstreamError, UpstreamTimeout

WORKER = WorkerRecord(worker_id="w", url="http://127.0.0.1:1", model_name="m")

FLAGS = [
    # (flag, env, attribute, default, a valid value)
    ("--request-first-byte-timeout", "INFERA_REQUEST_FIRST_BYTE_TIMEOUT", "request_first_byte_timeout",
     DEFAULT_REQUEST_FIRST_BYTE_TIMEOUT, "0.5"),
    ("--request-idle-timeout", "INFERA_REQUEST_IDLE_TIMEOUT", "request_idle_timeout", DEFAULT_REQUEST_IDLE_TIMEOUT,
     "0.25"),
    ("--max-upstream-reply-bytes", "INFERA_MAX_UPSTREAM_REPLY_BYTES", "max_upstream_reply_bytes",
     DEFAULT_MAX_UPSTREAM_REPLY_BYTES, "4096"),
]


def args(*argv: str, env: dict | None = None):
    return parse_args(["--etcd-endpoint", "h:1", *argv], environ=env or {})


def test_defaults_are_generous_but_bounded():
    a = args()
    assert a.request_first_byte_timeout == 300.0 and a.request_idle_timeout == 120.0
    assert a.max_upstream_reply_bytes == 64 * 1024 * 1024


@pytest.mark.parametrize("flag, env, attr, default, value", FLAGS)
def test_flag_beats_env_beats_default(flag, env, attr, default, value):
    parsed = type(default)(value)
    assert getattr(args(env={env: value}), attr) == parsed
    assert getattr(args(flag, value, env={env: "999"}), attr) == parsed
    assert getattr(args(), attr) == default


@pytest.mark.parametrize("flag, value, ok", [
    ("--request-first-byte-timeout", "0", True),  # 0 = off
    ("--request-idle-timeout", "0", True),
    ("--request-first-byte-timeout", "-1", False),
    ("--request-idle-timeout", "-0.5", False),
    ("--max-upstream-reply-bytes", "0", False),  # a reply read into memory always has a cap
    ("--max-upstream-reply-bytes", "x", False),
])
def test_values_are_validated(flag, value, ok):
    if ok:
        args(flag, value)
    else:
        with pytest.raises(SystemExit):
            args(flag, value)


def test_server_hands_the_flags_to_its_http_transport():
    from infera.server.main import InferaServer

    server = InferaServer(args("--router-policy", "round-robin", "--request-first-byte-timeout", "7",
                               "--request-idle-timeout", "3", "--max-upstream-reply-bytes", "1234"),
                          discovery=object())  # never started: construction only
    http = server.transport.http
    assert (http.first_byte_timeout, http.idle_timeout, http.max_reply_bytes) == (7.0, 3.0, 1234)


# -- a transport error before the first byte → a leg failure ------------------------------------------

class FailingTransport:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    async def send(self, worker, path, body, headers=(), stream=False):
        raise self.exc


class OversizedReply(ChunkedReply):
    """A unary 200 whose body goes on past the cap; records its release (the connection close)."""

    status, content_type = 200, "application/json"

    def __init__(self) -> None:
        self.released = 0

    async def next_chunk(self) -> bytes:
        return b"x" * 100

    async def read(self, limit=None) -> bytes:
        return await ChunkedReply.read(self, 250)

    def release(self) -> None:
        self.released += 1


class OneReply:
    def __init__(self, resp) -> None:
        self.resp = resp

    async def send(self, worker, path, body, headers=(), stream=False):
        return self.resp


@pytest.mark.parametrize("exc", [
    UpstreamTimeout("worker 127.0.0.1:1 sent no reply within 0.5s (first-byte timeout)", before_response=True),
    UpstreamTimeout("worker 127.0.0.1:1 stalled: nothing received for 0.5s (idle timeout)"),
])
def test_a_timeout_is_a_retryable_504_the_breaker_counts(exc):
    with pytest.raises(LegFailure) as info:
        asyncio.run(open_upstream(FailingTransport(exc), WORKER, "/v1/completions", b"{}", (), stream=True))
    f = info.value
    assert (f.status, f.reason, f.retryable, f.blames_worker) == (504, "timeout", True, True)
    err = json.loads(f.body)["error"]
    assert err["code"] == "timeout" and err["type"] == "server_error" and "timeout" in err["message"]


def test_an_oversized_reply_is_a_502_neither_retried_nor_blamed_and_closes_the_connection():
    resp = OversizedReply()
    with pytest.raises(LegFailure) as info:
        asyncio.run(open_upstream(OneReply(resp), WORKER, "/v1/completions", b"{}", (), stream=False))
    f = info.value
    assert (f.status, f.reason, f.retryable, f.blames_worker) == (502, "upstream_reply_too_large", False, False)
    assert json.loads(f.body)["error"]["code"] == "upstream_reply_too_large" and "250 bytes" in f.message
    assert resp.released >= 1


@pytest.mark.parametrize("limit, size, ok", [(None, 10_000, True), (0, 10_000, True), (300, 300, True),
                                             (300, 301, False)])
def test_read_cap(limit, size, ok):
    class Reply(ChunkedReply):
        def __init__(self) -> None:
            self.left = size

        async def next_chunk(self) -> bytes:
            n = min(100, self.left)
            self.left -= n
            return b"y" * n

    if ok:
        assert len(asyncio.run(Reply().read(limit))) == size
    else:
        with pytest.raises(ReplyTooLarge) as info:
            asyncio.run(Reply().read(limit))
        assert info.value.status == 502 and info.value.limit == limit


# -- after the first byte: the relay's error event ---------------------------------------------------------

class StallingReply:
    def __init__(self, exc: UpstreamError) -> None:
        self.exc = exc
        self.released = 0
        self.chunks = [b"data: 2\n\n"]

    async def next_chunk(self) -> bytes:
        if self.chunks:
            return self.chunks.pop(0)
        raise self.exc

    def release(self) -> None:
        self.released += 1


async def relay_all(resp) -> tuple[list[bytes], ServerMetrics, list[int]]:
    metrics, done = ServerMetrics(Fleet()), []
    r = Relay(Opened(200, "text/event-stream", resp=resp, first=b"data: 1\n\n"), WORKER, metrics,
              lambda: done.append(1))
    chunks = [c async for c in r]
    await r.aclose()
    return chunks, metrics, done


@pytest.mark.parametrize("exc, status, code", [
    (UpstreamTimeout("worker 127.0.0.1:1 stalled: nothing received for 0.5s (idle timeout)"), 504,
     "worker_timeout_midstream"),
    (UpstreamError("connection closed by the worker"), 502, "worker_failed_midstream"),
])
def test_stalled_stream_ends_with_a_timeout_event(exc, status, code):
    resp = StallingReply(exc)
    chunks, metrics, done = asyncio.run(relay_all(resp))
    assert chunks[:2] == [b"data: 1\n\n", b"data: 2\n\n"] and len(chunks) == 3
    event = chunks[-1]
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    err = json.loads(event[6:])["error"]
    assert err["code"] == code and err["type"] == "server_error"
    if status == 504:
        assert "idle timeout" in err["message"]
    assert done == [1] and resp.released == 1
    assert b'infera_midstream_failures_total{worker_id="w"} 1.0' in metrics.render()
