"""Paged KV cache with vLLM-style automatic prefix caching, for the simulated engine.

The cache only does bookkeeping (no tensors): which physical block holds which tokens, who
references it, and which full blocks are reusable by hash. Semantics follow vLLM v1's
``KVCacheManager``/``BlockPool``:

* Only FULL blocks are cacheable. A block's identity is a chained hash over its tokens and the
  hash of the block before it, so a hit on block ``i`` implies the whole prefix up to ``i`` matches.
* A block stays cached after its last reference goes away; it sits in an LRU list and loses its
  hash only when a fresh block is needed and no never-cached block is left (eviction).
* At least one prompt token is always recomputed (a full-prompt hit still has to produce logits),
  so a block-aligned prompt can hit at most ``len(tokens) - 1`` tokens, rounded down to a block.

KV-event hooks (``on_stored``/``on_removed``/``on_cleared``) fire when full blocks first enter the
cache, when cached blocks are evicted, and when the whole cache is reset.

Prefill/decode disaggregation adds *holds*: block references owned by a hold id instead of a
sequence (``hold_prefix_blocks`` pins a finished prefill's prompt blocks for a decode to pull;
``import_blocks`` fills blocks with KV that arrived by transfer). ``free(hold_id)`` releases one.

A *host tier* (``host_blocks > 0``; vLLM's CPU offloading, SGLang's HiCache, kvd behind a
connector) keeps what the GPU evicts: a cached block leaving the GPU is copied there (LRU, bounded;
``on_offloaded``), and falls out when the tier is full (``on_offload_evicted``). A prompt whose
prefix goes on in the host tier after its GPU hit *loads* those blocks instead of computing them:
they count as cached tokens (as vLLM counts connector-loaded tokens), the scheduler charges a load
time per block, and they re-enter the GPU as freshly filled blocks (``on_stored``). The host copy
stays (an inclusive tier), refreshed in its LRU order.

A request's ``cache_salt`` (vLLM's per-request isolation) salts its prompt's chain from the first
block on: the chain starts from ``scope_root(salt)`` instead of the root (the router's space, as
``infera.kv.hashing`` folds it), so its blocks never match the same tokens unsalted or under another
salt. A salted prompt's newly cached first block is announced through ``on_stored_salted`` (and
``on_offloaded_salted``) with the salt in place of the parent, as vLLM names it among the block's
extra keys; without those hooks it goes to ``on_stored`` like any first block.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from infera.kv.hashing import ROUTER_SEED, block_hashes, hash_chunk, salt_root  # noqa: F401  (re-exported)

from .lora import scope_root

# The cache's own prefix keys are the router's chained block hashes (one implementation); what
# it announces in KV events is re-rooted by the publisher, so the router still has to re-hash.
ROOT_PARENT_HASH = ROUTER_SEED

OnStored = Callable[[list[int], "int | None", list[int]], None]
OnRemoved = Callable[[list[int]], None]
OnCleared = Callable[[], None]
# A GPU-evicted block copied to the host tier: (its hash, its parent's hash or None, its tokens).
OnOffloaded = Callable[[int, "int | None", list[int]], None]
# A salted prompt's first block: (its hash(es), the salt, its tokens) -- stored, or offloaded.
OnStoredSalted = Callable[[list[int], str, list[int]], None]
OnOffloadedSalted = Callable[[int, str, list[int]], None]

@dataclass
class _SeqBlocks:
    """Blocks and tokens one sequence holds, in order."""

    block_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    # Hash of the last full block (parent for the next block to fill); ROOT when none.
    last_full_hash: int = ROOT_PARENT_HASH
    num_full_blocks: int = 0
    # Of the hit blocks, those loaded from the host tier (after the GPU hit).
    num_loaded_blocks: int = 0
    salt: str | None = None  # the request's cache_salt: its first block's parent is scope_root(salt)


class KVCache:
    """Block allocator + prefix cache. Not thread-safe; owned by one event loop."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        *,
        on_stored: OnStored | None = None,
        on_removed: OnRemoved | None = None,
        on_cleared: OnCleared | None = None,
        host_blocks: int = 0,
        on_offloaded: OnOffloaded | None = None,
        on_offload_evicted: OnRemoved | None = None,
    ) -> None:
        if block_size <= 0 or num_blocks <= 0:
            raise ValueError("block_size and num_blocks must be > 0")
        if host_blocks < 0:
            raise ValueError("host_blocks must be >= 0")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.on_stored = on_stored
        self.on_removed = on_removed
        self.on_cleared = on_cleared
        self.on_stored_salted: OnStoredSalted | None = None
        self.on_offloaded_salted: OnOffloadedSalted | None = None

        self._ref_counts = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        # Unreferenced blocks without a hash: handed out first, so cached content survives longest.
        self._never_cached: deque[int] = deque(range(num_blocks))
        # Unreferenced blocks that still hold a cached hash, oldest (next to evict) first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._seqs: dict[object, _SeqBlocks] = {}
        self._num_referenced = 0

        # Prefix-cache statistics, in tokens (what vLLM's counters report).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

        # Host tier: hash -> (parent hash, tokens) of blocks the GPU evicted, LRU first.
        self.host_blocks = host_blocks
        self.on_offloaded = on_offloaded
        self.on_offload_evicted = on_offload_evicted
        self._host: OrderedDict[int, tuple[int | None, list[int]]] = OrderedDict()
        # per GPU block, (parent hash, tokens, salt of a salted first block) while it is cached: what
        # goes to the host on eviction
        self._block_meta: list[tuple[int | None, list[int], str | None] | None] = (
            [None] * num_blocks if host_blocks else [])
        self.host_loaded_tokens = 0  # prompt tokens loaded from the host tier (not computed)

    # ----------------------------------------------------------------- queries

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences (cached-but-free blocks count as free)."""
        return self._num_referenced / self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (never-cached + evictable)."""
        return len(self._never_cached) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has_seq(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def seq_block_ids(self, seq_id: object) -> list[int]:
        return list(self._seqs[seq_id].block_ids)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._hash_to_block

    @property
    def num_host_blocks(self) -> int:
        """Blocks the host tier holds now."""
        return len(self._host)

    def in_host(self, block_hash: int) -> bool:
        return block_hash in self._host

    def loaded_tokens(self, seq_id: object) -> int:
        """Of ``seq_id``'s hit tokens at allocation, those loaded from the host tier."""
        return self._seqs[seq_id].num_loaded_blocks * self.block_size

    def _host_run(self, hashes: list[int], start: int, limit: int) -> int:
        """How many of ``hashes[start:limit]`` in a row the host tier holds."""
        host = self._host
        if not host:
            return 0
        n = start
        while n < limit and hashes[n] in host:
            n += 1
        return n - start

    def _max_hit_blocks(self, num_tokens: int) -> int:
        # At least one token must be computed to produce the next token's logits.
        return max(num_tokens - 1, 0) // self.block_size

    def _matching_blocks(self, hashes: list[int], limit: int) -> list[int]:
        blocks: list[int] = []
        for h in hashes[:limit]:
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def match_prefix(self, tokens: Sequence[int], salt: str | None = None) -> int:
        """How many leading tokens ``allocate`` would serve from the cache right now. No side effects."""
        limit = self._max_hit_blocks(len(tokens))
        if limit == 0:
            return 0
        hashes = block_hashes(tokens[: limit * self.block_size], self.block_size, scope_root(salt))
        hit = len(self._matching_blocks(hashes, limit))
        return (hit + self._host_run(hashes, hit, limit)) * self.block_size

    # ------------------------------------------------------------- allocation

    def match_full_blocks(self, tokens: Sequence[int], salt: str | None = None) -> int:
        """Leading tokens of ``tokens``' full blocks already cached (no one-token-recompute limit):
        what a KV transfer of those blocks would not need to move. No side effects."""
        num_full = len(tokens) // self.block_size
        hashes = block_hashes(tokens[: num_full * self.block_size], self.block_size, scope_root(salt))
        return len(self._matching_blocks(hashes, num_full)) * self.block_size

    def allocate(self, seq_id: object, tokens: Sequence[int], salt: str | None = None) -> int | None:
        """Give ``seq_id`` blocks for ``tokens``; return how many tokens were prefix-cache hits.

        Returns None (and changes nothing) when there are not enough free blocks.
        Full blocks are registered in the cache immediately, as vLLM does at schedule time.
        """
        tokens = list(tokens)
        hit_blocks = self._acquire(seq_id, tokens, self._max_hit_blocks(len(tokens)), salt)
        if hit_blocks is None:
            return None
        cached_tokens = len(hit_blocks) * self.block_size
        loaded_tokens = self._seqs[seq_id].num_loaded_blocks * self.block_size
        self.prefix_cache_queries += len(tokens)
        self.prefix_cache_hits += cached_tokens  # GPU hits only, as vLLM's counter
        self.host_loaded_tokens += loaded_tokens
        return cached_tokens + loaded_tokens

    def import_blocks(self, hold_id: object, tokens: Sequence[int], salt: str | None = None) -> list[int] | None:
        """Hold the full blocks of ``tokens`` under ``hold_id`` as KV that arrived by transfer.

        Blocks already cached are reused; the others are filled and registered exactly as if
        computed here (``on_stored`` fires), so a sequence with this prefix then hits them all.
        Returns the ids of the blocks filled by the transfer; None (nothing changed) when the free
        blocks don't suffice. Not counted as prefix-cache queries: no request asked yet.
        """
        num_full = len(tokens) // self.block_size
        full = list(tokens[: num_full * self.block_size])
        hit_blocks = self._acquire(hold_id, full, num_full, salt)
        if hit_blocks is None:
            return None
        return self._seqs[hold_id].block_ids[len(hit_blocks):]

    def hold_prefix_blocks(self, hold_id: object, seq_id: object, num_blocks: int) -> list[int]:
        """Pin the first ``num_blocks`` blocks of live ``seq_id`` under ``hold_id`` (a reference of
        its own, so they survive the sequence being freed and cannot be evicted); their ids."""
        if hold_id in self._seqs:
            raise ValueError(f"hold {hold_id!r} already holds blocks")
        seq = self._seqs[seq_id]
        block_ids = seq.block_ids[: max(num_blocks, 0)]
        for block_id in block_ids:
            self._ref(block_id)
        self._seqs[hold_id] = _SeqBlocks(block_ids=list(block_ids),
                                         tokens=seq.tokens[: len(block_ids) * self.block_size],
                                         num_full_blocks=len(block_ids), salt=seq.salt)
        return list(block_ids)

    def _acquire(self, owner: object, tokens: list[int], max_hit_blocks: int,
                 salt: str | None = None) -> list[int] | None:
        """Blocks for ``tokens`` under ``owner``, reusing up to ``max_hit_blocks`` cached ones;
        the hit block ids, or None (nothing changed) when there are not enough free blocks."""
        if owner in self._seqs:
            raise ValueError(f"sequence {owner!r} already holds blocks")
        bs = self.block_size
        salt = salt or None  # (an empty salt is no salt, as in vLLM)
        root = scope_root(salt)
        hashes = block_hashes(tokens, bs, root)
        hit_blocks = self._matching_blocks(hashes, max_hit_blocks)
        loaded = self._host_run(hashes, len(hit_blocks), max_hit_blocks)
        num_new = self.blocks_needed(len(tokens)) - len(hit_blocks)
        # Hit blocks currently sitting unreferenced are counted as free; don't count them twice.
        hits_in_evictable = sum(1 for b in hit_blocks if self._ref_counts[b] == 0)
        if num_new > self.num_free_blocks - hits_in_evictable:
            return None

        for block_id in hit_blocks:
            self._ref(block_id)
        host = self._host
        for h in hashes[len(hit_blocks):len(hit_blocks) + loaded]:
            host.move_to_end(h)  # most recently used: kept while fresh blocks push others out
        block_ids = list(hit_blocks)
        for _ in range(num_new):
            block_id = self._take_fresh_block()
            self._ref(block_id)
            block_ids.append(block_id)

        seq = _SeqBlocks(block_ids=block_ids, tokens=tokens, num_loaded_blocks=loaded, salt=salt)
        self._seqs[owner] = seq
        # Register the newly filled full blocks (hits are already cached).
        for i in range(len(hit_blocks), len(hashes)):
            parent = hashes[i - 1] if i > 0 else None
            self._register_full_block(block_ids[i], hashes[i], parent, tokens[i * bs : (i + 1) * bs],
                                      salt if i == 0 else None)
        seq.num_full_blocks = len(hashes)
        seq.last_full_hash = hashes[-1] if hashes else root
        return hit_blocks

    def append_token(self, seq_id: object, token: int) -> bool:
        """Append one generated token. Returns False (nothing changed) if a new block is needed and none is free."""
        seq = self._seqs[seq_id]
        bs = self.block_size
        if len(seq.tokens) == len(seq.block_ids) * bs:  # last block full (or none yet)
            if self.num_free_blocks == 0:
                return False
            block_id = self._take_fresh_block()
            self._ref(block_id)
            seq.block_ids.append(block_id)
        seq.tokens.append(token)
        if len(seq.tokens) % bs == 0:
            # The block just filled up: it becomes cacheable, generated tokens included.
            i = seq.num_full_blocks
            block_tokens = seq.tokens[i * bs :]
            parent = seq.last_full_hash if i > 0 else None
            h = hash_chunk(seq.last_full_hash, block_tokens)
            self._register_full_block(seq.block_ids[i], h, parent, block_tokens, seq.salt if i == 0 else None)
            seq.num_full_blocks = i + 1
            seq.last_full_hash = h
        return True

    def free(self, seq_id: object) -> None:
        """Drop a sequence's (or hold's) references. Its cached blocks stay reusable until evicted."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        # Tail blocks first, so they are evicted before the (more shareable) head of the prefix.
        for block_id in reversed(seq.block_ids):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._num_referenced -= 1
                if self._block_hash[block_id] is None:
                    self._never_cached.append(block_id)
                else:
                    self._evictable[block_id] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed when no block is referenced (like vLLM)."""
        if self._num_referenced:
            return False
        for block_id in list(self._evictable):
            self._block_hash[block_id] = None
            self._never_cached.append(block_id)
        self._evictable.clear()
        self._hash_to_block.clear()
        # the host tier too: the engine's clear event drops every tier in a router's view
        self._host.clear()
        if self.on_cleared:
            self.on_cleared()
        return True

    # ---------------------------------------------------------------- helpers

    def _ref(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            self._num_referenced += 1
            self._evictable.pop(block_id, None)
        self._ref_counts[block_id] += 1

    def _take_fresh_block(self) -> int:
        """An unreferenced block with no content we still care about; evicts the LRU cached one if needed."""
        if self._never_cached:
            return self._never_cached.popleft()
        block_id, _ = self._evictable.popitem(last=False)
        old_hash = self._block_hash[block_id]
        self._block_hash[block_id] = None
        if old_hash is not None and self._hash_to_block.get(old_hash) == block_id:
            del self._hash_to_block[old_hash]
            if self.host_blocks:
                meta = self._block_meta[block_id]
                self._block_meta[block_id] = None
                if meta is not None:
                    self._offload(old_hash, *meta)  # stored there before it leaves the GPU, as vLLM orders them
            if self.on_removed:
                self.on_removed([old_hash])
        return block_id

    def _register_full_block(self, block_id: int, block_hash: int, parent_hash: int | None, tokens: list[int],
                             salt: str | None = None) -> None:
        """``salt``: set for a salted prompt's first block (``parent_hash`` is then None)."""
        if block_hash in self._hash_to_block:
            # Same content already cached in another block (e.g. two identical prompts admitted
            # in one step): keep the existing entry; this copy stays private and is never reused.
            return
        self._hash_to_block[block_hash] = block_id
        self._block_hash[block_id] = block_hash
        if self.host_blocks:
            self._block_meta[block_id] = (parent_hash, tokens, salt)
        if salt is not None and self.on_stored_salted:
            self.on_stored_salted([block_hash], salt, list(tokens))
        elif self.on_stored:
            self.on_stored([block_hash], parent_hash, list(tokens))

    def _offload(self, block_hash: int, parent_hash: int | None, tokens: list[int], salt: str | None = None) -> None:
        """Copy an evicted GPU block to the host tier (LRU-bounded)."""
        host = self._host
        if block_hash in host:
            host.move_to_end(block_hash)  # loaded from there earlier: the copy is still good
            return
        while len(host) >= self.host_blocks:
            old, _ = host.popitem(last=False)
            if self.on_offload_evicted:
                self.on_offload_evicted([old])
        host[block_hash] = (parent_hash, tokens)
        if salt is not None and self.on_offloaded_salted:
            self.on_offloaded_salted(block_hash, salt, tokens)
        elif self.on_offloaded:
            self.on_offloaded(block_hash, parent_hash, tokens)
