"""KV-aware policy: send a request where the longest part of its prompt is already cached,
balanced against load.

cost(target) = w_overlap × missed_blocks + w_mm × missed_images + in_flight_blocks + recent_misses

* missed_blocks = request blocks − the longest cached prefix in that target's view (KV events),
  extended by the blocks of requests served there that its events have not caught up with (cached,
  though the events saying so may still be on the way); when no target has any of it cached, the
  blocks of requests still in flight there count (they are about to be cached: a concurrent second
  request must not prefill a duplicate elsewhere);
* in_flight_blocks = distinct blocks of requests in flight there (shared prefixes count once);
* recent_misses = missed blocks charged at pick time, decayed ×0.97 per pick (prefill work queued
  there that in-flight accounting alone would not show). Unlike upstream, a request's remaining
  charge is released when it finishes: a finished prefill is no load, and keeping it charged
  pushes the very next turn of a conversation away from the worker that just cached its prefix;
* w_overlap = the role's weight (``--kv-overlap-weight``, or the prefill/decode weights for PD
  legs) × the retention amplifier (long ×2, explicit none ×0.1);
* multimodal requests are steered by image affinity (w_mm = 48 × w) instead of text overlap.

While a candidate's view is still warming up (the observer's ``warming``: its history not yet
replayed, e.g. just after this server started), the pick is made by load alone: no target is
credited with a partial view's hits or blamed for blocks its view has not caught up with, and
``predicted_hit_blocks`` is 0 (``kv_load_only`` in the request state keeps the reply out of the
self-check).

A rank-multiplexed worker (DP attention) is scored per rank; the chosen rank travels as
``X-Data-Parallel-Rank``. The argmin is over (cost, load); remaining ties go to the target whose
cache holds the fewest blocks, then rotate.

Server replicas routing one fleet all read every engine's KV events, so they agree on what is
cached. What only one replica knows is what it has in flight and what it has just served. With a
replica sync (``replica_sync=``, e.g. :class:`infera.transport.replica_sync_nats.NatsReplicaSync`)
each replica tells the others (:class:`ReplicaShare`): their requests in flight count in
in_flight_blocks, in recent_misses (the charge of their pick, until they finish) and in the
in-flight rule of missed_blocks, and their served requests in the not-yet-caught-up extension,
exactly like this replica's own.

The hot path is kept to what can change the pick (bench/kv_path.py measures each step): a prompt is
tokenized only up to its ``Horizon`` (past the first block that no target holds, nothing can), the
hashes of shared prefixes come from a ``BlockHashCache``, the grouping of the candidates is kept
while the fleet hands out the same tuple, and a served request claims as landed only the blocks its
target's view does not already hold. The loop over a group's targets runs in C where the accelerator is
built (``native.score_targets``; no lower tiers, images or debug log), tie-break included: a pick in
front of 128 engines costs ~10-20 us instead of 40-65.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import time
from array import array
from collections import OrderedDict
from typing import Callable, Protocol, Sequence

import xxhash

from infera.api.cache_hints import LONG, NO_HINTS, NONE, RETENTION_NAMES, CacheHints, parse_cache_hints
from infera.discovery.record import WorkerRecord
from infera.kv.counts import BlockCounter, LandedClaims
from infera.kv.hashing import ROUTER_SEED, block_hash_array, tokens_le_bytes
from infera.kv.native import native
from infera.kv.prompt import ByteLRU, PromptTokenizer
# (PEER_TIMEOUT_S and SYNC_BLOCKS_PER_REQUEST are re-exported: callers imported them from here)
from infera.kv.replica_share import PEER_TIMEOUT_S, SYNC_BLOCKS_PER_REQUEST, ReplicaShare  # noqa: F401
from infera.router.policy import RoutedRequest
from infera.router.ttft_balance import TtftBalance

log = logging.getLogger(__name__)
_DEBUG = logging.DEBUG

RECENT_DECAY = 0.97
# The recent charges are kept divided by the decay applied since their last rebase; rebased (and
# the spent ones dropped) when that decay falls below this (every ~11,000 picks).
_REBASE_BELOW = 1e-150
_SPENT = 1e-3  # a recent charge below this is gone
# A served request's blocks count as cached where it ran until that engine's events catch up with
# the moment it finished (a batch made later is applied: the view then says what became of them,
# evictions included), or at most this long (an idle engine sends nothing). Engines publish KV
# events from a side thread: on a busy 2-core box vLLM's arrived up to 0.5 s after the reply
# (infera_kv_event_delay_seconds), and the next turn was routed on a view without its previous one.
LANDED_TTL_S = 2.0
LANDED_CAP = 1 << 16  # blocks per target: bounded whatever the request rate
MM_WEIGHT = 48.0
MM_AFFINITY_CAP = 256
# A block the target's engine holds on a lower tier (host memory, disk: kvd) costs this fraction of
# a miss: loading it back is a few % of prefilling it, plus the chance it is gone by then.
DEFAULT_LOWER_TIER_WEIGHT = 0.25
# Prompts of at least this many tokens are hashed before the pick, a slice at a time (see
# prepare()), for at most this many distinct block sizes (a fleet has one or two).
HASH_AHEAD_TOKENS = 16384
HASH_SLICE_BLOCKS = 1024  # ~1 ms of hashing
MAX_BLOCK_SIZES_AHEAD = 4


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

    def hashes(self, tokens: Sequence[int], block_size: int) -> array:
        """``block_hash_array(tokens, block_size)``: a new array the caller may extend."""
        n = len(tokens) // block_size if block_size > 0 else 0
        step = self.step
        if n < step or not self.lru.max_bytes:
            self.blocks_hashed += n
            return block_hash_array(tokens, block_size)
        if isinstance(tokens, array) and tokens.itemsize == 4:
            data = memoryview(tokens).cast("B")[:n * block_size * 4]
        else:
            data = memoryview(tokens_le_bytes(tokens[:n * block_size]))
        stride = step * block_size * 4
        tag = block_size.to_bytes(4, "little")
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
            out = block_hash_array(tokens, block_size)
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


async def hash_stepwise(tokens: Sequence[int], block_size: int) -> array:
    """``block_hash_array(tokens, block_size)``, yielding to the event loop every
    ``HASH_SLICE_BLOCKS`` blocks (the chain continues from the last hash of the slice before)."""
    hashes = array("Q")
    step = block_size * HASH_SLICE_BLOCKS
    for start in range(0, len(tokens), step):
        part = block_hash_array(tokens[start:start + step], block_size, hashes[-1] if hashes else ROUTER_SEED)
        if not part:
            break
        hashes += part
        await asyncio.sleep(0)
    return hashes


def _NOTHING_HELD(key: str) -> int:
    return 0


def route_key(worker_id: str, dp_rank: int | None) -> str:
    return worker_id if dp_rank is None else f"{worker_id}#dp{dp_rank}"


def expand_targets(worker: WorkerRecord) -> list[tuple[int | None, str]]:
    """(dp_rank, route_key) per target: a rank-multiplexed worker is one target per rank."""
    if worker.dp_size and worker.dp_size > 1 and worker.dp_rank is None:
        return [(r, route_key(worker.worker_id, r)) for r in range(worker.dp_size)]
    return [(None, worker.worker_id)]


_NO_HINTS = CacheHints()
_NO_BLOCKS: list[int] = []  # (never appended to)
_NO_LOWER = itertools.repeat(0)  # (zip stops at the targets)
_NO_HITS = _NO_LOWER


class Horizon:
    """How far a prompt's tokens can matter to its pick, for ``PromptTokenizer.token_ids``.

    Every target's hit is the longest prefix of the prompt's blocks it holds (in its view, or
    extended by blocks in flight or served there: ``pick``). So once a block is held by no target
    at all, for every block size in use, no hit can reach past it: the blocks after it cannot
    change which target wins, only add the same cost to every target. The tokenizer checks after
    each cached piece and after the first words of each new piece, and stops there: a long new
    turn, a document no worker has seen, costs a block's worth of tokenizing and hashing.

    ``chains``: per block size, the hashes of the full blocks checked (the pick's, when the ids
    stop at the last check); ``cut``: (tokens, characters encoded, characters in all), where the
    tokenizer stopped. The charge, the blocks in flight and the metrics then count the rest of
    the prompt by an estimate (``more_tokens``)."""

    __slots__ = ("_policy", "_open", "chains", "cut")

    def __init__(self, policy: "KvAwarePolicy", sizes: tuple[int, ...]) -> None:
        self._policy = policy
        self._open = set(sizes)  # block sizes whose horizon is not reached yet
        self.chains: dict[int, list[int]] = {}
        self.cut: tuple[int, int, int] | None = None

    def needed(self, n_ids: int) -> int:
        """Tokens after the first ``n_ids`` that complete the next block of every open size."""
        return max((bs - n_ids % bs for bs in self._open), default=0)

    def reached(self, ids: Sequence[int]) -> bool:
        held = self._policy._held_anywhere
        first_unheld = self._policy._first_unheld
        for bs in tuple(self._open):
            n = len(ids) // bs
            chain = self.chains.get(bs)
            if chain is None:
                chain = self.chains[bs] = self._policy.hash_cache.hashes(ids, bs)
                start = 0
            elif n > len(chain):
                start = len(chain)
                chain += block_hash_array(ids[start * bs:n * bs], bs, chain[-1] if chain else ROUTER_SEED)
            else:
                continue
            i = first_unheld(chain, start)  # most blocks are in some view: one dict lookup each
            while i < len(chain):
                if not held(chain[i]):
                    self._open.discard(bs)
                    break
                i = first_unheld(chain, i + 1)
        return not self._open

    def stop(self, tokens: int, chars: int, total_chars: int) -> None:
        self.cut = (tokens, chars, total_chars)


class PrefixIndex(Protocol):
    def match(self, hashes: list[int], keys: Sequence[str]) -> list[int]: ...


class KvPickObserver(Protocol):
    """Metrics sink (the server's); optional. It may also have ``warming``: a live collection of the
    route keys whose view is not caught up yet (picks among them are by load; see the docstring);
    and ``on_engine_restart``: a list the policy appends its callback to, called with a route key
    whose engine restarted (its cache is gone: so are the blocks served there just before)."""

    def record_pick(self, role: str, key: str, hit_blocks: int, request_blocks: int) -> None: ...


class ReplicaSyncLink(Protocol):
    """A replica sync's transport: it is handed the policy's :class:`ReplicaShare` once, drains its
    outbox in the background and applies what the other replicas say (on the event loop)."""

    def attach(self, share: "ReplicaShare") -> None: ...


class KvAwarePolicy:
    name = "kv-aware"

    def __init__(self, index: PrefixIndex, prompts: PromptTokenizer, *, overlap_weight: float = 1.0,
                 prefill_overlap_weight: float | None = None, decode_overlap_weight: float | None = None,
                 observer: KvPickObserver | None = None, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, replica_sync: ReplicaSyncLink | None = None,
                 hash_cache_bytes: int = DEFAULT_HASH_CACHE_BYTES, horizon: bool = True,
                 inflight_weight: float | None = None,
                 lower_tier_weight: float = DEFAULT_LOWER_TIER_WEIGHT) -> None:
        if not 0.0 <= lower_tier_weight <= 1.0:
            raise ValueError(f"lower_tier_weight must be in [0, 1], got {lower_tier_weight!r}")
        self.index = index
        # 1.0: tier-blind (a lower-tier block is a miss); the index may know no lower tiers at all
        self.lower_tier_weight = lower_tier_weight
        self._match_lower = getattr(index, "match_lower", None)
        self._has_lower_tiers = getattr(index, "has_lower_tiers", None)
        self.clock = clock
        self.wall_clock = wall_clock  # compared with engine event timestamps
        self._events_made_until = getattr(index, "events_made_until", None)
        # blocks cached on a target, for the tie-break (an index without counts: all alike)
        self._held = getattr(index, "block_count", None) or _NOTHING_HELD
        # pick()'s loop over a group of targets in C (None: the Python loop there, which it matches);
        # it settles ties itself where the index gives every key's count in one call
        self._score = native.score_targets if native is not None else None
        self._block_counts = getattr(index, "block_counts", None)
        self._match_one = getattr(index, "match_one", None)
        self.hash_cache = BlockHashCache(hash_cache_bytes)
        self.prompts = prompts
        # Per model (RouterTokenizers) or one for all; the PromptTokenizer itself is called, so that
        # it can stop at the Horizon.
        self._prompts_for = getattr(prompts, "prompts_for", None)
        self._first_unheld = getattr(index, "first_unheld", None)
        self.horizon = horizon and self._first_unheld is not None  # see Horizon
        # The ids as an array when the tokenizer offers them so (no list of 100k ints per request).
        self._tokenize = getattr(prompts, "token_ids", None) or prompts.tokens
        self.weights = {"mixed": overlap_weight,
                        "prefill": overlap_weight if prefill_overlap_weight is None else prefill_overlap_weight,
                        "decode": overlap_weight if decode_overlap_weight is None else decode_overlap_weight}
        self.observer = observer
        self._warming = getattr(observer, "warming", None)  # route keys whose view is still warming up
        restarts = getattr(observer, "on_engine_restart", None)
        if restarts is not None:
            restarts.append(self.engine_restarted)
        # route key → block hash → requests in flight, this replica's and (with a sync) the others'
        self.active: dict[str, BlockCounter] = {}
        # route key → blocks in flight there beyond their prompts' horizons (estimated, not hashed)
        self.unhashed: dict[str, int] = {}
        # route key → requests in flight there (this replica's and the others'), weighed in the load
        # by what one costs a new request's TTFT, in missed blocks (see ttft_balance; None: learned)
        self.inflight: dict[str, int] = {}
        self.balance = TtftBalance(inflight_weight)
        # route key → the recent picks' charges there, decaying by RECENT_DECAY per pick; stored
        # divided by ``_decay`` (RECENT_DECAY^picks since the last rebase), so that decaying every
        # target's is one multiplication per pick, not a walk over the fleet (``recent_charge``).
        self.recent: dict[str, float] = {}
        self._decay = 1.0
        self._picks = 0  # decay clock: remaining charge = charge × RECENT_DECAY^(picks since)
        self.mm_affinity: dict[str, OrderedDict[int, None]] = {}
        # route key → block hash → (wall time it finished, monotonic expiry), in order of arrival
        self.landed: dict[str, LandedClaims] = {}
        self._block_sizes: set[int] = set()  # of the targets picked among: hashed ahead for big prompts
        self._layout_of: object = None  # the candidates _layout was made for
        self._layout: tuple[list, int] = ([], 0)
        self._next_sweep = 0.0  # landed claims of targets no pick looks at are swept from pick()
        self.replicas: ReplicaShare | None = None  # what the other server replicas share
        if replica_sync is not None:
            self.replicas = ReplicaShare(self)
            replica_sync.attach(self.replicas)

    def prepare_cached(self, request: RoutedRequest) -> bool:
        """``prepare`` done synchronously when the prompt's token ids are cached (a repeated prompt:
        the common case), so the caller awaits no coroutine for it; False: ``prepare`` must run."""
        parsed = request.parsed
        prompts = self._prompts_for(getattr(parsed, "model", None)) if self._prompts_for is not None else self.prompts
        if type(prompts) is PromptTokenizer:
            tokens, keyed = prompts.lookup(request.route, parsed)
        else:
            lookup = getattr(prompts, "lookup", None)
            if lookup is None:
                return False
            tokens, keyed = lookup(request.route, parsed)
        st = request.state
        if tokens is None:
            st["prompt_keyed"] = (prompts, keyed)  # prepare() tokenizes without keying the prompt again
            return False
        st["tokens"] = tokens
        st["hints"] = parse_cache_hints(parsed)
        return len(tokens) < HASH_AHEAD_TOKENS or not self._block_sizes  # else prepare() hashes ahead

    async def prepare(self, request: RoutedRequest) -> None:
        """Tokenize once per request (cached across requests), before any pick: at most the
        prompt's routing prefix, off the event loop when it is big (``PromptTokenizer``), and
        only as far as it can matter (``Horizon``)."""
        st = request.state
        parsed = request.parsed
        prompts = self._prompts_for(getattr(parsed, "model", None)) if self._prompts_for is not None else self.prompts
        handed = st.pop("prompt_keyed", None)
        keyed = handed[1] if handed is not None and handed[0] is prompts else None
        if "tokens" in st:  # prepare_cached() found them
            tokens = st["tokens"]
        elif prompts is None:  # its tokenizer is loading: routed by load for that moment
            tokens: Sequence[int] = ()
        elif self.horizon and self._block_sizes and isinstance(prompts, PromptTokenizer):
            made: list[Horizon] = []
            sizes = tuple(self._block_sizes)

            def horizon() -> Horizon:
                made.append(Horizon(self, sizes))
                return made[-1]

            tokens = await prompts.token_ids(request.route, parsed, horizon=horizon, keyed=keyed)
            if made:
                st["chains"] = made[0].chains  # hashes of a prefix of the ids: the pick goes on from them
                if made[0].cut is not None:
                    n, chars, total_chars = made[0].cut
                    # The prompt goes on: its blocks count as missed and in flight as before, by an
                    # estimate from the characters not encoded.
                    st["more_tokens"] = int(n * (total_chars - chars) / chars) if chars else 0
        elif keyed is not None:
            tokens = await prompts.token_ids(request.route, parsed, keyed=keyed)
        elif prompts is self.prompts:
            tokens = await self._tokenize(request.route, parsed)
        else:
            tokens = await prompts.token_ids(request.route, parsed)
        st["tokens"] = tokens
        st["hints"] = parse_cache_hints(parsed)
        if len(tokens) >= HASH_AHEAD_TOKENS and self._block_sizes:
            # Hashing 100k+ tokens is tens of ms of Python: done here a slice at a time, yielding
            # to the loop between slices, rather than in one go inside pick().
            request.state["hashes"] = {bs: await hash_stepwise(tokens, bs) for bs in tuple(self._block_sizes)}

    def _hashes(self, request: RoutedRequest, block_size: int) -> Sequence[int]:
        st = request.state
        by_size = st.get("hashes")
        if by_size is None:
            by_size = st["hashes"] = {}
        hashes = by_size.get(block_size)
        if hashes is None:
            tokens = st.get("tokens") or ()
            chain = st["chains"].get(block_size) if "chains" in st else None
            if chain:  # the Horizon's, of a prefix of these tokens (or a little more: see _cut_ids)
                n = len(tokens) // block_size
                hashes = chain[:n] if len(chain) >= n else chain + block_hash_array(
                    tokens[len(chain) * block_size:n * block_size], block_size, chain[-1])
            elif len(tokens) >= block_size:
                hashes = self.hash_cache.hashes(tokens, block_size)
            else:
                hashes = []
            by_size[block_size] = hashes
        return hashes

    def _layout_for(self, candidates: Sequence[WorkerRecord]) -> tuple[list, int]:
        """The candidates' targets grouped by block size (one hash chain and one index walk per
        group; block size 0: unsized, last), and their count. The fleet hands out the same tuple
        while it is unchanged, so this is kept for the last candidates object seen."""
        if candidates is self._layout_of:  # (a tuple: lists are not kept, a caller may change one)
            return self._layout
        groups: dict[int, list[tuple[WorkerRecord, int | None, str]]] = {}
        unsized: list[tuple[WorkerRecord, int | None, str]] = []
        for w in candidates:
            for rank, key in expand_targets(w):
                (groups.setdefault(w.kv_block_size, []) if w.kv_block_size else unsized).append((w, rank, key))
        if len(self._block_sizes) < MAX_BLOCK_SIZES_AHEAD:
            self._block_sizes.update(groups)
        layout = [(bs, targets, [t[2] for t in targets]) for bs, targets in groups.items()]
        if unsized:
            layout.append((0, unsized, [t[2] for t in unsized]))
        out = (layout, sum(len(t) for _, t, _ in layout))
        if type(candidates) is tuple:
            self._layout_of, self._layout = candidates, out
        return out

    def pick(self, candidates: Sequence[WorkerRecord], request: RoutedRequest, role: str = "mixed") -> WorkerRecord:
        st = request.state
        hints = st.get("hints")
        weight = self.weights.get(role)
        if weight is None:
            weight = self.weights["mixed"]
        if hints is None or hints is NO_HINTS:  # (nearly every request: no hint field, no media)
            amplified = w_overlap = weight
            w_mm = 0.0
            mm_keys: Sequence[str] = ()
        else:
            amplified = weight * (2.0 if hints.retention == LONG
                                  else 0.1 if (hints.retention == NONE and hints.explicit) else 1.0)
            w_overlap, w_mm = (0.0, amplified * MM_WEIGHT) if hints.multimodal else (amplified, 0.0)
            mm_keys = hints.image_keys
        layout, n_targets = self._layout if candidates is self._layout_of else self._layout_for(candidates)
        warming = self._warming
        load_only = bool(warming) and any(k in warming for _, _, keys in layout for k in keys)
        if load_only:
            st["kv_load_only"] = True

        # Ties on (cost, load) — typically a cold prompt on an idle fleet — go to the target whose
        # cache holds the least (spreading new prefixes keeps the fleet's caches balanced), then
        # rotate, so sequential cold traffic never piles onto the first worker.
        best_cost = best_load = 0.0
        tied: list[tuple] = []  # (position, w, rank, key, hit, total, block_size, lower, hashes, view hit) at best
        position = 0
        most_blocks = 0
        scored: list[str] | None = [] if log.isEnabledFor(_DEBUG) else None  # why this target
        active_of, recent, landed_of, unhashed = self.active.get, self.recent.get, self.landed, self.unhashed
        decay = self._decay
        inflight = self.inflight
        per_request = amplified * self.balance.ratio if inflight else 0.0
        more = st.get("more_tokens", 0)
        tokens = st.get("tokens") or ()
        n_tokens = len(tokens)
        has_lower = self._has_lower_tiers
        lower_discount = 1.0 - self.lower_tier_weight
        score = self._score
        one_group = len(layout) == 1
        for block_size, targets, keys in layout:
            if block_size:
                hashes = self._hashes(request, block_size) if n_tokens >= block_size else _NO_BLOCKS
                total = len(hashes)
                if more:  # cut at the horizon (prepare): the rest of the prompt, estimated
                    total = max(total, (n_tokens + more) // block_size)
                if total > most_blocks:
                    most_blocks = total
            else:
                # No block size registered: nothing can be known cached there, so it pays for every
                # block (upstream charged it nothing, making it look like a perfect cache hit).
                total, hashes = most_blocks, _NO_BLOCKS
            if load_only:  # a view is warming up: every target misses every block, the load decides
                hits = view_hits = [0] * len(keys)
                pending, lowers, first = False, _NO_LOWER, None
            elif hashes:
                hits = view_hits = self.index.match(hashes, keys)
                # Served there, events still on the way: as good as cached (see LANDED_TTL_S).
                if landed_of:
                    now = self.clock()
                    hits = [self._with_landed(key, hashes, hit, now) if key in landed_of else hit
                            for key, hit in zip(keys, hits)]
                # A prefix cached nowhere yet but being prefilled somewhere counts as held there: a
                # second conversation of it starting before the first one's events arrive follows it
                # instead of computing a duplicate. Only then: where a copy is already cached, the
                # cache decides, and a prefill in flight elsewhere must not outbid it.
                pending = not any(hits)
                # Blocks after each GPU hit held on a lower tier: loaded, not computed (one check
                # while no engine publishes lower tiers).
                lowers = (self._match_lower(hashes, keys, hits) if has_lower is not None and has_lower()
                          else _NO_LOWER)
                first = hashes[0]
            else:  # nothing hashed: every target misses all of it, the load decides
                hits = view_hits = _NO_HITS
                pending, lowers, first = False, _NO_LOWER, None
            if (score is not None and lowers is _NO_LOWER and not w_mm and scored is None
                    and (not hashes or type(hits) is list)):
                # The loop below in C (the common case: no lower tiers, images or debug log); with one
                # group it settles the ties too.
                if one_group:
                    held, offset = self._block_counts, self._picks % n_targets
                else:
                    held, offset = None, 0
                group, cost, load = score(keys, hits if hashes else None, self.active, self.recent, decay, unhashed,
                                          inflight, per_request, w_overlap, total, hashes or None, pending, held,
                                          offset)
                if not tied or cost < best_cost or (cost == best_cost and load < best_load):
                    best_cost, best_load = cost, load
                    tied = []
                elif not (cost == best_cost and load == best_load):
                    group = ()
                for i, hit in group:
                    w, rank, key = targets[i]
                    tied.append((position + i, w, rank, key, hit, total, block_size, 0,
                                 hashes, view_hits[i] if hashes else 0))
                position += len(targets)
                continue
            missed_all = w_overlap * total
            for (w, rank, key), hit, lower, view_hit in zip(targets, hits, lowers, view_hits):
                active = active_of(key)
                if active:
                    if pending and first in active:
                        gpu_hit = hit
                        hit = active.run(hashes, hit)
                        if lower and hit > gpu_hit:  # the run in flight covers part of the lower-tier run
                            lower = max(0, gpu_hit + lower - hit)
                    load = len(active) + recent(key, 0.0) * decay
                else:
                    load = recent(key, 0.0) * decay
                if unhashed:
                    load += unhashed.get(key, 0)
                if per_request:
                    load += per_request * inflight.get(key, 0)
                if hit or lower:
                    cost = w_overlap * (total - hit - lower_discount * lower) + load
                else:
                    cost = missed_all + load
                if w_mm:
                    affinity = self.mm_affinity.get(key)
                    cost += w_mm * sum(1 for k in mm_keys if not affinity or k not in affinity)
                if scored is not None:
                    scored.append(f"{key}:hit={hit},load={load:.1f},held={self._held(key)},cost={cost:.1f}")
                if not tied or cost < best_cost or (cost == best_cost and load < best_load):
                    best_cost, best_load = cost, load
                    tied = [(position, w, rank, key, hit, total, block_size, lower, hashes, view_hit)]
                elif cost == best_cost and load == best_load:
                    tied.append((position, w, rank, key, hit, total, block_size, lower, hashes, view_hit))
                position += 1
        assert tied, "pick() needs at least one candidate"
        chosen = tied[0]
        if len(tied) > 1:  # (cached blocks held, rotation): computed for the tied targets only
            offset = self._picks % n_targets
            least = None
            held = self._held
            for t in tied:
                rank_key = (held(t[3]), (t[0] - offset) % n_targets)
                if least is None or rank_key < least:
                    least, chosen = rank_key, t
        _, worker, rank, key, hit, total, block_size, lower, blocks, view_hit = chosen

        if mm_keys:
            affinity = self.mm_affinity.setdefault(key, OrderedDict())
            for k in mm_keys:
                affinity[k] = None
                affinity.move_to_end(k)
            while len(affinity) > MM_AFFINITY_CAP:
                affinity.popitem(last=False)
        missed = total - hit - lower_discount * lower if lower else total - hit
        st["charge"] = (self._charge(key, missed, total), self._picks)
        st["route_key"], st["dp_rank"], st["block_size"] = key, rank, block_size
        st["blocks"] = blocks
        st["view_hit"] = view_hit  # the leading blocks its view held (on_finished claims after them)
        st["unhashed"] = total - len(blocks) if more and block_size else 0
        # engines report blocks loaded from a lower tier as cached tokens too
        st["predicted_hit_blocks"] = hit + lower
        st["pick_obs"] = (missed, inflight.get(key, 0))
        if self.observer is not None:
            self.observer.record_pick(role, key, hit + lower, total)
        if scored is not None:
            log.debug("pick policy=kv-aware role=%s retention=%s request_id=%s picked=%s cache_hits=%d "
                      "request_blocks=%d active_blocks=%d targets=[%s]", role, RETENTION_NAMES[(hints or _NO_HINTS).retention],
                      request.request_id, key, hit, total, len(self.active.get(key, ())), " ".join(scored))
        return worker

    def _with_landed(self, key: str, hashes: Sequence[int], hit: int, now: float) -> int:
        """``hit`` extended by blocks served on ``key`` that its events have not caught up with
        (each block checked: entries from other replicas arrive a little out of order, so one
        behind a valid one may already be caught up with)."""
        landed = self.landed.get(key)
        if not landed:
            return hit
        caught_up = self._events_made_until(key) if self._events_made_until is not None else 0.0
        return landed.extend(hashes, hit, caught_up, now)

    def recent_charge(self, key: str) -> float:
        """What is left of the recent picks' charges on ``key``."""
        return self.recent.get(key, 0.0) * self._decay

    def _add_recent(self, key: str, charge: float) -> None:
        self.recent[key] = self.recent.get(key, 0.0) + charge / self._decay

    def _rebase(self) -> None:
        """Fold the decay into the stored charges; the spent ones go (bounded by the fleet)."""
        decay, recent = self._decay, self.recent
        for k in list(recent):
            v = recent[k] * decay
            if v < _SPENT:
                del recent[k]
            else:
                recent[k] = v
        self._decay = 1.0

    def _charge(self, key: str, missed: int, total: int) -> float:
        # Decay per pick (not wall clock): one multiplication whatever the fleet's size.
        self._picks += 1
        self._decay *= RECENT_DECAY
        if self._decay < _REBASE_BELOW:
            self._rebase()
        charge = 1.0 if total == 0 else float(missed)
        if charge:
            recent = self.recent
            recent[key] = recent.get(key, 0.0) + charge / self._decay  # (_add_recent, inlined)
        if self.landed:
            # A target no pick looks at (it left, or lost every pick) would keep its expired claims
            # forever: a request still running on a worker that left lands after forget().
            now = self.clock()
            if now >= self._next_sweep:
                self._next_sweep = now + LANDED_TTL_S
                self.sweep_landed(now)
        return charge

    def on_started(self, worker: WorkerRecord, request: RoutedRequest) -> None:
        st = request.state
        key = st.get("route_key")
        if key is None:
            return
        inflight = self.inflight
        inflight[key] = inflight.get(key, 0) + 1
        blocks = st.get("blocks")
        if blocks:
            self._count_in(key, blocks)
            if self.replicas is not None:
                st["sync_rid"] = self.replicas.started(request.model, key, blocks, st.get("charge", (0.0, 0))[0])
        extra = st.get("unhashed")
        if extra:
            self.unhashed[key] = self.unhashed.get(key, 0) + extra

    def on_first_byte(self, request: RoutedRequest, seconds: float) -> None:
        """A streamed reply's first byte came ``seconds`` after it was sent: what its pick's missed
        blocks and the requests ahead of it cost (``TtftBalance``)."""
        obs = request.state.pop("pick_obs", None)
        if obs is not None:
            self.balance.observe(obs[0], obs[1], seconds)

    def on_finished(self, worker: WorkerRecord, request: RoutedRequest) -> None:
        st = request.state
        key = st.get("route_key")
        if key is None:
            return
        inflight = self.inflight
        n = inflight.get(key, 0) - 1
        if n > 0:
            inflight[key] = n
        else:
            inflight.pop(key, None)
        charge = st.pop("charge", None)
        if charge is not None and charge[0]:
            self._release_charge(key, charge[0], charge[1])
        blocks = st.get("blocks")
        finished_at = 0.0
        if blocks:
            if st.get("served"):  # the worker answered: it computed the prompt
                finished_at = self.wall_clock()
                self._land(key, blocks, finished_at, st.get("view_hit", 0))
            self._count_out(key, blocks)
        if self.replicas is not None:
            rid = st.pop("sync_rid", None)
            if rid is not None:
                self.replicas.finished(rid, finished_at)
        extra = st.pop("unhashed", 0)
        if extra and key in self.unhashed:
            left = self.unhashed[key] - extra
            if left > 0:
                self.unhashed[key] = left
            else:
                del self.unhashed[key]

    def _release_charge(self, key: str, charge: float, at: int) -> None:
        """A request charged ``charge`` at pick ``at`` finished: what is left of it goes."""
        stored = self.recent.get(key)
        if charge and stored is not None:
            left = stored * self._decay - charge * RECENT_DECAY ** (self._picks - at)
            if left < _SPENT:
                del self.recent[key]
            else:
                self.recent[key] = left / self._decay

    def _inflight_out(self, key: str) -> None:
        n = self.inflight.get(key, 0) - 1
        if n > 0:
            self.inflight[key] = n
        else:
            self.inflight.pop(key, None)

    def _count_in(self, key: str, blocks: Sequence[int]) -> None:
        if not blocks:
            return
        counts = self.active.get(key)
        if counts is None:
            counts = self.active[key] = BlockCounter()
        counts.add(blocks)

    def _count_out(self, key: str, blocks: Sequence[int]) -> None:
        counts = self.active.get(key)
        if counts is None or not blocks:
            return
        counts.remove(blocks)
        if not counts:  # bounded by what is in flight, not by every target ever seen
            del self.active[key]

    def _land(self, key: str, blocks: Sequence[int], finished_at: float, view_hit: int = 0) -> None:
        """``blocks`` were computed on ``key`` by a request that finished at ``finished_at`` (wall
        clock, compared with the engine's event timestamps): cached there until the events catch up.
        The leading blocks its view already holds need no claim (a shared prefix: most of them):
        the events already said so, and a later eviction event is what happened to them after.

        ``view_hit``: how many leading blocks the view held at the pick; they are not looked up
        again. The request used them, so they were there; one evicted since is what the events say
        (a claim would contradict them). This is the walk a request ends with, long after its
        hashes left the CPU caches: over the whole prompt it cost ~67 us in the server (one cache
        miss or more per block) for ~3 us in a benchmark loop."""
        if self._match_one is not None:
            tail = blocks[view_hit:] if view_hit else blocks
            held = view_hit + self._match_one(tail, key) if tail else view_hit
            if held:
                blocks = blocks[held:]
                if not blocks:
                    return
        landed = self.landed.get(key)
        if landed is None:
            landed = self.landed[key] = LandedClaims()
        landed.land(blocks, finished_at, self.clock() + LANDED_TTL_S, LANDED_CAP)

    def engine_restarted(self, key: str) -> None:
        """``key``'s engine restarted: the blocks served there that its events had not confirmed
        yet are not cached there any more (the view itself was dropped by its owner)."""
        self.landed.pop(key, None)

    def sweep_landed(self, now: float) -> None:
        """Drop expired landed claims of every target (a target no pick looks at keeps none)."""
        for key in list(self.landed):
            landed = self.landed[key]
            landed.expire(now)
            if not landed:
                del self.landed[key]

    def active_blocks(self, key: str) -> int:
        """Distinct hashed blocks in flight on ``key`` (what replicas share; the pick's load also
        counts ``unhashed``, the estimated blocks past prompts' horizons)."""
        return len(self.active.get(key, ()))

    def _held_anywhere(self, block: int) -> bool:
        """Whether some target holds ``block``: in its view, in flight there, or served there and
        not yet in its events (a claim past its time counts too: erring long). May run in a
        tokenizer thread (``Horizon``): the tables are read through snapshots of their values."""
        if self._first_unheld is not None and self._first_unheld((block,)):  # 1: not unheld at 0
            return True
        try:
            return (any(block in counts for counts in tuple(self.active.values()))
                    or any(block in claims for claims in tuple(self.landed.values())))
        except RuntimeError:  # changed under a tokenizer thread's snapshot: err long
            return True

    def forget(self, worker_id: str) -> None:
        prefix = worker_id + "#dp"
        if self.replicas is not None:
            self.replicas.forget(worker_id)
        for table in (self.active, self.recent, self.mm_affinity, self.landed, self.unhashed, self.inflight):
            for k in [k for k in table if k == worker_id or k.startswith(prefix)]:
                del table[k]


def predicted_cached_tokens(hit_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """What the engine should report as cached: full hit blocks, but never the whole prompt
    (vLLM always recomputes at least the last prompt token, dropping that block's hit)."""
    if block_size <= 0 or prompt_tokens <= 0:
        return 0
    return min(hit_blocks * block_size, ((prompt_tokens - 1) // block_size) * block_size)
