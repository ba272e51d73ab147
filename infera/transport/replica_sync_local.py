"""Replica sync among the processes of one server (``--replica-sync local``): no broker needed.

``python -m infera.server --workers N`` runs N server processes, each a full replica. On the dev
plane (etcd + HTTP + ZMQ) there is no NATS to share what only each knows, so the siblings talk to
each other directly: process ``i`` listens on ``sync-<i>.sock``, a Unix stream socket in the
server's private 0700 runtime folder, and holds one connection to each sibling's socket. A
publish writes the message to each sibling's connection (in order: one stream per pair), framed
as ``[u32 data length][u16 subject length][subject][data]``; the messages, subjects and repair
rules are :mod:`infera.transport.replica_sync`'s, exactly as over NATS.

Why not a broker-like proxy (a ZMQ XSUB/XPUB in the supervisor, tried first): every message then
crossed three processes' ZMQ I/O threads, each a wake-up on cores the router needs, and a
subscription had to propagate before anything could be sent; a write and a read on a Unix socket,
in the event loops that already run, cost a few µs each, and a connection is there or not.

Losses are repaired as over NATS, never silently drifted: a sibling that is down or restarting
gets nothing (a connection is retried every ``RECONNECT_S``), and one that stops reading (stuck,
SIGSTOPped) is written to until ``MAX_BUFFERED_BYTES`` are queued for it, then skipped until it
drains; either way it sees a gap in the sequence numbers, or hears a heartbeat listing requests it
does not know, and asks for the full state. The supervisor says ``bye`` for a child that died
(:func:`announce_gone`), so its siblings drop its requests at once rather than after the peer
timeout.
"""
from __future__ import annotations

import asyncio
import logging
import os
import struct
from typing import Any

from infera.runtime import cancel_all_and_wait, wait_for
from infera.transport.replica_sync import ReplicaSync, bye_message

log = logging.getLogger(__name__)

RECONNECT_S = 0.2  # a sibling not (yet) listening is tried again this often (sooner at first)
# Queued for one sibling that does not read; beyond, its messages are skipped until it drains. Above
# any full state one tick writes (8192 requests in flight × 128 blocks is 8 MiB), so a sibling that
# reads again is never skipped in the middle of the full state it asked for.
MAX_BUFFERED_BYTES = 64 * 1024 * 1024
MAX_FRAME_BYTES = 64 * 1024 * 1024  # a longer frame is garbage: the connection is closed
_HEADER = struct.Struct("<IH")


def sync_socket(runtime_dir: str, index: int) -> str:
    return os.path.join(runtime_dir, f"sync-{index}.sock")


def frame(subject: str, data: bytes) -> bytes:
    s = subject.encode()
    return _HEADER.pack(len(data), len(s)) + s + data


class _Reader(asyncio.Protocol):
    """A sibling's connection to us: frames in, handed to ``on_message``."""

    def __init__(self, sync: "LocalReplicaSync") -> None:
        self.sync = sync
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.sync._readers.add(self)
        self.sync._changed.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.sync._readers.discard(self)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos, end = 0, len(buf)
        while end - pos >= _HEADER.size:
            n, k = _HEADER.unpack_from(buf, pos)
            if n > MAX_FRAME_BYTES:
                log.warning("replica sync (local): a %d-byte frame: closing the connection", n)
                self.sync.decode_errors += 1
                assert self.transport is not None
                self.transport.close()
                buf.clear()
                return
            stop = pos + _HEADER.size + k + n
            if stop > end:
                break
            start = pos + _HEADER.size
            try:
                subject = bytes(buf[start:start + k]).decode()
            except UnicodeDecodeError:
                self.sync.decode_errors += 1
            else:
                try:
                    self.sync.receive(subject, bytes(buf[start + k:stop]))
                except Exception:  # noqa: BLE001 - one bad message must not end the connection
                    log.exception("replica sync (local): message not applied")
            pos = stop
        if pos:
            del buf[:pos]


class _Writer(asyncio.Protocol):
    """Our connection to a sibling: write only (nothing comes back on it)."""

    def __init__(self) -> None:
        self.lost = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)


class LocalReplicaSync(ReplicaSync):
    """Child ``index`` of ``count``: listens on its socket, connects to every sibling's."""

    transport = "local"

    def __init__(self, runtime_dir: str, index: int, count: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.runtime_dir = runtime_dir
        self.index = index
        self.count = count
        self._server: asyncio.AbstractServer | None = None
        self._readers: set[_Reader] = set()
        self._peers: dict[int, asyncio.Transport] = {}  # sibling index → our connection to it
        self._dialers: list[asyncio.Task] = []
        self._changed = asyncio.Event()  # a connection came up (wait_siblings)
        self.frames_skipped = 0  # a sibling not connected, or not reading: repaired by its gap
        self.reconnects = 0

    @property
    def connected(self) -> bool:
        return self._server is not None

    async def _open(self) -> None:
        if self._server is None:
            path = sync_socket(self.runtime_dir, self.index)
            try:
                os.unlink(path)  # left by the process this one replaces
            except FileNotFoundError:
                pass
            loop = asyncio.get_running_loop()
            self._server = await loop.create_unix_server(lambda: _Reader(self), path)
            self._dialers = [asyncio.ensure_future(self._dial(j)) for j in range(self.count) if j != self.index]

    async def _dial(self, j: int) -> None:
        """Keep a connection to sibling ``j`` (it may start later, die and come back)."""
        loop = asyncio.get_running_loop()
        path = sync_socket(self.runtime_dir, j)
        delay = 0.005
        while True:
            try:
                transport, writer = await loop.create_unix_connection(_Writer, path)
            except OSError:  # not listening (yet, or any more)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_S)
                continue
            delay = 0.005
            self._peers[j] = transport  # type: ignore[assignment]
            self._changed.set()
            self._wake.set()  # a (re)connected sibling may have missed messages: the next ones show the gap
            try:
                await writer.lost
            finally:
                self._peers.pop(j, None)
                transport.close()
            self.reconnects += 1
            await asyncio.sleep(RECONNECT_S)

    def siblings_connected(self) -> bool:
        """Connected to every sibling, and every sibling to us."""
        return len(self._peers) == len(self._readers) == self.count - 1

    async def wait_siblings(self, timeout: float) -> bool:
        """Until :meth:`siblings_connected` (a child waits for it before it takes requests, so that
        none of its first messages is skipped), at most ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.siblings_connected():
            self._changed.clear()
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                await wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                return False
        return True

    async def _send(self, subject: str, data: bytes) -> None:
        msg = frame(subject, data)
        skipped = self.count - 1 - len(self._peers)
        for transport in self._peers.values():
            if transport.get_write_buffer_size() > MAX_BUFFERED_BYTES:
                skipped += 1  # it does not read: it will see the gap when it does
                continue
            transport.write(msg)
        self.frames_skipped += skipped

    async def _close(self) -> None:
        await cancel_all_and_wait(self._dialers)
        self._dialers = []
        for transport in list(self._peers.values()):  # the goodbyes were written: close flushes them
            transport.close()
        self._peers.clear()
        if self._server is not None:
            self._server.close()
            self._server = None
            try:
                os.unlink(sync_socket(self.runtime_dir, self.index))
            except OSError:
                pass
        for reader in list(self._readers):
            if reader.transport is not None:
                reader.transport.close()

    def stats(self) -> dict[str, int]:
        out = super().stats()
        out.update(siblings_connected=len(self._peers), frames_skipped=self.frames_skipped,
                   reconnects=self.reconnects)
        return out


async def announce_gone(runtime_dir: str, count: int, replica_id: str, timeout: float = 1.0) -> int:
    """Tell every listening child that ``replica_id`` is gone (the supervisor, for a child that
    died): they drop what it had in flight now. Returns how many were told; best effort."""
    subject, data = bye_message(replica_id)
    msg = frame(subject, data)

    async def tell(j: int) -> bool:
        try:
            _, writer = await wait_for(asyncio.open_unix_connection(sync_socket(runtime_dir, j)), timeout)
        except (OSError, asyncio.TimeoutError):
            return False
        try:
            writer.write(msg)
            await wait_for(writer.drain(), timeout)
            return True
        except (OSError, asyncio.TimeoutError):
            return False
        finally:
            writer.close()

    return sum(await asyncio.gather(*(tell(j) for j in range(count))))
