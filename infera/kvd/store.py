"""The L2 host store: values in RAM (inline bytes, or slots of the shared arena) under retention
classes with priority eviction, lazy TTL and no downgrade of an entry's retention.

Only inline bytes count toward ``max_bytes``; arena-resident values are bounded by the arena's slot
count, and the arena's own LRU picks the slot to reuse (the store then drops that entry). Not
thread-safe: the daemon drives it from its event loop.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple

from infera.kvd.arena import SharedArena

RETENTION_PRIORITY = {"none": 0, "ephemeral": 10, "short": 50, "long": 100}
DEFAULT_RETENTION = "short"

# SET outcomes (wire reasons); "" = stored
UNKNOWN_RETENTION = "unknown_retention"
RETENTION_DOWNGRADE = "retention_downgrade_not_allowed"
WOULD_DISPLACE = "would_displace_higher_priority"
LARGER_THAN_STORE = "value_larger_than_store"
TTL_EXPIRED = "ttl_expired"  # accepted (counted) but not stored: it would expire on arrival


class Namespaced(NamedTuple):
    model: str
    compat_key: str
    key: bytes


@dataclass(slots=True)
class Entry:
    retention: str
    priority: int
    length: int
    value: bytes | None = None  # inline value; None when the value lives in an arena slot
    slot: int = -1
    version: int = 0  # arena slot version at commit
    expires_at: float | None = None  # monotonic clock
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def in_arena(self) -> bool:
        return self.slot >= 0


class SetOutcome(NamedTuple):
    accepted: bool
    reason: str = ""


def resolve_retention(retention: str) -> int | None:
    return RETENTION_PRIORITY.get(retention)


class HostStore:
    def __init__(self, max_bytes: int, arena: SharedArena | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 on_evict: Callable[[Namespaced, Entry], None] | None = None):
        self.max_bytes = max_bytes
        self.arena = arena
        self._clock = clock
        self.on_evict = on_evict  # called for every entry evicted for space
        self._entries: dict[Namespaced, Entry] = {}
        # inline entries only, per priority, least recently accessed first
        self._lru: dict[int, OrderedDict[Namespaced, None]] = {p: OrderedDict() for p in
                                                               sorted(RETENTION_PRIORITY.values())}
        self._inline_bytes_by_priority = {p: 0 for p in RETENTION_PRIORITY.values()}
        self._slot_owner: dict[int, Namespaced] = {}
        self.inline_bytes = 0
        self.arena_bytes = 0
        self.evictions_total = 0

    # --- reads ----------------------------------------------------------------------------------

    def lookup(self, ns: Namespaced, *, touch: bool = True) -> Entry | None:
        """The live entry (an expired one is dropped here: TTL is lazy); a hit refreshes its LRU."""
        entry = self._entries.get(ns)
        if entry is None:
            return None
        if entry.expires_at is not None and self._clock() >= entry.expires_at:
            self._remove(ns)
            return None
        if touch:
            if entry.in_arena:
                self.arena.touch(entry.slot)
            else:
                self._lru[entry.priority].move_to_end(ns)
        return entry

    def value_of(self, entry: Entry) -> bytes:
        if entry.in_arena:
            return self.arena.read(entry.slot, entry.length)
        return entry.value

    def contains(self, ns: Namespaced) -> bool:
        return self.lookup(ns, touch=False) is not None

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> Iterator[Namespaced]:
        return iter(list(self._entries))

    # --- writes ---------------------------------------------------------------------------------

    def set(self, ns: Namespaced, value: bytes, retention: str = DEFAULT_RETENTION, *,
            metadata: dict[str, Any] | None = None, ttl_seconds: float | None = None) -> SetOutcome:
        priority = resolve_retention(retention)
        if priority is None:
            return SetOutcome(False, UNKNOWN_RETENTION)
        if ttl_seconds is not None and ttl_seconds <= 0:
            return SetOutcome(True, TTL_EXPIRED)
        existing = self.lookup(ns, touch=False)
        if existing is not None and existing.priority > priority:
            return SetOutcome(False, RETENTION_DOWNGRADE)
        expires_at = None if ttl_seconds is None else self._clock() + ttl_seconds
        if self.arena is not None and self.arena.fits(len(value)):
            got = self.arena.allocate()
            if got is not None:
                slot, evicted = got
                if evicted is not None:
                    self.evict_slot(evicted)
                version = self.arena.write(slot, value)
                self._install(ns, Entry(retention, priority, len(value), None, slot, version, expires_at,
                                        metadata or {}))
                return SetOutcome(True)
            # every slot leased: fall through to inline storage
        size = len(value)
        if size > self.max_bytes:
            return SetOutcome(False, LARGER_THAN_STORE)
        if not self._make_room(size, priority, ns):
            return SetOutcome(False, WOULD_DISPLACE)
        self._install(ns, Entry(retention, priority, size, bytes(value), -1, 0, expires_at, metadata or {}))
        return SetOutcome(True)

    def commit_slot(self, ns: Namespaced, slot: int, length: int, retention: str,
                    ttl_seconds: float | None = None) -> SetOutcome:
        """Index a leased arena slot the client has written. On rejection the caller frees it."""
        priority = resolve_retention(retention)
        if priority is None:
            return SetOutcome(False, UNKNOWN_RETENTION)
        existing = self.lookup(ns, touch=False)
        if existing is not None and existing.priority > priority:
            return SetOutcome(False, RETENTION_DOWNGRADE)
        version = self.arena.finish_write(slot, length)
        expires_at = None if ttl_seconds is None else self._clock() + ttl_seconds
        self._install(ns, Entry(retention, priority, length, None, slot, version, expires_at, {}))
        return SetOutcome(True)

    def insert_if_absent(self, ns: Namespaced, value: bytes, retention: str,
                         ttl_seconds: float | None = None) -> bool:
        """Promotion from a lower tier: never replaces what a SET put there meanwhile."""
        if self.contains(ns):
            return False
        return self.set(ns, value, retention, ttl_seconds=ttl_seconds).reason == ""

    def remove(self, ns: Namespaced) -> bool:
        if ns not in self._entries:
            return False
        self._remove(ns)
        return True

    def clear(self, model: str = "", compat_key: str = "") -> list[Namespaced]:
        """Drop every entry matching the non-empty filters (both empty: everything); returns them."""
        doomed = [ns for ns in self._entries
                  if (not model or ns.model == model) and (not compat_key or ns.compat_key == compat_key)]
        for ns in doomed:
            self._remove(ns)
        return doomed

    # --- internals ------------------------------------------------------------------------------

    def _install(self, ns: Namespaced, entry: Entry) -> None:
        if ns in self._entries:  # overwrite: the old value's space goes back first
            self._remove(ns)
        self._entries[ns] = entry
        if entry.in_arena:
            self._slot_owner[entry.slot] = ns
            self.arena.commit(entry.slot)
            self.arena_bytes += entry.length
        else:
            self._lru[entry.priority][ns] = None
            self._inline_bytes_by_priority[entry.priority] += entry.length
            self.inline_bytes += entry.length

    def _remove(self, ns: Namespaced) -> Entry:
        entry = self._entries.pop(ns)
        if entry.in_arena:
            self._slot_owner.pop(entry.slot, None)
            self.arena.free(entry.slot)
            self.arena_bytes -= entry.length
        else:
            del self._lru[entry.priority][ns]
            self._inline_bytes_by_priority[entry.priority] -= entry.length
            self.inline_bytes -= entry.length
        return entry

    def evict_slot(self, slot: int) -> None:
        """The arena reused ``slot`` for a new value: the entry that lived there is gone."""
        ns = self._slot_owner.pop(slot, None)
        if ns is None:
            return
        entry = self._entries.pop(ns)
        self.arena_bytes -= entry.length
        self._evicted(ns, entry)

    def _evicted(self, ns: Namespaced, entry: Entry) -> None:
        self.evictions_total += 1
        if self.on_evict is not None:
            self.on_evict(ns, entry)

    def _make_room(self, size: int, priority: int, incoming: Namespaced) -> bool:
        """Evict inline entries (lowest priority first, then least recently accessed; only
        priorities <= the incoming one) until ``size`` fits. Evicts nothing when it cannot fit."""
        existing = self._entries.get(incoming)
        reclaimed = existing.length if existing is not None and not existing.in_arena else 0
        free = self.max_bytes - self.inline_bytes + reclaimed
        if free >= size:
            return True
        evictable = sum(b for p, b in self._inline_bytes_by_priority.items() if p <= priority) - reclaimed
        if free + evictable < size:
            return False
        for p, order in self._lru.items():
            if p > priority:
                break
            for victim in list(order):
                if victim == incoming:
                    continue
                entry = self._remove(victim)
                self._evicted(victim, entry)
                free += entry.length
                if free >= size:
                    return True
        return free >= size
