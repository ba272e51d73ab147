"""HTTP request transport: a lean keep-alive HTTP/1.1 client for the router's hot path.

Why not aiohttp's ClientSession here: profiling the router (bench/router_overhead.py, py-spy)
showed its per-request machinery (request objects, header multidicts, pool bookkeeping) was the
largest share of the server's CPU. Talking to a worker needs far less: one prebuilt request
written in a single ``transport.write``, a C parser (httptools) for the reply, and a pool of
idle connections per worker. Body bytes are handed over exactly as the engine sent them.

Every wait on a worker is bounded (when the server configures it): ``first_byte_timeout`` from
writing the request to the first body byte (a unary reply arrives whole, so for it this bounds the
generation; a stream's headers come at once and its first chunk after the prefill), then
``idle_timeout`` between body chunks while the router waits for one. Expiry fails the reply with
``UpstreamTimeout`` (504) and closes the connection, so the engine aborts the request. The timers
cost one ``call_later`` per request and phase, not one per chunk: a wait only stamps the loop
clock, and the idle timer, when it fires, re-arms itself for the time still left (a stall is
rare; a chunk is the hot path). A reply read whole into memory (``read``) is capped at
``max_reply_bytes`` (``ReplyTooLarge``, 502).
"""
from __future__ import annotations

import asyncio
import collections
import logging
from typing import Iterable

import httptools

from infera.runtime import wait_for

log = logging.getLogger(__name__)

# Pause reading from a worker when this much of its reply is buffered and not yet consumed
# (a slow client must not make the router buffer a whole generation).
_HIGH_WATER = 256 * 1024


class UpstreamError(Exception):
    """The worker could not be reached, or its reply broke off."""

    def __init__(self, message: str, *, before_response: bool = False) -> None:
        super().__init__(message)
        self.before_response = before_response


class UpstreamTimeout(UpstreamError):
    """The worker sent no first byte within the first-byte timeout, or its body stalled past the
    idle timeout."""

    status = 504


class ReplyTooLarge(UpstreamError):
    """A reply read whole into memory is over the byte cap: failed instead of buffered. The same
    request would be as large anywhere, so it is not retried, nor held against the worker."""

    status = 502

    def __init__(self, where: str, limit: int) -> None:
        super().__init__(f"{where}: reply larger than {limit} bytes (--max-upstream-reply-bytes)")
        self.limit = limit


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to a worker; serves one request at a time."""

    __slots__ = ("key", "loop", "transport", "parser", "closed", "response", "_idle_pool", "_paused", "reused")

    def __init__(self, key: tuple[str, int], loop: asyncio.AbstractEventLoop) -> None:
        self.key = key
        self.loop = loop  # its replies' loop: asyncio.get_running_loop() is a getpid() syscall per call on 3.11
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.response: UpstreamResponse | None = None
        self._paused = False
        self.reused = False

    # -- asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: the connection is out of sync
            self._abort()
            return
        resp = self.response
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            resp._fail(f"malformed HTTP reply: {exc}")
            self._abort()
            return
        if resp._got_body and not resp._idle_armed and not resp.complete and resp._error is None:
            resp._arm_idle()  # the body goes on past these bytes: the idle timer takes over

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is not None and not self.response.complete:
            self.response._fail("connection closed by the worker" + (f": {exc}" if exc else ""))

    def pause_writing(self) -> None:  # request bodies are small; nothing to throttle
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks ----------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self.response
        if resp is None:
            return
        n = len(name)
        if n == 12 and name.lower() == b"content-type":
            resp.content_type = value.decode("latin-1")
        elif n == 14 and name.lower() == b"content-length":
            try:
                resp.content_length = int(value)
            except ValueError:  # httptools rejects it itself; the cap still applies while reading
                pass

    def on_headers_complete(self) -> None:
        resp = self.response
        if resp is not None:
            resp.status = self.parser.get_status_code()
            resp._headers_done()

    def on_body(self, body: bytes) -> None:
        resp = self.response
        if resp is not None:
            resp._feed(body)
            if resp._buffered > _HIGH_WATER and not self._paused and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()

    def on_message_complete(self) -> None:
        resp = self.response
        if resp is not None:
            resp._finish(self.parser.should_keep_alive())

    # -- helpers -------------------------------------------------------------------------------------
    def resume_if_drained(self) -> None:
        if self._paused and self.transport is not None and self.response is not None and self.response._buffered < _HIGH_WATER // 2:
            self._paused = False
            self.transport.resume_reading()

    def _abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class ChunkedReply:
    """``read()`` for replies that hand out their body chunk by chunk (``next_chunk``; b"" ends)."""

    __slots__ = ()

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; more than ``limit`` bytes (0/None: no cap) raises ``ReplyTooLarge``
        (the caller releases the reply, which closes the connection)."""
        parts = []
        size = 0
        while True:
            chunk = await self.next_chunk()  # type: ignore[attr-defined]  # the subclass's
            if not chunk:
                return b"".join(parts)
            size += len(chunk)
            if limit and size > limit:
                raise ReplyTooLarge(self._describe(), limit)
            parts.append(chunk)

    def _describe(self) -> str:
        return "worker"


class UpstreamResponse(ChunkedReply):
    """A worker's reply: status and content type first, then the body as it arrives."""

    __slots__ = ("_conn", "_pool", "status", "content_type", "content_length", "complete", "_chunks", "_buffered",
                 "_error", "_waiter", "_headers_future", "_keep_alive", "_released", "_loop", "_timer", "_got_body",
                 "_idle_armed", "_wait_since")

    def __init__(self, conn: UpstreamConnection, pool: "HttpTransport") -> None:
        self._conn = conn
        self._pool = pool
        self.status = 0
        self.content_type = "application/json"
        self.content_length = -1  # -1: not announced (chunked, or read to close)
        self.complete = False
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future | None = None
        self._loop = conn.loop
        self._headers_future: asyncio.Future = self._loop.create_future()
        self._keep_alive = False
        self._released = False
        self._timer: asyncio.TimerHandle | None = None  # first-byte timer, then the idle one
        self._got_body = False
        self._idle_armed = False  # the timer is the idle one (else the first-byte one, or none)
        self._wait_since = 0.0  # loop time the consumer began its current wait for a chunk

    # -- fed by the connection -------------------------------------------------------------------------
    def _headers_done(self) -> None:
        if not self._headers_future.done():
            self._headers_future.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._got_body = True
        self._chunks.append(data)
        self._buffered += len(data)
        self._wake()

    def _finish(self, keep_alive: bool) -> None:
        self.complete = True
        self._keep_alive = keep_alive
        self._stop_timer()
        self._wake()

    def _fail(self, error: "str | UpstreamError") -> None:
        if self.complete or self._error is not None:
            return
        if isinstance(error, str):
            error = UpstreamError(error, before_response=not self._headers_future.done())
        self._error = error
        self._stop_timer()
        if not self._headers_future.done():
            self._headers_future.set_exception(error)
            self._headers_future.exception()  # retrieved: no "never retrieved" warning if nobody waits
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- timeouts ------------------------------------------------------------------------------------------
    def _where(self) -> str:
        host, port = self._conn.key
        return f"worker {host}:{port}"

    _describe = _where

    def _start_clock(self) -> None:
        """The request is written: the first-byte timeout starts."""
        t = self._pool.first_byte_timeout
        if t > 0:
            self._timer = self._loop.call_later(t, self._first_byte_expired)

    def _arm_idle(self) -> None:
        """Body bytes came and more are due: the first-byte timer gives way to the idle timer.
        Called by the connection once it has fed a read's bytes, so that a reply whose body
        arrives whole with its first bytes (most unary ones) never arms it."""
        self._idle_armed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        idle = self._pool.idle_timeout
        if idle > 0:
            self._timer = self._loop.call_later(idle, self._idle_check)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _first_byte_expired(self) -> None:
        self._timer = None
        self._expire(UpstreamTimeout(f"{self._where()} sent no reply within {self._pool.first_byte_timeout:g}s "
                                     "(first-byte timeout)", before_response=True))

    def _idle_check(self) -> None:
        """Fires at most once per idle period. Only a wait the consumer is in counts: while it is
        away (writing to a slow client, reading paused) the worker is not the one stalling."""
        self._timer = None
        if self.complete or self._error is not None or self._released:
            return
        idle = self._pool.idle_timeout
        left = idle
        if self._waiter is not None and not self._chunks:
            left = self._wait_since + idle - self._loop.time()
            if left <= 0.001:
                self._expire(UpstreamTimeout(f"{self._where()} stalled: nothing received for {idle:g}s "
                                             "(idle timeout)"))
                return
        self._timer = self._loop.call_later(left, self._idle_check)

    def _expire(self, error: UpstreamTimeout) -> None:
        if self.complete or self._error is not None or self._released:
            return
        self._fail(error)  # logged by whoever handles it (a retry, or the relay's mid-stream failure)
        self._conn._abort()  # the engine sees the close and aborts the request

    # -- consumer side -------------------------------------------------------------------------------------
    async def wait_headers(self) -> None:
        await self._headers_future

    @property
    def ready(self) -> bool:
        """Body bytes are waiting: ``next_chunk`` returns them without waiting."""
        return bool(self._chunks)

    async def next_chunk(self) -> bytes:
        """Everything received since the last call (joined), waiting if nothing is there.

        Returns b"" at the end of the body; raises UpstreamError if the reply broke off.
        """
        while True:
            if self._chunks:
                data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
                self._chunks.clear()
                self._buffered = 0
                self._conn.resume_if_drained()
                return data
            if self.complete:
                return b""
            if self._error is not None:
                raise self._error
            loop = self._loop
            self._waiter = loop.create_future()
            self._wait_since = loop.time()  # the idle timer reads it; no timer of its own per wait
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body, capped at ``limit`` (default: the transport's ``max_reply_bytes``); an
        announced Content-Length over the cap fails before any of it is read."""
        if limit is None:
            limit = self._pool.max_reply_bytes
        if limit and self.content_length > limit:
            raise ReplyTooLarge(self._where(), limit)
        return await ChunkedReply.read(self, limit)

    def release(self) -> None:
        """Return the connection to the pool if the reply was fully read, else close it.

        Closing an unfinished reply is how an abandoned request is cancelled: the engine sees
        the connection close and aborts the generation.
        """
        if self._released:
            return
        self._released = True
        self._stop_timer()
        conn = self._conn
        conn.response = None
        if self.complete and self._keep_alive and not conn.closed and not self._chunks:
            self._pool._put_idle(conn)
        else:
            conn._abort()

    close = release


def split_http_url(url: str) -> tuple[str, int]:
    """``http://host:port`` → (host, port); the router only speaks plain HTTP to workers."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"unsupported worker URL {url!r} (expected http://host:port)")
    return parts.hostname, parts.port or 80


class HttpTransport:
    """Connection pools to workers, keyed by (host, port)."""

    def __init__(self, connect_timeout: float = 10.0, max_idle_per_worker: int = 1024, *,
                 first_byte_timeout: float = 0.0, idle_timeout: float = 0.0, max_reply_bytes: int = 0) -> None:
        # 0 = off for all three: the server sets them from its flags (the NATS worker's proxy has
        # its own watchdog).
        self.connect_timeout = connect_timeout
        self.max_idle_per_worker = max_idle_per_worker
        self.first_byte_timeout = first_byte_timeout
        self.idle_timeout = idle_timeout
        self.max_reply_bytes = max_reply_bytes
        self._idle: dict[tuple[str, int], list[UpstreamConnection]] = {}
        self._request_heads: dict[tuple[str, int, str], bytes] = {}
        self._addresses: dict[str, tuple[str, int]] = {}
        self._started = False

    def address(self, url: str) -> tuple[str, int]:
        """Parsed once per worker URL, then a dict lookup."""
        addr = self._addresses.get(url)
        if addr is None:
            addr = self._addresses[url] = split_http_url(url)
        return addr

    async def start(self) -> None:
        self._started = True

    async def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c._abort()
        self._idle.clear()

    def forget(self, url: str) -> None:
        """A worker left: close its idle connections and drop what was cached for it."""
        addr = self._addresses.pop(url, None)
        if addr is None:
            return
        for c in self._idle.pop(addr, []):
            c._abort()
        for k in [k for k in self._request_heads if k[:2] == addr]:
            del self._request_heads[k]

    # -- pool -------------------------------------------------------------------------------------------------
    def _put_idle(self, conn: UpstreamConnection) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) < self.max_idle_per_worker:
            conn.reused = True
            idle.append(conn)
        else:
            conn._abort()

    async def _connect(self, key: tuple[str, int]) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await wait_for(
                loop.create_connection(lambda: UpstreamConnection(key, loop), key[0], key[1]), self.connect_timeout)
        except asyncio.TimeoutError:
            raise UpstreamError(f"connect to {key[0]}:{key[1]} timed out after {self.connect_timeout}s",
                                before_response=True) from None
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {key[0]}:{key[1]}: {exc.strerror or exc}", before_response=True) from None
        return conn

    def _take_idle(self, key: tuple[str, int]) -> UpstreamConnection | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        return None

    def _head(self, host: str, port: int, path: str) -> bytes:
        k = (host, port, path)
        head = self._request_heads.get(k)
        if head is None:
            head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                    f"Accept: */*\r\n").encode("latin-1")
            self._request_heads[k] = head
        return head

    # -- requests ----------------------------------------------------------------------------------------------
    async def send(self, worker, path: str, body: bytes, headers: Iterable[tuple[str, str]] = (),
                   stream: bool = False) -> UpstreamResponse:
        """The request transport interface (``infera.transport.request``): POST to a worker record."""
        host, port = self.address(worker.url)
        return await self.post(host, port, path, body, headers)

    async def post(self, host: str, port: int, path: str, body: bytes,
                   headers: Iterable[tuple[str, str]] = ()) -> UpstreamResponse:
        """POST ``body``; returns once the reply's status line and headers have arrived.

        A reused idle connection the worker already closed fails before any reply byte; that
        attempt is transparently repeated once on a fresh connection (no request reached the
        engine). Any other failure raises UpstreamError (``UpstreamTimeout`` past the first-byte
        timeout, never repeated: the worker got the request). The caller must ``release()``.
        """
        key = (host, port)
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers)
        request = b"".join((self._head(host, port, path), f"{extra}Content-Length: {len(body)}\r\n\r\n".encode("latin-1"), body))
        conn = self._take_idle(key)
        for attempt in (0, 1):
            if conn is None:
                conn = await self._connect(key)
            resp = UpstreamResponse(conn, self)
            conn.response = resp
            reused = conn.reused
            try:
                assert conn.transport is not None
                conn.transport.write(request)
                resp._start_clock()
                await resp.wait_headers()
                return resp
            except UpstreamError as exc:
                resp.release()
                if reused and attempt == 0 and not isinstance(exc, UpstreamTimeout):
                    conn = None  # stale keep-alive connection: one fresh try
                    continue
                raise
            except BaseException:  # cancelled: close so the engine aborts the request
                resp.release()
                raise
        raise AssertionError("unreachable")
