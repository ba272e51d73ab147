"""The shared arena across processes: a daemon process, a writer (this test) and a reader process
that maps the memfd it received over SCM_RIGHTS; write leases die with their connection."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from infera.kvd import protocol as p
from infera.kvd.client import KvdClient
from tests.conftest import wait_for
from tests.integration.test_kvd_daemon import ROOT, KvdProcess

pytestmark = pytest.mark.integration

READER = r"""
import hashlib, json, sys
from infera.kvd import protocol as p
from infera.kvd.client import SyncKvdClient
c = SyncKvdClient(sys.argv[1], client_id="reader", prefers_shared_arena=True)
resp = c.request(p.Get(key=bytes.fromhex(sys.argv[2]), model="m"))
value = c.arena.read(resp.slot_offset, resp.length, resp.version) if isinstance(resp, p.GetSharedResponse) else None
buf = bytearray(len(value) if value is not None else 0)
n = c.get_into(bytes.fromhex(sys.argv[2]), buf, model="m")
assert n == len(buf) and bytes(buf) == value, "get_into copied something else"
batch = c.request(p.BatchGet(keys=[bytes.fromhex(sys.argv[2]), b"missing!"], model="m"))
print(json.dumps({"answer": type(resp).__name__, "batch": type(batch).__name__,
                  "sha": hashlib.sha256(value).hexdigest() if value is not None else None,
                  "batch_offsets": getattr(batch, "offsets", None),
                  "arena": list(c.hello.shared_arena)}))
"""


@pytest.fixture
async def kvd():
    d = KvdProcess("--max-bytes", "1M", "--shared-arena-bytes", str(4 * 65600), "--no-shared-arena-pin").start()
    await d.ready()
    yield d
    d.stop()
    shutil.rmtree(d.dir, ignore_errors=True)


async def test_reader_process_maps_the_arena_and_reads_what_a_writer_put(kvd):
    value = os.urandom(64 * 1024)
    key = b"\x11" * 8
    async with await KvdClient.connect(kvd.socket, client_id="writer", prefers_shared_arena=True) as w:
        arena_size, slot_size, pid = w.hello.shared_arena
        assert arena_size == 4 * 65600 and pid == kvd.proc.pid
        lease = await w.reserve(len(value))
        assert lease.lease_token > 0 and lease.reason == ""
        w.arena.write_payload(lease.payload_offset, value)  # zero-copy: the value never crosses the socket
        assert await w.commit(lease.lease_token, key, len(value), model="m") == (True, "")
        out = subprocess.run([sys.executable, "-c", READER, kvd.socket, key.hex()], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout)
        assert got["answer"] == "GetSharedResponse" and got["batch"] == "BatchGetSharedResponse"
        assert got["sha"] == hashlib.sha256(value).hexdigest()
        assert got["batch_offsets"][1] == -1 and got["arena"][2] == kvd.proc.pid
        # a client without the arena gets the same bytes inline
        async with await KvdClient.connect(kvd.socket) as plain:
            assert await plain.get(key, model="m") == value
            buf = bytearray(len(value) + 10)
            assert await plain.get_into(key, buf, model="m") == len(value) and bytes(buf[:len(value)]) == value
            assert await plain.get_into(b"\x99" * 8, buf, model="m") is None
            with pytest.raises(ValueError):
                await plain.get_into(key, bytearray(10), model="m")
        # and a plain SET is readable through the arena
        assert await plain_set(kvd.socket, b"\x22" * 8, b"inline-set")
        assert await w.get(b"\x22" * 8, model="m") == b"inline-set"


async def plain_set(path: str, key: bytes, value: bytes) -> bool:
    async with await KvdClient.connect(path) as c:
        return (await c.set(key, value, model="m")).accepted


async def test_leases_die_with_their_connection(kvd):
    holder = await KvdClient.connect(kvd.socket, client_id="holder", prefers_shared_arena=True)
    leases = [await holder.reserve(65000) for _ in range(4)]  # slot size 65024: four slots, all leased
    assert all(lease.lease_token for lease in leases)
    async with await KvdClient.connect(kvd.socket, client_id="other", prefers_shared_arena=True) as other:
        full = await other.reserve(100)
        assert full.lease_token == 0 and full.reason == "arena_full_no_evictable"
        # a lease is the connection's own: another connection cannot commit it
        assert await other.commit(leases[0].lease_token, b"k" * 8, 10) == (False, "unknown_lease")
        await holder.close()  # the daemon cancels the dead connection's leases

        async def reservable() -> bool:
            r = await other.reserve(100)
            if r.lease_token:
                await other.cancel(r.lease_token)
            return bool(r.lease_token)

        await wait_for(reservable, 10, message="leases released after disconnect")
        r = await other.reserve(100)
        await other.cancel(r.lease_token)
        await other.cancel(r.lease_token)  # idempotent
        assert (await other.stats())["arena_entries"] == 0


async def test_put_zero_copy_and_eviction_by_slot_lru(kvd):
    async with await KvdClient.connect(kvd.socket, prefers_shared_arena=True) as c:
        for i in range(5):  # four slots: the fifth put reuses the least recently used one
            assert await c.put_zero_copy(bytes([i]) * 8, bytes([i]) * 60000, model="m") == (True, "")
        assert await c.batch_get([bytes([i]) * 8 for i in range(5)], model="m") == \
            [None] + [bytes([i]) * 60000 for i in range(1, 5)]
        stats = await c.stats()
        assert stats["evictions_total"] == 1 and stats["arena_entries"] == 4
        r = await c.request(p.SetReserve(size=10**6))
        assert r.lease_token == 0 and r.reason == "oversize"
