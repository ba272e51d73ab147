"""HTTP request transport: a lean keep-alive HTTP/1.1 client for the router's hot path.

Why not aiohttp's ClientSession here: profiling the router (bench/router_overhead.py, py-spy)
showed its per-request machinery (request objects, header multidicts, pool bookkeeping) was the
largest share of the server's CPU. Talking to a worker needs far less: one prebuilt request
written in a single ``transport.write``, a C parser (httptools) for the reply, and a pool of
idle connections per worker. Body bytes are handed over exactly as the engine sent them.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from typing import Iterable

import httptools

log = logging.getLogger(__name__)

# Pause reading from a worker when this much of its reply is buffered and not yet consumed
# (a slow client must not make the router buffer a whole generation).
_HIGH_WATER = 256 * 1024


class UpstreamError(Exception):
    """The worker could not be reached, or its reply broke off."""

    def __init__(self, message: str, *, before_response: bool = False) -> None:
        super().__init__(message)
        self.before_response = before_response


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection to a worker; serves one request at a time."""

    __slots__ = ("key", "transport", "parser", "closed", "response", "_idle_pool", "_paused", "reused")

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
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
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.response._fail(f"malformed HTTP reply: {exc}")
            self._abort()

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
        if resp is not None and len(name) == 12 and name.lower() == b"content-type":
            resp.content_type = value.decode("latin-1")

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

    async def read(self) -> bytes:
        parts = []
        while True:
            chunk = await self.next_chunk()  # type: ignore[attr-defined]  # the subclass's
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)


class UpstreamResponse(ChunkedReply):
    """A worker's reply: status and content type first, then the body as it arrives."""

    __slots__ = ("_conn", "_pool", "status", "content_type", "complete", "_chunks", "_buffered", "_error",
                 "_waiter", "_headers_future", "_keep_alive", "_released")

    def __init__(self, conn: UpstreamConnection, pool: "HttpTransport") -> None:
        self._conn = conn
        self._pool = pool
        self.status = 0
        self.content_type = "application/json"
        self.complete = False
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._error: str | None = None
        self._waiter: asyncio.Future | None = None
        self._headers_future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._keep_alive = False
        self._released = False

    # -- fed by the connection -------------------------------------------------------------------------
    def _headers_done(self) -> None:
        if not self._headers_future.done():
            self._headers_future.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        self._wake()

    def _finish(self, keep_alive: bool) -> None:
        self.complete = True
        self._keep_alive = keep_alive
        self._wake()

    def _fail(self, message: str) -> None:
        if self.complete or self._error:
            return
        self._error = message
        if not self._headers_future.done():
            self._headers_future.set_exception(UpstreamError(message, before_response=True))
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- consumer side -------------------------------------------------------------------------------------
    async def wait_headers(self) -> None:
        await self._headers_future

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
            if self._error:
                raise UpstreamError(self._error)
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def release(self) -> None:
        """Return the connection to the pool if the reply was fully read, else close it.

        Closing an unfinished reply is how an abandoned request is cancelled: the engine sees
        the connection close and aborts the generation.
        """
        if self._released:
            return
        self._released = True
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

    def __init__(self, connect_timeout: float = 10.0, max_idle_per_worker: int = 1024) -> None:
        self.connect_timeout = connect_timeout
        self.max_idle_per_worker = max_idle_per_worker
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
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: UpstreamConnection(key), key[0], key[1]), self.connect_timeout)
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
        engine). Any other failure raises UpstreamError. The caller must ``release()``.
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
                await resp.wait_headers()
                return resp
            except UpstreamError:
                resp.release()
                if reused and attempt == 0:
                    conn = None  # stale keep-alive connection: one fresh try
                    continue
                raise
            except BaseException:  # cancelled: close so the engine aborts the request
                resp.release()
                raise
        raise AssertionError("unreachable")
