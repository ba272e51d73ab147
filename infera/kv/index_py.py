# mypy: disable-error-code="arg-type,assignment,attr-defined,type-var,union-attr,misc"
# (as pyproject.toml's override for infera.kv.index, which these were split from: events are told apart by
# ``type(ev) is Stored``, which mypy does not narrow)
"""The KV index in Python dicts (:class:`PyKvIndex`): the reference twin of the C view and the
index where the accelerator is not built (``infera.kv.index`` has the overview and the semantics).

Its GPU view is ``router hash -> bitmask of the targets holding it`` (one dict) and per target
``engine hash -> router hash``; the lower tiers come from :class:`infera.kv.index_target.LowerTiers`.
Under a byte bound (``max_bytes``; ``infera.kv.bound`` has the model) it keeps the same ages, in
the same epochs, as the C view and evicts the same blocks at the same points, so the differential
tests compare the two past the bound too.
"""
from __future__ import annotations

import heapq
import logging
import time
from array import array
from itertools import islice
from typing import Iterator, Optional, Sequence

from infera.kv.bound import BLOCK_BYTES, ENTRY_BYTES, HOLDER_BYTES, BoundStats, model_bytes
from infera.kv.events import BlockHash, Cleared, EventBatch, Removed, Stored
from infera.kv.hashing import ROUTER_SEED
from infera.kv.index_target import (_SWAP, _U32, FULL_ATTENTION_KINDS, LowerTiers, TargetStats, _pack_u64, _Target,
                                    _xxh3, lower_tier)

__all__ = ["PyKvIndex", "AGE_OLD", "AGE_EVERY_MIN"]

log = logging.getLogger("infera.kv.index")  # (one logger for the index, whichever file says it)

#: ages past this many epochs are one bucket (the C view's HS_AGE_OLD)
AGE_OLD = 96
#: the epoch advances after max(AGE_EVERY_MIN, blocks // 64) touches (u64table.h's infera_h_tick)
AGE_EVERY_MIN = 64


class PyKvIndex(LowerTiers):
    """Every target's cached router block hashes, with single-pass longest-prefix matching
    (dicts; see :class:`NativeKvIndex` for the same in the C accelerator). ``max_bytes``: the byte
    bound (0: none; ``infera.kv.bound``)."""

    __slots__ = ("_holders", "_targets", "_free_bits", "_next_bit", "_lower_targets", "_by_bit", "_max_bytes",
                 "_members", "_age", "_epoch", "_touches", "_evicted_entries", "_evicted_blocks", "_rounds")

    def __init__(self, max_bytes: int = 0) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes!r}")
        self._holders: dict[int, int] = {}   # router hash -> bitmask of targets holding it
        self._targets: dict[str, _Target] = {}
        self._by_bit: dict[int, _Target] = {}
        self._free_bits: list[int] = []      # heap of released bits
        self._next_bit = 0
        self._lower_targets = 0              # targets whose ``lower`` is not None (match_lower's gate)
        # The byte bound (infera.kv.bound): the targets' counts summed (entries), each block's epoch of
        # its last store or match (kept while bounded), touches since the epoch advanced.
        self._max_bytes = max_bytes
        self._members = 0
        self._age: dict[int, int] = {}
        self._epoch = 0
        self._touches = 0
        self._evicted_entries = self._evicted_blocks = self._rounds = 0

    # --- targets ---------------------------------------------------------------------------

    def add_target(self, key: str, block_size: int) -> None:
        """Register ``key``. Re-adding with the same block size is a no-op; with another block
        size the old view is dropped (its hashes were computed for the old size)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size!r}")
        t = self._targets.get(key)
        if t is not None:
            if t.block_size != block_size:
                self._drop_view(t)
                self._drop_lower(t)
                t.block_size = block_size
                t.warned_bs = False
            return
        bit = heapq.heappop(self._free_bits) if self._free_bits else self._next_bit
        if bit == self._next_bit:
            self._next_bit += 1
        self._targets[key] = self._by_bit[bit] = _Target(key, block_size, bit)

    def remove_target(self, key: str) -> bool:
        """Forget ``key``: its view, its engine→router map and its bit (reused later)."""
        t = self._targets.pop(key, None)
        if t is None:
            return False
        self._drop_view(t)
        self._drop_lower(t)
        del self._by_bit[t.bit]
        heapq.heappush(self._free_bits, t.bit)
        return True

    def reset(self, key: str) -> None:
        """Empty ``key``'s view and map (sequence gap without replay, engine restart)."""
        t = self._targets.get(key)
        if t is not None:
            self._drop_view(t)
            self._drop_lower(t)
            t.stats.resets += 1

    def has_target(self, key: str) -> bool:
        return key in self._targets

    def block_size(self, key: str) -> Optional[int]:
        t = self._targets.get(key)
        return None if t is None else t.block_size

    def keys(self) -> list[str]:
        return list(self._targets)

    def block_count(self, key: str) -> int:
        """Number of distinct router block hashes in ``key``'s view (0 if unknown)."""
        t = self._targets.get(key)
        return 0 if t is None else t.count

    def block_counts(self, keys: Sequence[str]) -> list[int]:
        """``[block_count(k) for k in keys]``."""
        targets = self._targets
        return [t.count if (t := targets.get(k)) is not None else 0 for k in keys]

    def events_made_until(self, key: str) -> float:
        """Engine wall-clock time up to which ``key``'s events are applied (batches arrive in
        order): what happened there before it is in the view. 0.0 if unknown."""
        t = self._targets.get(key)
        return 0.0 if t is None else t.stats.last_batch_ts

    def mapped_count(self, key: str) -> int:
        """Number of engine hashes ``key`` can resolve (parents, removals)."""
        t = self._targets.get(key)
        return 0 if t is None else len(t.emap)

    def stats(self, key: str) -> Optional[TargetStats]:
        t = self._targets.get(key)
        return None if t is None else t.stats

    def __len__(self) -> int:
        """Distinct router block hashes held by any target."""
        return len(self._holders)

    def __contains__(self, key: object) -> bool:
        return key in self._targets

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._targets))

    def first_unheld(self, hashes: Sequence[int], start: int = 0) -> int:
        """The position of the first of ``hashes[start:]`` that no target's view holds (``len``
        when all are held)."""
        holders = self._holders
        i = start
        for h in islice(hashes, start, None):
            if h not in holders:
                return i
            i += 1
        return i

    def holds(self, key: str, router_hash: int) -> bool:
        t = self._targets.get(key)
        return t is not None and bool(self._holders.get(router_hash, 0) & t.mask)

    def _drop_view(self, t: _Target) -> None:
        holders = self._holders
        m = t.mask
        self._members -= t.count
        if t.count and not t.unmapped:
            # every viewed hash was added together with a map entry: clear through the map
            for h in t.emap.values():
                old = holders.get(h, 0)
                if old & m:
                    if old == m:
                        del holders[h]
                    else:
                        holders[h] = old ^ m
                    t.count -= 1
        if t.count:
            # misaligned events (or a remapped engine hash) left hashes no map entry names: scan
            for h, old in list(holders.items()):
                if old & m:
                    if old == m:
                        del holders[h]
                    else:
                        holders[h] = old ^ m
        t.count = 0
        t.emap.clear()
        t.unmapped = False

    # --- events ----------------------------------------------------------------------------

    def apply(self, key: str, batch: EventBatch) -> int:
        """Apply one decoded batch to ``key``'s view. Returns the number of block events applied
        to the GPU view (blocks re-hashed from BlockStored + engine hashes of BlockRemoved that
        resolved; lower-tier blocks are counted in :class:`TargetStats` only); 0 if ``key`` is
        not registered."""
        t = self._targets.get(key)
        if t is None:
            return 0
        self._tick()
        aging = self._max_bytes > 0
        age = self._age
        epoch = self._epoch
        touches = 0
        holders = self._holders
        hget = holders.get
        emap = t.emap
        eget = emap.get
        epop = emap.pop
        m = t.mask
        bs = t.block_size
        step = 4 * bs
        st = t.stats
        xxh = _xxh3
        pack = _pack_u64
        applied = 0
        removed = 0
        count = base = t.count  # base: the count already in self._members
        stored_events = removed_events = 0
        for ev in batch.events:
            tp = type(ev)
            if tp is Removed:  # first: vLLM sends one BlockRemoved per evicted block
                med = ev.medium
                if med is not None and med != "GPU" and (tier := lower_tier(med)) is not None:
                    self._remove_lower(t, tier, ev.block_hashes)
                    continue
                removed_events += 1
                for eh in ev.block_hashes:
                    h = epop(eh, None)
                    if h is None:
                        continue
                    removed += 1
                    old = hget(h, 0)
                    if old & m:
                        if old == m:
                            del holders[h]
                        else:
                            holders[h] = old ^ m
                        count -= 1
            elif tp is Stored:
                kind = ev.spec_kind
                if kind is not None and kind not in FULL_ATTENTION_KINDS:
                    st.skipped_events += 1
                    continue
                med = ev.medium
                if med is not None and med != "GPU" and (tier := lower_tier(med)) is not None:
                    self._store_lower(t, tier, ev)
                    continue
                parent = ev.parent
                if parent is None:
                    h = ROUTER_SEED if ev.extra_keys is None else ev.root()  # (a salted prompt's own root)
                else:
                    h = eget(parent)
                    if h is not None and not hget(h, 0) & m:
                        h = None  # evicted: unknown, as the C view's 32-bit map cannot name it either
                    if h is None and t.lower:
                        h = self._lower_parent(t, None, parent)
                    if h is None:
                        st.dropped_events += 1
                        continue
                tokens = ev.token_ids
                if ev.block_size != bs and not t.warned_bs:
                    t.warned_bs = True
                    log.warning("kv index: %s reports block_size %d but registered %d; hashing with %d",
                                t.key, ev.block_size, bs, bs)
                n = len(tokens) // bs
                try:
                    arr = array(_U32, tokens)  # every token of the event converted once
                except (OverflowError, TypeError):
                    st.dropped_events += 1
                    continue
                if _SWAP:
                    arr.byteswap()
                data = arr.tobytes()
                ehs = ev.block_hashes
                stored_events += 1
                applied += n
                off = 0
                if n == len(ehs):
                    for eh in ehs:
                        h = xxh(pack(h) + data[off:off + step])
                        off += step
                        emap[eh] = h
                        old = hget(h, 0)
                        if not old & m:
                            holders[h] = old | m
                            count += 1
                        if aging:
                            age[h] = epoch
                            touches += 1
                else:
                    st.misaligned_events += 1
                    if n:
                        t.unmapped = True
                    for _ in range(n):
                        h = xxh(pack(h) + data[off:off + step])
                        off += step
                        old = hget(h, 0)
                        if not old & m:
                            holders[h] = old | m
                            count += 1
                        if aging:
                            age[h] = epoch
                            touches += 1
            elif tp is Cleared:
                t.count = count
                self._members += count - base
                self._clear(t, ev)
                count = base = t.count
        t.count = count
        self._members += count - base
        self._touches += touches
        st.stored_events += stored_events
        st.stored_blocks += applied
        st.removed_events += removed_events
        st.removed_blocks += removed
        st.batches += 1
        st.last_apply = time.monotonic()
        if batch.ts > st.last_batch_ts:
            st.last_batch_ts = batch.ts
        if aging:
            self._trim()
        return applied + removed

    def apply_payload(self, key: str, payload: bytes) -> Optional[tuple[int, float]]:
        """Apply an undecoded map-form payload when that can be done without decoding it to
        events: (block events applied, the batch's timestamp). None when not (always here; see
        :meth:`NativeKvIndex.apply_payload`): decode the payload and call :meth:`apply`."""
        return None

    def _clear(self, t: _Target, ev: Cleared) -> None:
        """An AllBlocksCleared: one lower tier when its medium names one (ATOM), else the GPU view,
        and every lower tier too when it names none (vLLM's clear cannot say which pool)."""
        med = ev.medium
        tier = None if med is None else lower_tier(med)
        if tier is not None:  # one lower tier only: the GPU view stays
            if t.lower is not None:
                self._clear_lower_tier(t, tier)
            t.stats.lower_cleared += 1
            return
        self._drop_view(t)
        if med is None:
            self._drop_lower(t)
        t.stats.cleared += 1

    def _gpu_parent(self, t: _Target, parent: BlockHash) -> Optional[int]:
        """Router hash of engine hash ``parent`` in ``t``'s GPU map, or None (also when ``t`` no
        longer holds it: evicted)."""
        h = t.emap.get(parent)
        return h if h is not None and self._holders.get(h, 0) & t.mask else None

    # --- matching --------------------------------------------------------------------------

    def match(self, hashes: Sequence[int], keys: Sequence[str]) -> list[int]:
        """For each key, the length of the longest prefix of ``hashes`` in that target's view.

        One walk over ``hashes`` for all keys: an *alive* bitmask of the candidates' bits is
        and-ed with each block's holder mask; a candidate's length is fixed when its bit dies and
        the walk stops when none is alive. Unregistered keys get 0. ``hashes`` must be router
        hashes for the targets' block size (callers group targets by block size)."""
        targets = self._targets
        alive = 0
        for k in keys:
            t = targets.get(k)
            if t is not None:
                alive |= t.mask
        if not alive or not hashes:
            return [0] * len(keys)
        get = self._holders.get
        self._tick()
        touch = self._touch if self._max_bytes else None
        died: dict[int, int] = {}
        depth = 0
        for h in hashes:
            v = get(h, 0)
            if v and touch is not None:
                touch(h)  # walked to: warm (the C view touches the same blocks)
            held = v & alive
            if held != alive:
                dead = alive ^ held
                while dead:
                    low = dead & -dead
                    died[low] = depth
                    dead ^= low
                alive = held
                if not alive:
                    break
            depth += 1
        full = len(hashes)
        out = []
        for k in keys:
            t = targets.get(k)
            if t is None:
                out.append(0)
            else:
                out.append(died.get(t.mask, full))
        return out

    def match_one(self, hashes: Sequence[int], key: str) -> int:
        """``match(hashes, [key])[0]`` without the bitmask bookkeeping."""
        t = self._targets.get(key)
        if t is None:
            return 0
        m = t.mask
        get = self._holders.get
        self._tick()
        touch = self._touch if self._max_bytes else None
        n = 0
        for h in hashes:
            if not get(h, 0) & m:
                break
            if touch is not None:
                touch(h)  # a hit: warm
            n += 1
        return n

    # --- the byte bound (infera.kv.bound; the C view's view.c and u64table.h do the same) -----

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    def bound_stats(self) -> BoundStats:
        """The bytes held by the model, the bound, and what it evicted so far."""
        return BoundStats(model_bytes(len(self._holders), self._members), self._max_bytes, self._evicted_entries,
                          self._evicted_blocks, self._rounds)

    def evicted_entries(self, key: str) -> int:
        """``key``'s (block, target) entries the bound evicted since it was added (0 if unknown)."""
        t = self._targets.get(key)
        return 0 if t is None else t.stats.evicted_entries

    def _touch(self, h: int) -> None:
        self._age[h] = self._epoch
        self._touches += 1

    def _tick(self) -> None:
        """Once per batch or match: the epoch advances after max(64, blocks // 64) touches."""
        if self._max_bytes and self._touches >= max(AGE_EVERY_MIN, len(self._holders) // 64):
            self._epoch += 1
            self._touches = 0

    def _trim(self) -> None:
        """Past the bound: evict whole ages, oldest first, down to 95% of it (as view.c's trim)."""
        holders = self._holders
        held = model_bytes(len(holders), self._members)
        cap = self._max_bytes
        age = self._age
        if held <= cap:
            if len(age) > 2 * len(holders) + 1024:  # ages of blocks gone since: compacted now and then
                self._age = {h: a for h, a in age.items() if h in holders}
            return
        need = held - (cap - cap // 20)
        epoch = self._epoch
        by_age = [0] * (AGE_OLD + 1)
        for h, v in holders.items():
            d = min(epoch - age.get(h, 0), AGE_OLD)
            n = v.bit_count()
            by_age[d] += BLOCK_BYTES + HOLDER_BYTES * (n - 1) + ENTRY_BYTES * n
        oldest_kept = 0
        freed = 0
        for d in range(AGE_OLD, -1, -1):
            freed += by_age[d]
            if freed >= need:
                oldest_kept = d
                break
        by_bit = self._by_bit
        victims = [h for h in holders if min(epoch - age.get(h, 0), AGE_OLD) >= oldest_kept]
        entries = 0
        for h in victims:
            v = holders.pop(h)
            age.pop(h, None)
            while v:
                low = v & -v
                v ^= low
                t = by_bit[low.bit_length() - 1]
                t.count -= 1
                t.stats.evicted_entries += 1
                entries += 1
        self._members -= entries
        self._evicted_entries += entries
        self._evicted_blocks += len(victims)
        self._rounds += 1
        for t in self._targets.values():
            emap = t.emap
            if len(emap) > t.count + t.count // 4 + 64:  # map entries of evicted blocks: swept
                m = t.mask
                for eh in [eh for eh, h in emap.items() if not holders.get(h, 0) & m]:
                    del emap[eh]
        self._age = {h: a for h, a in age.items() if h in holders}
