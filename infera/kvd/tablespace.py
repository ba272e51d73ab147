"""The L3 tablespace: preallocated container files cut into fixed slots, a RAM bitset allocator, and
a journal of JSON lines that makes each write durable and recoverable.

A put reserves a run of contiguous free slots in one container, writes the value there, makes the
data durable (fsync), and only then appends its journal record (and fsyncs the journal): a record
on disk always points at complete data. Each record carries the value's xxh64, checked on every
read, so a slot that was reused after a crash (an eviction whose journal line never landed) is a
miss, never served. Recovery loads ``index.snapshot.json`` (``.bak`` if the newest is unreadable)
and replays the journal, truncating a torn tail. With a flush interval > 0 puts are group-committed:
one fsync of each touched container and one of the journal per window.

Blocking file I/O throughout: the daemon calls this from worker threads, never its event loop.
"""
from __future__ import annotations

import base64
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import xxhash

from infera.kvd.store import Namespaced

log = logging.getLogger("infera.kvd.tablespace")

JOURNAL = "index.log"
SNAPSHOT = "index.snapshot.json"
GEOMETRY = "geometry.json"
COMPACT_MIN_RECORDS = 10_000


@dataclass(slots=True)
class Record:
    ns: Namespaced
    container: int
    slot: int
    nslots: int
    length: int
    checksum: int
    retention: str
    expires_at: float | None  # wall clock (survives restarts)
    seq: int

    def to_json(self) -> dict[str, Any]:
        return {"op": "put", "seq": self.seq, "m": self.ns.model, "c": self.ns.compat_key,
                "k": base64.b64encode(self.ns.key).decode(), "cont": self.container, "slot": self.slot,
                "n": self.nslots, "len": self.length, "xxh": self.checksum, "ret": self.retention,
                "exp": self.expires_at}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Record":
        ns = Namespaced(str(d["m"]), str(d["c"]), base64.b64decode(d["k"], validate=True))
        exp = d.get("exp")
        return cls(ns, int(d["cont"]), int(d["slot"]), int(d["n"]), int(d["len"]), int(d["xxh"]), str(d["ret"]),
                   None if exp is None else float(exp), int(d["seq"]))


def _ns_json(ns: Namespaced, seq: int) -> dict[str, Any]:
    return {"op": "del", "seq": seq, "m": ns.model, "c": ns.compat_key, "k": base64.b64encode(ns.key).decode()}


class Tablespace:
    def __init__(self, root: str, total_bytes: int, *, container_bytes: int = 1 << 30, slot_bytes: int = 64 << 10,
                 flush_interval_ms: int = 0):
        if slot_bytes <= 0 or container_bytes < slot_bytes or total_bytes < container_bytes:
            raise ValueError("need total_bytes >= container_bytes >= slot_bytes > 0")
        self.root = root
        self.container_bytes = container_bytes
        self.slot_bytes = slot_bytes
        self.slots_per_container = container_bytes // slot_bytes
        self.num_containers = total_bytes // container_bytes
        self.flush_interval = flush_interval_ms / 1000.0
        self._lock = threading.Lock()  # index, bitsets, pending records
        self._journal_lock = threading.Lock()  # journal appends, snapshots; taken before _lock
        self._committed = threading.Condition()
        self._index: OrderedDict[Namespaced, Record] = OrderedDict()  # least recently used first
        self._bits: list[bytearray] = []
        self._fds: list[int] = []
        self._pending: list[tuple[int, dict[str, Any], Record | None]] = []
        self._seq = 0
        self._committed_seq = 0
        self._journal_records = 0
        self._journal_fd = -1
        self._closed = False
        self._inflight = 0  # puts between reservation and commit
        self._committer: threading.Thread | None = None
        self.used_bytes = 0
        self.evictions_total = 0
        self.corrupt_reads_total = 0

    # --- lifecycle ------------------------------------------------------------------------------

    def open(self) -> "Tablespace":
        os.makedirs(os.path.join(self.root, "containers"), exist_ok=True)
        for i in range(self.num_containers):
            path = os.path.join(self.root, "containers", f"{i:04d}.bin")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            if os.fstat(fd).st_size < self.container_bytes:
                try:
                    os.posix_fallocate(fd, 0, self.container_bytes)
                except OSError:  # a filesystem without fallocate: a sparse file still works
                    os.ftruncate(fd, self.container_bytes)
            self._fds.append(fd)
            self._bits.append(bytearray(self.slots_per_container))
        self._recover()
        if self.flush_interval > 0:
            self._committer = threading.Thread(target=self._commit_loop, name="kvd-tablespace-commit", daemon=True)
            self._committer.start()
        return self

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True  # no new puts from here on
        with self._committed:
            self._committed.notify_all()
            while self._inflight:  # puts already past reservation commit themselves, fds still open
                self._committed.wait(1.0)
        if self._committer is not None:
            self._committer.join()
        self._flush()
        self._snapshot()
        os.close(self._journal_fd)
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def _recover(self) -> None:
        geometry = {"slot_bytes": self.slot_bytes, "container_bytes": self.container_bytes}
        try:
            with open(self._path(GEOMETRY)) as f:
                old = json.load(f)
        except (OSError, ValueError):
            old = None
        fresh = old != geometry
        if fresh and old is not None:
            log.warning("tablespace geometry changed (%s -> %s): starting empty", old, geometry)
        if fresh:
            for name in (SNAPSHOT, SNAPSHOT + ".bak", JOURNAL):
                try:
                    os.unlink(self._path(name))
                except FileNotFoundError:
                    pass
            _write_atomic(self._path(GEOMETRY), json.dumps(geometry).encode())
        index: dict[Namespaced, Record] = {}
        snap_seq = 0
        for name in (SNAPSHOT, SNAPSHOT + ".bak"):
            try:
                with open(self._path(name), "rb") as f:
                    snap = json.loads(f.read())
                recs = [Record.from_json(d) for d in snap["records"]]
                snap_seq = int(snap["seq"])
            except FileNotFoundError:
                continue
            except (ValueError, KeyError, TypeError) as e:
                log.warning("tablespace snapshot %s unreadable (%s)", name, e)
                continue
            index = {r.ns: r for r in recs}
            break
        self._journal_fd = os.open(self._path(JOURNAL), os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        max_seq, replayed = self._replay(index, snap_seq)
        # rebuild the allocator; a record out of bounds or overlapping an earlier one is dropped
        for rec in sorted(index.values(), key=lambda r: r.seq):
            if not self._extent_valid(rec) or any(self._bits[rec.container][rec.slot:rec.slot + rec.nslots]):
                continue
            self._mark(rec, 1)
            self._index[rec.ns] = rec
            self.used_bytes += rec.length
        self._seq = self._committed_seq = max(max_seq, snap_seq)
        self._journal_records = replayed
        log.info("tablespace %s: %d entries, %d bytes recovered", self.root, len(self._index), self.used_bytes)

    def _replay(self, index: dict[Namespaced, Record], snap_seq: int) -> tuple[int, int]:
        size = os.fstat(self._journal_fd).st_size
        data = os.pread(self._journal_fd, size, 0) if size else b""
        pos, max_seq, count = 0, 0, 0
        while pos < len(data):
            end = data.find(b"\n", pos)
            if end < 0:
                break  # a line the crash cut short
            try:
                d = json.loads(data[pos:end])
                seq = int(d["seq"])
                if d["op"] == "put":
                    rec = Record.from_json(d)
                    if seq > snap_seq:
                        index[rec.ns] = rec
                elif d["op"] == "del":
                    ns = Namespaced(str(d["m"]), str(d["c"]), base64.b64decode(d["k"], validate=True))
                    if seq > snap_seq:
                        index.pop(ns, None)
                else:
                    raise ValueError(f"unknown journal op {d['op']!r}")
            except (ValueError, KeyError, TypeError) as e:
                log.warning("tablespace journal: bad record at byte %d (%s)", pos, e)
                break
            max_seq = max(max_seq, seq)
            count += 1
            pos = end + 1
        if pos < len(data):
            log.warning("tablespace journal: truncating %d torn bytes at %d", len(data) - pos, pos)
            os.ftruncate(self._journal_fd, pos)
            os.fsync(self._journal_fd)
        return max_seq, count

    def _extent_valid(self, rec: Record) -> bool:
        return (0 <= rec.container < self.num_containers and rec.nslots >= 1 and 0 <= rec.slot
                and rec.slot + rec.nslots <= self.slots_per_container
                and 0 <= rec.length <= rec.nslots * self.slot_bytes)

    # --- allocator ------------------------------------------------------------------------------

    def _mark(self, rec: Record, value: int) -> None:
        self._bits[rec.container][rec.slot:rec.slot + rec.nslots] = bytes([value]) * rec.nslots

    def _find_extent(self, nslots: int) -> tuple[int, int] | None:
        hole = bytes(nslots)
        for c, bits in enumerate(self._bits):
            i = bits.find(hole)
            if i >= 0:
                return c, i
        return None

    def _evict_one(self, incoming: Namespaced) -> bool:
        if not self._index:
            return False
        ns, rec = self._index.popitem(last=False)
        self._drop(rec)
        if ns != incoming:  # making room by dropping the version being replaced is no eviction
            self.evictions_total += 1
        return True

    def _drop(self, rec: Record) -> None:
        """Forget ``rec`` (under _lock): its slots are free, and a del record is queued."""
        self._mark(rec, 0)
        self.used_bytes -= rec.length
        self._seq += 1
        self._pending.append((self._seq, _ns_json(rec.ns, self._seq), None))

    # --- operations (blocking; called from worker threads) --------------------------------------

    def put(self, ns: Namespaced, value: bytes | memoryview, retention: str = "long",
            expires_at: float | None = None) -> bool:
        """Durably store ``value``; False when it can never fit (larger than a container)."""
        length = len(value)
        nslots = max(1, -(-length // self.slot_bytes))
        if nslots > self.slots_per_container:
            return False
        with self._lock:
            if self._closed:
                return False
            while (where := self._find_extent(nslots)) is None:
                if not self._evict_one(ns):
                    return False
            container, slot = where
            rec = Record(ns, container, slot, nslots, length, xxhash.xxh64_intdigest(value), retention, expires_at, 0)
            self._mark(rec, 1)
            self._inflight += 1
        try:
            try:
                _pwrite_all(self._fds[container], value, slot * self.slot_bytes)
            except OSError:
                with self._lock:
                    self._mark(rec, 0)
                raise
            with self._lock:
                self._seq += 1
                rec.seq = self._seq
                self._pending.append((rec.seq, rec.to_json(), rec))
            if self.flush_interval <= 0:
                self._flush()
            self._wait_committed(rec.seq)
            return True
        finally:
            with self._committed:
                self._inflight -= 1
                self._committed.notify_all()

    def get(self, ns: Namespaced) -> tuple[bytes, str] | None:
        with self._lock:
            rec = self._index.get(ns)
            if rec is None:
                return None
            if rec.expires_at is not None and time.time() >= rec.expires_at:
                del self._index[ns]
                self._drop(rec)
                return None
            self._index.move_to_end(ns)
        data = os.pread(self._fds[rec.container], rec.length, rec.slot * self.slot_bytes)
        if len(data) != rec.length or xxhash.xxh64_intdigest(data) != rec.checksum:
            with self._lock:
                self.corrupt_reads_total += 1
                if self._index.get(ns) is rec:
                    del self._index[ns]
                    self._drop(rec)
            log.warning("tablespace: checksum mismatch for %r; dropped", ns)
            return None
        return data, rec.retention

    def contains(self, ns: Namespaced) -> bool:
        with self._lock:
            rec = self._index.get(ns)
            return rec is not None and (rec.expires_at is None or time.time() < rec.expires_at)

    def remove(self, ns: Namespaced) -> bool:
        with self._lock:
            rec = self._index.pop(ns, None)
            if rec is not None:
                self._drop(rec)
        if rec is not None:
            self._flush()
        return rec is not None

    def clear(self, model: str = "", compat_key: str = "") -> list[Namespaced]:
        with self._lock:
            doomed = [ns for ns in self._index
                      if (not model or ns.model == model) and (not compat_key or ns.compat_key == compat_key)]
            for ns in doomed:
                self._drop(self._index.pop(ns))
        self._flush()
        return doomed

    def __len__(self) -> int:
        return len(self._index)

    # --- commit ---------------------------------------------------------------------------------

    def _commit_loop(self) -> None:
        while not self._closed:
            with self._committed:
                self._committed.wait(self.flush_interval)
            self._flush()

    def _flush(self) -> None:
        with self._journal_lock:
            with self._lock:
                batch, self._pending = self._pending, []
            if not batch:
                return
            for c in {rec.container for _, _, rec in batch if rec is not None}:
                os.fsync(self._fds[c])
            lines = b"".join(json.dumps(d, separators=(",", ":")).encode() + b"\n" for _, d, _ in batch)
            _write_all(self._journal_fd, lines)
            os.fsync(self._journal_fd)
            with self._lock:
                for _, _, rec in batch:
                    if rec is None:
                        continue
                    old = self._index.pop(rec.ns, None)
                    if old is not None:
                        self._mark(old, 0)
                        self.used_bytes -= old.length
                    self._index[rec.ns] = rec
                    self.used_bytes += rec.length
                self._journal_records += len(batch)
                compact = self._journal_records > max(COMPACT_MIN_RECORDS, 4 * len(self._index))
            with self._committed:
                self._committed_seq = max(self._committed_seq, batch[-1][0])
                self._committed.notify_all()
            if compact:
                self._snapshot_locked()

    def _wait_committed(self, seq: int) -> None:
        while True:
            with self._committed:
                if self._committed_seq >= seq:
                    return
                if not self._closed:
                    self._committed.wait(1.0)
                    continue
            self._flush()  # closed while this put was in flight: nobody else will commit it

    def _snapshot(self) -> None:
        with self._journal_lock:
            self._snapshot_locked()

    def _snapshot_locked(self) -> None:
        """Write the whole index atomically (the previous snapshot becomes .bak), then empty the
        journal: replay skips records the snapshot already covers, so a crash in between is safe."""
        with self._lock:
            records = [r.to_json() for r in self._index.values()]
            seq = self._committed_seq
        body = json.dumps({"seq": seq, "records": records}, separators=(",", ":")).encode()
        snap = self._path(SNAPSHOT)
        tmp = snap + ".tmp"
        with open(tmp, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(snap):
            os.replace(snap, snap + ".bak")
        os.replace(tmp, snap)
        _fsync_dir(self.root)
        os.ftruncate(self._journal_fd, 0)
        os.fsync(self._journal_fd)
        self._journal_records = 0


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, body: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def selfcheck(root: str, nbytes: int = 16 << 20) -> tuple[float, float]:
    """Write (with fsync) and read back ``nbytes`` under ``root``; returns (write, read) GB/s."""
    path = os.path.join(root, ".kvd-selfcheck.tmp")
    block = os.urandom(1 << 20)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, len(block)):
            _pwrite_all(fd, block, off)
        os.fsync(fd)
        t1 = time.perf_counter()
        for off in range(0, nbytes, len(block)):
            if os.pread(fd, len(block), off) != block:
                raise OSError(f"self-check read back different bytes at offset {off}")
        t2 = time.perf_counter()
    finally:
        os.close(fd)
        os.unlink(path)
    return nbytes / max(t1 - t0, 1e-9) / 1e9, nbytes / max(t2 - t1, 1e-9) / 1e9
