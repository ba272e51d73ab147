"""Shared arena: slot geometry, seqlock reads (torn or reused slots are misses), leases, fd passing."""
from __future__ import annotations

import multiprocessing
import os
import socket
import struct
import time

import pytest

from infera.kvd.arena import (ARENA_FULL, OVERSIZE, SLOT_HEADER, ArenaView, SharedArena, recv_fd, send_fd,
                              slot_size_for)


@pytest.fixture
def arena():
    a = SharedArena(1024, pin=False)
    yield a
    a.close()


def view_of(arena: SharedArena) -> ArenaView:
    return ArenaView(os.dup(arena.fd), arena.capacity)


def test_slot_size_rounds_up_with_header():
    assert slot_size_for(0) == 64 and slot_size_for(48) == 64 and slot_size_for(49) == 128
    assert slot_size_for(4096) == 4160


def test_first_put_fixes_geometry(arena):
    assert arena.fits(200)  # 216 -> 256
    assert (arena.slot_size, arena.num_slots, arena.payload_max) == (256, 4, 240)
    assert arena.fits(240) and not arena.fits(241)


def test_write_publishes_an_even_version_and_header(arena):
    arena.fits(100)
    slot, _ = arena.allocate()
    v = arena.write(slot, b"hello")
    version, length = SLOT_HEADER.unpack_from(arena.mm, arena.offset(slot))
    assert (version, length) == (v, 5) and v % 2 == 0 and v > 0
    v2 = arena.write(slot, b"again")
    assert v2 == v + 2


def test_reader_sees_value_and_misses_reused_or_busy_slot(arena):
    arena.fits(100)
    view = view_of(arena)
    try:
        slot, _ = arena.allocate()
        v = arena.write(slot, b"payload")
        assert view.read(arena.offset(slot), 7, v) == b"payload"
        out = bytearray(10)
        assert view.read_into(arena.offset(slot), 7, v, out) and out[:7] == b"payload"
        arena.write(slot, b"other!!")  # the slot was reused: the old version must not match
        assert view.read(arena.offset(slot), 7, v) is None
        assert not view.read_into(arena.offset(slot), 7, v, out)
        v3 = arena.version(slot)
        arena.begin_write(slot)  # a writer is mid-way: odd version, never served
        assert arena.version(slot) % 2 == 1
        assert view.read(arena.offset(slot), 7, v3) is None
        assert view.read(-1, 7, v3) is None and view.read(0, 10**6, v3) is None  # out of bounds
    finally:
        view.close()


def _hammer(arena: SharedArena, slot: int, size: int, stop_at: float) -> None:
    patterns = (b"A" * size, b"B" * size)
    i = 0
    while time.monotonic() < stop_at:
        arena.write(slot, patterns[i % 2])
        i += 1
        if i % 4 == 0:
            time.sleep(0.0002)  # leave the reader some quiet windows, else every read may overlap a write


def test_seqlock_never_serves_a_torn_copy_under_a_concurrent_writer():
    """A writer process rewrites one 1 MiB slot with AAAA… / BBBB… as fast as it can; every read
    the seqlock accepts must be entirely one pattern."""
    size = 1 << 20
    arena = SharedArena(2 * size + 128, pin=False)
    view = view_of(arena)
    try:
        arena.fits(size)
        slot, _ = arena.allocate()
        arena.write(slot, b"A" * size)
        off = arena.offset(slot)
        writer = multiprocessing.get_context("fork").Process(
            target=_hammer, args=(arena, slot, size, time.monotonic() + 1.5))
        writer.start()
        accepted = rejected = 0
        buf = bytearray(size)
        try:
            while writer.is_alive() and accepted + rejected < 2000:
                version = arena.version(slot)
                if version % 2:
                    continue
                if (accepted + rejected) % 2:  # both copy paths: into a new bytes, into a caller's buffer
                    data = view.read(off, size, version)
                else:
                    data = bytes(buf) if view.read_into(off, size, version, buf) else None
                if data is None:
                    rejected += 1
                    continue
                accepted += 1
                assert data.count(data[:1]) == size, "a torn copy was served"
        finally:
            writer.join(10)
        assert accepted > 0
    finally:
        view.close()
        arena.close()


def test_lru_reuse_and_leases_pin_slots(arena):
    lease, evicted, reason = arena.reserve(200)  # fixes 4 slots of 256
    assert reason == "" and evicted is None and lease.token > 0
    others = [arena.reserve(10)[0] for _ in range(3)]
    assert all(others)
    none, _, reason = arena.reserve(10)
    assert none is None and reason == ARENA_FULL  # every slot leased: nothing evictable
    assert arena.reserve(10_000)[2] == OVERSIZE
    assert arena.version(lease.slot) % 2 == 1  # leased slot reads as "being written"
    taken = arena.take_lease(lease.token)
    arena.finish_write(taken.slot, 5)
    arena.commit(taken.slot)
    again, evicted, _ = arena.reserve(10)  # the committed slot is the only evictable one
    assert again.slot == taken.slot and evicted == taken.slot
    assert arena.cancel(again.token) and not arena.cancel(again.token)  # idempotent
    assert arena.version(again.slot) % 2 == 0


def test_fd_passing_over_scm_rights(arena):
    arena.fits(100)
    slot, _ = arena.allocate()
    v = arena.write(slot, b"across")
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        a.sendall(struct.pack(">I", 0))  # ordinary bytes before it do not disturb the fd message
        send_fd(a, arena.fd)
        assert b.recv(4) == b"\0\0\0\0"
        fd = recv_fd(b)
        assert fd != arena.fd
        view = ArenaView(fd, arena.capacity)
        try:
            assert view.read(arena.offset(slot), 6, v) == b"across"
        finally:
            view.close()
        a.sendall(b"X")  # a message without a descriptor is refused
        with pytest.raises(ConnectionError):
            recv_fd(b)
    finally:
        a.close()
        b.close()


def test_pin_degrades_silently():
    a = SharedArena(1 << 16, pin=True)
    try:
        assert a.pinned in (True, False)
    finally:
        a.close()


def test_hugetlb_falls_back_when_unavailable():
    a = SharedArena(1 << 16, pin=False, hugetlb=True)
    try:
        assert a.capacity >= 1 << 16
        assert a.fits(100)
    finally:
        a.close()
