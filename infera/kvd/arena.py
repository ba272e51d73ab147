"""The L2 shared arena: one memfd the daemon maps and hands to engine clients over SCM_RIGHTS, so a
value moves between the daemon and an engine without passing through the socket.

Layout: fixed-size slots; each starts with a 16-byte header (u32 LE version, u32 LE payload
length, 8 reserved bytes). The version is a seqlock: odd while the slot is being written, even
when stable, and it moves on every rewrite, so a reader holding an old version sees the slot was
reused. The slot size is fixed by the first put (header included, rounded up to 64 bytes).
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import itertools
import logging
import mmap
import os
import socket
import struct
from collections import OrderedDict
from dataclasses import dataclass

from infera.kvd.protocol import FD_MESSAGE_BYTE

log = logging.getLogger("infera.kvd.arena")

SLOT_HEADER = struct.Struct("<II8x")
SLOT_HEADER_BYTES = SLOT_HEADER.size  # 16
SLOT_ALIGN = 64
HUGE_PAGE_BYTES = 2 * 1024 * 1024
READ_RETRIES = 4

# reserve rejections (wire reasons)
NO_ARENA = "no_arena"
OVERSIZE = "oversize"
ARENA_FULL = "arena_full_no_evictable"


def slot_size_for(payload_len: int) -> int:
    need = payload_len + SLOT_HEADER_BYTES
    return (need + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


def _mlock(mm: mmap.mmap, length: int) -> bool:
    """Pin the arena (best effort: RLIMIT_MEMLOCK or a missing libc just leaves it unpinned)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        anchor = ctypes.c_char.from_buffer(mm)
        try:
            addr = ctypes.addressof(anchor)
        finally:
            del anchor  # the export would otherwise keep the mmap from closing
        rc = libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(length))
        if rc != 0:
            log.info("arena not pinned (mlock: %s)", os.strerror(ctypes.get_errno()))
            return False
        return True
    except (OSError, AttributeError, TypeError) as e:
        log.info("arena not pinned (%s)", e)
        return False


@dataclass(slots=True)
class Lease:
    token: int
    slot: int


class SharedArena:
    """Daemon side: owns the memfd, the slot allocator (free list + LRU of committed slots) and the
    zero-copy write leases. Not thread-safe: the daemon drives it from its event loop only."""

    def __init__(self, capacity: int, *, pin: bool = True, hugetlb: bool = False, name: str = "infera-kvd-arena"):
        if capacity <= 0:
            raise ValueError("arena capacity must be > 0")
        self.hugetlb = False
        if hugetlb:
            try:
                size = (capacity + HUGE_PAGE_BYTES - 1) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
                self.fd, self.mm = self._create(name, size, os.MFD_CLOEXEC | os.MFD_HUGETLB)
                capacity, self.hugetlb = size, True
            except OSError as e:
                log.warning("hugetlb arena unavailable (%s); using normal pages", e)
        if not self.hugetlb:
            self.fd, self.mm = self._create(name, capacity, os.MFD_CLOEXEC)
        self.capacity = capacity
        self.pinned = _mlock(self.mm, capacity) if pin else False
        self.slot_size = 0
        self.num_slots = 0
        self._free: list[int] = []
        self._lru: OrderedDict[int, None] = OrderedDict()  # committed slots, oldest first
        self._leases: dict[int, Lease] = {}
        self._leased_slots: set[int] = set()
        self._tokens = itertools.count(1)  # 0 means "rejected" on the wire

    @staticmethod
    def _create(name: str, size: int, flags: int) -> tuple[int, mmap.mmap]:
        fd = os.memfd_create(name, flags)
        try:
            os.ftruncate(fd, size)
            return fd, mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            raise

    def close(self) -> None:
        try:
            self.mm.close()
        finally:
            os.close(self.fd)

    # --- geometry -------------------------------------------------------------------------------

    def fits(self, payload_len: int) -> bool:
        """Whether a payload can live in a slot; the first call fixes the slot size."""
        if self.slot_size == 0:
            size = slot_size_for(payload_len)
            if size > self.capacity:
                return False
            self.slot_size = size
            self.num_slots = self.capacity // size
            self._free = list(range(self.num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        return payload_len + SLOT_HEADER_BYTES <= self.slot_size

    def offset(self, slot: int) -> int:
        return slot * self.slot_size

    @property
    def payload_max(self) -> int:
        return max(0, self.slot_size - SLOT_HEADER_BYTES)

    @property
    def used_slots(self) -> int:
        return len(self._lru)

    # --- allocation -----------------------------------------------------------------------------

    def allocate(self) -> tuple[int, int | None] | None:
        """A slot to write: a free one, else the least recently used committed one. Returns
        (slot, evicted slot or None) — the caller drops whatever entry the evicted slot held — or
        None when every slot is leased."""
        if self._free:
            return self._free.pop(), None
        if not self._lru:
            return None
        victim, _ = self._lru.popitem(last=False)
        return victim, victim

    def commit(self, slot: int) -> None:
        self._lru[slot] = None
        self._lru.move_to_end(slot)

    def touch(self, slot: int) -> None:
        if slot in self._lru:
            self._lru.move_to_end(slot)

    def free(self, slot: int) -> None:
        self._lru.pop(slot, None)
        self._free.append(slot)

    # --- seqlock writes -------------------------------------------------------------------------

    def version(self, slot: int) -> int:
        return SLOT_HEADER.unpack_from(self.mm, self.offset(slot))[0]

    def begin_write(self, slot: int) -> None:
        off = self.offset(slot)
        version, length = SLOT_HEADER.unpack_from(self.mm, off)
        if version % 2 == 0:
            SLOT_HEADER.pack_into(self.mm, off, (version + 1) & 0xFFFFFFFF, length)

    def finish_write(self, slot: int, length: int) -> int:
        off = self.offset(slot)
        version = SLOT_HEADER.unpack_from(self.mm, off)[0]
        if version % 2 == 0:  # finish without begin: still move past any version a reader holds
            version = (version + 1) & 0xFFFFFFFF
        version = (version + 1) & 0xFFFFFFFF
        struct.pack_into("<I", self.mm, off + 4, length)
        struct.pack_into("<I", self.mm, off, version)  # the version store last publishes the slot
        return version

    def write(self, slot: int, data: bytes | bytearray | memoryview) -> int:
        self.begin_write(slot)
        start = self.offset(slot) + SLOT_HEADER_BYTES
        self.mm[start:start + len(data)] = data
        return self.finish_write(slot, len(data))

    def read(self, slot: int, length: int) -> bytes:
        start = self.offset(slot) + SLOT_HEADER_BYTES
        return self.mm[start:start + length]

    # --- zero-copy write leases -----------------------------------------------------------------

    def reserve(self, size: int) -> tuple[Lease | None, int | None, str]:
        """(lease, evicted slot, reason). The slot is marked odd (being written) until commit."""
        if size < 0 or not self.fits(size):
            return None, None, OVERSIZE
        got = self.allocate()
        if got is None:
            return None, None, ARENA_FULL
        slot, evicted = got
        lease = Lease(next(self._tokens), slot)
        self._leases[lease.token] = lease
        self._leased_slots.add(slot)
        self.begin_write(slot)
        return lease, evicted, ""

    def take_lease(self, token: int) -> Lease | None:
        lease = self._leases.pop(token, None)
        if lease is not None:
            self._leased_slots.discard(lease.slot)
        return lease

    def cancel(self, token: int) -> bool:
        lease = self.take_lease(token)
        if lease is None:
            return False
        self.finish_write(lease.slot, 0)  # readers of an older version must not match it
        self.free(lease.slot)
        return True


class ArenaView:
    """Client side: the arena mapped from the descriptor the daemon sent. Reads use the seqlock;
    writes go into a slot the daemon leased to this client."""

    def __init__(self, fd: int, size: int):
        self.fd = fd
        self.size = size
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def close(self) -> None:
        try:
            self.mm.close()
        finally:
            os.close(self.fd)

    def read(self, slot_offset: int, length: int, version: int) -> bytes | None:
        """The payload if the slot still holds ``version``; None once it was rewritten (a miss)."""
        start = slot_offset + SLOT_HEADER_BYTES
        if slot_offset < 0 or start + length > self.size:
            return None
        for _ in range(READ_RETRIES):
            v1 = SLOT_HEADER.unpack_from(self.mm, slot_offset)[0]
            if v1 != version:  # rewritten (or being rewritten) since the daemon answered
                return None
            data = self.mm[start:start + length]
            if SLOT_HEADER.unpack_from(self.mm, slot_offset)[0] == v1:
                return data
        return None

    def read_into(self, slot_offset: int, length: int, version: int, out: memoryview | bytearray) -> bool:
        """Copy the payload straight into ``out`` (e.g. a pinned host buffer); False on a miss, and
        then ``out`` may hold a partial copy."""
        start = slot_offset + SLOT_HEADER_BYTES
        if slot_offset < 0 or start + length > self.size or len(out) < length:
            return False
        for _ in range(READ_RETRIES):
            v1 = SLOT_HEADER.unpack_from(self.mm, slot_offset)[0]
            if v1 != version:
                return False
            with memoryview(self.mm) as whole:  # released at once: a live export would pin the mmap open
                memoryview(out)[:length] = whole[start:start + length]
            if SLOT_HEADER.unpack_from(self.mm, slot_offset)[0] == v1:
                return True
        return False

    def write_payload(self, payload_offset: int, data: bytes | bytearray | memoryview) -> None:
        self.mm[payload_offset:payload_offset + len(data)] = data


# --- descriptor passing ---------------------------------------------------------------------------

def send_fd(sock: socket.socket, fd: int) -> None:
    socket.send_fds(sock, [FD_MESSAGE_BYTE], [fd])


async def send_fd_async(loop: asyncio.AbstractEventLoop, sock: socket.socket, fd: int) -> None:
    while True:
        try:
            send_fd(sock, fd)
            return
        except BlockingIOError:
            await _wait_fd(loop, sock, writable=True)


def recv_fd(sock: socket.socket) -> int:
    msg, fds, _flags, _addr = socket.recv_fds(sock, 1, 1)
    return _check_fd_message(msg, fds)


async def recv_fd_async(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> int:
    while True:
        try:
            return recv_fd(sock)
        except BlockingIOError:
            await _wait_fd(loop, sock, writable=False)


def _check_fd_message(msg: bytes, fds: list[int]) -> int:
    if msg != FD_MESSAGE_BYTE or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ConnectionError(f"expected the arena descriptor message, got {msg!r} with {len(fds)} fds")
    return fds[0]


async def _wait_fd(loop: asyncio.AbstractEventLoop, sock: socket.socket, *, writable: bool) -> None:
    fut = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if writable else (loop.add_reader, loop.remove_reader)
    add(sock.fileno(), lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        remove(sock.fileno())


__all__ = ["SharedArena", "ArenaView", "Lease", "send_fd", "recv_fd", "send_fd_async", "recv_fd_async",
           "slot_size_for", "SLOT_HEADER", "SLOT_HEADER_BYTES", "NO_ARENA", "OVERSIZE", "ARENA_FULL"]
