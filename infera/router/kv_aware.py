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

A request with a ``cache_salt`` (``cache_salt`` in its state, set by the server: an isolated
tenant's, or one its client sent) is hashed from the salt's root (``infera.kv.hashing.salt_root``),
as vLLM salts its blocks, so its hits and the self-check stay exact. Among candidates of an engine
that does not salt (not in ``SALTING_ENGINES``) it is picked by load alone, ``kv_load_only`` as above.

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

This module owns the cost model and the pick. Its neighbours own the rest of the policy: preparing a
request (``kv_prepare``: tokenizing to the horizon; ``kv_hash_cache``: hashing the blocks), the
per-target tables (``kv_targets``), how picks, starts and finishes change them (``kv_accounting``)
and what the self-check compares (``kv_self_check``).
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from typing import Callable, Protocol, Sequence

from infera.api.cache_hints import LONG, NO_HINTS, NONE, RETENTION_NAMES, CacheHints
from infera.discovery.record import WorkerRecord
from infera.kv.native import native
from infera.kv.prompt import PromptTokenizer
# (PEER_TIMEOUT_S and SYNC_BLOCKS_PER_REQUEST are re-exported: callers imported them from here)
from infera.kv.replica_share import PEER_TIMEOUT_S, SYNC_BLOCKS_PER_REQUEST, ReplicaShare  # noqa: F401
# The policy's other concerns, in their own modules; their names are re-exported here, where callers
# imported them from.
from infera.router.kv_accounting import LANDED_CAP, LANDED_TTL_S, RECENT_DECAY, KvAccounting  # noqa: F401
from infera.router.kv_hash_cache import (  # noqa: F401
    DEFAULT_HASH_CACHE_BYTES, HASH_CACHE_STEP, HASH_SLICE_BLOCKS, BlockHashCache, hash_stepwise)
from infera.router.kv_prepare import HASH_AHEAD_TOKENS, MAX_BLOCK_SIZES_AHEAD, Horizon, KvPrepare  # noqa: F401
from infera.router.kv_self_check import predicted_cached_tokens  # noqa: F401
from infera.router.kv_targets import _NOTHING_HELD, expand_targets, route_key  # noqa: F401
from infera.router.policy import RoutedRequest
from infera.router.ttft_balance import TtftBalance

log = logging.getLogger(__name__)
_DEBUG = logging.DEBUG

MM_WEIGHT = 48.0
MM_AFFINITY_CAP = 256
# A block the target's engine holds on a lower tier (host memory, disk: kvd) costs this fraction of
# a miss: loading it back is a few % of prefilling it, plus the chance it is gone by then.
DEFAULT_LOWER_TIER_WEIGHT = 0.25
# Engines that fold a request's cache_salt into their prefix-cache hashes (vLLM; the simulator as
# vLLM). A salted request (``cache_salt`` in its state: an isolated tenant's) among candidates of any
# other engine is routed cache-blind, by load: such an engine shares its cache across tenants, so
# neither its view nor the salted hashes can say what it will hit.
SALTING_ENGINES = frozenset({"vllm", "sim"})

_NO_HINTS = CacheHints()
_NO_BLOCKS: list[int] = []  # (never appended to)
_NO_LOWER = itertools.repeat(0)  # (zip stops at the targets)
_NO_HITS = _NO_LOWER


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


class KvAwarePolicy(KvPrepare, KvAccounting):
    """The cost model and the pick (this module's docstring); preparing a request is
    :class:`KvPrepare`'s, the per-target tables and their accounting :class:`KvAccounting`'s."""

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
        self._init_target_state()  # the per-target tables (kv_targets)
        self.balance = TtftBalance(inflight_weight)
        self._block_sizes: set[int] = set()  # of the targets picked among: hashed ahead for big prompts
        self._layout_of: object = None  # the candidates _layout was made for
        self._layout: tuple[list, int] = ([], 0)
        self.replicas: ReplicaShare | None = None  # what the other server replicas share
        if replica_sync is not None:
            self.replicas = ReplicaShare(self)
            replica_sync.attach(self.replicas)

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
        if not load_only and "cache_salt" in st:
            load_only = any(w.engine not in SALTING_ENGINES for _, targets, _ in layout for w, _, _ in targets)
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
