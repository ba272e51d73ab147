"""kill -9 in the middle of L3 writes, restart, and check: every acknowledged write is there, and
nothing torn is ever served (each value carries its own key and version and is checked whole)."""
from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
import sys

import pytest

from infera.kvd.client import KvdClient
from infera.kvd.store import Namespaced
from infera.kvd.tablespace import Tablespace
from tests.integration.test_kvd_daemon import ROOT, KvdProcess

pytestmark = pytest.mark.integration

SLOT = 4096
CONTAINER = 1 << 20
TOTAL = 8 * CONTAINER
KEYS = 8

WRITER = r"""
import hashlib, sys
from infera.kvd.store import Namespaced
from infera.kvd.tablespace import Tablespace
root, interval, base = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t = Tablespace(root, %(total)d, container_bytes=%(container)d, slot_bytes=%(slot)d, flush_interval_ms=interval).open()
print("open", len(t), flush=True)
version = base
while True:
    for i in range(%(keys)d):
        version += 1
        size = 20000 + (version * 7919) %% 180000
        head = i.to_bytes(8, "big") + version.to_bytes(8, "big")
        value = head + hashlib.shake_128(head).digest(size)
        t.put(Namespaced("m", "c", i.to_bytes(8, "big")), value)
        print(i, version, flush=True)
""" % {"total": TOTAL, "container": CONTAINER, "slot": SLOT, "keys": KEYS}


def check_value(i: int, value: bytes) -> int:
    """The version a value claims, after checking that every byte of it is what that version wrote."""
    head = value[:16]
    assert int.from_bytes(head[:8], "big") == i, "value under the wrong key"
    version = int.from_bytes(head[8:], "big")
    size = 20000 + (version * 7919) % 180000
    assert value == head + hashlib.shake_128(head).digest(size), f"torn value for key {i} v{version}"
    return version


async def run_writer_and_kill(root: str, interval: int, base: int, acks_before_kill: int) -> dict[int, int]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", WRITER, root, str(interval), str(base),
                                                cwd=ROOT, stdout=asyncio.subprocess.PIPE)
    acked: dict[int, int] = {}
    try:
        first = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert first.startswith(b"open"), first
        n = 0
        while n < acks_before_kill:
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert line, "writer died"
            i, version = map(int, line.split())
            acked[i] = version
            n += 1
        proc.send_signal(signal.SIGKILL)  # mid-put: the writer never pauses between puts
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
    return acked


@pytest.mark.parametrize("interval_ms", [0, 20])
async def test_kill9_mid_write_then_recover(tmp_path, interval_ms):
    root = str(tmp_path / "l3")
    last_acked: dict[int, int] = {}
    for cycle in range(3):
        acked = await run_writer_and_kill(root, interval_ms, base=cycle * 1_000_000, acks_before_kill=25 + 10 * cycle)
        last_acked.update(acked)
        t = await asyncio.to_thread(
            lambda: Tablespace(root, TOTAL, container_bytes=CONTAINER, slot_bytes=SLOT).open())
        try:
            for i in range(KEYS):
                got = t.get(Namespaced("m", "c", i.to_bytes(8, "big")))
                if i in last_acked:
                    assert got is not None, f"acknowledged key {i} lost"
                if got is not None:
                    version = check_value(i, got[0])
                    if i in last_acked:
                        assert version >= last_acked[i], "an acknowledged version went back"
            assert t.corrupt_reads_total == 0, "a journaled record pointed at torn data"
        finally:
            await asyncio.to_thread(t.close)


async def test_daemon_kill9_keeps_long_entries(tmp_path):
    d = KvdProcess("--max-bytes", "4M", "--shared-arena-bytes", "0", "--long-path", str(tmp_path / "l3"),
                   "--use-tablespace", "--long-bytes", "8M", "--tablespace-container-bytes", "1M",
                   "--tablespace-slot-bytes", "4K")
    d.start()
    try:
        await d.ready()
        values = {bytes([i]) * 8: os.urandom(50_000 + i) for i in range(6)}
        async with await KvdClient.connect(d.socket) as c:
            for key, value in values.items():
                assert await c.set(key, value, retention="long", model="m") == (True, "")
            assert await c.set(b"short!!!", b"ram only", model="m") == (True, "")
            assert (await c.stats())["long_bytes"] == sum(map(len, values.values()))
        d.kill()  # SIGKILL: no snapshot, no cleanup; the stale socket file stays behind
        assert os.path.exists(d.socket)
        d.start()
        await d.ready()
        async with await KvdClient.connect(d.socket) as c:
            assert await c.batch_get(list(values), model="m") == list(values.values())  # promoted from L3
            assert await c.get(b"short!!!", model="m") is None  # short retention never reached L3
            stats = await c.stats()
            assert stats["l3_hits_total"] == len(values) and stats["entries"] == len(values)
            assert await c.get(list(values)[0], model="m") == list(values.values())[0]
            assert (await c.stats())["l2_hits_total"] == 1  # the promoted copy now answers from RAM
    finally:
        d.stop()
        shutil.rmtree(d.dir, ignore_errors=True)
