"""No request hangs on the HTTP path: the first-byte and idle timeouts and the reply-size cap.

Three levels, all over real loopback HTTP: the transport against raw asyncio servers that misbehave
byte by byte; a real server against fake workers (failover, breaker, 504, the SSE error event, PD
legs); a real server against sim workers whose engine is SIGSTOPped. Timeouts are short (0.5 s);
every wait is on a condition or a request with a deadline.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest
from aiohttp import web

from infera.discovery.record import WorkerRecord
from infera.engine.base.prom import sample_sum
from infera.transport.http import HttpTransport, ReplyTooLarge, UpstreamTimeout
from tests.conftest import children_of, wait_for
from tests.integration.conftest import LoopbackEngine, wait_workers
from tests.integration.test_http_transport import RawServer, ok_json
from tests.integration.test_pd_router import NIXL, FakeEngine, chat
from tests.integration.test_router_errors import CHAT, SSE_OK, assert_openai_error

FB = IDLE = 0.5
SLACK = 2.5  # loaded CI: a bound is "within FB + SLACK", never exactly FB
CLOSED, OPEN = 0, 2
SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def bounded(aw):
    """A wait the timeouts under test should end: if they do not, the test fails instead of hanging."""
    return asyncio.wait_for(aw, FB + SLACK + 5)


# -- the transport against raw servers -------------------------------------------------------------------

@pytest.fixture
async def transport():
    t = HttpTransport(connect_timeout=2, first_byte_timeout=FB, idle_timeout=IDLE, max_reply_bytes=1024)
    await t.start()
    yield t
    await t.close()


async def hold(r: asyncio.StreamReader) -> str:
    await r.read()  # returns once the client closes the connection
    return "eof"


async def test_no_answer_times_out_before_the_response_and_closes(transport):
    async def never(req, w, r):
        return await hold(r)

    async with RawServer(never) as srv:
        started = time.monotonic()
        with pytest.raises(UpstreamTimeout) as info:
            await bounded(transport.post("127.0.0.1", srv.port, "/v1/completions", b"{}"))
        elapsed = time.monotonic() - started
        assert FB * 0.9 <= elapsed < FB + SLACK
        assert info.value.status == 504 and info.value.before_response and "first-byte timeout" in str(info.value)
        await wait_for(lambda: srv.closed_by_peer == 1, 5, message="the worker saw the connection close")
        assert srv.connections == 1  # the worker got the request: never repeated on a fresh connection


async def test_a_reused_connection_that_stops_answering_is_not_retried(transport):
    async def first_ok_then_never(req, w, r):
        if len(srv.requests) == 1:
            return await ok_json(req, w)
        return await hold(r)

    async with RawServer(first_ok_then_never) as srv:
        resp = await transport.post("127.0.0.1", srv.port, "/x", b"{}")
        assert await resp.read() == b'{"ok":true}'
        resp.release()
        with pytest.raises(UpstreamTimeout):
            await bounded(transport.post("127.0.0.1", srv.port, "/x", b"{}"))
        assert srv.connections == 1 and len(srv.requests) == 2


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n",  # unary
    SSE_HEAD,  # a stream: headers at once, then nothing
])
async def test_headers_then_nothing_is_a_first_byte_timeout(transport, head):
    async def headers_only(req, w, r):
        w.write(head)
        await w.drain()
        return await hold(r)

    async with RawServer(headers_only) as srv:
        started = time.monotonic()
        resp = await transport.post("127.0.0.1", srv.port, "/x", b"{}")
        assert resp.status == 200
        with pytest.raises(UpstreamTimeout) as info:
            await bounded(resp.read() if b"Content-Length" in head else resp.next_chunk())
        assert FB * 0.9 <= time.monotonic() - started < FB + SLACK  # from the request, not the headers
        assert info.value.before_response and "first-byte timeout" in str(info.value)
        resp.release()
        await wait_for(lambda: srv.closed_by_peer == 1, 5, message="the worker saw the connection close")


async def test_chunks_then_stall_is_an_idle_timeout_and_closes(transport):
    async def stall(req, w, r):
        w.write(SSE_HEAD + chunk(b"data: 1\n\n") + chunk(b"data: 2\n\n"))
        await w.drain()
        return await hold(r)

    async with RawServer(stall) as srv:
        resp = await transport.post("127.0.0.1", srv.port, "/x", b"{}")
        got = b""
        while got != b"data: 1\n\ndata: 2\n\n":
            got += await resp.next_chunk()
        assert resp._idle_armed  # more is due after these chunks: the idle timer took over
        waiting = time.monotonic()
        with pytest.raises(UpstreamTimeout) as info:
            await bounded(resp.next_chunk())
        assert IDLE * 0.9 <= time.monotonic() - waiting < IDLE + SLACK
        assert not info.value.before_response and "idle timeout" in str(info.value)
        resp.release()
        await wait_for(lambda: srv.closed_by_peer == 1, 5, message="the worker saw the connection close")


async def test_steady_chunks_outlast_both_timeouts(transport):
    async def slow_but_steady(req, w, r):
        w.write(SSE_HEAD)
        for i in range(8):  # 8 × 0.15 s: the stream lasts over twice each timeout
            await asyncio.sleep(0.15)
            w.write(chunk(b"data: %d\n\n" % i))
            await w.drain()
        w.write(b"0\r\n\r\n")
        await w.drain()

    async with RawServer(slow_but_steady) as srv:
        resp = await transport.post("127.0.0.1", srv.port, "/x", b"{}")
        body = await bounded(resp.read())
        resp.release()
    assert body == b"".join(b"data: %d\n\n" % i for i in range(8))


async def test_time_the_router_spends_away_is_not_the_workers_stall(transport):
    """A slow client: the router stops reading (high-water mark), so the worker cannot send; the
    gap is not the worker's, and nothing times out."""
    payload = b"x" * (2 * 1024 * 1024)

    async def big_stream(req, w, r):
        w.write(SSE_HEAD)
        for i in range(0, len(payload), 64 * 1024):
            w.write(chunk(payload[i:i + 64 * 1024]))
            await w.drain()
        w.write(b"0\r\n\r\n")
        await w.drain()

    async with RawServer(big_stream) as srv:
        resp = await transport.post("127.0.0.1", srv.port, "/x", b"{}")
        got = [await resp.next_chunk()]
        await wait_for(lambda: resp._conn._paused, 5, message="reading paused at the high-water mark")
        await asyncio.sleep(IDLE * 3)  # the client is away well past the idle timeout
        while data := await resp.next_chunk():
            got.append(data)
        resp.release()
    assert b"".join(got) == payload


@pytest.mark.parametrize("announced", [True, False])
async def test_an_oversized_reply_fails_and_closes(transport, announced):
    body = b"z" * 5000  # the fixture's cap is 1024

    async def big(req, w, r):
        if announced:  # refused on the header alone
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        else:  # chunked: refused once past the cap
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            for i in range(0, len(body), 500):
                w.write(chunk(body[i:i + 500]))
                await w.drain()
        await w.drain()
        return await hold(r)

    async with RawServer(big) as srv:
        resp = await transport.post("127.0.0.1", srv.port, "/x", b"{}")
        with pytest.raises(ReplyTooLarge) as info:
            await bounded(resp.read())
        assert info.value.status == 502 and "1024 bytes" in str(info.value)
        resp.release()
        await wait_for(lambda: srv.closed_by_peer == 1, 5, message="the worker saw the connection close")


async def test_timers_do_not_outlive_a_reply(transport):
    async with RawServer(ok_json) as srv:
        for _ in range(3):
            resp = await transport.post("127.0.0.1", srv.port, "/x", b"{}")
            assert await resp.read() == b'{"ok":true}'
            assert resp._timer is None  # finished: no timer left behind
            assert not resp._idle_armed  # the body came whole with the head: no idle timer was made for it
            resp.release()
        idle_conn = transport._idle[("127.0.0.1", srv.port)][0]
        await asyncio.sleep(FB * 2)  # past both timeouts: a pooled connection is never aborted
        assert not idle_conn.closed
        resp = await transport.post("127.0.0.1", srv.port, "/x", b"{}")
        assert await resp.read() == b'{"ok":true}'
        resp.release()
        assert srv.connections == 1


# -- a real server against fake workers -------------------------------------------------------------------

class StallingWorker(LoopbackEngine):
    """``mode``: ok; hang (accepts, never answers); headers (stream headers, then nothing); stall
    (two SSE chunks, or part of a unary body, then nothing); big (a 10 KB unary reply). Counts the
    requests the router abandoned (the handler is cancelled when the connection closes)."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.hits = 0
        self.cancelled = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        body = await request.json()
        try:
            if self.mode == "hang":
                await asyncio.sleep(3600)
            if self.mode == "big":
                return web.json_response({"id": "x", "pad": "p" * 10_000})
            if self.mode == "headers" or (self.mode == "stall" and body.get("stream")):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                if self.mode == "stall":
                    for frame in SSE_OK[:2]:
                        await resp.write(frame)
                await asyncio.sleep(3600)
            if self.mode == "stall":  # unary: part of the body, then nothing
                resp = web.StreamResponse(headers={"Content-Type": "application/json"})
                resp.content_length = 1000
                await resp.prepare(request)
                await resp.write(b'{"id": "x", ')
                await asyncio.sleep(3600)
            if not body.get("stream"):
                return web.json_response({"id": "x", "choices": [{"message": {"content": "ok"}}]})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for frame in SSE_OK:
                await resp.write(frame)
            return resp
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    def record(self) -> WorkerRecord:
        return WorkerRecord(worker_id=f"{self.mode}-{self.port}", url=f"http://127.0.0.1:{self.port}", model_name="m")


@pytest.fixture
async def env(fed_server):
    started: list = []

    async def worker(mode: str = "ok") -> StallingWorker:
        w = await StallingWorker(mode).start()
        started.append(w)
        return w

    async def engine(name: str, mode: str, **kw) -> FakeEngine:
        e = await FakeEngine(name, mode, NIXL, **kw).start()
        started.append(e)
        return e

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield fed_server, worker, engine, session
    for w in started:
        await w.stop()


async def metrics(s: aiohttp.ClientSession, base: str) -> str:
    async with s.get(base + "/metrics") as r:
        return await r.text()


def breaker(text: str, worker_id: str) -> tuple[float, float]:
    label = f'worker_id="{worker_id}"'
    return sample_sum(text, "infera_router_worker_breaker_state", label), sample_sum(text, "infera_router_worker_breaker_trips_total", label)


async def timed_chat(s: aiohttp.ClientSession, base: str, stream: bool, body: dict | None = None):
    started = time.monotonic()
    async with s.post(base + "/v1/chat/completions", json={**(body or CHAT), "stream": stream}) as r:
        data = await r.read()
    return r.status, data, time.monotonic() - started


@pytest.mark.parametrize("stream", [False, True])
async def test_no_first_byte_fails_over_and_opens_the_breaker(env, stream):
    server, worker, _, s = env
    srv, base = await server("--request-first-byte-timeout", str(FB), "--request-max-retries", "1",
                             "--breaker-failure-threshold", "2", "--breaker-cooldown-s", "60",
                             "--breaker-max-cooldown-s", "60")
    hung, good = await worker("hang"), await worker()
    srv.fleet.upsert(hung.record())
    srv.fleet.upsert(good.record())
    for _ in range(8):  # round-robin: every other request tries the hung worker first
        status, data, elapsed = await timed_chat(s, base, stream)
        assert status == 200 and (b"[DONE]" in data if stream else b'"ok"' in data), data
        assert elapsed < FB + SLACK
        if hung.hits == 2:
            break
    assert hung.hits == 2
    await wait_for(lambda: hung.cancelled == 2, 5, message="the router closing both hung connections")
    text = await metrics(s, base)
    assert breaker(text, hung.record().worker_id) == (OPEN, 1)
    assert breaker(text, good.record().worker_id) == (CLOSED, 0)
    assert sample_sum(text, "infera_request_retries_total", 'reason="timeout"') == 2
    for _ in range(4):  # open: requests no longer wait on it
        status, _, elapsed = await timed_chat(s, base, stream)
        assert status == 200 and elapsed < FB
    assert hung.hits == 2


@pytest.mark.parametrize("mode, stream", [("hang", False), ("hang", True), ("headers", False), ("headers", True)])
async def test_no_worker_left_is_a_504_within_the_bound(env, mode, stream):
    server, worker, _, s = env
    srv, base = await server("--request-first-byte-timeout", str(FB), "--request-max-retries", "0")
    w = await worker(mode)
    srv.fleet.upsert(w.record())
    status, data, elapsed = await timed_chat(s, base, stream)
    assert status == 504, data
    err = assert_openai_error(json.loads(data), "timeout")
    assert err["type"] == "server_error" and "first-byte timeout" in err["message"]
    assert FB * 0.9 <= elapsed < FB + SLACK
    await wait_for(lambda: w.cancelled == 1, 5, message="the router closing the connection")


async def test_a_stream_that_stalls_ends_with_an_sse_error_event(env):
    server, worker, _, s = env
    srv, base = await server("--request-first-byte-timeout", "30", "--request-idle-timeout", str(IDLE))
    w = await worker("stall")
    srv.fleet.upsert(w.record())
    events, last_data_at = [], 0.0
    async with s.post(base + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        assert r.status == 200
        async for line in r.content:
            if line.startswith(b"data:"):
                events.append(line)
                if len(events) <= 2:
                    last_data_at = time.monotonic()
    assert events[:2] == [f.rstrip(b"\n") + b"\n" for f in SSE_OK[:2]] and len(events) == 3
    assert IDLE * 0.9 <= time.monotonic() - last_data_at < IDLE + SLACK
    err = json.loads(events[-1][5:])["error"]
    assert err["code"] == "worker_timeout_midstream" and "idle timeout" in err["message"]
    await wait_for(lambda: w.cancelled == 1, 5, message="the router closing the stalled connection")
    text = await metrics(s, base)
    assert sample_sum(text, "infera_midstream_failures_total", f'worker_id="{w.record().worker_id}"') == 1


async def test_a_unary_reply_that_stalls_is_a_504(env):
    server, worker, _, s = env
    srv, base = await server("--request-first-byte-timeout", "30", "--request-idle-timeout", str(IDLE),
                             "--request-max-retries", "0")
    w = await worker("stall")
    srv.fleet.upsert(w.record())
    status, data, elapsed = await timed_chat(s, base, False)
    assert status == 504, data
    assert "idle timeout" in assert_openai_error(json.loads(data), "timeout")["message"]
    assert elapsed < IDLE + SLACK
    await wait_for(lambda: w.cancelled == 1, 5, message="the router closing the stalled connection")


async def test_an_oversized_unary_reply_is_a_502_not_retried_nor_blamed(env):
    server, worker, _, s = env
    srv, base = await server("--max-upstream-reply-bytes", "2048", "--request-max-retries", "1",
                             "--breaker-failure-threshold", "1")
    big = await worker("big")
    srv.fleet.upsert(big.record())
    for _ in range(2):
        status, data, _ = await timed_chat(s, base, False)
        assert status == 502, data
        err = assert_openai_error(json.loads(data), "upstream_reply_too_large")
        assert "2048 bytes" in err["message"] and "--max-upstream-reply-bytes" in err["message"]
    assert big.hits == 2  # one try per request: the same request would be as large elsewhere
    assert breaker(await metrics(s, base), big.record().worker_id) == (CLOSED, 0)
    # Within the cap (and a stream, relayed chunk by chunk, is not capped): served.
    srv2, base2 = await server("--max-upstream-reply-bytes", "65536")
    srv2.fleet.upsert(big.record())
    status, data, _ = await timed_chat(s, base2, False)
    assert status == 200 and len(data) > 10_000


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_a_pd_leg_without_a_first_byte_is_retried_on_another_pair(env, role):
    """Per leg: a hung prefill (well inside --pd-prefill-timeout) or a hung decode is cut at the
    first-byte timeout, the pair is retried, and only the hung worker is blamed."""
    server, _, engine, s = env
    srv, base = await server("--request-first-byte-timeout", str(FB), "--pd-prefill-timeout", "60",
                             "--request-max-retries", "1", "--breaker-failure-threshold", "1",
                             "--breaker-cooldown-s", "60", "--breaker-max-cooldown-s", "60")
    other = "decode" if role == "prefill" else "prefill"
    hung = await engine(f"{role}-hung", role, behaviour="hang")
    good = await engine(f"{role}-good", role)
    partner = await engine(f"{other}-only", other)
    srv.fleet.replace_all([hung.record(), good.record(), partner.record()])
    for stream in (False, True, False):
        status, data, elapsed = await timed_chat(s, base, stream, chat())
        assert status == 200, data
        assert elapsed < FB + SLACK
    assert len(hung.bodies) == 1  # tried once, then open
    await wait_for(lambda: hung.cancelled == 1, 5, message="the router closing the hung leg")
    text = await metrics(s, base)
    assert breaker(text, f"{role}-hung") == (OPEN, 1)
    assert breaker(text, f"{other}-only") == (CLOSED, 0) and breaker(text, f"{role}-good") == (CLOSED, 0)
    assert sample_sum(text, "infera_request_retries_total", f'reason="{role}_timeout"') == 1


# -- a real server against sim workers, one of them SIGSTOPped ---------------------------------------------

async def test_a_sigstopped_worker_is_bounded_failed_over_and_opened(make_server, spawn_worker):
    server = await make_server("--router-policy", "round-robin", "--request-first-byte-timeout", "1",
                               "--request-idle-timeout", "1", "--request-max-retries", "1",
                               "--breaker-failure-threshold", "2", "--breaker-cooldown-s", "60",
                               "--breaker-max-cooldown-s", "60")
    # A long lease: the launcher keeps it alive while its engine is stopped, as in production.
    frozen_w = await spawn_worker(lease_ttl=30)
    other = await spawn_worker(lease_ttl=30, speedup=1.0)  # slow enough for a stream to be stopped midway
    await wait_workers(server, {frozen_w.worker_id, other.worker_id})
    base = f"http://127.0.0.1:{server.port}"
    engines = {w.worker_id: children_of(w.proc.pid) for w in (frozen_w, other)}
    assert all(engines.values()), "a sim launcher without an engine child"
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    stopped: list[int] = []
    try:
        for pid in engines[frozen_w.worker_id]:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            for i in range(6):  # round-robin: every other request tries the stopped engine first
                status, data, elapsed = await timed_chat(s, base, bool(i % 2), body)
                assert status == 200, data
                assert elapsed < 1 + SLACK
            text = await metrics(s, base)
            assert breaker(text, frozen_w.worker_id) == (OPEN, 1)
            assert breaker(text, other.worker_id) == (CLOSED, 0)
            assert sample_sum(text, "infera_request_retries_total", 'reason="timeout"') == 2

            # Mid-stream: the only healthy engine stops after the first byte; the stream ends
            # with the idle timeout's error event, within the bound.
            long = {**body, "max_tokens": 2000, "ignore_eos": True, "stream": True}
            events, stop_at = [], 0.0
            async with s.post(base + "/v1/chat/completions", json=long) as r:
                assert r.status == 200
                async for line in r.content:
                    if not line.startswith(b"data:"):
                        continue
                    events.append(line)
                    if len(events) == 3:
                        for pid in engines[other.worker_id]:
                            os.kill(pid, signal.SIGSTOP)
                            stopped.append(pid)
                        stop_at = time.monotonic()
            assert len(events) >= 3 and b"[DONE]" not in events[-1]
            assert json.loads(events[-1][5:])["error"]["code"] == "worker_timeout_midstream"
            assert time.monotonic() - stop_at < 1 + SLACK
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
