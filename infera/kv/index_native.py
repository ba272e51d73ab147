# mypy: disable-error-code="arg-type,assignment,attr-defined,type-var,union-attr,misc"
# (as pyproject.toml's override for infera.kv.index, which these were split from: events are told apart by
# ``type(ev) is Stored``, which mypy does not narrow)
"""The KV index with its GPU view in the C accelerator (:class:`NativeKvIndex`; ``infera.kv.index``
has the overview and the semantics).

The same targets, bits, stats and lower tiers as :class:`infera.kv.index_py.PyKvIndex`, whose
bookkeeping it inherits; the GPU view itself (holder sets, engine-hash maps, event application,
matches, the byte bound's ages and evictions) is ``infera.kv._native.GpuView``. Needs the
accelerator (``infera.kv.native``).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from time import monotonic as _monotonic
from typing import Optional, Sequence

import msgspec

from infera.kv.bound import BLOCK_BYTES, ENTRY_BYTES, HOLDER_BYTES, BoundStats
from infera.kv.events import BlockHash, Cleared, EventBatch, Removed, Stored
from infera.kv.hashing import ROUTER_SEED
from infera.kv.index_py import PyKvIndex
from infera.kv.index_target import FULL_ATTENTION_KINDS, TargetStats, _Target, lower_tier
from infera.kv.native import native

__all__ = ["NativeKvIndex"]

log = logging.getLogger("infera.kv.index")  # (one logger for the index, whichever file says it)

# A salted prompt's first block (vLLM's cache_salt, named in its extra keys) chains from the salt's
# root, not ROUTER_SEED; the C view takes a first block's root as 0. Such an event goes to it with
# this parent instead, a bytes engine hash no engine sends, which the parent resolver (the view's
# lower_parent hook: called for a parent it has not mapped) turns into the root it carries.
_SALT_PARENT = b"\x00infera-salt-root\x00"
_SALT_PARENT_LEN = len(_SALT_PARENT)
_EXTRA_KEYS = b"\xaaextra_keys"  # the msgpack key, as vLLM writes it


def _salted_first(ev: object) -> bool:
    return (type(ev) is Stored and ev.parent is None and ev.extra_keys is not None and bool(ev.extra_keys)
            and ev.extra_keys[0] is not None and lower_tier(ev.medium) is None)


def _with_salt_parent(ev: object) -> object:
    if _salted_first(ev):
        root = ev.root()
        if root != ROUTER_SEED:
            return msgspec.structs.replace(ev, parent=_SALT_PARENT + root.to_bytes(8, "little"))
    return ev


def names_first_block_keys(payload: bytes) -> bool:
    """Whether a map-form payload may hold a BlockStored whose first block has extra keys (a salt,
    a LoRA name, images): those are applied through the decoded events, which read them. A scan for
    the key and the first item of its array; anything unexpected counts as yes."""
    i = payload.find(_EXTRA_KEYS)
    n = len(payload)
    while i >= 0:
        j = i + len(_EXTRA_KEYS)
        if j >= n:
            return True
        b = payload[j]
        if b == 0xC0 or b == 0x90:  # nil, or an empty array
            first = 0xC0
        elif 0x91 <= b <= 0x9F:
            first = payload[j + 1] if j + 1 < n else -1
        elif b == 0xDC:
            first = payload[j + 3] if j + 3 < n else -1
        elif b == 0xDD:
            first = payload[j + 5] if j + 5 < n else -1
        else:
            return True
        if first != 0xC0:
            return True
        i = payload.find(_EXTRA_KEYS, j)
    return False


class NativeKvIndex(PyKvIndex):
    """:class:`PyKvIndex` with its GPU view in the C accelerator (``GpuView``): the same targets,
    bits, stats and lower tiers, the same results. Needs ``infera.kv._native``."""

    __slots__ = ("_view", "_generation", "_bits_memo")

    def __init__(self, max_bytes: int = 0, shared_bytes: int = 0) -> None:
        """``shared_bytes``: the holder table lives in a shared arena of that size (sparse), which
        other processes match against with ``native.GpuViewReader(fd)`` (:meth:`shared_fd`)."""
        if native is None:
            raise RuntimeError("NativeKvIndex needs the C accelerator (infera.kv.native says why it is missing)")
        super().__init__(max_bytes)
        self._view = native.GpuView(Stored, Removed, Cleared, FULL_ATTENTION_KINDS, shared_bytes=shared_bytes)
        self._view.set_bound(max_bytes, BLOCK_BYTES, HOLDER_BYTES, ENTRY_BYTES)  # (0: counts, never evicts)
        self._generation = 0  # targets added or removed: the bits of a list of keys may differ
        self._bits_memo: tuple[list[str], int, list[int]] | None = None

    def add_target(self, key: str, block_size: int) -> None:
        known = key in self._targets
        super().add_target(key, block_size)
        if not known and key in self._targets:
            self._view.add(self._targets[key].bit)
            self._generation += 1

    def remove_target(self, key: str) -> bool:
        t = self._targets.get(key)
        if t is None:
            return False
        super().remove_target(key)  # drops the view (_drop_view) and frees the bit
        self._view.remove(t.bit)
        self._generation += 1
        return True

    def _bits(self, keys: Sequence[str]) -> list[int]:
        """The targets' bits (-1: unknown key). The policy asks for the same keys on every pick: the
        last answer is kept while the targets are the same and so are the keys (compared by value:
        a caller may reuse a list it changed; equal strings compare by identity first)."""
        memo = self._bits_memo
        if memo is not None and memo[1] == self._generation and memo[0] == keys:
            return memo[2]
        targets = self._targets
        bits = [t.bit if (t := targets.get(k)) is not None else -1 for k in keys]
        self._bits_memo = (list(keys), self._generation, bits)
        return bits

    def shared_fd(self) -> int | None:
        """The shared arena's file descriptor (this index's; a reader maps it), or None: private."""
        shared = self._view.shared()
        return None if shared is None else shared[0]

    def target_rows(self) -> list[tuple[str, int, int, int, float, int]]:
        """Every target as (key, bit, block size, blocks held, events made until, entries the byte
        bound evicted): what a shared index's readers are told (``infera.kv.index_shared``)."""
        targets = list(self._targets.values())
        counts = self._view.counts([t.bit for t in targets])
        counters = self._view.counters
        return [(t.key, t.bit, t.block_size, n, t.stats.last_batch_ts, counters(t.bit)[7])
                for t, n in zip(targets, counts)]

    def block_count(self, key: str) -> int:
        t = self._targets.get(key)
        return 0 if t is None else self._view.count(t.bit)

    def block_counts(self, keys: Sequence[str]) -> list[int]:
        """``[block_count(k) for k in keys]``, in one C call."""
        return self._view.counts(self._bits(keys))

    def mapped_count(self, key: str) -> int:
        t = self._targets.get(key)
        return 0 if t is None else self._view.mapped(t.bit)

    def __len__(self) -> int:
        return len(self._view)

    def first_unheld(self, hashes: Sequence[int], start: int = 0) -> int:
        return self._view.first_unheld(hashes, start)

    def holds(self, key: str, router_hash: int) -> bool:
        t = self._targets.get(key)
        return t is not None and self._view.holds(t.bit, router_hash)

    def _drop_view(self, t: _Target) -> None:
        self._view.drop(t.bit)

    def _gpu_parent(self, t: _Target, parent: BlockHash) -> Optional[int]:
        return self._view.emap_get(t.bit, parent)

    def apply(self, key: str, batch: EventBatch) -> int:
        t = self._targets.get(key)
        if t is None:
            return 0
        events = batch.events
        salted = any(map(_salted_first, events))
        if salted:
            events = [_with_salt_parent(ev) for ev in events]
        n = len(events)
        st = t.stats
        view = self._view
        view.tick()  # (one batch: the bound's ages may advance, as the twin's)
        view_apply = view.apply
        applied = 0
        i = 0
        while True:
            lower_parent = (self._parent_resolver(t) if salted
                            else (lambda parent, t=t: self._lower_parent(t, None, parent)) if t.lower else None)
            i, done, other_bs = view_apply(t.bit, t.block_size, events, i, lower_parent)
            applied += done
            if other_bs:
                self._warn_block_size(t, other_bs)
            if i >= n:
                break
            applied += self._apply_one(t, events[i])
            i += 1
        st.batches += 1
        st.last_apply = time.monotonic()
        if batch.ts > st.last_batch_ts:
            st.last_batch_ts = batch.ts
        if self._max_bytes:
            view.trim()
        return applied

    def _parent_resolver(self, t: _Target):
        """The view's resolver of unmapped parents: a salted root (``_SALT_PARENT``), else a lower tier."""
        def resolve(parent: BlockHash) -> Optional[int]:
            if type(parent) is bytes and parent.startswith(_SALT_PARENT):
                return int.from_bytes(parent[_SALT_PARENT_LEN:], "little")
            return self._lower_parent(t, None, parent) if t.lower else None
        return resolve

    def _warn_block_size(self, t: _Target, other: int) -> None:
        if not t.warned_bs:
            t.warned_bs = True
            log.warning("kv index: %s reports block_size %d but registered %d; hashing with %d",
                        t.key, other, t.block_size, t.block_size)

    def stats(self, key: str) -> Optional[TargetStats]:
        """A snapshot (the event counters live in the C view; the rest in ``t.stats``)."""
        t = self._targets.get(key)
        if t is None:
            return None
        snap = dataclasses.replace(t.stats)
        (stored_events, stored_blocks, removed_events, removed_blocks, dropped, skipped,
         misaligned, evicted) = self._view.counters(t.bit)
        snap.stored_events += stored_events
        snap.stored_blocks += stored_blocks
        snap.removed_events += removed_events
        snap.removed_blocks += removed_blocks
        snap.dropped_events += dropped
        snap.skipped_events += skipped
        snap.misaligned_events += misaligned
        snap.evicted_entries += evicted
        return snap

    def apply_payload(self, key: str, payload: bytes) -> Optional[tuple[int, float]]:
        """A map-form batch of GPU stores and removals applied straight from its msgpack bytes
        (``GpuView.apply_payload``: no event objects, no token id ints); None for anything else
        (another form, a clear, a lower tier, odd values), with nothing applied: decode it and call
        :meth:`apply`, which gives the same result. An unknown ``key``: (0, 0.0)."""
        t = self._targets.get(key)
        if t is None:
            return 0, 0.0
        if t.lower:  # GPU parents may live on a lower tier: resolved in Python (apply)
            return None
        if names_first_block_keys(payload):  # a salt, say: apply() reads the decoded events' extra keys
            return None
        r = self._view.apply_payload(t.bit, t.block_size, payload)
        if r is None:
            return None
        applied, ts, other_bs = r
        if other_bs:
            self._warn_block_size(t, other_bs)
        st = t.stats
        st.batches += 1
        st.last_apply = _monotonic()
        if ts > st.last_batch_ts:
            st.last_batch_ts = ts
        return applied, ts

    def _apply_one(self, t: _Target, ev: object) -> int:
        """An event ``GpuView.apply`` left to Python: a lower-tier one, a clear, or an unknown type
        (ignored, as :meth:`PyKvIndex.apply` ignores it). Returns the GPU block events applied."""
        st = t.stats
        tp = type(ev)
        if tp is Cleared:
            self._clear(t, ev)
            return 0
        if tp is not Stored and tp is not Removed:
            return 0
        if tp is Stored:
            kind = ev.spec_kind
            if kind is not None and kind not in FULL_ATTENTION_KINDS:
                st.skipped_events += 1
                return 0
        tier = lower_tier(ev.medium)
        if tier is None:  # a spelling of the GPU tier the view did not take as one: as a GPU event
            return self._apply_gpu(t, [msgspec.structs.replace(ev, medium=None)])
        if tp is Stored:
            self._store_lower(t, tier, ev)
        else:
            self._remove_lower(t, tier, ev.block_hashes)
        return 0

    def _apply_gpu(self, t: _Target, events: list) -> int:
        """GPU events through the view (no batch bookkeeping); returns the block events applied."""
        lower_parent = (lambda parent: self._lower_parent(t, None, parent)) if t.lower else None
        _, applied, other_bs = self._view.apply(t.bit, t.block_size, events, 0, lower_parent)
        if other_bs:
            self._warn_block_size(t, other_bs)
        return applied

    def match(self, hashes: Sequence[int], keys: Sequence[str]) -> list[int]:
        return self._view.match(hashes, self._bits(keys))

    def match_one(self, hashes: Sequence[int], key: str) -> int:
        t = self._targets.get(key)
        return 0 if t is None else self._view.match_one(hashes, t.bit)

    # --- the byte bound: kept in the view (view.c) -------------------------------------------

    def bound_stats(self) -> BoundStats:
        return BoundStats(*self._view.bound())

    def evicted_entries(self, key: str) -> int:
        t = self._targets.get(key)
        return 0 if t is None else self._view.counters(t.bit)[7]

    def memory_bytes(self) -> int:
        """What the view's C tables have allocated (the model's bytes are :meth:`bound_stats`)."""
        return self._view.memory_bytes()
