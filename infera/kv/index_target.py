# mypy: disable-error-code="arg-type,assignment,attr-defined,type-var,union-attr,misc"
# (as pyproject.toml's override for infera.kv.index, which these were split from: events are told apart by
# ``type(ev) is Stored``, which mypy does not narrow)
"""The KV index's per-target records and its lower tiers (``infera.kv.index`` has the overview).

What both implementations of the index share: the GPU tier's name and the kinds of KV cache spec
that count as prefix blocks, a target's counters (:class:`TargetStats`) and record (``_Target``: its
bit, its Python-side maps), and :class:`LowerTiers`, the methods that keep each target's lower-tier
maps (host memory, disk: ``tier -> {engine_hash -> router_hash}`` and a count per router hash),
which stay in Python in both implementations because they are off the routing hot path.
"""
from __future__ import annotations

import struct
import sys
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

import xxhash

from infera.kv.events import BlockHash, Stored
from infera.kv.hashing import block_hashes

__all__ = ["FULL_ATTENTION_KINDS", "GPU_MEDIUM", "TargetStats", "LowerTiers", "lower_tier"]

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
    evicted_entries: int = 0  #: (block, target) entries dropped by the byte bound (coldest first)


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


class LowerTiers:
    """The lower-tier half of an index (a mixin): needs ``_targets`` (key -> ``_Target``),
    ``_lower_targets`` (how many have a lower tier) and ``_gpu_parent`` from the index."""

    __slots__ = ()
    _targets: dict
    _lower_targets: int

    if TYPE_CHECKING:  # the index's (declared for the type checker only, never shadowing it)

        def _gpu_parent(self, t: _Target, parent: BlockHash) -> Optional[int]: ...

    def tier_block_counts(self, key: str) -> dict[str, int]:
        """Blocks (engine hashes) ``key``'s engine holds on each lower tier, by upper-cased medium
        name; only tiers it has published to. Empty if unknown."""
        t = self._targets.get(key)
        if t is None or not t.lower:
            return {}
        return {tier: len(m) for tier, m in t.lower.items()}

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

    def _store_lower(self, t: _Target, tier: str, ev: Stored) -> None:
        st = t.stats
        st.lower_events += 1
        parent = ev.parent
        if parent is None:
            h = ev.root()  # ROUTER_SEED, or a salted prompt's own root
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
