"""Hashing a prompt's blocks for the kv-aware policy: :class:`BlockHashCache`, which hashes a
prefix many prompts share (a system prompt, a tool list, a conversation's earlier turns) once per
block size instead of once per request, and :func:`hash_stepwise`, which hashes a very long prompt a
slice at a time, yielding to the event loop between slices. Both return the chained hashes of
``infera.kv.hashing.block_hash_array`` unchanged; the C accelerator digests the prefixes where it is
built. Nothing here knows targets, costs or requests (those are ``kv_aware.py`` and its
neighbours).
"""
from __future__ import annotations

import asyncio
from array import array
from typing import Sequence

import xxhash

from infera.kv.hashing import ROUTER_SEED, block_hash_array, tokens_le_bytes
from infera.kv.native import native
from infera.kv.prompt import ByteLRU

HASH_SLICE_BLOCKS = 1024  # ~1 ms of hashing (hash_stepwise's slice)

# Hashes of prompt prefixes are cached (see BlockHashCache) at every multiple of this many blocks.
HASH_CACHE_STEP = 16
DEFAULT_HASH_CACHE_BYTES = 16 * 1024 * 1024


class BlockHashCache:
    """Chained block hashes of prompt prefixes, so that a prefix many prompts share (a system
    prompt, an agent's tool list, a conversation's earlier turns) is hashed once per block size,
    not once per request: a kv_routing.py prompt hashed 137 blocks, 128 of them its group's system
    prompt (bench/kv_path.py, "hash").

    Keyed by block size + XXH3-128 of the prefix's token bytes, at every ``HASH_CACHE_STEP``
    blocks: a prompt is digested once, in one pass with a snapshot at each step, its longest cached
    step is looked up, and only the blocks after it are hashed. Chains are ``array('Q')``: a
    prompt's chain is its cached prefix copied (a memcpy) plus the new blocks, and the C
    accelerator's walks over it (the index, the blocks in flight) read it in place, where a list
    cost a cold int object per block; the entries share one LRU bounded in bytes (``ByteLRU``).
    ``hits``/``misses`` count prompts; ``blocks_reused``/``blocks_hashed`` count blocks."""

    def __init__(self, max_bytes: int = DEFAULT_HASH_CACHE_BYTES, step: int = HASH_CACHE_STEP) -> None:
        self.lru = ByteLRU(max_bytes)
        self.step = step
        self.hits = self.misses = 0
        self.blocks_reused = self.blocks_hashed = 0

    def hashes(self, tokens: Sequence[int], block_size: int, root: int = ROUTER_SEED) -> array:
        """``block_hash_array(tokens, block_size, root)``: a new array the caller may extend.
        ``root``: a salted prompt's (``infera.kv.hashing.salt_root``), part of the cache's keys."""
        n = len(tokens) // block_size if block_size > 0 else 0
        step = self.step
        if n < step or not self.lru.max_bytes:
            self.blocks_hashed += n
            return block_hash_array(tokens, block_size, root)
        if isinstance(tokens, array) and tokens.itemsize == 4:
            data = memoryview(tokens).cast("B")[:n * block_size * 4]
        else:
            data = memoryview(tokens_le_bytes(tokens[:n * block_size]))
        stride = step * block_size * 4
        tag = block_size.to_bytes(4, "little") + (root.to_bytes(8, "little") if root != ROUTER_SEED else b"")
        if native is not None:
            keys = native.prefix_keys(data, stride, tag)
        else:
            digest = xxhash.xxh3_128()
            keys = []
            for end in range(stride, len(data) + 1, stride):
                digest.update(data[end - stride:end])
                keys.append(tag + digest.digest())
        get = self.lru.get
        found = None
        for i in range(len(keys) - 1, -1, -1):
            found = get(keys[i])
            if found is not None:
                break
        if found is not None:
            self.hits += 1
            out = found[:]
            self.blocks_reused += len(out)
            if len(out) < n:
                start = len(out) * block_size
                out += block_hash_array(data[start * 4:].cast("I") if isinstance(tokens, array) and tokens.itemsize == 4
                                        else tokens[start:n * block_size], block_size, out[-1])
        else:
            self.misses += 1
            out = block_hash_array(tokens, block_size, root)
        self.blocks_hashed += n - (len(found) if found is not None else 0)
        # Stored: this prompt's longest step, and on a miss its steps at 1, 2, 4, 8… steps too, so
        # that a later prompt sharing only a shorter prefix (a system prompt before a document)
        # finds one (log2 entries, half of them small).
        have = len(found) if found is not None else 0
        k = 1
        while found is None and k < len(keys):
            self.lru.put(keys[k - 1], out[:k * step])
            k *= 2
        if have < len(keys) * step:
            self.lru.put(keys[-1], out[:len(keys) * step])
        return out


async def hash_stepwise(tokens: Sequence[int], block_size: int, root: int = ROUTER_SEED) -> array:
    """``block_hash_array(tokens, block_size, root)``, yielding to the event loop every
    ``HASH_SLICE_BLOCKS`` blocks (the chain continues from the last hash of the slice before)."""
    hashes = array("Q")
    step = block_size * HASH_SLICE_BLOCKS
    for start in range(0, len(tokens), step):
        part = block_hash_array(tokens[start:start + step], block_size, hashes[-1] if hashes else root)
        if not part:
            break
        hashes += part
        await asyncio.sleep(0)
    return hashes
