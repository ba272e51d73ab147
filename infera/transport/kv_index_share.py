"""The channel of a host's shared KV index (issue 30 item 4): the writer process hands the other
server processes its arena and tells them about its targets.

The writer listens on ``kv-index.sock``, a Unix stream socket in the server's private 0700 runtime
folder. A reader that connects gets, first, a fixed 16-byte hello (``b"IKVS"``, version, the
writer's generation) carrying the arena's file descriptor (SCM_RIGHTS); then, every
:data:`ROWS_INTERVAL_S` and at once on connecting, frames of ``[u32 length][msgpack]``: the
writer's targets (route key, bit, block size, blocks held, how far its events are applied, its
stream's state) and the view's size. The reader never writes; its connection closing is how each
side learns the other is gone: a reader whose writer went detaches (nothing known held: it routes
by load) and connects again, every :data:`RECONNECT_S` (doubling to :data:`RECONNECT_MAX_S`),
until a writer -- the one the supervisor restarted -- answers with its new arena.

Bounded: a reader that stops reading is skipped while :data:`MAX_BUFFERED_BYTES` are queued for it;
a frame longer than :data:`MAX_FRAME_BYTES` closes the connection; the hello has a deadline, and a
writer that sends no rows for :data:`ROWS_TIMEOUT_S` (stopped, wedged) is taken for gone.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from typing import Any, Callable

import msgspec

from infera.runtime import cancel_and_wait, wait_for

log = logging.getLogger(__name__)

HELLO = struct.Struct("<4sIQ")
MAGIC = b"IKVS"
VERSION = 1
ROWS_INTERVAL_S = 0.5
ROWS_TIMEOUT_S = 5.0  # no rows for this long: the writer is taken for gone (SIGSTOPped, wedged)
RECONNECT_S = 0.05
RECONNECT_MAX_S = 2.0
HELLO_TIMEOUT_S = 5.0
MAX_BUFFERED_BYTES = 8 * 1024 * 1024
MAX_FRAME_BYTES = 64 * 1024 * 1024
_LEN = struct.Struct("<I")


def share_socket(runtime_dir: str) -> str:
    return os.path.join(runtime_dir, "kv-index.sock")


class KvIndexShareServer:
    """The writer's side: hands each reader the arena (``arena_fd``) and sends it ``rows()`` (any
    msgpack-able value) every :data:`ROWS_INTERVAL_S`."""

    def __init__(self, path: str, arena_fd: int, generation: int, rows: Callable[[], Any],
                 interval_s: float = ROWS_INTERVAL_S) -> None:
        self.path = path
        self.arena_fd = arena_fd
        self.generation = generation
        self.rows = rows
        self.interval_s = interval_s
        self.readers: set[asyncio.StreamWriter] = set()
        self.skipped = 0  # frames not sent to a reader that did not read
        self._server: asyncio.AbstractServer | None = None
        self._task: asyncio.Task | None = None
        self._encoder = msgspec.msgpack.Encoder()

    async def start(self) -> None:
        try:
            os.unlink(self.path)  # a dead writer's socket
        except FileNotFoundError:
            pass
        self._server = await asyncio.start_unix_server(self._accept, self.path)
        os.chmod(self.path, 0o600)
        self._task = asyncio.get_running_loop().create_task(self._send_rows(), name="kv-index-share")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for w in list(self.readers):
            w.close()
        self.readers.clear()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _frame(self) -> bytes:
        data = self._encoder.encode(self.rows())
        return _LEN.pack(len(data)) + data

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            # The hello with the arena's fd, before anything else is written on this connection: a
            # duplicate of the socket, so that the fd travels with the hello's bytes.
            raw = writer.get_extra_info("socket")
            with socket.socket(fileno=os.dup(raw.fileno())) as dup:
                socket.send_fds(dup, [HELLO.pack(MAGIC, VERSION, self.generation)], [self.arena_fd])
            writer.write(self._frame())
            self.readers.add(writer)
            while await reader.read(4096):  # a reader sends nothing: this returns at its close
                pass
        except (OSError, ConnectionError) as exc:
            log.debug("kv index share: a reader's connection failed: %s", exc)
        finally:
            self.readers.discard(writer)
            writer.close()

    async def _send_rows(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not self.readers:
                continue
            frame = self._frame()
            for w in list(self.readers):
                if w.transport.get_write_buffer_size() > MAX_BUFFERED_BYTES:
                    self.skipped += 1  # it does not read: it gets the rows again when it does
                    continue
                w.write(frame)


def _hello(path: str) -> tuple[socket.socket, int, int]:
    """Connect and take the hello (blocking, with a deadline: run in a thread)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(HELLO_TIMEOUT_S)
        sock.connect(path)
        data, fds, _flags, _addr = socket.recv_fds(sock, HELLO.size, 1)
        got = bytearray(data)
        while len(got) < HELLO.size:  # (the hello's bytes may come in parts; its fd with the first)
            more = sock.recv(HELLO.size - len(got))
            if not more:
                raise ConnectionError("the writer closed during the hello")
            got += more
        magic, version, generation = HELLO.unpack(bytes(got))
        if magic != MAGIC or version != VERSION or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ConnectionError(f"not a KV index writer of this version ({magic!r} v{version}, {len(fds)} fds)")
        sock.setblocking(False)
        return sock, fds[0], generation
    except BaseException:
        sock.close()
        raise


class KvIndexShareClient:
    """A reader's side: ``on_attach(fd, generation)`` when a writer hands its arena (the fd is
    closed after the call), ``on_rows(rows)`` for each frame, ``on_lost()`` when the connection
    ends; connects again with a backoff until :meth:`stop`."""

    def __init__(self, path: str, on_attach: Callable[[int, int], None], on_rows: Callable[[Any], None],
                 on_lost: Callable[[], None]) -> None:
        self.path = path
        self.on_attach = on_attach
        self.on_rows = on_rows
        self.on_lost = on_lost
        self.connected = False
        self.attaches = 0
        self._task: asyncio.Task | None = None
        self._decoder = msgspec.msgpack.Decoder()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-index-share-client")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        delay = RECONNECT_S
        while True:
            try:
                sock, fd, generation = await asyncio.to_thread(_hello, self.path)
            except (OSError, ConnectionError) as exc:
                log.debug("kv index share: no writer at %s yet (%s)", self.path, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_S)
                continue
            delay = RECONNECT_S
            try:
                self.on_attach(fd, generation)
            finally:
                os.close(fd)  # mapped (or refused): the descriptor is not needed any more
            self.connected = True
            self.attaches += 1
            writer = None
            try:
                reader, writer = await asyncio.open_unix_connection(sock=sock)
                while True:
                    # a writer that sends no rows for this long is stopped or wedged: gone, for us
                    (n,) = _LEN.unpack(await wait_for(reader.readexactly(_LEN.size), ROWS_TIMEOUT_S))
                    if n > MAX_FRAME_BYTES:
                        raise ConnectionError(f"a frame of {n} bytes")
                    self.on_rows(self._decoder.decode(await wait_for(reader.readexactly(n), ROWS_TIMEOUT_S)))
            except (OSError, ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError,
                    msgspec.DecodeError) as exc:
                log.info("kv index share: the writer's connection ended (%s): routing by load until it is back",
                         exc or type(exc).__name__)
            finally:
                self.connected = False
                if writer is not None:
                    writer.close()
                else:
                    sock.close()
                self.on_lost()
            await asyncio.sleep(delay)
