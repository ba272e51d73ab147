"""KV cache + prefix caching of the simulated engine."""
from __future__ import annotations

import struct

import pytest
import xxhash

from infera.engine.sim.cache import KVCache, block_hashes, hash_chunk


def expected_hash(parent: int, tokens: list[int]) -> int:
    # Written independently of the implementation: explicit struct layout.
    return xxhash.xxh3_64_intdigest(struct.pack("<Q", parent) + struct.pack(f"<{len(tokens)}I", *tokens))


class Events:
    def __init__(self) -> None:
        self.stored: list[tuple[list[int], int | None, list[int]]] = []
        self.removed: list[int] = []
        self.cleared = 0

    def attach(self, cache: KVCache) -> KVCache:
        cache.on_stored = lambda hashes, parent, toks: self.stored.append((hashes, parent, toks))
        cache.on_removed = lambda hashes: self.removed.extend(hashes)
        cache.on_cleared = lambda: setattr(self, "cleared", self.cleared + 1)
        return cache


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


@pytest.mark.parametrize("parent,tokens", [(0, [1, 2, 3, 4]), (123456789, [0, 70000, 2**32 - 1]), (2**64 - 1, [])])
def test_hash_chunk_matches_spec(parent, tokens):
    assert hash_chunk(parent, tokens) == expected_hash(parent, tokens)


def test_block_hash_chain_known_input():
    tokens = toks(1000, 16 * 3 + 5)
    h0 = expected_hash(0, tokens[0:16])
    h1 = expected_hash(h0, tokens[16:32])
    h2 = expected_hash(h1, tokens[32:48])
    assert block_hashes(tokens, 16) == [h0, h1, h2]  # trailing 5 tokens: no hash

    events = Events()
    cache = events.attach(KVCache(16, 10))
    assert cache.allocate("a", tokens) == 0
    assert [e[0][0] for e in events.stored] == [h0, h1, h2]
    assert [e[1] for e in events.stored] == [None, h0, h1]  # parent of the first block is None
    assert events.stored[1][2] == tokens[16:32]


def test_reuse_and_refcounts():
    cache = KVCache(16, 10)
    prompt = toks(1, 40)  # 2 full blocks + 8
    assert cache.allocate("a", prompt) == 0
    a_blocks = cache.seq_block_ids("a")
    assert cache.match_prefix(prompt) == 32
    assert cache.allocate("b", prompt) == 32
    b_blocks = cache.seq_block_ids("b")
    assert b_blocks[:2] == a_blocks[:2] and b_blocks[2] != a_blocks[2]
    assert [cache.ref_count(b) for b in a_blocks[:2]] == [2, 2]
    assert cache.usage == pytest.approx(4 / 10)
    cache.free("a")
    assert [cache.ref_count(b) for b in a_blocks] == [1, 1, 0]
    cache.free("b")
    assert cache.usage == 0
    # Still cached after every reference is gone.
    assert cache.allocate("c", prompt) == 32
    assert cache.seq_block_ids("c")[:2] == a_blocks[:2]
    assert cache.prefix_cache_queries == 120 and cache.prefix_cache_hits == 64


def test_match_prefix_has_no_side_effects():
    cache = KVCache(16, 4)
    cache.allocate("a", toks(1, 33))
    cache.free("a")
    before = (cache.num_free_blocks, cache.num_cached_blocks, cache.prefix_cache_queries, cache.usage)
    assert cache.match_prefix(toks(1, 33)) == 32
    assert (cache.num_free_blocks, cache.num_cached_blocks, cache.prefix_cache_queries, cache.usage) == before


@pytest.mark.parametrize("n_tokens,expected", [
    (15, 0),   # no full block
    (16, 0),   # one full block, but the last token must be recomputed
    (17, 16),
    (32, 16),  # block-aligned: the last block cannot be a hit
    (33, 32),
    (40, 32),  # partial trailing block never counts
])
def test_match_granularity(n_tokens, expected):
    cache = KVCache(16, 10)
    cache.allocate("a", toks(1, 64))
    assert cache.match_prefix(toks(1, n_tokens)) == expected


def test_partial_trailing_block_never_cached():
    cache = KVCache(16, 10)
    cache.allocate("a", toks(1, 20))
    assert cache.num_cached_blocks == 1
    cache.free("a")
    # Same 20 tokens + more: only the full first block can match.
    assert cache.match_prefix(toks(1, 40)) == 16


def test_diverging_prefix_stops_at_first_mismatch():
    cache = KVCache(4, 10)
    cache.allocate("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 0, 9, 9]) == 4
    assert cache.match_prefix([0, 2, 3, 4, 5, 6, 7, 8, 9]) == 0


def test_lru_eviction_order_and_touch():
    events = Events()
    cache = events.attach(KVCache(4, 4))
    x, y = [1, 2, 3, 4, 9], [5, 6, 7, 8, 9]  # each: 1 full (cached) + 1 partial block
    cache.allocate("x", x)
    cache.allocate("y", y)
    hx, hy = block_hashes(x, 4)[0], block_hashes(y, 4)[0]
    cache.free("x")
    cache.free("y")
    # Touch x: reusing it makes it most recently used.
    assert cache.allocate("x2", x) == 4
    cache.free("x2")
    # 3 fresh blocks: 2 never-cached first, then evict the LRU cached block -> y's.
    assert cache.allocate("z", [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]) == 0
    assert events.removed == [hy]
    assert cache.match_prefix(x) == 4 and cache.match_prefix(y) == 0
    assert cache.is_cached(hx) and not cache.is_cached(hy)


def test_referenced_blocks_are_never_evicted_and_full_cache_fails():
    events = Events()
    cache = events.attach(KVCache(4, 3))
    assert cache.allocate("a", toks(1, 12)) == 0  # all 3 blocks, all full and referenced
    free_before = cache.num_free_blocks
    assert cache.allocate("b", toks(100, 2)) is None  # nothing free: fails without side effects
    assert cache.num_free_blocks == free_before == 0
    assert not cache.has_seq("b")
    assert events.removed == []
    assert all(cache.is_cached(h) for h in block_hashes(toks(1, 12), 4))
    assert cache.append_token("a", 99) is False  # no room for a new block either


def test_allocation_counts_cached_free_blocks_once():
    cache = KVCache(4, 3)
    cache.allocate("a", toks(1, 9))  # 2 full + 1 partial
    cache.free("a")
    # Needs 3 blocks: 2 are cached hits (sitting in the evictable list), 1 fresh. Fits exactly.
    assert cache.allocate("b", toks(1, 9)) == 8
    assert cache.num_free_blocks == 0


def test_append_token_fills_and_caches_generated_blocks():
    events = Events()
    cache = events.attach(KVCache(4, 5))
    prompt = [1, 2, 3, 4, 5, 6]
    cache.allocate("a", prompt)
    assert len(cache.seq_block_ids("a")) == 2
    h0 = block_hashes(prompt, 4)[0]
    events.stored.clear()
    assert cache.append_token("a", 7)
    assert events.stored == []
    assert cache.append_token("a", 8)  # second block full -> hashed, parent h0
    h1 = expected_hash(h0, [5, 6, 7, 8])
    assert events.stored == [([h1], h0, [5, 6, 7, 8])]
    assert cache.append_token("a", 9)  # needs a third block
    assert len(cache.seq_block_ids("a")) == 3
    cache.free("a")
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8


def test_duplicate_content_is_cached_once():
    cache = KVCache(4, 10)
    cache.allocate("a", [1, 2, 3, 4])  # block-aligned: its block is cached but can't be hit by itself
    assert cache.allocate("b", [1, 2, 3, 4]) == 0
    assert cache.num_cached_blocks == 1
    cache.free("a")
    cache.free("b")
    assert cache.match_prefix([1, 2, 3, 4, 5]) == 4


def test_reset_prefix_cache():
    events = Events()
    cache = events.attach(KVCache(4, 4))
    cache.allocate("a", toks(1, 8))
    assert cache.reset_prefix_cache() is False  # blocks in use
    cache.free("a")
    assert cache.reset_prefix_cache() is True
    assert events.cleared == 1 and cache.num_cached_blocks == 0
    assert cache.match_prefix(toks(1, 9)) == 0
    assert cache.num_free_blocks == 4
