"""The router's view of every target's KV cache, kept from engine KV events (spec §3.4–3.6).

A *target* is a route key — ``"<worker_id>"`` or ``"<worker_id>#dp<rank>"`` — with the KV block
size its engine registered. Storage is laid out for prefix matching in O(prefix length):

* ``router_hash -> int`` bitmask of the targets holding that block (one dict for all targets);
  every target owns one bit, and the bits of removed targets are reused (lowest first);
* per target, ``engine_hash -> router_hash`` (engine hashes are opaque keys: int or bytes), so
  ``BlockRemoved`` and the ``parent_block_hash`` of later ``BlockStored`` events can be resolved.

``BlockStored`` token ids are re-hashed in the router's own space (``infera.kv.hashing``: chained
XXH3-64, parent of the first block ``ROUTER_SEED``) so routing never depends on an engine's hash
function or seed. Events are per target; batches for an unknown key are ignored (the worker may
have gone while a batch was in flight).

**Storage tiers.** The view is of the engine's *GPU* prefix cache, the tier requests are routed
on. An event's ``medium`` names its tier; the GPU tier is ``None`` (the engine did not say: every
first-generation publisher, SGLang's radix cache, vLLM's block pool without offload) and ``"GPU"``
(any case). Every other value is a lower tier and never touches the GPU view: a ``BlockStored``
there does not enter it, a ``BlockRemoved`` there does not drop from it, and a medium-scoped
``AllBlocksCleared`` (ATOM sends ``medium="CPU"``) empties only that tier. The names in use
(``tests/fixtures/kv_events/README.md`` has the sources): vLLM 0.32 ``GPU``/``CPU``/``STORAGE``
(its Mooncake store connector writes ``"cpu"``, hence the case folding), SGLang 0.5.23
``GPU``/``CPU_PINNED``/``DISK``/``EXTERNAL``, ATOM v0.1.5 ``GPU``/``CPU``/``DISK``/``REMOTE`` (ATOM
names where a block lives; its ``REMOTE`` stores announce blocks a decode received from its
prefill, and count as a lower tier until ATOM also announces them on the GPU). An
``AllBlocksCleared`` without a medium empties every tier: vLLM's has no medium field at all, so
one from its host-memory pool cannot be told from the GPU pool's.

Lower tiers are kept per target as ``tier -> {engine_hash -> router_hash}`` (upper-cased tier
name), created on a target's first lower-tier event, so the GPU path pays one comparison per
event and nothing per block. They give per-tier block counts (:meth:`KvIndex.tier_block_counts`)
and resolve parents: a GPU ``BlockStored`` whose parent left the GPU but is still on a lower tier
(a block loaded back from host memory) is chained instead of dropped. Each target also keeps a
count per router hash over all its lower tiers (``lower_held``), which :meth:`KvIndex.match_lower`
walks: how far a prompt continues on a lower tier after its GPU hit (the kv-aware policy scores
those blocks as a cheap load, not a miss). While no target has a lower tier it costs one check.

Semantics follow the spec exactly: the view is a *set* of router hashes per target, so a
``BlockRemoved`` drops the router hash even if a second engine block (another LoRA, say) with the
same tokens maps to it; blocks of a misaligned ``BlockStored`` (``len(token_ids)//block_size !=
len(block_hashes)``) enter the view but are not mapped, so only a clear or reset removes them.

Two implementations with one behaviour: :class:`NativeKvIndex` keeps the GPU view in the C
accelerator's tables (``infera.kv._native.GpuView``: plain u64 open addressing, where a walk over a
prompt's blocks touches a few cache lines instead of a dict entry and two int objects per block,
and a batch is applied without a bytecode per block), :class:`PyKvIndex` in dicts. ``KvIndex`` is
the native one where the accelerator is built (``infera.kv.native``). The native view folds an
engine hash to 64 bits (an int as its two's complement, a bytes digest by a seeded XXH3), as vLLM
itself folds its digests for int hashes; lower tiers stay in Python in both (off the hot path).

Not thread-safe: one writer (the event loop) applies batches and answers ``match`` (the native
calls hold the GIL, so a tokenizer thread's ``first_unheld`` never sees a table mid-change).
"""
from __future__ import annotations

import dataclasses
import heapq
import logging
import struct
import sys
import time
from array import array
from time import monotonic as _monotonic
from itertools import islice
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import xxhash

import msgspec

from infera.kv.events import BlockHash, Cleared, EventBatch, Removed, Stored
from infera.kv.hashing import ROUTER_SEED, block_hashes
from infera.kv.native import native

__all__ = ["KvIndex", "PyKvIndex", "NativeKvIndex", "TargetStats", "FULL_ATTENTION_KINDS", "GPU_MEDIUM",
           "lower_tier"]

log = logging.getLogger(__name__)

#: ``kv_cache_spec_kind`` values whose blocks hold the whole prefix (hybrid models also publish
#: sliding-window / mamba groups, which must not count as prefix hits). Absent kind → accepted.
FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})

#: The medium name of the tier the view holds (an event's ``medium`` None counts as this too).
GPU_MEDIUM = "GPU"


def lower_tier(medium: Optional[str]) -> Optional[str]:
    """The lower tier an event's ``medium`` names (upper-cased), or None for the GPU tier."""
    if medium is None or medium == GPU_MEDIUM:
        return None
    tier = medium.upper()
    return None if tier == GPU_MEDIUM else tier


_xxh3 = xxhash.xxh3_64_intdigest
_pack_u64 = struct.Struct("<Q").pack
_U32 = "I" if array("I").itemsize == 4 else "L"
_SWAP = sys.byteorder != "little"


@dataclass(slots=True)
class TargetStats:
    """Per-target counters (live object; read only)."""
    stored_events: int = 0    #: BlockStored events applied
    stored_blocks: int = 0    #: blocks re-hashed from applied BlockStored events
    removed_events: int = 0   #: BlockRemoved events applied
    removed_blocks: int = 0   #: engine hashes of BlockRemoved that resolved to a router hash
    dropped_events: int = 0   #: BlockStored dropped: unknown parent, or token ids not u32
    skipped_events: int = 0   #: BlockStored skipped by the kv_cache_spec_kind filter
    misaligned_events: int = 0  #: BlockStored with len(tokens)//bs != len(block_hashes) (not mapped)
    cleared: int = 0          #: AllBlocksCleared applied to the GPU view (no medium, or GPU)
    lower_events: int = 0     #: BlockStored/BlockRemoved on a lower tier (never in the GPU view)
    lower_stored_blocks: int = 0   #: blocks mapped on a lower tier
    lower_removed_blocks: int = 0  #: engine hashes removed from a lower tier that it held
    lower_cleared: int = 0    #: AllBlocksCleared scoped to one lower tier
    resets: int = 0           #: reset() calls
    batches: int = 0          #: batches applied
    last_apply: float = 0.0   #: time.monotonic() of the last apply (0.0: never)
    last_batch_ts: float = 0.0  #: engine timestamp (wall clock) of the newest batch applied


class _Target:
    __slots__ = ("key", "block_size", "bit", "mask", "emap", "count", "unmapped", "stats", "warned_bs", "lower",
                 "lower_held")

    def __init__(self, key: str, block_size: int, bit: int) -> None:
        self.key = key
        self.block_size = block_size
        self.bit = bit
        self.mask = 1 << bit
        self.emap: dict[BlockHash, int] = {}
        self.count = 0           # router hashes whose holder mask has our bit
        self.unmapped = False    # view may hold router hashes that no emap value names
        self.stats = TargetStats()
        self.warned_bs = False
        # lower tier -> engine hash -> router hash; None until the first lower-tier event
        self.lower: Optional[dict[str, dict[BlockHash, int]]] = None
        # router hash -> how many (tier, engine hash) entries of ``lower`` map to it
        self.lower_held: dict[int, int] = {}


class PyKvIndex:
    """Every target's cached router block hashes, with single-pass longest-prefix matching
    (dicts; see :class:`NativeKvIndex` for the same in the C accelerator)."""

    __slots__ = ("_holders", "_targets", "_free_bits", "_next_bit", "_lower_targets")

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}   # router hash -> bitmask of targets holding it
        self._targets: dict[str, _Target] = {}
        self._free_bits: list[int] = []      # heap of released bits
        self._next_bit = 0
        self._lower_targets = 0              # targets whose ``lower`` is not None (match_lower's gate)

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
        self._targets[key] = _Target(key, block_size, bit)

    def remove_target(self, key: str) -> bool:
        """Forget ``key``: its view, its engine→router map and its bit (reused later)."""
        t = self._targets.pop(key, None)
        if t is None:
            return False
        self._drop_view(t)
        self._drop_lower(t)
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

    def tier_block_counts(self, key: str) -> dict[str, int]:
        """Blocks (engine hashes) ``key``'s engine holds on each lower tier, by upper-cased medium
        name; only tiers it has published to. Empty if unknown."""
        t = self._targets.get(key)
        if t is None or not t.lower:
            return {}
        return {tier: len(m) for tier, m in t.lower.items()}

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
        count = t.count
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
                    h = ROUTER_SEED
                else:
                    h = eget(parent)
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
            elif tp is Cleared:
                t.count = count
                self._clear(t, ev)
                count = t.count
        t.count = count
        st.stored_events += stored_events
        st.stored_blocks += applied
        st.removed_events += removed_events
        st.removed_blocks += removed
        st.batches += 1
        st.last_apply = time.monotonic()
        if batch.ts > st.last_batch_ts:
            st.last_batch_ts = batch.ts
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

    # --- lower tiers (off the GPU hot path) -------------------------------------------------

    def _drop_lower(self, t: _Target) -> None:
        if t.lower is not None:
            t.lower = None
            self._lower_targets -= 1
        t.lower_held.clear()

    @staticmethod
    def _clear_lower_tier(t: _Target, tier: str) -> None:
        assert t.lower is not None
        m = t.lower.pop(tier, None)
        if not m:
            return
        held = t.lower_held
        for h in m.values():
            n = held[h] - 1
            if n:
                held[h] = n
            else:
                del held[h]

    @staticmethod
    def _lower_parent(t: _Target, tier: Optional[str], parent: BlockHash) -> Optional[int]:
        """Router hash of ``parent`` from the lower tiers (``tier``'s own first), or None."""
        lower = t.lower
        if not lower:
            return None
        if tier is not None:
            own = lower.get(tier)
            if own is not None:
                h = own.get(parent)
                if h is not None:
                    return h
        for m in lower.values():
            h = m.get(parent)
            if h is not None:
                return h
        return None

    def _gpu_parent(self, t: _Target, parent: BlockHash) -> Optional[int]:
        """Router hash of engine hash ``parent`` in ``t``'s GPU map, or None."""
        return t.emap.get(parent)

    def _store_lower(self, t: _Target, tier: str, ev: Stored) -> None:
        st = t.stats
        st.lower_events += 1
        parent = ev.parent
        if parent is None:
            h = ROUTER_SEED
        else:
            # a block offloaded from the GPU usually names a parent that is (still) on the GPU
            h = self._gpu_parent(t, parent)
            if h is None:
                h = self._lower_parent(t, tier, parent)
            if h is None:
                st.dropped_events += 1
                return
        bs = t.block_size
        n = len(ev.token_ids) // bs
        if n != len(ev.block_hashes):
            st.misaligned_events += 1  # no map entry could name them: nothing to keep
            return
        try:
            arr = array(_U32, ev.token_ids)  # every token checked, the partial block's too
        except (OverflowError, TypeError):
            st.dropped_events += 1
            return
        if _SWAP:
            arr.byteswap()
        chain = block_hashes(arr, bs, h) if n else []
        if t.lower is None:
            t.lower = {}
            self._lower_targets += 1
        m = t.lower.get(tier)
        if m is None:
            m = t.lower[tier] = {}
        held = t.lower_held
        for eh, h in zip(ev.block_hashes, chain):
            old = m.get(eh)
            if old == h:
                continue  # stored again (re-offloaded): already counted
            if old is not None:
                c = held[old] - 1
                if c:
                    held[old] = c
                else:
                    del held[old]
            m[eh] = h
            held[h] = held.get(h, 0) + 1
        st.lower_stored_blocks += n

    @staticmethod
    def _remove_lower(t: _Target, tier: str, hashes: Sequence[BlockHash]) -> None:
        st = t.stats
        st.lower_events += 1
        m = None if t.lower is None else t.lower.get(tier)
        if m is None:
            return
        pop = m.pop
        held = t.lower_held
        n = 0
        for eh in hashes:
            h = pop(eh, None)
            if h is not None:
                n += 1
                c = held[h] - 1
                if c:
                    held[h] = c
                else:
                    del held[h]
        st.lower_removed_blocks += n

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
        died: dict[int, int] = {}
        depth = 0
        for h in hashes:
            held = get(h, 0) & alive
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

    def has_lower_tiers(self) -> bool:
        """Whether any target has published a lower-tier event (else :meth:`match_lower` is all 0)."""
        return self._lower_targets > 0

    def match_lower(self, hashes: Sequence[int], keys: Sequence[str], starts: Sequence[int]) -> list[int]:
        """For each key, how many consecutive blocks of ``hashes`` from ``starts[i]`` on (its GPU
        hit, usually) that target holds on a lower tier, any of them. What an engine with an
        offload connector loads instead of computing. All 0 at the cost of one check while no
        target has a lower tier."""
        if not self._lower_targets:
            return [0] * len(keys)
        targets = self._targets
        n = len(hashes)
        out = []
        for k, start in zip(keys, starts):
            t = targets.get(k)
            held = None if t is None else t.lower_held
            if not held:
                out.append(0)
                continue
            i = start
            while i < n and hashes[i] in held:
                i += 1
            out.append(i - start)
        return out

    def lower_block_count(self, key: str) -> int:
        """Distinct router hashes ``key`` holds on its lower tiers, all together."""
        t = self._targets.get(key)
        return 0 if t is None else len(t.lower_held)

    def match_one(self, hashes: Sequence[int], key: str) -> int:
        """``match(hashes, [key])[0]`` without the bitmask bookkeeping."""
        t = self._targets.get(key)
        if t is None:
            return 0
        m = t.mask
        get = self._holders.get
        n = 0
        for h in hashes:
            if not get(h, 0) & m:
                break
            n += 1
        return n


class NativeKvIndex(PyKvIndex):
    """:class:`PyKvIndex` with its GPU view in the C accelerator (``GpuView``): the same targets,
    bits, stats and lower tiers, the same results. Needs ``infera.kv._native``."""

    __slots__ = ("_view", "_generation", "_bits_memo")

    def __init__(self) -> None:
        if native is None:
            raise RuntimeError("NativeKvIndex needs the C accelerator (infera.kv.native says why it is missing)")
        super().__init__()
        self._view = native.GpuView(Stored, Removed, Cleared, FULL_ATTENTION_KINDS)
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
        n = len(events)
        st = t.stats
        view_apply = self._view.apply
        applied = 0
        i = 0
        while True:
            lower_parent = (lambda parent, t=t: self._lower_parent(t, None, parent)) if t.lower else None
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
        return applied

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
         misaligned) = self._view.counters(t.bit)
        snap.stored_events += stored_events
        snap.stored_blocks += stored_blocks
        snap.removed_events += removed_events
        snap.removed_blocks += removed_blocks
        snap.dropped_events += dropped
        snap.skipped_events += skipped
        snap.misaligned_events += misaligned
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


#: The index the server uses: the native one where the accelerator is built.
KvIndex = NativeKvIndex if native is not None else PyKvIndex
