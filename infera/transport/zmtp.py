"""A ZeroMQ SUB socket on an asyncio Protocol: the ZMTP 3.0 wire protocol (RFC 23), spoken to an
engine's real libzmq PUB (vLLM, SGLang, ATOM and the simulator publish KV events through pyzmq).

Why not pyzmq's SUB: on this path libzmq costs the router ~100-150 us of CPU per KV-event batch
(bench/kv_path.py, "zmq"): every message crosses from libzmq's I/O thread to the caller's through
a mailbox (an eventfd write and read, a poll, a getpid per API call) and the caller's loop re-arms
the socket's FD (epoll_ctl), about twenty syscalls a batch, which at ~4 batches a request was the
largest part of kv-aware routing's CPU. Here the frames are parsed straight out of the TCP reads on
the event loop: no thread, no mailbox, several batches per read when they arrive together.

What it speaks, as a SUB peer announcing ZMTP 3.0 with the NULL mechanism (what every engine's
PUB uses): the greeting, the READY command with ``Socket-Type: SUB``, the subscription as a message
(``0x01`` + topic, the 3.0 form libzmq's PUB accepts from 3.0 and 3.1 peers alike), then messages of
one or more frames (short or long), delivered whole. A PING command is answered with PONG. A peer
that is not a ZMTP 3.x PUB/XPUB, wants another security mechanism, sends an ERROR, breaks the
framing or sends a frame or a message over its cap (``DEFAULT_MAX_*``, checked at the frame's
header) is dropped, with one log line. A message arriving in many reads is scanned once: each read
resumes where the last one stopped. Like a libzmq SUB it reconnects by itself, forever, after
``reconnect_s`` doubling up to ``reconnect_max_s``; what was published meanwhile is lost, which the
caller's sequence tracking sees as a gap (``infera.transport.kv_events_zmq``).

Endpoints: ``tcp://host:port`` (an IPv6 host in brackets) and ``ipc://path``.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

from infera.kv.native import native
from infera.runtime import wait_for

log = logging.getLogger("infera.transport.zmtp")

# Our greeting: signature, version 3.0, mechanism NULL, as-server 0, filler (64 bytes).
GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
_GREETING_LEN = 64
_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04
DEFAULT_MAX_FRAME_BYTES = 64 << 20  # a KV-event batch is kilobytes: anything near this is a broken stream
# A whole message (its frames' payloads together) is bounded the same, and so is its number of frames
# (an engine's KV-event message has 1 to 3): a publisher that never ends a message (MORE on every
# frame) would otherwise grow the read buffer without limit. Many tiny frames would also cost a
# Python bytes object each (tens of bytes for 2 to 4 on the wire) when the message completes.
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
DEFAULT_MAX_MESSAGE_FRAMES = 4096
# Frames are parsed for at most this long per loop turn: a burst of queued batches cannot hold the loop.
_TURN_S = 0.002

OnMessage = Callable[[list[bytes]], None]


class ZmtpError(Exception):
    """The peer broke the protocol (or asked for what this client does not speak)."""


def command(name: bytes, properties: dict[bytes, bytes] | None = None) -> bytes:
    """A ZMTP command frame: name (short string) then properties (short name, 4-byte value size)."""
    body = bytes([len(name)]) + name
    for key, value in (properties or {}).items():
        body += bytes([len(key)]) + key + len(value).to_bytes(4, "big") + value
    return _frame_header(_COMMAND, len(body)) + body


def message_frame(body: bytes, more: bool = False) -> bytes:
    return _frame_header(_MORE if more else 0, len(body)) + body


def _frame_header(flags: int, size: int) -> bytes:
    if size < 256:
        return bytes([flags, size])
    return bytes([flags | _LONG]) + size.to_bytes(8, "big")


def split(buf: bytes | bytearray, start: int, max_frame: int, max_message: int, max_frames: int,
          partial: tuple[int, int, int, int] | None = None) -> tuple[list, list[int], str | None, tuple | None]:
    """The complete items of a frame stream from ``start``: a message as the list of its frames, a
    command as its body (bytes), in order, and the offset after each. An incomplete frame, or a
    message whose last frame has not arrived, ends the scan.

    The third value is None, or why the stream is broken where the scan stopped, decided at the
    frame's header (before its body arrives): a frame over ``max_frame`` bytes, a command among a
    message's frames, a message of more than ``max_frames`` frames or ``max_message`` payload
    bytes. The items before it are whole.

    The fourth: when the scan stopped inside a message that has whole frames already, ``(message
    start, scan offset, frames, payload bytes)``, else None. Passed back as ``partial`` with the
    next call (the same buffer grown, its offsets shifted by what the caller dropped from the
    front), the scan of that message resumes where it stopped: each frame header is read once
    (plus once more to collect the frames when the message completes), however many reads the
    message takes. Rescanning it from its start on every read was quadratic in a message that
    never ends. (The C accelerator's ``zmtp_split`` where it is built, the same in every output
    and verdict: tests/unit/test_zmtp.py and test_fuzz_zmtp.py run both.)"""
    global _headers_read
    n = len(buf)
    if not 0 <= start <= n:
        raise ValueError("start out of range")
    ms = -1
    if partial is not None:
        if type(partial) is not tuple or len(partial) != 4:
            raise TypeError("partial must be None or a 4-tuple")
        ms, mscan, mframes, mtotal = partial
        if not (0 <= ms <= mscan <= n and mframes >= 1 and 0 <= mtotal <= mscan - ms):
            raise ValueError("bad partial state")
    items: list = []
    ends: list[int] = []
    pos, headers, error, out = start, 0, None, None
    while True:
        q, nframes, total, item = pos, 0, 0, None
        if pos == ms:  # the message the last call left incomplete: on from where its scan stopped
            q, nframes, total = mscan, mframes, mtotal
        while q + 2 <= n:
            flags = buf[q]
            if flags & _LONG:
                if q + 9 > n:
                    break
                size, hdr = int.from_bytes(buf[q + 1:q + 9], "big"), 9
            else:
                size, hdr = buf[q + 1], 2
            headers += 1
            if size > max_frame:
                error = f"a frame of {size} bytes (the limit is {max_frame})"
                break
            if flags & _COMMAND:
                if nframes:
                    error = "a command among a message's frames"
                    break
            elif nframes >= max_frames:
                error = f"a message of more than {max_frames} frames"
                break
            elif size > max_message - total:
                error = f"a message of more than {max_message} bytes"
                break
            if n - q - hdr < size:
                break
            q += hdr + size
            nframes += 1
            total += size
            if flags & _COMMAND:
                item = bytes(buf[q - size:q])
                break
            if not flags & _MORE:
                item, headers = _frames(buf, pos, nframes, headers)
                break
        if item is None:  # broken, or the item is not all here yet
            if error is None and nframes:
                out = (pos, q, nframes, total)
            break
        items.append(item)
        ends.append(q)
        pos = q
    _headers_read += headers
    return items, ends, error, out


def _frames(buf: bytes | bytearray, q: int, nframes: int, headers: int) -> tuple[list[bytes], int]:
    """The frames of a message of ``nframes`` frames at ``q`` (scanned, so whole; the bounds are
    checked all the same, ``q`` may come from a caller's partial state), and ``headers`` counted on."""
    n, frames = len(buf), []
    for _ in range(nframes):
        if q + 2 > n:
            raise ValueError("bad partial state")
        if buf[q] & _LONG:
            if q + 9 > n:
                raise ValueError("bad partial state")
            size, hdr = int.from_bytes(buf[q + 1:q + 9], "big"), 9
        else:
            size, hdr = buf[q + 1], 2
        headers += 1
        if n - q - hdr < size:
            raise ValueError("bad partial state")
        frames.append(bytes(buf[q + hdr:q + hdr + size]))
        q += hdr + size
    return frames, headers


_headers_read = 0  # frame headers ``split`` has read (the C twin: native.zmtp_headers_read()): a work counter


def headers_read() -> int:
    """Frame headers the active splitter has read so far: what the tests count to show that a
    message arriving in many reads is scanned once (not a wall-clock bound)."""
    return native.zmtp_headers_read() if _split is not split else _headers_read


_split = native.zmtp_split if native is not None else split


def parse_properties(data: bytes) -> dict[bytes, bytes]:
    """The properties of a READY command (after its name)."""
    props, pos = {}, 0
    while pos < len(data):
        n = data[pos]
        name = data[pos + 1:pos + 1 + n]
        pos += 1 + n
        if pos + 4 > len(data):
            raise ZmtpError("truncated READY property")
        size = int.from_bytes(data[pos:pos + 4], "big")
        pos += 4
        if pos + size > len(data):
            raise ZmtpError("truncated READY property value")
        props[name.lower()] = data[pos:pos + size]
        pos += size
    return props


def _peer_text(data: bytes, limit: int = 40) -> str:
    """What the peer said (a mechanism, a socket type, an ERROR reason) fit for a log line: at most
    ``limit`` characters, non-ASCII and control characters escaped (no newline can split the line)."""
    text = ascii(data[:limit].decode("utf-8", "replace"))[1:-1]
    return text[:limit] + "..." if len(data) > limit or len(text) > limit else text


def parse_endpoint(endpoint: str) -> tuple[str, str, int]:
    """``("tcp", host, port)`` or ``("ipc", path, 0)``; ValueError for anything else."""
    if endpoint.startswith("tcp://"):
        rest = endpoint[len("tcp://"):]
        host, sep, port = rest.rpartition(":")
        if not sep or not port.isdigit() or not host or ";" in host:
            raise ValueError(f"not a tcp://host:port endpoint: {endpoint!r}")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        return "tcp", host, int(port)
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return "ipc", endpoint[len("ipc://"):], 0
    raise ValueError(f"unsupported ZMQ endpoint {endpoint!r} (tcp://host:port or ipc://path)")


class ZmtpSubProtocol(asyncio.Protocol):
    """One connection: handshake, subscription, frames -> whole messages for ``on_message``.

    ``pause()``/``resume()`` stop and restart delivery (and reading): what is buffered is kept and
    delivered, in order, on resume."""

    def __init__(self, topic: bytes, on_message: OnMessage, on_ready: Callable[[], None],
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 max_message_frames: int = DEFAULT_MAX_MESSAGE_FRAMES) -> None:
        self.topic = topic
        self.on_message = on_message
        self.on_ready = on_ready
        self.max_frame_bytes = max_frame_bytes
        self.max_message_bytes = max_message_bytes
        self.max_message_frames = max_message_frames
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()  # what a read left unparsed (an incomplete frame, a pause)
        # the splitter's state of the incomplete message in _buf (offsets into it), or None: the
        # next read's scan resumes there instead of reading the message's frames again
        self._partial: tuple[int, int, int, int] | None = None
        self._greeted = False
        self._ready = False
        self._paused = False
        self._reading = True
        self._continue: asyncio.Handle | None = None
        self.closed = asyncio.get_running_loop().create_future()  # set with the reason when the connection ends
        self.messages = 0

    # -- asyncio.Protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(GREETING)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if self.closed.done():  # dropped: what a transport still hands over is not parsed
            return
        if self._buf:
            self._buf += data
            self._consume_buffer()
            return
        taken = self._consume(data)  # the common case: parsed from the read itself, no copy first
        if taken < len(data) and not self.closed.done():
            self._buf = bytearray(data[taken:] if taken else data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._continue is not None:
            self._continue.cancel()
        if not self.closed.done():
            if not self._greeted:
                # libzmq closes on a mechanism mismatch without a word (the rest of its greeting
                # is never sent): the likeliest reason a listening PUB hangs up here
                exc = ZmtpError("the publisher closed the connection during the ZMTP handshake (does it "
                                "require CURVE or PLAIN security? only NULL is supported)")
            self.closed.set_result(exc)

    # -- flow --------------------------------------------------------------------------------------
    def pause(self) -> None:
        """Deliver nothing more until ``resume`` (the kernel buffers, then the publisher). The
        handshake goes on while paused: the subscription must be in place meanwhile, or the
        publisher drops what it publishes during the caller's wait (a first-contact replay)."""
        self._paused = True
        if self._ready:
            self._set_reading(False)

    def resume(self) -> None:
        self._paused = False
        self._set_reading(True)
        if self._buf and self.transport is not None and not self.transport.is_closing():
            self._consume_buffer()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _set_reading(self, on: bool) -> None:
        if on == self._reading or self.transport is None or self.transport.is_closing():
            return
        self._reading = on
        if on:
            self.transport.resume_reading()
        else:
            self.transport.pause_reading()

    def _fail(self, why: str) -> None:
        if not self.closed.done():
            self.closed.set_result(ZmtpError(why))
        if self.transport is not None:
            self.transport.abort()

    # -- parsing -----------------------------------------------------------------------------------
    def _consume_buffer(self) -> None:
        taken = self._consume(self._buf)
        if taken:
            del self._buf[:taken]

    def _consume(self, buf: bytes | bytearray) -> int:
        """Parse and deliver what ``buf`` holds; returns how many bytes were taken (the rest waits:
        an incomplete frame, a pause, the end of this loop turn's budget). The caller drops them
        from the front of what it keeps: the partial message's offsets move with them."""
        taken = self._parse(buf)
        if taken and self._partial is not None:
            start, scan, frames, size = self._partial
            self._partial = (start - taken, scan - taken, frames, size)
        return taken

    def _parse(self, buf: bytes | bytearray) -> int:
        pos = 0
        if not self._greeted:
            if len(buf) < _GREETING_LEN:
                if len(buf) >= 1 and buf[0] != 0xFF:
                    self._fail("not a ZMTP peer (bad signature)")
                return 0
            self._check_greeting(bytes(buf[:_GREETING_LEN]))
            if self.closed.done():
                return 0
            pos = _GREETING_LEN
            self._greeted = True
            self.transport.write(command(b"READY", {b"Socket-Type": b"SUB"}))  # type: ignore[union-attr]
        if self._paused and self._ready:  # paused (the handshake's commands are read all the same)
            return pos
        turn_ends = time.perf_counter() + _TURN_S
        # every complete item in buf at once; the incomplete message after them (if any) leaves its
        # scan state for the next read (kept also when delivery stops early: that message lies after
        # every item, and the next scan reaches it at the same offset)
        items, ends, broken, self._partial = _split(buf, pos, self.max_frame_bytes, self.max_message_bytes,
                                                    self.max_message_frames, self._partial)
        for i, item in enumerate(items):
            if type(item) is bytes:  # a command
                self._command(item)
                if self.closed.done() or (self._paused and self._ready):
                    return ends[i]  # closed, or the handshake completed while paused: the rest waits
                continue
            if not self._ready:
                self._fail("a message before the handshake completed")
                return ends[i]
            self.messages += 1
            self.on_message(item)
            if self._paused:
                return ends[i]
            if i % 16 == 15 and time.perf_counter() >= turn_ends and i + 1 < len(items):
                # a long burst: the loop gets a turn, then the rest is parsed
                self._set_reading(False)
                self._continue = asyncio.get_running_loop().call_soon(self._resume_parse)
                return ends[i]
        if broken is not None:  # one reason, no content of the stream (sizes and limits only)
            self._fail(broken)
        return ends[-1] if ends else pos

    def _resume_parse(self) -> None:
        self._continue = None
        if self.transport is None or self.transport.is_closing():
            return
        if not self._paused:
            self._set_reading(True)
            if self._buf:
                self._consume_buffer()

    def _check_greeting(self, g: bytes) -> None:
        if g[0] != 0xFF or not g[9] & 0x01:
            self._fail("not a ZMTP peer (bad signature)")
        elif g[10] < 3:
            self._fail(f"ZMTP {g[10]}.{g[11]} peer (3.0 or newer needed)")
        elif g[12:32].rstrip(b"\x00") != b"NULL":
            self._fail(f"the publisher wants the {_peer_text(g[12:32].rstrip(bytes(1)))} "
                       "security mechanism; only NULL is supported")

    def _command(self, body: bytes) -> None:
        if not body:
            self._fail("an empty command")
            return
        name = body[1:1 + body[0]]
        rest = body[1 + body[0]:]
        if name == b"READY":
            if self._ready:  # the handshake's, once: a repeat (no libzmq peer sends one) changes nothing
                return
            try:
                props = parse_properties(rest) if rest else {}
            except ZmtpError as exc:  # a broken READY drops the peer, like any broken framing
                self._fail(str(exc))
                return
            socket_type = props.get(b"socket-type", b"")
            if socket_type not in (b"PUB", b"XPUB"):
                self._fail(f"the peer is a {_peer_text(socket_type) or '?'} socket, not a PUB")
                return
            self._ready = True
            self.transport.write(message_frame(b"\x01" + self.topic))  # type: ignore[union-attr]
            if self._paused:
                self._set_reading(False)  # subscribed; nothing more is read until resume
            self.on_ready()
        elif not self._ready and name != b"ERROR":
            # As libzmq's NULL mechanism: the handshake is READY (or ERROR); any other command
            # before it is a protocol error (a PING answered then put our PONG before the
            # subscription)
            self._fail(f"a {_peer_text(name) or '?'} command before the handshake completed")
        elif name == b"PING":  # ZMTP 3.1 heartbeat: TTL (2 bytes) + context (at most 16 bytes), echoed in PONG
            context = rest[2:18]  # as libzmq: no more is echoed, whatever the peer sent
            self.transport.write(_frame_header(_COMMAND, 5 + len(context)) + b"\x04PONG" + context)  # type: ignore[union-attr]
        elif name == b"ERROR":
            self._fail(f"the publisher sent ERROR: {_peer_text(rest[1:1 + rest[0]], 100) if rest else ''}")
        # other commands (PONG, SUBSCRIBE echoes of a 3.1 peer...) are not ours to act on


class ZmtpSubscription:
    """A SUB to one endpoint that keeps itself connected, like a libzmq SUB: ``on_message`` gets
    each message's frames, in order; ``on_connect`` is called after each handshake (a new
    connection may have missed messages). ``pause``/``resume`` hold delivery (the caller is busy:
    a replay, a gap) without losing what is already read.

    A task runs only while a connection is being made; a live connection is followed by a callback
    on its ``closed`` future, and a retry waits on a timer. A fleet's server holds one of these per
    engine, all connected nearly all the time: a task parked on each connection (its frame and its
    entry in the loop's task set) was ~1 KB a worker for nothing."""

    def __init__(self, endpoint: str, topic: bytes, on_message: OnMessage, *,
                 on_connect: Callable[[], None] | None = None, reconnect_s: float = 0.1,
                 reconnect_max_s: float = 5.0, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 max_message_frames: int = DEFAULT_MAX_MESSAGE_FRAMES) -> None:
        self.kind, self.host, self.port = parse_endpoint(endpoint)
        self.endpoint = endpoint
        self.topic = topic
        self.on_message = on_message
        self.on_connect = on_connect
        self.reconnect_s = reconnect_s
        self.reconnect_max_s = reconnect_max_s
        self.max_frame_bytes = max_frame_bytes
        self.max_message_bytes = max_message_bytes
        self.max_message_frames = max_message_frames
        self.protocol: ZmtpSubProtocol | None = None
        self.connects = 0  # handshakes completed
        self.failures = 0  # connections refused, dropped or broken
        self._paused = False
        self._running = False  # between start() and close()
        self._delay = reconnect_s  # the next retry's wait (doubles up to reconnect_max_s)
        self._task: asyncio.Task | None = None  # a connection being made
        self._timer: asyncio.TimerHandle | None = None  # a retry waiting
        self._warned: set[str] | None = None  # made at the first warning

    @property
    def connected(self) -> bool:
        return self.protocol is not None and self.protocol._ready and not self.protocol.closed.done()

    def start(self) -> None:
        if not self._running:
            self._running = True
            self._delay = self.reconnect_s
            self._connect()

    async def close(self) -> None:
        self._running = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        if self.protocol is not None:
            self.protocol.close()
            self.protocol = None

    def pause(self) -> None:
        self._paused = True
        if self.protocol is not None:
            self.protocol.pause()

    def resume(self) -> None:
        self._paused = False
        if self.protocol is not None:
            self.protocol.resume()

    def _ready(self) -> None:
        self.connects += 1
        if self.on_connect is not None:
            self.on_connect()

    def _connect(self) -> None:
        self._timer = None
        if self._running:
            self._task = asyncio.get_running_loop().create_task(self._attempt(), name=f"zmtp-sub:{self.endpoint}")

    async def _attempt(self) -> None:
        loop = asyncio.get_running_loop()
        protocol = ZmtpSubProtocol(self.topic, self.on_message, self._ready, self.max_frame_bytes,
                                   self.max_message_bytes, self.max_message_frames)
        try:
            if self.kind == "tcp":
                await wait_for(loop.create_connection(lambda: protocol, self.host, self.port), 10)
            else:
                await wait_for(loop.create_unix_connection(lambda: protocol, self.host), 10)
        except (OSError, asyncio.TimeoutError) as exc:
            self._task = None
            self.failures += 1
            self._warn("connect", "KV events %s: cannot connect (%s); retrying", self.endpoint, exc)
            self._retry()
            return
        self._task = None
        if not self._running:  # closed while the connection was being made (its cancel came late)
            protocol.close()
            return
        self.protocol = protocol
        if self._paused:
            protocol.pause()
        protocol.closed.add_done_callback(lambda closed: self._lost(protocol, closed))

    def _lost(self, protocol: ZmtpSubProtocol, closed: asyncio.Future) -> None:
        if not self._running or closed.cancelled():
            return
        why = closed.result()
        if protocol._ready:
            self._delay = self.reconnect_s  # it worked: the next failure starts the backoff over
            if self._warned is not None:
                self._warned.discard("connect")
        self.failures += 1
        if isinstance(why, ZmtpError):
            self._warn(str(why), "KV events %s: %s; reconnecting", self.endpoint, why)
        else:
            log.info("KV events %s: connection closed (%s); reconnecting", self.endpoint, why or "EOF")
        self._retry()

    def _retry(self) -> None:
        if self._running:
            self._timer = asyncio.get_running_loop().call_later(self._delay, self._connect)
            self._delay = min(self._delay * 2, self.reconnect_max_s)

    def _warn(self, what: str, msg: str, *args: object) -> None:
        if self._warned is None:
            self._warned = set()
        if what in self._warned:
            log.debug(msg, *args)
        else:
            self._warned.add(what)
            log.warning(msg, *args)
