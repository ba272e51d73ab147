"""The hashes the simulated engine announces in its KV events: the cache's XXH3 chain (the router's
own hash space) re-rooted at a seed-dependent parent (:func:`engine_root_hash`, like vLLM's
``NONE_HASH``), so that a router must re-hash ``token_ids`` rather than trust engine hashes.
:class:`EngineHashes` keeps the cache-hash -> engine-hash map of the blocks cached on the GPU and
in the host tier.
"""
from __future__ import annotations

from typing import Sequence

import xxhash

from .cache import hash_chunk


def engine_root_hash(seed: int) -> int:
    """The simulated engine's parent of the first block (vLLM's ``NONE_HASH`` analogue)."""
    return xxhash.xxh3_64_intdigest(f"sim-{seed}".encode())


def salted_root_hash(root: int, salt: str) -> int:
    """The parent of a salted prompt's first block in the engine's chain (vLLM folds the salt into
    that block's hash; the router re-hashes from the salt the event names, never from this)."""
    return xxhash.xxh3_64_intdigest(root.to_bytes(8, "little") + b"salt\x00" + salt.encode("utf-8", "surrogatepass"))


class EngineHashes:
    """Maps the cache's block hashes (router hash space) to the engine's announced hashes.

    ``engine(block) = hash_chunk(engine(parent), tokens)`` with ``engine_root_hash(seed)`` as the
    parent of the first block: the same chain, re-rooted. Entries live while the block is cached.
    """

    def __init__(self, seed: int) -> None:
        self.root = engine_root_hash(seed)
        self._map: dict[int, int] = {}
        self._host: dict[int, int] = {}  # the same, for blocks in the host tier

    def __len__(self) -> int:
        return len(self._map)

    def get(self, cache_hash: int) -> int | None:
        return self._map.get(cache_hash)

    def parent(self, cache_parent: int | None) -> int | None:
        """The engine hash to announce as parent (None for a first block)."""
        if cache_parent is None:
            return None
        h = self._map.get(cache_parent)
        if h is None:
            h = self._host.get(cache_parent)
        if h is None:
            # The parent's content lives on only in a private (never registered) copy, and its
            # registered twin was evicted: derive a stable stand-in so the chain stays unique.
            h = xxhash.xxh3_64_intdigest(self.root.to_bytes(8, "little") + cache_parent.to_bytes(8, "little"))
        return h

    def stored(self, cache_hashes: Sequence[int], cache_parent: int | None, token_ids: Sequence[int],
               block_size: int, salt: str | None = None) -> tuple[list[int], int | None]:
        """Register newly cached blocks; returns (their engine hashes, engine parent). ``salt``: the
        first block of a salted prompt (``cache_parent`` None)."""
        eng_parent = self.parent(cache_parent)
        prev = self._root(salt) if eng_parent is None else eng_parent
        out: list[int] = []
        for i, ch in enumerate(cache_hashes):
            prev = hash_chunk(prev, token_ids[i * block_size:(i + 1) * block_size])
            self._map[ch] = prev
            out.append(prev)
        return out, eng_parent

    def removed(self, cache_hash: int) -> int | None:
        return self._map.pop(cache_hash, None)

    def _root(self, salt: str | None) -> int:
        return self.root if not salt else salted_root_hash(self.root, salt)

    def offloaded(self, cache_hash: int, cache_parent: int | None, token_ids: Sequence[int],
                  salt: str | None = None) -> tuple[int, int | None]:
        """A block copied to the host tier: (its engine hash, the same it had on the GPU; its engine
        parent)."""
        eng_parent = self.parent(cache_parent)
        eng = self._map.get(cache_hash)
        if eng is None:
            eng = hash_chunk(self._root(salt) if eng_parent is None else eng_parent, token_ids)
        self._host[cache_hash] = eng
        return eng, eng_parent

    def offload_evicted(self, cache_hash: int) -> int | None:
        return self._host.pop(cache_hash, None)

    def clear(self) -> None:
        self._map.clear()
        self._host.clear()
