"""The front door's fast path: plain HTTP/1.1 requests to the OpenAI inference routes, served
without aiohttp's request, response and middleware objects.

Why: the profile of a proxied request (``bench/README.md``, issue 30 item 8) put ~21 % of the
router's CPU in aiohttp's server objects, for requests that need none of its generality. This
protocol answers ``POST /v1/chat/completions`` and ``POST /v1/completions`` itself when the request
is the plain case; everything else on the connection (another route, chunked bodies, ``Expect``,
``Upgrade``, HTTP/1.0, a head it does not fully trust) is handed to aiohttp's protocol with the bytes
read so far, for the rest of the connection's life. aiohttp's strict parser then sees the original
bytes and answers exactly as before: the fast path only ever takes what it has validated.

The same handler serves both paths (``app.serve_inference``), and the same limits hold
(``limits.py``): the connection cap (this protocol sits in ``ServerLimits.connections`` and can be
evicted while idle), the header, body and keep-alive timeouts (one lazily re-armed timer per
connection, so a kept-alive request costs no timer operation), the request bytes in flight, and
handler cancellation when the client goes away. So do the API keys' and the fair queue's (the
tenant's permit and count, the queue's slot: ``app.take_tenant_permit`` and its kin, shared with
the middlewares); a request without a valid key goes to aiohttp, which answers and counts the 401
before reading the body. ``--access-log`` lines are written by aiohttp's own access logger, in its
format, on both paths. Off with ``--http-fast-path off``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, cast

from aiohttp import HttpVersion11, web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.web_log import AccessLogger
from multidict import CIMultiDict

from infera.api.errors import ApiError
from infera.server.app import release_ticket, serve_inference, settle_api_key, take_tenant_permit
from infera.server.app_state import API_KEY_KEY, REQUEST_ID_HEADER, REQUEST_ID_KEY, STATE_KEY, _request_id
from infera.server.limits import ServerLimits

log = logging.getLogger("infera.server.fast_http")

# The longest head the fast path reads (aiohttp's own line limit); a longer one goes to aiohttp, whose
# limits judge it.
MAX_HEAD_BYTES = 8190
# Pipelined bytes buffered while a request is handled before the socket stops being read.
MAX_PIPELINED_BYTES = 64 * 1024

_ROUTES = {
    b"POST /v1/chat/completions HTTP/1.1": "/v1/chat/completions",
    b"POST /v1/completions HTTP/1.1": "/v1/completions",
}
# RFC 9110 field-name (token) and field-value (visible ASCII or obs-text, inner spaces and tabs),
# with optional whitespace around the value; the whole header block must match, line by line.
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_VALUE = rb"(?:[\x21-\x7e\x80-\xff](?:[\x20-\x7e\x80-\xff\t]*[\x21-\x7e\x80-\xff])?)?"
_FIELD = rb"(" + _TOKEN + rb"):[ \t]*(" + _VALUE + rb")[ \t]*\r\n"
# Anchored at a line's start, a field matches its whole line (a value holds no CR or LF): the block
# is well-formed when every LF ends a matched line, so one findall both validates and extracts.
_HEADER_LINE = re.compile(rb"(?m)^" + _FIELD)
_DIGITS = re.compile(rb"[0-9]{1,15}")
# Headers whose presence sends the request to aiohttp: its framing or semantics are not the plain case.
_HANDOFF_HEADERS = frozenset({b"transfer-encoding", b"expect", b"upgrade", b"te", b"http2-settings"})

_REASONS = {s.value: s.phrase for s in HTTPStatus}


def _reason(status: int) -> str:
    return _REASONS.get(status, "Unknown")


class HttpDate:
    """The ``Date`` header's value, formatted once a second."""

    __slots__ = ("_second", "_value")

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def value(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = formatdate(now, usegmt=True).encode("ascii")
        return self._value


class FastRequest(dict[Any, Any]):
    """The part of ``aiohttp.web.Request`` the inference handler reads; a dict for the keys
    handlers leave on a request (as aiohttp's request is a mutable mapping)."""

    __slots__ = ("_body", "app", "content_length", "headers", "path")
    method = "POST"
    body_exists = True

    def __init__(self, app: Any, path: str, headers: CIMultiDict[str], body: bytes) -> None:
        super().__init__()
        self.app = app
        self.path = path
        self.headers = headers
        self.content_length = len(body)
        self._body = body

    async def read(self) -> bytes:
        return self._body


def parse_head(head: bytes) -> tuple[str, CIMultiDict[str], int, bool] | None:
    """``(route, headers, content_length, keep_alive)`` for a head (without its blank line) that
    the fast path takes, else None: the request goes to aiohttp, which parses the same bytes."""
    line_end = head.find(b"\r\n")
    if line_end < 0:
        return None
    route = _ROUTES.get(head[:line_end])
    if route is None:
        return None
    block = head[line_end + 2 :] + b"\r\n"
    fields = _HEADER_LINE.findall(block)
    if len(fields) != block.count(b"\n"):
        return None  # a line that is not a field, a bare LF or CR, an obs-fold
    headers: CIMultiDict[str] = CIMultiDict()
    length = None
    keep_alive = True
    for raw_name, raw_value in fields:
        name = raw_name.lower()
        if name == b"content-length":
            if length is not None or _DIGITS.fullmatch(raw_value) is None:
                return None  # two lengths, or not a plain number: aiohttp's 400
            length = int(raw_value)
        elif name == b"connection":
            token = raw_value.lower()
            if token == b"close":
                keep_alive = False
            elif token != b"keep-alive":
                return None  # upgrade, or a list of options
        elif name in _HANDOFF_HEADERS:
            return None
        headers.add(raw_name.decode("ascii"), raw_value.decode("utf-8", "surrogateescape"))
    if length is None:
        return None
    return route, headers, length, keep_alive


def _safe_header(value: str) -> str:
    if "\r" in value or "\n" in value:
        raise ValueError(f"header value with a line break: {value!r}")
    return value


class _LoggedRequest:
    """What aiohttp's ``AccessLogger`` reads of a request."""

    __slots__ = ("headers", "path_qs", "remote")
    method = "POST"
    version = HttpVersion11

    def __init__(self, remote: str | None, path: str, headers: CIMultiDict[str]) -> None:
        self.remote = remote
        self.path_qs = path  # the fast path takes no query string
        self.headers = headers


class _LoggedReply:
    """What aiohttp's ``AccessLogger`` reads of a reply."""

    __slots__ = ("body_length", "headers", "status")

    def __init__(self, status: int, body_length: int) -> None:
        self.status = status
        self.body_length = body_length
        self.headers: dict[str, str] = {}


# What a connection is doing, for its single timer (see _on_timer).
_IDLE, _HEAD, _BODY, _BUSY = range(4)


class FastConnection(asyncio.Protocol):
    """One client connection on the fast path, until it is handed to aiohttp (or closes)."""

    def __init__(
        self,
        app: Any,
        server: Any,
        limits: ServerLimits,
        handoff: Callable[[], asyncio.Protocol],
        date: HttpDate,
        access_log: AbstractAccessLogger | None = None,
    ) -> None:
        self._app = app
        self._access_log = access_log  # --access-log: aiohttp's own logger, so both paths write one format
        self._peer: str | None = None
        self._state = app[STATE_KEY]
        self._server = server  # aiohttp's Server: its connection list is what shutdown closes
        self._limits = limits
        self._handoff_factory = handoff
        self._date = date
        self._loop = server._loop
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._phase = _HEAD
        self._since = 0.0  # when the current phase began (loop time)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._task: asyncio.Task[None] | None = None
        # a parsed head whose body is still arriving: route, headers, length, keep-alive, API key
        self._pending: tuple[str, CIMultiDict[str], int, bool, Any] | None = None
        self._closing = False  # shutdown asked: no new request on this connection
        self._paused = False
        self._write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._refused = False
        # what ServerLimits.admit reads to pick an idle victim, as on aiohttp's RequestHandler
        self._request_in_progress = False
        self._messages = ()

    # -- the connection's life --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tcp = cast(asyncio.Transport, transport)
        if not self._limits.admit(self):  # type: ignore[arg-type]
            self._refused = True
            log.debug("connection refused: %d connections open (--max-connections)", self._limits.max_connections)
            tcp.abort()
            return
        self.transport = tcp
        self._server._connections[self] = tcp
        if self._access_log is not None:
            peer = tcp.get_extra_info("peername")
            self._peer = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else None
        self._set_phase(_HEAD)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            return
        self._forget()
        self.transport = None
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client left: the upstream request is aborted too
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client disconnected"))

    def _forget(self) -> None:
        self._limits.connections.pop(self, None)
        self._server._connections.pop(self, None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pending is not None:
            self._limits.inflight_bytes -= self._pending[2]
            self._pending = None

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    # -- reading --
    def data_received(self, data: bytes) -> None:
        self._buf += data
        if self._task is not None:  # pipelined: read once the current reply is out
            if len(self._buf) > MAX_PIPELINED_BYTES and not self._paused:
                self._paused = True
                self.transport.pause_reading()  # type: ignore[union-attr]
            return
        self._process()

    def _process(self) -> None:
        """Take the next request from the buffer, if it is whole."""
        buf = self._buf
        pending = self._pending
        if pending is None:
            if self._closing:
                self.transport.close()  # type: ignore[union-attr]
                return
            if not buf:
                self._enter(_IDLE)
                return
            end = buf.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    self._hand_off()  # a long head: aiohttp's limits judge it
                else:
                    self._enter(_HEAD)
                return
            parsed = parse_head(bytes(buf[:end]))
            if parsed is None or parsed[2] > self._limits.max_request_bytes:
                self._hand_off()
                return
            route, headers, length, keep_alive = parsed
            key = None
            keys = self._state.api_keys
            if keys is not None:
                key = keys.find(headers)
                if key is None:  # aiohttp's path answers and counts the 401, before reading the body
                    self._hand_off()
                    return
            if not self._limits.reserve(length):
                self._hand_off()  # aiohttp's path answers 503 server_busy, counted there
                return
            del buf[: end + 4]
            pending = self._pending = (route, headers, length, keep_alive, key)
        length = pending[2]
        if len(buf) < length:
            self._enter(_BODY)
            return
        body = bytes(buf[:length])
        del buf[:length]
        self._pending = None
        self._limits.fast_requests += 1
        self._request_in_progress = True
        self._phase = _BUSY  # no timer while the request is answered
        self._task = self._loop.create_task(self._serve(pending[0], pending[1], length, pending[3], body, pending[4]))

    def _hand_off(self) -> None:
        """The rest of this connection is aiohttp's, starting from the bytes not yet answered."""
        transport = self.transport
        if transport is None:
            return
        self._forget()
        self._limits.handoffs += 1
        handler = self._handoff_factory()
        self.transport = None
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if self._paused:
            transport.resume_reading()
        if self._buf:
            data = bytes(self._buf)
            self._buf.clear()
            handler.data_received(data)

    # -- serving --
    async def _serve(
        self, route: str, headers: CIMultiDict[str], length: int, keep_alive: bool, body: bytes, key: Any
    ) -> None:
        request = FastRequest(self._app, route, headers, body)
        writer = FastReplyWriter(self)
        writer.close = not keep_alive
        started = self._loop.time()
        try:
            await self._answer(request, route, writer, key)
        except asyncio.CancelledError:
            raise
        except Exception:  # not even an error reply could go out: cut the connection, never leave it hanging
            log.exception("error answering %s", route)
            self._abort()
        finally:
            self._limits.inflight_bytes -= length
            self._request_in_progress = False
            self._task = None
            if self._access_log is not None and writer.status is not None and self._access_log.enabled:
                self._access_log.log(
                    _LoggedRequest(self._peer, route, headers),  # type: ignore[arg-type]
                    _LoggedReply(writer.status, writer.sent),  # type: ignore[arg-type]
                    self._loop.time() - started,
                )
        if self.transport is None:
            return
        if self._closing or writer.close:
            self.transport.close()
            return
        if self._paused:
            self._paused = False
            self.transport.resume_reading()
        self._process()

    async def _answer(self, request: FastRequest, route: str, writer: FastReplyWriter, key: Any) -> None:
        """The reply, or the error reply in the OpenAI shape, as ``_errors_middleware`` writes it;
        with ``--api-keys-file`` the tenant's permit and count, and the fair queue's slot given back,
        as ``_api_key_middleware`` and ``_admission_middleware`` do on aiohttp's path."""
        permit = None
        status: int | None = None
        try:
            if key is not None:
                request[API_KEY_KEY] = key
                permit = await take_tenant_permit(request, key, self._state.limiter)
            await serve_inference(request, route, writer)
            status = writer.status
        except ApiError as exc:
            status = exc.status
            self._send_error(request, exc, writer)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            status = exc.status
            self._send_error(request, ApiError(exc.status, exc.reason, None), writer)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug: the client gets a 500, the connection closes
            log.exception("error handling %s", route)
            self._send_error(request, ApiError(500, "internal server error", "internal_error"), writer, close=True)
        finally:
            release_ticket(request)
            if key is not None:
                settle_api_key(request, self._state.api_keys, key, permit, status)

    def _send_error(self, request: FastRequest, exc: ApiError, writer: FastReplyWriter, close: bool = False) -> None:
        if writer.started:  # the stream's head is out: the only signal left is to cut it
            self._abort()
            return
        request_id = request.get(REQUEST_ID_KEY) or _request_id(cast(web.Request, request))
        headers = {REQUEST_ID_HEADER: request_id, **exc.headers}
        writer.close = writer.close or close
        writer.unary(exc.status, exc.body(), headers, "application/json")

    def _abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -- one timer for the head, body and keep-alive timeouts --
    def _enter(self, phase: int) -> None:
        if self._phase != phase:  # a head or body arriving in pieces keeps the time it began
            self._set_phase(phase)

    def _set_phase(self, phase: int) -> None:
        self._phase = phase
        self._since = now = self._loop.time()
        limits = self._limits
        if phase == _BUSY:
            return
        timeout = (
            limits.keepalive_timeout
            if phase == _IDLE
            else limits.header_timeout
            if phase == _HEAD
            else limits.body_timeout
        )
        if timeout <= 0:
            return
        at = now + timeout
        if self._timer is not None:
            if self._timer_at <= at:
                return  # fires first and re-arms for what is then due
            self._timer.cancel()
        self._timer_at = at
        self._timer = self._loop.call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self.transport is None or self._phase == _BUSY:
            return
        limits = self._limits
        timeout = (
            limits.keepalive_timeout
            if self._phase == _IDLE
            else limits.header_timeout
            if self._phase == _HEAD
            else limits.body_timeout
        )
        if timeout <= 0:
            return
        due = self._since + timeout
        if due > self._loop.time():
            self._timer_at = due
            self._timer = self._loop.call_at(due, self._on_timer)
            return
        if self._phase == _HEAD:
            limits.header_timeouts += 1
            log.debug("closing a connection whose request head took over %.0f s", limits.header_timeout)
        elif self._phase == _BODY:
            limits.body_timeouts += 1
            log.debug("closing a connection whose request body took over %.0f s", limits.body_timeout)
        self._abort() if self._phase != _IDLE else self.transport.close()

    # -- what ServerLimits and aiohttp's Server call --
    def evict(self) -> None:
        log.debug("closing an idle connection for a new one (--max-connections %d)", self._limits.max_connections)
        self._abort()

    def close(self) -> None:
        """Shutdown begins: finish the request in progress, take no other."""
        self._closing = True
        if self._task is None and self.transport is not None:
            self.transport.close()

    async def shutdown(self, timeout: float | None = None) -> None:
        self._closing = True
        task = self._task
        if task is not None and not task.done():
            try:
                await asyncio.wait({task}, timeout=timeout)
            finally:
                if not task.done():
                    task.cancel()
        if self.transport is not None:
            self.transport.close()


class FastReplyWriter:
    """Writes an inference reply straight to the connection's transport (HTTP/1.1; a stream as
    chunked transfer coding, as aiohttp sends it)."""

    __slots__ = ("close", "conn", "sent", "started", "status")

    def __init__(self, conn: FastConnection) -> None:
        self.conn = conn
        self.started = False
        self.close = False
        self.status: int | None = None  # of the reply written (the tenant's count, the access log)
        self.sent = 0  # bytes written, head included (the access log's %b, as aiohttp counts it)

    def _head(self, status: int, headers: dict[str, str], framing: bytes) -> bytearray:
        out = bytearray(b"HTTP/1.1 %d %s\r\n" % (status, _reason(status).encode("ascii")))
        for name, value in headers.items():
            out += b"%s: %s\r\n" % (name.encode("ascii"), _safe_header(value).encode("utf-8"))
        out += b"Date: %s\r\n%s" % (self.conn._date.value(), framing)
        if self.close or self.conn._closing:
            out += b"Connection: close\r\n"
        out += b"\r\n"
        return out

    def unary(self, status: int, body: bytes | None, headers: dict[str, str], content_type: str) -> None:
        body = body or b""
        self.status = status
        transport = self.conn.transport
        if transport is None:
            return
        out = self._head(
            status,
            headers,
            b"Content-Type: %s\r\nContent-Length: %d\r\n" % (_safe_header(content_type).encode("utf-8"), len(body)),
        )
        out += body
        self.sent += len(out)
        transport.write(out)

    async def open_stream(self, headers: dict[str, str]) -> None:
        out = self._head(200, headers, b"Transfer-Encoding: chunked\r\n")
        self.started = True
        self.status = 200
        await self._send(out)

    async def write(self, chunk: bytes) -> None:
        if chunk:
            await self._send(b"%x\r\n%s\r\n" % (len(chunk), chunk))

    async def end_stream(self) -> None:
        await self._send(b"0\r\n\r\n")

    async def _send(self, data: bytes | bytearray) -> None:
        conn = self.conn
        transport = conn.transport
        if transport is None:
            raise ConnectionResetError("the client disconnected")
        self.sent += len(data)
        transport.write(data)
        if conn._write_paused:
            if conn._drain is None:
                conn._drain = conn._loop.create_future()
            await conn._drain


__all__ = ["FastConnection", "FastReplyWriter", "FastRequest", "HttpDate", "fast_front", "parse_head"]


def fast_front(
    app: Any, limits: ServerLimits, access_log: logging.Logger | None = None
) -> Callable[[Any], asyncio.Protocol]:
    """The protocol factory for ``LimitedAppRunner(front=...)``: a fast-path connection that hands
    itself to ``server``'s aiohttp protocol when a request is not the plain case. ``access_log``:
    the logger aiohttp's path writes ``--access-log`` to, written in aiohttp's own format."""
    date = HttpDate()
    access = AccessLogger(access_log, AccessLogger.LOG_FORMAT) if access_log is not None else None

    def front(server: Any) -> asyncio.Protocol:
        return FastConnection(app, server, limits, server.aiohttp_protocol, date, access)

    return front
