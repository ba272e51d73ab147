"""The router's view of every target's KV cache, kept from engine KV events (spec §3.4–3.6).

A *target* is a route key — ``"<worker_id>"`` or ``"<worker_id>#dp<rank>"`` — with the KV block
size its engine registered. Storage is laid out for prefix matching in O(prefix length):

* ``router_hash -> int`` bitmask of the targets holding that block (one dict for all targets);
  every target owns one bit, and the bits of removed targets are reused (lowest first);
* per target, ``engine_hash -> router_hash`` (engine hashes are opaque keys: int or bytes), so
  ``BlockRemoved`` and the ``parent_block_hash`` of later ``BlockStored`` events can be resolved.

``BlockStored`` token ids are re-hashed in the router's own space (``infera.kv.hashing``: chained
XXH3-64, parent of the first block ``ROUTER_SEED``, or for a prompt with a ``cache_salt`` the
salt's root: ``Stored.root``) so routing never depends on an engine's hash function or seed. Events are per target; batches for an unknown key are ignored (the worker may
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

**Bounded by bytes** (``--kv-index-max-bytes``; ``infera.kv.bound`` has the model and the default):
past the bound the coldest blocks -- the longest since stored or matched, by epochs of touches --
are evicted from every target's view, whole ages at a time, down to 95% of the bound; both
implementations evict the same blocks. An evicted block is one the engine may still hold: the view
under-predicts there (the server's self-check knows, ``infera.server.kv``), never over-predicts.

The code is split by concern: :mod:`infera.kv.index_target` (the per-target records and the lower
tiers), :mod:`infera.kv.index_py` (:class:`PyKvIndex`), :mod:`infera.kv.index_native`
(:class:`NativeKvIndex`); this module names them all, as before.
"""
from __future__ import annotations

from infera.kv.bound import BoundStats
from infera.kv.index_native import NativeKvIndex
from infera.kv.index_py import PyKvIndex
from infera.kv.index_target import FULL_ATTENTION_KINDS, GPU_MEDIUM, TargetStats, lower_tier
from infera.kv.native import native

__all__ = ["KvIndex", "PyKvIndex", "NativeKvIndex", "TargetStats", "FULL_ATTENTION_KINDS", "GPU_MEDIUM",
           "lower_tier", "BoundStats"]

#: The index the server uses: the native one where the accelerator is built.
KvIndex = NativeKvIndex if native is not None else PyKvIndex
