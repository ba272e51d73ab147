"""The channel of a host's shared KV index (infera/transport/kv_index_share.py) over a real Unix
socket: a reader gets the writer's arena (its fd over SCM_RIGHTS) and its targets' rows, detaches
when the writer goes, attaches to the next writer's new arena, and refuses what is not a writer."""
from __future__ import annotations

import asyncio
import os
import socket
import struct
from typing import Any

import pytest

from infera.kv.events import EventBatch, Stored
from infera.kv.hashing import block_hashes
from infera.kv.index import NativeKvIndex
from infera.kv.index_shared import SharedKvIndex, TargetRow
from infera.kv.native import native
from infera.transport import kv_index_share as share
from tests.conftest import wait_for

pytestmark = pytest.mark.skipif(native is None, reason="the C accelerator is not built")

BS = 4
TOKENS = list(range(64))
HASHES = block_hashes(TOKENS, BS)


def _writer(blocks: int) -> NativeKvIndex:
    w = NativeKvIndex(shared_bytes=16 << 20)
    w.add_target("a", BS)
    w.apply("a", EventBatch(1.0, [Stored(list(range(1, blocks + 1)), None, TOKENS[:blocks * BS], BS)]))
    return w


def _rows(w: NativeKvIndex) -> Any:
    return {"t": [list(r) for r in w.target_rows()], "n": len(w)}


class Reader:
    def __init__(self, path: str) -> None:
        self.index = SharedKvIndex()
        self.frames = 0
        self.lost = 0
        self.client = share.KvIndexShareClient(path, self.index.attach, self.rows, self.on_lost)

    def rows(self, msg: Any) -> None:
        self.frames += 1
        self.index.update({k: TargetRow(b, bs, n, m, ev) for k, b, bs, n, m, ev in msg["t"]}, msg["n"])

    def on_lost(self) -> None:
        self.lost += 1
        self.index.detach()


async def _serve_and_read(path: str, w: NativeKvIndex, generation: int = 1,
                          rows: Any = None) -> tuple[share.KvIndexShareServer, Reader]:
    """A writer's share server (rows every 20 ms: ``rows()``, else the index's) and a reader of it."""
    server = share.KvIndexShareServer(path, w.shared_fd(), generation, rows or (lambda: _rows(w)), interval_s=0.02)
    await server.start()
    reader = Reader(path)
    reader.client.start()
    return server, reader


async def test_a_reader_follows_its_writer_across_a_restart(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(share, "RECONNECT_S", 0.01)
    path = str(tmp_path / "kv-index.sock")
    w1 = _writer(10)
    server, reader = await _serve_and_read(path, w1)
    try:
        await wait_for(lambda: reader.index.match(HASHES, ["a"]) == [10], 10, message="attached to writer 1")
        assert reader.index.generation == 1 and reader.client.connected
        frames = reader.frames
        await wait_for(lambda: reader.frames >= frames + 3, 10, message="rows every interval")
        await server.stop()  # the writer goes: the reader routes by load until the next one
        await wait_for(lambda: reader.lost == 1, 10, message="the writer's loss seen")
        assert not reader.index.attached and reader.index.match(HASHES, ["a"]) == [0]
        w2 = _writer(6)  # the supervisor's restarted writer: a new arena
        server = share.KvIndexShareServer(path, w2.shared_fd(), 2, lambda: _rows(w2), interval_s=0.02)
        await server.start()
        await wait_for(lambda: reader.index.match(HASHES, ["a"]) == [6], 10, message="attached to writer 2")
        assert reader.index.generation == 2 and reader.client.attaches == 2
    finally:
        await reader.client.stop()
        await server.stop()


async def test_a_socket_that_is_not_a_writer_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(share, "RECONNECT_S", 0.01)
    path = str(tmp_path / "kv-index.sock")
    hellos = []

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hellos.append(1)
        writer.write(struct.pack("<4sIQ", b"NOPE", 1, 0))  # no fd, wrong magic
        await writer.drain()
        writer.close()

    server = await asyncio.start_unix_server(impostor, path)
    reader = Reader(path)
    reader.client.start()
    try:
        await wait_for(lambda: len(hellos) >= 3, 10, message="the client tries again, with a backoff")
        assert reader.client.attaches == 0 and not reader.index.attached
    finally:
        await reader.client.stop()
        server.close()
        await server.wait_closed()


async def test_an_oversized_frame_closes_the_connection(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(share, "RECONNECT_S", 0.01)
    monkeypatch.setattr(share, "MAX_FRAME_BYTES", 1000)
    path = str(tmp_path / "kv-index.sock")
    big = {"t": [["k" * 2000, 0, BS, 0, 0.0, 0]], "n": 0}
    w = _writer(4)  # (alive while its arena's fd is handed out)
    server, reader = await _serve_and_read(path, w, 7, lambda: big)
    try:
        await wait_for(lambda: reader.lost >= 2, 10, message="each connection closed at its first frame")
        assert reader.frames == 0
    finally:
        await reader.client.stop()
        await server.stop()


def test_hello_is_fixed_size() -> None:
    assert share.HELLO.size == 16
    a, b = socket.socketpair()
    with a, b:
        socket.send_fds(a, [share.HELLO.pack(share.MAGIC, share.VERSION, 5)], [a.fileno()])
        data, fds, _, _ = socket.recv_fds(b, share.HELLO.size, 1)
        assert share.HELLO.unpack(data)[2] == 5 and len(fds) == 1
        os.close(fds[0])


async def test_a_writer_that_stops_sending_rows_is_taken_for_gone(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(share, "RECONNECT_S", 0.01)
    monkeypatch.setattr(share, "ROWS_TIMEOUT_S", 0.3)
    path = str(tmp_path / "kv-index.sock")
    w = _writer(5)
    server, reader = await _serve_and_read(path, w)
    try:
        await wait_for(lambda: reader.index.match(HASHES, ["a"]) == [5], 10, message="attached")
        assert server._task is not None
        server._task.cancel()  # wedged: connected, sending nothing
        await wait_for(lambda: reader.lost >= 1, 10, message="the silent writer taken for gone")
    finally:
        await reader.client.stop()
        await server.stop()
