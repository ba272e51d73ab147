"""A lean core-NATS client for the request hot path: publish, subscribe, flush, reconnect.

Requests over NATS are many small messages (a stream is one per SSE chunk), and nats-py spends
more per message than the HTTP path it replaces: a pure-Python parser building a ``Msg`` per
message, a queue and a task switch per subscription delivery, and a flusher-task wake-up per
publish. Measured with ``bench/router_overhead.py --request-transport both`` that kept NATS at
0.59-0.64x HTTP's throughput. This client speaks the same text protocol
(https://docs.nats.io/reference/reference-protocols/nats-protocol) with none of that: an
``asyncio.Protocol`` parses ``MSG``/``HMSG`` straight out of the read buffer and calls the
subscription's callback synchronously with ``bytes``; publishes are appended to one output buffer
written once per loop iteration. It covers what the request transport needs (no JetStream: KV
events and replica sync keep nats-py, on their own connection). The NATS team's own lean client,
``nats-core``, needs Python >= 3.13.

Connection behaviour matches what ``NatsConnection`` gives nats-py: the first connect is retried
in the background forever; after a loss it reconnects forever, cycling through the servers, and
re-subscribes; listeners hear ``disconnected``/``reconnected``; PINGs every ``ping_interval``
detect a dead peer (``max_outstanding_pings`` unanswered: the connection is dropped). Credentials
in the URL (``nats://user:pass@host``, ``nats://token@host``) and TLS (``tls://`` or a server that
requires it) work as in nats-py, and so do the process's ``NatsAuth`` (user/password or token, a
.creds file or NKey seed signing the server's nonce, TLS with a custom CA and a client certificate).
No log line or error message carries a password or token.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import os
import ssl
from typing import Awaitable, Callable
from urllib.parse import unquote, urlsplit

from infera.runtime import cancel_and_wait, wait_for
from infera.transport.nats_auth import NatsAuth, redact, redact_url

log = logging.getLogger(__name__)

# (subject, reply, payload, status): status is the header block's status code (503 "no
# responders"), 0 when the message has no headers.
MsgCallback = Callable[[bytes, bytes, bytes, int], None]
Listener = Callable[[], "Awaitable[None] | None"]

_CRLF = b"\r\n"
_DEFAULT_MAX_PAYLOAD = 1024 * 1024
# A server line longer than this without CRLF is a broken peer, not a message.
_MAX_CONTROL_LINE = 64 * 1024
# Above this many bytes in the output buffer a publisher waits (``drain``) for the socket.
_HIGH_WATER = 8 * 1024 * 1024


class NatsError(ConnectionError):
    """Not connected, or the server refused us."""


class _Server:
    __slots__ = ("host", "port", "tls", "user", "password", "token", "netloc")

    def __init__(self, url: str) -> None:
        if "://" not in url:
            url = "nats://" + url
        u = urlsplit(url)
        if u.scheme not in ("nats", "tls"):
            raise ValueError(f"unsupported NATS URL scheme {u.scheme!r} in {redact_url(url)!r} (nats:// or tls://)")
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 4222
        self.tls = u.scheme == "tls"
        self.user = self.password = self.token = None
        if u.username and u.password is not None:
            self.user, self.password = unquote(u.username), unquote(u.password)
        elif u.username:
            self.token = unquote(u.username)
        self.netloc = f"{self.host}:{self.port}"


class _Protocol(asyncio.Protocol):
    """Parses the server's stream; one per TCP connection."""

    def __init__(self, client: "NatsCoreClient") -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.info: asyncio.Future = asyncio.get_running_loop().create_future()
        self.lost: asyncio.Future = asyncio.get_running_loop().create_future()
        self.paused = False
        self.resumed: asyncio.Future | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def connection_lost(self, exc) -> None:  # type: ignore[override]
        if not self.lost.done():
            self.lost.set_result(exc)
        if not self.info.done():
            self.info.set_exception(exc or ConnectionResetError("connection closed"))
            self.info.exception()
        self._resume()
        self.client._lost(self, exc)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self._resume()

    def _resume(self) -> None:
        self.paused = False
        if self.resumed is not None and not self.resumed.done():
            self.resumed.set_result(None)
        self.resumed = None

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos = 0
        end = len(buf)
        client = self.client
        subs = client._subs
        try:
            while pos < end:
                eol = buf.find(_CRLF, pos)
                if eol < 0:
                    if end - pos > _MAX_CONTROL_LINE:
                        raise ValueError("control line too long")
                    break
                op = buf[pos:pos + 4]
                if op == b"MSG ":
                    # MSG <subject> <sid> [reply] <#bytes>
                    parts = buf[pos + 4:eol].split()
                    size = int(parts[-1])
                    start = eol + 2
                    if start + size + 2 > end:
                        break  # the payload is not all here yet
                    pos = start + size + 2
                    sub = subs.get(parts[1])
                    if sub is not None:
                        try:
                            sub(parts[0], parts[2] if len(parts) == 4 else b"", buf[start:start + size], 0)
                        except Exception:  # the subscriber's bug: the connection is fine
                            log.exception("NATS message callback failed")
                elif op == b"HMSG":
                    # HMSG <subject> <sid> [reply] <#header bytes> <#total bytes>
                    parts = buf[pos + 5:eol].split()
                    hsize, size = int(parts[-2]), int(parts[-1])
                    start = eol + 2
                    if start + size + 2 > end:
                        break
                    sub = subs.get(parts[1])
                    if sub is not None:
                        head = buf[start:start + hsize]
                        status = 0
                        # "NATS/1.0 503\r\n..." (a status line with no headers: no responders)
                        first = head[:head.find(_CRLF)] if _CRLF in head else head
                        fields = first.split()
                        if len(fields) > 1 and fields[1].isdigit():
                            status = int(fields[1])
                        try:
                            sub(parts[0], parts[2] if len(parts) == 5 else b"", buf[start + hsize:start + size], status)
                        except Exception:
                            log.exception("NATS message callback failed")
                    pos = start + size + 2
                else:
                    line = buf[pos:eol]
                    pos = eol + 2
                    self._control(line)
        except Exception as exc:  # a protocol error: drop the connection
            log.error("NATS protocol error, reconnecting: %r", exc)
            self.buf = b""
            if self.transport is not None:
                self.transport.abort()
            return
        self.buf = buf[pos:] if pos < end else b""

    def _control(self, line: bytes) -> None:
        if line == b"PING":
            self.transport.write(b"PONG\r\n")
        elif line == b"PONG":
            self.client._pong()
        elif line.startswith(b"INFO "):
            info = json.loads(line[5:])
            if not self.info.done():
                self.info.set_result(info)
            else:
                self.client._update_info(info)
        elif line.startswith(b"-ERR"):
            self.client._server_error(line[4:].strip().strip(b"'").decode("utf-8", "replace"))
        # +OK: only in verbose mode, which we do not ask for


class ConnectionEvents:
    """What a NATS connection tells its users: the first connect can be awaited, and listeners
    hear of a loss and of the connection coming back (shared by this client and nats-py's)."""

    def _init_events(self) -> None:
        self._connected = asyncio.Event()
        self._on_disconnect: list[Listener] = []
        self._on_reconnect: list[Listener] = []

    async def wait_connected(self, timeout: float | None = None) -> bool:
        try:
            await wait_for(self._connected.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def on_disconnect(self, listener: Listener) -> None:
        self._on_disconnect.append(listener)

    def on_reconnect(self, listener: Listener) -> None:
        self._on_reconnect.append(listener)

    async def _fire(self, listeners: list[Listener]) -> None:
        for listener in listeners:
            try:
                result = listener()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("NATS connection listener failed")


class NatsCoreClient(ConnectionEvents):
    def __init__(self, servers: str | list[str], *, name: str = "infera", reconnect_wait: float = 0.5,
                 connect_timeout: float = 2.0, ping_interval: float = 5.0, max_outstanding_pings: int = 2,
                 auth: NatsAuth | None = None) -> None:
        urls = servers.split(",") if isinstance(servers, str) else servers
        self.servers = [_Server(s.strip()) for s in urls if s.strip()]
        if not self.servers:
            raise ValueError("no NATS server given")
        self.auth = auth or NatsAuth()
        self._secrets = self.auth.secrets + tuple(x for s in self.servers for x in (s.password, s.token) if x)
        self.name = name
        self.reconnect_wait = reconnect_wait
        self.connect_timeout = connect_timeout
        self.ping_interval = ping_interval
        self.max_outstanding_pings = max_outstanding_pings
        self.max_payload = _DEFAULT_MAX_PAYLOAD
        self.connected_url: str | None = None
        self.disconnects = 0
        self._proto: _Protocol | None = None
        self._init_events()
        self._subs: dict[bytes, MsgCallback] = {}
        self._sub_lines: dict[bytes, bytes] = {}  # sid → the SUB line, re-sent on reconnect
        self._sids = itertools.count(1)
        self._out: list[bytes] = []
        self._out_bytes = 0
        self._flush_scheduled = False
        self._pongs: collections.deque[asyncio.Future | None] = collections.deque()
        self._pings_out = 0
        self._task: asyncio.Task | None = None
        self._ping_timer: asyncio.TimerHandle | None = None
        self._closing = False
        self._ever_connected = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox_prefix = b"_INBOX." + os.urandom(11).hex().encode()

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self.begin()

    def begin(self) -> None:
        """Returns at once: the connection comes up (and comes back) in the background."""
        if self._task is None and not self._closing:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.ensure_future(self._run())

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    async def close(self) -> None:
        self._closing = True
        await cancel_and_wait(self._task)
        self._task = None
        proto = self._proto
        if proto is not None and proto.transport is not None:
            self._write_out()
            proto.transport.close()
        self._connected.clear()

    # -- messaging ----------------------------------------------------------------------------
    def new_inbox(self) -> bytes:
        return self._inbox_prefix + b"." + os.urandom(6).hex().encode()

    def publish(self, subject: bytes, data: bytes, reply: bytes = b"") -> None:
        """Queue one message; it is written with everything else published in this loop
        iteration. Raises ``NatsError`` when not connected (nothing is buffered across a loss:
        the callers fail over or fail the request instead)."""
        if not self._connected.is_set():
            raise NatsError("NATS is not connected")
        if reply:
            self._out.append(b"PUB %s %s %d\r\n%s\r\n" % (subject, reply, len(data), data))
        else:
            self._out.append(b"PUB %s %d\r\n%s\r\n" % (subject, len(data), data))
        self._out_bytes += len(data) + 64
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._write_out)

    @property
    def congested(self) -> bool:
        proto = self._proto
        return self._out_bytes > _HIGH_WATER or (proto is not None and proto.paused)

    async def drain(self) -> None:
        """Wait until the socket takes writes again (for publishers of long streams)."""
        if self._out_bytes > _HIGH_WATER:
            self._write_out()
        proto = self._proto
        if proto is not None and proto.paused:
            if proto.resumed is None:
                proto.resumed = self._loop.create_future()
            await proto.resumed

    def subscribe(self, subject: str | bytes, callback: MsgCallback) -> bytes:
        """Subscribe (restored on reconnect); returns the sid. The callback runs synchronously
        in the read path: it must not block."""
        subj = subject.encode() if isinstance(subject, str) else subject
        sid = str(next(self._sids)).encode()
        self._subs[sid] = callback
        line = b"SUB %s %s\r\n" % (subj, sid)
        self._sub_lines[sid] = line
        if self._connected.is_set():
            self._queue(line)
        return sid

    def unsubscribe(self, sid: bytes) -> None:
        self._subs.pop(sid, None)
        if self._sub_lines.pop(sid, None) is not None and self._connected.is_set():
            self._queue(b"UNSUB %s\r\n" % sid)

    async def flush(self, timeout: float = 5.0) -> None:
        """Round trip to the server: everything sent before has been processed there."""
        if not self._connected.is_set():
            raise NatsError("NATS is not connected")
        fut = self._loop.create_future()
        self._pongs.append(fut)
        self._queue(b"PING\r\n")
        await wait_for(fut, timeout)

    # -- internals ----------------------------------------------------------------------------
    def _queue(self, line: bytes) -> None:
        self._out.append(line)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._write_out)

    def _write_out(self) -> None:
        self._flush_scheduled = False
        out = self._out
        if not out:
            return
        self._out = []
        self._out_bytes = 0
        proto = self._proto
        if proto is None or proto.transport is None or proto.transport.is_closing():
            return  # lost meanwhile: the callers hear of it through the disconnect listeners
        proto.transport.write(out[0] if len(out) == 1 else b"".join(out))

    async def _run(self) -> None:
        warned = False
        index = 0
        while not self._closing:
            server = self.servers[index % len(self.servers)]
            index += 1
            try:
                proto = await wait_for(self._connect(server), self.connect_timeout)
            except Exception as exc:
                if not warned:
                    log.warning("cannot reach NATS at %s (%s); retrying every %.1fs",
                                ",".join(s.netloc for s in self.servers),
                                redact(str(exc), self._secrets) or type(exc).__name__, self.reconnect_wait)
                    warned = True
                await asyncio.sleep(self.reconnect_wait)
                continue
            warned = False
            reconnected = self._ever_connected
            self._ever_connected = True
            self.connected_url = server.netloc
            self._connected.set()
            self._arm_ping()
            log.info("NATS request connection %s to %s", "restored" if reconnected else "up", server.netloc)
            if reconnected:
                await self._fire(self._on_reconnect)
            await asyncio.shield(proto.lost)
            if self._closing:
                return
            await asyncio.sleep(self.reconnect_wait if len(self.servers) == 1 else 0)

    async def _connect(self, server: _Server) -> _Protocol:
        loop = asyncio.get_running_loop()
        transport, proto = await loop.create_connection(lambda: _Protocol(self), server.host, server.port)
        try:
            info = await proto.info
            self.max_payload = int(info.get("max_payload") or _DEFAULT_MAX_PAYLOAD)
            auth = self.auth
            if server.tls or info.get("tls_required") or auth.tls_enabled:
                ctx = auth.ssl_context() if auth.tls_enabled else ssl.create_default_context()
                transport = await loop.start_tls(transport, proto, ctx, server_hostname=server.host)
                proto.transport = transport
            connect = {"verbose": False, "pedantic": False, "lang": "python3", "version": "infera",
                       "protocol": 1, "headers": True, "no_responders": True, "name": self.name}
            if server.user is not None:
                connect.update(user=server.user, **{"pass": server.password})
            elif server.token is not None:
                connect["auth_token"] = server.token
            elif auth.user is not None:
                connect.update(user=auth.user, **{"pass": auth.password})
            elif auth.token is not None:
                connect["auth_token"] = auth.token
            if info.get("nonce") is not None:
                connect.update(auth.sign_nonce(info["nonce"]))
            pong = loop.create_future()
            self._pongs.clear()
            self._pongs.append(pong)
            self._pings_out = 0
            self._proto = proto
            transport.write(b"CONNECT " + json.dumps(connect).encode() + b"\r\n"
                            + b"".join(self._sub_lines.values()) + b"PING\r\n")
            await pong  # the server accepted CONNECT (an auth failure is an -ERR and a close)
            return proto
        except BaseException:
            if self._proto is proto:
                self._proto = None
            transport.abort()
            raise

    def _lost(self, proto: _Protocol, exc) -> None:
        if proto is not self._proto:
            return
        self._proto = None
        self._out = []
        self._out_bytes = 0
        if self._ping_timer is not None:
            self._ping_timer.cancel()
            self._ping_timer = None
        for fut in self._pongs:
            if fut is not None and not fut.done():
                fut.set_exception(NatsError("NATS connection lost"))
                fut.exception()
        self._pongs.clear()
        if not self._connected.is_set():
            return  # never got through the handshake: _connect raises
        self._connected.clear()
        if self._closing:
            return
        self.disconnects += 1
        log.warning("NATS request connection lost (%s); reconnecting", exc or "closed")
        asyncio.ensure_future(self._fire(self._on_disconnect))

    def _pong(self) -> None:
        self._pings_out = 0
        if self._pongs:
            fut = self._pongs.popleft()
            if fut is not None and not fut.done():
                fut.set_result(None)

    def _arm_ping(self) -> None:
        if self.ping_interval > 0:
            self._ping_timer = self._loop.call_later(self.ping_interval, self._ping)

    def _ping(self) -> None:
        self._ping_timer = None
        proto = self._proto
        if proto is None or not self._connected.is_set():
            return
        if self._pings_out >= self.max_outstanding_pings:
            log.warning("NATS server %s stopped answering PINGs; dropping the connection", self.connected_url)
            proto.transport.abort()
            return
        self._pings_out += 1
        self._pongs.append(None)
        self._queue(b"PING\r\n")
        self._arm_ping()

    def _update_info(self, info: dict) -> None:
        if info.get("max_payload"):
            self.max_payload = int(info["max_payload"])

    def _server_error(self, message: str) -> None:
        # Authorization and protocol errors are followed by the server closing the connection.
        log.error("NATS server %s: %s", self.connected_url, redact(message, self._secrets))
