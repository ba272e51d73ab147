"""``python -m infera.kvd`` as a real process on a temporary Unix socket, driven by the real clients."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile

import msgspec
import pytest

from infera.kvd import protocol as p
from infera.kvd.client import KvdClient, KvdError, SyncKvdClient
from tests.conftest import stop_process, wait_for

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K1, K2, K3 = b"\x01" * 8, b"\x02" * 8, b"\x03" * 8


def connectable(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


class KvdProcess:
    """One daemon process; its socket lives in a short /tmp dir (Unix socket paths max ~107 bytes)."""

    def __init__(self, *args: str, workdir: str | None = None, env: dict | None = None):
        self.dir = workdir or tempfile.mkdtemp(prefix="kvd")
        self.socket = os.path.join(self.dir, "kvd.sock")
        self.args = ["--socket", self.socket, *args]
        self.env = {**os.environ, "INFERA_KVD_STORAGE_SELFCHECK": "0", **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.log = os.path.join(self.dir, "kvd.log")

    def start(self) -> "KvdProcess":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "infera.kvd", *self.args], cwd=ROOT, env=self.env,
                                         stdout=log, stderr=subprocess.STDOUT)
        return self

    async def ready(self, timeout: float = 20) -> "KvdProcess":
        await wait_for(lambda: self.proc.poll() is not None or connectable(self.socket), timeout,
                       message=f"kvd on {self.socket}")
        assert self.proc.poll() is None, self.output()
        return self

    def output(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def stop(self) -> int | None:
        stop_process(self.proc)
        return self.proc.returncode if self.proc else None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
async def kvd():
    d = KvdProcess("--max-bytes", "1M", "--shared-arena-bytes", "256K", "--no-shared-arena-pin").start()
    await d.ready()
    yield d
    d.stop()
    shutil.rmtree(d.dir, ignore_errors=True)


async def raw_exchange(path: str, payload: bytes) -> dict:
    """Send raw bytes, read one frame back as a plain map."""
    loop = asyncio.get_running_loop()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        await loop.sock_connect(s, path)
        await loop.sock_sendall(s, payload)
        return msgspec.msgpack.decode(bytes(await asyncio.wait_for(p.read_frame(loop, s), 10)))
    finally:
        s.close()


def framed(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


async def test_every_op_over_the_socket(kvd):
    mode = os.stat(kvd.socket).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    async with await KvdClient.connect(kvd.socket, client_id="test") as c:
        assert c.hello.server_id and c.hello.protocol_version == 1 and c.hello.shared_arena is None
        assert await c.set(K1, b"one", model="m", compat_key="tp0of1_pp0of1") == (True, "")
        assert await c.get(K1, model="m", compat_key="tp0of1_pp0of1") == b"one"
        assert await c.get(K1, model="m") is None  # another compat_key is another namespace
        assert await c.get_with_retention(K1, model="m", compat_key="tp0of1_pp0of1") == (b"one", "short")
        assert await c.set(K1, b"x", retention="bogus", model="m") == (False, "unknown_retention")
        assert await c.set(K2, b"two", retention="long", model="m") == (True, "")
        assert await c.set(K2, b"2", retention="short", model="m") == (False, "retention_downgrade_not_allowed")
        assert await c.set(K3, b"gone", ttl_seconds=0, model="m") == (True, "ttl_expired")
        assert await c.batch_get([K1, K2, K3], model="m") == [None, b"two", None]
        results = await c.batch_set([K1, K3], [b"a", b"c"], retentions=["ephemeral", "long"],
                                    ttls_seconds=[None, 60], model="b")
        assert results == [(True, ""), (True, "")]
        assert await c.exists([K1, K2, K3], model="b") == [True, False, True]
        assert await c.clear(model="b") == 2
        assert await c.exists([K1, K3], model="b") == [False, False]
        # batch_set arity mismatch is an error frame, and the connection goes on
        with pytest.raises(KvdError) as e:
            await c.batch_set([K1, K2], [b"only one"])
        assert e.value.code == "batch_set_arity_mismatch"
        # no arena on this connection: reserve says so
        r = await c.reserve(100)
        assert r.lease_token == 0 and r.reason == "no_arena"
        await c.prefetch_hint([K1, K2], model="m", deadline_ms=100)  # fire-and-forget: no reply frame
        stats = await c.stats()  # the next reply is the stats one: prefetch_hint answered nothing
        assert stats["sets_total"] >= 6 and stats["gets_total"] >= 5 and stats["hits_total"] >= 3
        assert stats["entries"] == 2 and stats["spillover_bytes"] == 0
        assert await c.clear() == 2
        assert (await c.stats())["entries"] == 0


async def test_first_frame_may_skip_hello(kvd):
    async with await KvdClient.connect(kvd.socket, send_hello=False) as c:
        assert c.hello is None
        assert await c.set(K1, b"v") == (True, "")
        assert await c.get(K1) == b"v"


async def test_bad_frames_get_error_replies_not_a_crash(kvd):
    assert (await raw_exchange(kvd.socket, framed(b"\xc1")))["code"] == "bad_frame"
    assert (await raw_exchange(kvd.socket, framed(msgspec.msgpack.encode({"op": "nope"}))))["code"] == "bad_op"
    assert (await raw_exchange(kvd.socket, framed(msgspec.msgpack.encode({"op": "get"}))))["code"] == "bad_request"
    reply = await raw_exchange(kvd.socket, struct.pack(">I", p.MAX_FRAME_BYTES + 1))
    assert reply == {"op": "error", "code": "frame_too_large", "message": reply["message"]}
    # a connection that sent garbage keeps working afterwards
    loop = asyncio.get_running_loop()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        await loop.sock_connect(s, kvd.socket)
        await loop.sock_sendall(s, framed(b"\xc1") + bytes(p.encode_frame(p.Stats())))
        first = p.decode_response(await p.read_frame(loop, s))
        second = p.decode_response(await p.read_frame(loop, s))
        assert isinstance(first, p.Error) and isinstance(second, p.StatsResponse)
    finally:
        s.close()
    # a peer that vanishes mid-frame does not hurt either
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(kvd.socket)
    s.sendall(struct.pack(">I", 1000) + b"partial")
    s.close()
    async with await KvdClient.connect(kvd.socket) as c:
        assert (await c.stats())["entries"] == 0
    assert kvd.proc.poll() is None


async def test_sync_client_from_threads(kvd):
    def work(tag: int) -> list[bytes | None]:
        with SyncKvdClient(kvd.socket, client_id=f"thread{tag}") as c:
            for i in range(20):
                assert c.set(bytes([tag, i]) * 4, bytes([i]) * 1000, model="m").accepted
            return c.batch_get([bytes([tag, i]) * 4 for i in range(20)], model="m")

    results = await asyncio.gather(*(asyncio.to_thread(work, t) for t in range(4)))
    for values in results:
        assert values == [bytes([i]) * 1000 for i in range(20)]
    shared = SyncKvdClient(kvd.socket)  # one client shared by threads: calls are serialized
    try:
        got = await asyncio.gather(*(asyncio.to_thread(shared.get, bytes([0, i]) * 4, model="m") for i in range(20)))
        assert got == [bytes([i]) * 1000 for i in range(20)]
    finally:
        shared.close()


async def test_large_values_roundtrip(kvd):
    value = os.urandom(700 * 1024)
    async with await KvdClient.connect(kvd.socket) as c:
        assert await c.set(K1, value) == (True, "")
        assert await c.get(K1) == value
        assert await c.set(K2, os.urandom(2 * 1024 * 1024)) == (False, "value_larger_than_store")


async def test_stale_socket_is_unlinked_and_live_one_refused(tmp_path):
    d = KvdProcess("--shared-arena-bytes", "0", "--max-bytes", "1M")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(d.socket)  # a socket file nobody listens on: what a crashed daemon leaves
    stale.close()
    d.start()
    try:
        await d.ready()
        second = KvdProcess("--shared-arena-bytes", "0", workdir=d.dir)
        second.log = os.path.join(d.dir, "second.log")
        second.start()
        assert second.proc.wait(30) == 2
        assert "another daemon is listening" in second.output()
        assert connectable(d.socket)
    finally:
        assert d.stop() == 0
    assert not os.path.exists(d.socket), "a clean stop removes the socket"
    shutil.rmtree(d.dir, ignore_errors=True)


async def test_sigterm_stops_cleanly(kvd):
    kvd.proc.send_signal(signal.SIGTERM)
    assert kvd.proc.wait(20) == 0
    assert not os.path.exists(kvd.socket)


def test_unknown_flag_is_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "infera.kvd", "--long-backend", "mooncake"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unrecognized arguments" in out.stderr
