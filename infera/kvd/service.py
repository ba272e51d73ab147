"""What each kvd op does: the tiers (L2 host store + arena, L3 tablespace) behind the wire protocol.

Runs on the daemon's event loop. Every L3 call goes to a thread pool; ``long`` SETs are written
through to L3 before they are acknowledged, serialized per key and re-reading the value RAM holds
at that moment, so concurrent SETs of one key leave L3 with the one RAM kept.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from infera.kvd import protocol as p
from infera.kvd.arena import NO_ARENA, SLOT_HEADER_BYTES, SharedArena
from infera.kvd.metrics import L2, L3, KvdMetrics
from infera.kvd.store import DEFAULT_RETENTION, Entry, HostStore, Namespaced, SetOutcome
from infera.kvd.tablespace import Tablespace

log = logging.getLogger("infera.kvd.service")

PREFETCH_QUEUE = 64
PREFETCH_YIELD_EVERY = 256  # prefetch: keys between yields to the event loop (a yield costs ~1 µs)
UNKNOWN_LEASE = "unknown_lease"


@dataclass
class Connection:
    """Per-connection state: who it is, whether it mapped the arena, which leases it holds."""
    client_id: str = ""
    shared: bool = False
    leases: set[int] = field(default_factory=set)


@dataclass
class _Hint:
    keys: list[Namespaced]
    deadline: float  # monotonic
    ttl: float


class KvdService:
    def __init__(self, store: HostStore, *, long_region: Tablespace | None = None,
                 metrics: KvdMetrics | None = None, io_workers: int = 8, server_id: str | None = None):
        self.store = store
        self.arena: SharedArena | None = store.arena
        self.long = long_region
        self.metrics = metrics or KvdMetrics()
        self.server_id = server_id or f"kvd-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._io = ThreadPoolExecutor(max_workers=io_workers, thread_name_prefix="kvd-io")
        self._key_locks: dict[Namespaced, list] = {}  # [lock, users]
        self._prefetch: asyncio.Queue[_Hint] = asyncio.Queue(PREFETCH_QUEUE)
        self._prefetch_task: asyncio.Task | None = None
        self._long_evictions_seen = 0
        self.gets_total = self.sets_total = self.hits_total = self.misses_total = 0
        self.l2_hits_total = self.l3_hits_total = 0
        self.prefetch_dropped_total = self.prefetch_loaded_total = 0
        store.on_evict = lambda ns, e: self.metrics.evictions.labels(L2).inc()
        self.metrics.watch_tier(L2, lambda: store.inline_bytes + store.arena_bytes, lambda: len(store))
        if long_region is not None:
            self.metrics.watch_tier(L3, lambda: long_region.used_bytes, lambda: len(long_region))
        self._handlers: dict[type, Callable[[object, Connection], Awaitable[p.Message | None]]] = {
            p.Get: self._get, p.BatchGet: self._batch_get, p.Set: self._set, p.BatchSet: self._batch_set,
            p.SetReserve: self._set_reserve, p.SetCommit: self._set_commit, p.SetCancel: self._set_cancel,
            p.PrefetchHint: self._prefetch_hint, p.Exists: self._exists, p.Clear: self._clear, p.Stats: self._stats,
        }

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._prefetch_task = asyncio.get_running_loop().create_task(self._prefetch_worker(), name="kvd-prefetch")

    async def close(self) -> None:
        if self._prefetch_task is not None:
            self._prefetch_task.cancel()
            try:
                await self._prefetch_task
            except asyncio.CancelledError:
                pass
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._io.shutdown, True)
        if self.long is not None:
            await loop.run_in_executor(None, self.long.close)
        if self.arena is not None:
            self.arena.close()

    # --- dispatch -------------------------------------------------------------------------------

    def hello(self, req: p.Hello, conn: Connection) -> tuple[p.HelloAck, bool]:
        """The ack, and whether the arena descriptor must follow it."""
        conn.client_id = req.client_id
        conn.shared = bool(req.prefers_shared_arena and self.arena is not None)
        arena = (self.arena.capacity, self.arena.slot_size, os.getpid()) if conn.shared else None
        return p.HelloAck(server_id=self.server_id, protocol_version=p.PROTOCOL_VERSION, shared_arena=arena), \
            conn.shared

    async def handle(self, req: p.Request, conn: Connection) -> p.Message | None:
        return await self._handlers[type(req)](req, conn)

    def disconnect(self, conn: Connection) -> None:
        """Leases die with their connection."""
        for token in conn.leases:
            self.arena.cancel(token)
        conn.leases.clear()

    # --- reads ----------------------------------------------------------------------------------

    async def _lookup(self, ns: Namespaced) -> tuple[Entry | None, bytes | None]:
        """(entry in RAM, or None plus the value when only L3 had it and RAM could not take it)."""
        self.gets_total += 1
        t0 = time.perf_counter()
        entry = self.store.lookup(ns)
        if entry is not None:
            self.hits_total += 1
            self.l2_hits_total += 1
            self.metrics.hits.labels(L2).inc()
            self.metrics.load_seconds.labels(L2).observe(time.perf_counter() - t0)
            return entry, None
        self.metrics.misses.labels(L2).inc()
        if self.long is None:
            self.misses_total += 1
            return None, None
        found = await asyncio.get_running_loop().run_in_executor(self._io, self.long.get, ns)
        if found is None:
            self.misses_total += 1
            self.metrics.misses.labels(L3).inc()
            return None, None
        value, retention = found
        self.hits_total += 1
        self.l3_hits_total += 1
        self.metrics.hits.labels(L3).inc()
        self.metrics.load_seconds.labels(L3).observe(time.perf_counter() - t0)
        self.store.insert_if_absent(ns, value, retention)  # promote; a newer SET meanwhile wins
        entry = self.store.lookup(ns, touch=False)
        return (entry, None) if entry is not None else (None, value)

    async def _get(self, req: p.Get, conn: Connection) -> p.Message:
        entry, value = await self._lookup(Namespaced(req.model, req.compat_key, req.key))
        if entry is None:
            return p.GetResponse(value=value, retention="long" if value is not None else "")
        if conn.shared and entry.in_arena:
            return p.GetSharedResponse(slot_offset=self.arena.offset(entry.slot), length=entry.length,
                                       version=entry.version, retention=entry.retention,
                                       slot_size=self.arena.slot_size)
        return p.GetResponse(value=self.store.value_of(entry), retention=entry.retention)

    async def _batch_get(self, req: p.BatchGet, conn: Connection) -> p.Message:
        found = await asyncio.gather(*(self._lookup(Namespaced(req.model, req.compat_key, k)) for k in req.keys))
        # one shared answer only when every hit sits in the arena; else plain values for all
        if conn.shared and all(v is None and (e is None or e.in_arena) for e, v in found):
            offsets, lengths, versions, retentions = [], [], [], []
            for e, _ in found:
                offsets.append(self.arena.offset(e.slot) if e else -1)
                lengths.append(e.length if e else 0)
                versions.append(e.version if e else 0)
                retentions.append(e.retention if e else "")
            return p.BatchGetSharedResponse(offsets=offsets, lengths=lengths, versions=versions,
                                            retentions=retentions, slot_size=self.arena.slot_size)
        values, retentions = [], []
        for e, v in found:
            values.append(self.store.value_of(e) if e is not None else v)
            retentions.append(e.retention if e is not None else ("long" if v is not None else ""))
        return p.BatchGetResponse(values=values, retentions=retentions)

    async def _exists(self, req: p.Exists, conn: Connection) -> p.Message:
        present = []
        for k in req.keys:
            ns = Namespaced(req.model, req.compat_key, k)
            present.append(self.store.contains(ns) or (self.long is not None and self.long.contains(ns)))
        return p.ExistsResponse(present=present)

    # --- writes ---------------------------------------------------------------------------------

    async def _store(self, ns: Namespaced, value: bytes, retention: str, metadata: dict,
                     ttl: float | None) -> SetOutcome:
        self.sets_total += 1
        outcome = self.store.set(ns, value, retention, metadata=metadata, ttl_seconds=ttl)
        self.metrics.sets.labels(outcome.reason).inc()
        if outcome.accepted and outcome.reason == "" and retention == "long":
            await self._write_through(ns, ttl)
        return outcome

    async def _write_through(self, ns: Namespaced, ttl: float | None) -> None:
        if self.long is None:
            return
        held = self._key_locks.setdefault(ns, [asyncio.Lock(), 0])
        held[1] += 1
        try:
            async with held[0]:
                entry = self.store.lookup(ns, touch=False)
                if entry is None or entry.retention != "long":
                    return  # overwritten or evicted meanwhile: that writer decides
                value = self.store.value_of(entry)
                expires_at = None if ttl is None else time.time() + ttl
                ok = await asyncio.get_running_loop().run_in_executor(
                    self._io, self.long.put, ns, value, "long", expires_at)
                if not ok:
                    log.warning("L3 could not take %d bytes for %r", len(value), ns)
                evicted = self.long.evictions_total - self._long_evictions_seen
                if evicted > 0:
                    self._long_evictions_seen += evicted
                    self.metrics.evictions.labels(L3).inc(evicted)
        except OSError as e:
            log.error("L3 write-through failed for %r: %s", ns, e)
        finally:
            held[1] -= 1
            if held[1] == 0:
                del self._key_locks[ns]

    async def _set(self, req: p.Set, conn: Connection) -> p.Message:
        outcome = await self._store(Namespaced(req.model, req.compat_key, req.key), req.value, req.retention,
                                    req.metadata, req.ttl_seconds)
        return p.SetAck(accepted=outcome.accepted, reason=outcome.reason)

    async def _batch_set(self, req: p.BatchSet, conn: Connection) -> p.Message:
        n = len(req.keys)
        if (len(req.values) != n or (req.retentions and len(req.retentions) != n)
                or (req.metadatas and len(req.metadatas) != n)
                or (req.ttls_seconds is not None and len(req.ttls_seconds) != n)):
            return p.Error(code=p.BATCH_SET_ARITY_MISMATCH,
                           message="keys, values, retentions, metadatas and ttls_seconds must be equally long")
        accepted, reasons = [], []
        for i, key in enumerate(req.keys):
            outcome = await self._store(
                Namespaced(req.model, req.compat_key, key), req.values[i],
                req.retentions[i] if req.retentions else DEFAULT_RETENTION,
                req.metadatas[i] if req.metadatas else {},
                req.ttls_seconds[i] if req.ttls_seconds is not None else None)
            accepted.append(outcome.accepted)
            reasons.append(outcome.reason)
        return p.BatchSetAck(accepted=accepted, reasons=reasons)

    async def _set_reserve(self, req: p.SetReserve, conn: Connection) -> p.Message:
        if not conn.shared:
            return p.SetReserveResponse(lease_token=0, reason=NO_ARENA)
        lease, evicted, reason = self.arena.reserve(req.size)
        if evicted is not None:
            self.store.evict_slot(evicted)
        if lease is None:
            return p.SetReserveResponse(lease_token=0, reason=reason)
        conn.leases.add(lease.token)
        return p.SetReserveResponse(lease_token=lease.token, slot_id=lease.slot,
                                    payload_offset=self.arena.offset(lease.slot) + SLOT_HEADER_BYTES,
                                    payload_max_size=self.arena.payload_max, reason="")

    async def _set_commit(self, req: p.SetCommit, conn: Connection) -> p.Message:
        if req.lease_token not in conn.leases:
            return p.SetCommitResponse(accepted=False, reason=UNKNOWN_LEASE)
        conn.leases.discard(req.lease_token)
        lease = self.arena.take_lease(req.lease_token)
        retention = DEFAULT_RETENTION if req.retention in ("", "default") else req.retention
        ttl = req.ttl_seconds if req.ttl_seconds > 0 else None
        self.sets_total += 1
        if not 0 <= req.length <= self.arena.payload_max:
            outcome = SetOutcome(False, "oversize")
        else:
            outcome = self.store.commit_slot(Namespaced(req.model, req.compat_key, req.key), lease.slot,
                                             req.length, retention, ttl)
        self.metrics.sets.labels(outcome.reason).inc()
        if not outcome.accepted:
            self.arena.finish_write(lease.slot, 0)
            self.arena.free(lease.slot)
        elif retention == "long":
            await self._write_through(Namespaced(req.model, req.compat_key, req.key), ttl)
        return p.SetCommitResponse(accepted=outcome.accepted, reason=outcome.reason)

    async def _set_cancel(self, req: p.SetCancel, conn: Connection) -> p.Message:
        if req.lease_token in conn.leases:
            conn.leases.discard(req.lease_token)
            self.arena.cancel(req.lease_token)
        return p.SetCancelResponse()

    async def _clear(self, req: p.Clear, conn: Connection) -> p.Message:
        cleared = set(self.store.clear(req.model, req.compat_key))
        if self.long is not None:
            cleared.update(await asyncio.get_running_loop().run_in_executor(
                self._io, self.long.clear, req.model, req.compat_key))
        return p.ClearAck(cleared_entries=len(cleared))  # distinct entries, whichever tiers held them

    async def _stats(self, req: p.Stats, conn: Connection) -> p.Message:
        return self.stats()

    def stats(self) -> p.StatsResponse:
        s, a, lr = self.store, self.arena, self.long
        return p.StatsResponse(
            entries=len(s), host_bytes=s.inline_bytes + s.arena_bytes, spillover_bytes=0,
            long_bytes=lr.used_bytes if lr else 0, gets_total=self.gets_total, sets_total=self.sets_total,
            hits_total=self.hits_total, misses_total=self.misses_total,
            evictions_total=s.evictions_total + (lr.evictions_total if lr else 0),
            l2_hits_total=self.l2_hits_total, l3_hits_total=self.l3_hits_total, long_entries=len(lr) if lr else 0,
            arena_slots=a.num_slots if a else 0, arena_slot_size=a.slot_size if a else 0,
            arena_entries=a.used_slots if a else 0, prefetch_dropped_total=self.prefetch_dropped_total,
            prefetch_loaded_total=self.prefetch_loaded_total)

    # --- prefetch -------------------------------------------------------------------------------

    async def _prefetch_hint(self, req: p.PrefetchHint, conn: Connection) -> None:
        ttl = max(req.deadline_ms, 1) / 1000.0
        hint = _Hint([Namespaced(req.model, req.compat_key, k) for k in req.keys], time.monotonic() + ttl, ttl)
        try:
            self._prefetch.put_nowait(hint)
        except asyncio.QueueFull:
            self.prefetch_dropped_total += len(hint.keys)
            self.metrics.prefetch.labels("dropped").inc(len(hint.keys))
        return None  # fire-and-forget: no response frame

    async def _prefetch_worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            hint = await self._prefetch.get()
            for i, ns in enumerate(hint.keys):
                if i and i % PREFETCH_YIELD_EVERY == 0:
                    # a big hint of keys in RAM or absent would never await: let other clients' gets run
                    await asyncio.sleep(0)
                if time.monotonic() >= hint.deadline:
                    self.metrics.prefetch.labels("expired").inc(len(hint.keys) - i)  # the rest, at once
                    break
                if self.store.contains(ns):
                    self.metrics.prefetch.labels("in_ram").inc()
                    continue
                if self.long is None:
                    self.metrics.prefetch.labels("absent").inc()
                    continue
                try:
                    found = await loop.run_in_executor(self._io, self.long.get, ns)
                except OSError as e:
                    log.warning("prefetch read failed for %r: %s", ns, e)
                    found = None
                if found is None:
                    self.metrics.prefetch.labels("absent").inc()
                    continue
                if self.store.insert_if_absent(ns, found[0], "short", ttl_seconds=hint.ttl):
                    self.prefetch_loaded_total += 1
                    self.metrics.prefetch.labels("loaded").inc()
