"""KvIndex with router hashes whose low 32 bits are equal.

The C view's engine-hash map keeps only a router hash's low 32 bits and finds the whole key among
the holder table's keys that share them (``infera/kv/csrc/view_emap.c``); where one target holds two
such keys its entries keep the high half too. Real pairs are found here by brute force (one in ~2^16
single-block roots), and every test runs on both implementations: the Python twin's map holds whole
router hashes, so the two agree only if the C view resolves every entry right."""
from __future__ import annotations

import functools

import pytest

from infera.kv.events import EventBatch, Removed, Stored
from infera.kv.hashing import ROUTER_SEED, hash_chunk
from infera.kv.index import NativeKvIndex, PyKvIndex
from infera.kv.native import native

IMPLS = [PyKvIndex] + ([NativeKvIndex] if native is not None else [])
BS = 4
TAIL = [7, 7, 7]


@functools.lru_cache(maxsize=1)
def twin_roots() -> tuple[list[int], list[int], int]:
    """Two single-block prompts whose router hashes differ but share their low 32 bits."""
    seen: dict[int, int] = {}
    for first in range(1, 1_000_000):
        h = hash_chunk(ROUTER_SEED, [first, *TAIL])
        other = seen.setdefault(h & 0xFFFFFFFF, first)
        if other != first:
            return [other, *TAIL], [first, *TAIL], h
    raise AssertionError("no pair found")  # pragma: no cover (one is expected in ~93k)


def rh(tokens: list[int], parent: int = ROUTER_SEED) -> int:
    return hash_chunk(parent, tokens)


CHILD = [11, 12, 13, 14]
EA, EB, ECHILD = 501, 502, 503


def stored(hashes, parent, tokens) -> EventBatch:
    return EventBatch(1.0, [Stored(hashes, parent, tokens, BS, None)])


def removed(*hashes) -> EventBatch:
    return EventBatch(1.0, [Removed(list(hashes))])


def emap_of(idx, key: str, engine_hash):
    t = idx._targets[key]
    if isinstance(idx, NativeKvIndex):
        return idx._view.emap_get(t.bit, engine_hash)
    return idx._gpu_parent(t, engine_hash)


@pytest.fixture(params=IMPLS, ids=lambda c: c.__name__)
def idx(request):
    index = request.param()
    index.add_target("w", BS)
    index.add_target("v", BS)
    return index


def test_pair_is_real():
    a, b, _ = twin_roots()
    ha, hb = rh(a), rh(b)
    assert ha != hb and ha & 0xFFFFFFFF == hb & 0xFFFFFFFF


@pytest.mark.parametrize("first_removed", ["a", "b"])
def test_one_target_holds_both(idx, first_removed):
    a, b, _ = twin_roots()
    ha, hb = rh(a), rh(b)
    idx.apply("w", stored([EA], None, a))
    idx.apply("w", stored([EB], None, b))
    assert idx.block_count("w") == 2
    assert (emap_of(idx, "w", EA), emap_of(idx, "w", EB)) == (ha, hb)
    # a child chains from the right parent
    idx.apply("w", stored([ECHILD], EB, CHILD))
    assert idx.match_one([hb, rh(CHILD, hb)], "w") == 2
    assert idx.match_one([ha, rh(CHILD, ha)], "w") == 1
    gone, kept, hkept = (EA, EB, hb) if first_removed == "a" else (EB, EA, ha)
    idx.apply("w", removed(gone))
    assert emap_of(idx, "w", gone) is None
    assert emap_of(idx, "w", kept) == hkept
    assert idx.match_one([hkept], "w") == 1
    assert idx.match_one([ha if hkept == hb else hb], "w") == 0
    idx.apply("w", removed(kept))
    assert idx.block_count("w") == 1  # the child
    assert idx.match_one([ha], "w") == idx.match_one([hb], "w") == 0


def test_second_key_joins_unmapped(idx):
    """B arrives in a misaligned store (no map entry): A's entry must still name A."""
    a, b, _ = twin_roots()
    ha, hb = rh(a), rh(b)
    idx.apply("w", stored([EA], None, a))
    idx.apply("w", stored([EB, 999], None, b))  # two hashes for one block: misaligned, unmapped
    assert idx.match_one([hb], "w") == 1
    assert emap_of(idx, "w", EA) == ha
    idx.apply("w", stored([ECHILD], EA, CHILD))
    assert idx.match_one([ha, rh(CHILD, ha)], "w") == 2
    idx.apply("w", removed(EA))
    assert idx.match_one([ha], "w") == 0 and idx.match_one([hb], "w") == 1


def test_targets_hold_one_each(idx):
    a, b, _ = twin_roots()
    ha, hb = rh(a), rh(b)
    idx.apply("w", stored([EA], None, a))
    idx.apply("v", stored([EA], None, b))  # the same engine hash in another target: its own map
    assert (emap_of(idx, "w", EA), emap_of(idx, "v", EA)) == (ha, hb)
    idx.apply("w", removed(EA))
    assert idx.match_one([ha], "w") == 0 and idx.match_one([hb], "v") == 1


def test_reset_drops_both(idx):
    a, b, _ = twin_roots()
    idx.apply("w", stored([EA], None, a))
    idx.apply("w", stored([EB], None, b))
    idx.reset("w")
    assert idx.block_count("w") == 0
    assert emap_of(idx, "w", EA) is None and emap_of(idx, "w", EB) is None


@pytest.mark.parametrize("kind", IMPLS, ids=lambda c: c.__name__)
def test_an_evicted_keys_entry_does_not_name_a_later_twin(kind):
    """A evicted by the byte bound leaves its map entry (until a sweep); B, with A's low bits, joins
    later: the entry must still name nothing held (a removal of A's engine hash leaves B, a child of
    it is dropped), not B, which the C map would otherwise find by those bits."""
    from infera.kv.bound import BLOCK_BYTES, ENTRY_BYTES

    a, b, _ = twin_roots()
    ha, hb = rh(a), rh(b)
    idx = kind(max_bytes=(BLOCK_BYTES + ENTRY_BYTES) * 300)
    idx.add_target("w", BS)
    idx.apply("w", stored([EA], None, a))  # epoch 0, with the first chain
    for c in range(3):  # 100-block chains, a batch each: the third passes the bound
        tokens = [100_000 * (c + 1) + i for i in range(100 * BS)]
        idx.apply("w", stored([10_000 * (c + 1) + i for i in range(100)], None, tokens))
    assert idx.bound_stats().evicted_blocks > 0
    assert idx.match_one([ha], "w") == 0  # evicted
    assert idx.mapped_count("w") > idx.block_count("w")  # its entry is still there: not swept
    idx.apply("w", stored([EB], None, b))
    assert emap_of(idx, "w", EB) == hb and emap_of(idx, "w", EA) is None
    dropped = idx.stats("w").dropped_events
    idx.apply("w", stored([ECHILD], EA, CHILD))  # A's child: its parent is unknown
    assert idx.stats("w").dropped_events == dropped + 1
    assert idx.match_one([hb, rh(CHILD, hb)], "w") == 1
    idx.apply("w", removed(EA))
    assert idx.match_one([hb], "w") == 1  # B stays
