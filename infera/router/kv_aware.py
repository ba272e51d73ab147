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

A rank-multiplexed worker (DP attention) is scored per rank; the chosen rank travels as
``X-Data-Parallel-Rank``. The argmin is over (cost, load); remaining ties go to the target whose
cache holds the fewest blocks, then rotate.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Callable, Protocol, Sequence

from infera.api.cache_hints import LONG, NONE, RETENTION_NAMES, CacheHints, parse_cache_hints
from infera.discovery.record import WorkerRecord
from infera.kv.hashing import block_hashes
from infera.kv.prompt import PromptTokenizer
from infera.router.policy import RoutedRequest

log = logging.getLogger(__name__)

RECENT_DECAY = 0.97
# A served request's blocks count as cached where it ran until that engine's events catch up with
# the moment it finished (a batch made later is applied: the view then says what became of them,
# evictions included), or at most this long (an idle engine sends nothing). Engines publish KV
# events from a side thread: on a busy 2-core box vLLM's arrived up to 0.5 s after the reply
# (infera_kv_event_delay_seconds), and the next turn was routed on a view without its previous one.
LANDED_TTL_S = 2.0
LANDED_CAP = 1 << 16  # blocks per target: bounded whatever the request rate
MM_WEIGHT = 48.0
MM_AFFINITY_CAP = 256


def route_key(worker_id: str, dp_rank: int | None) -> str:
    return worker_id if dp_rank is None else f"{worker_id}#dp{dp_rank}"


def expand_targets(worker: WorkerRecord) -> list[tuple[int | None, str]]:
    """(dp_rank, route_key) per target: a rank-multiplexed worker is one target per rank."""
    if worker.dp_size and worker.dp_size > 1 and worker.dp_rank is None:
        return [(r, route_key(worker.worker_id, r)) for r in range(worker.dp_size)]
    return [(None, worker.worker_id)]


class PrefixIndex(Protocol):
    def match(self, hashes: list[int], keys: Sequence[str]) -> list[int]: ...


class KvPickObserver(Protocol):
    """Metrics sink (the server's); optional."""

    def record_pick(self, role: str, key: str, hit_blocks: int, request_blocks: int) -> None: ...


class KvAwarePolicy:
    name = "kv-aware"

    def __init__(self, index: PrefixIndex, prompts: PromptTokenizer, *, overlap_weight: float = 1.0,
                 prefill_overlap_weight: float | None = None, decode_overlap_weight: float | None = None,
                 observer: KvPickObserver | None = None, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.index = index
        self.clock = clock
        self.wall_clock = wall_clock  # compared with engine event timestamps
        self._events_made_until = getattr(index, "events_made_until", None)
        self.prompts = prompts
        self.weights = {"mixed": overlap_weight,
                        "prefill": overlap_weight if prefill_overlap_weight is None else prefill_overlap_weight,
                        "decode": overlap_weight if decode_overlap_weight is None else decode_overlap_weight}
        self.observer = observer
        self.active: dict[str, dict[int, int]] = {}  # route key → {block hash: requests in flight}
        self.recent: dict[str, float] = {}
        self._picks = 0  # decay clock: remaining charge = charge × RECENT_DECAY^(picks since)
        self.mm_affinity: dict[str, OrderedDict[int, None]] = {}
        # route key → {block hash: (wall time it finished, monotonic expiry)}, oldest first
        self.landed: dict[str, OrderedDict[int, tuple[float, float]]] = {}

    async def prepare(self, request: RoutedRequest) -> None:
        """Tokenize once per request (cached across requests), before any pick."""
        request.state["tokens"] = await self.prompts.tokens(request.route, request.parsed)
        request.state["hints"] = parse_cache_hints(request.parsed)

    def _hashes(self, request: RoutedRequest, block_size: int) -> list[int]:
        by_size = request.state.setdefault("hashes", {})
        hashes = by_size.get(block_size)
        if hashes is None:
            hashes = by_size[block_size] = block_hashes(request.state.get("tokens") or [], block_size)
        return hashes

    def pick(self, candidates: Sequence[WorkerRecord], request: RoutedRequest, role: str = "mixed") -> WorkerRecord:
        hints: CacheHints = request.state.get("hints") or CacheHints()
        amplified = self.weights.get(role, self.weights["mixed"]) * (
            2.0 if hints.retention == LONG else 0.1 if (hints.retention == NONE and hints.explicit) else 1.0)
        w_overlap, w_mm = (0.0, amplified * MM_WEIGHT) if hints.multimodal else (amplified, 0.0)
        mm_keys = hints.image_keys

        # Group targets by block size: one hash chain and one index walk per group.
        groups: dict[int, list[tuple[WorkerRecord, int | None, str]]] = {}
        unsized: list[tuple[WorkerRecord, int | None, str]] = []
        for w in candidates:
            for rank, key in expand_targets(w):
                (groups.setdefault(w.kv_block_size, []) if w.kv_block_size else unsized).append((w, rank, key))

        # Ties on (cost, load) — typically a cold prompt on an idle fleet — go to the target whose
        # cache holds the least (spreading new prefixes keeps the fleet's caches balanced), then
        # rotate, so sequential cold traffic never piles onto the first worker.
        n_targets = sum(len(t) for t in groups.values()) + len(unsized)
        offset = self._picks % n_targets if n_targets else 0
        block_count = getattr(self.index, "block_count", None)
        best = None
        position = 0
        most_blocks = 0
        scored: list[str] | None = [] if log.isEnabledFor(logging.DEBUG) else None  # why this target
        for block_size, targets in [*groups.items(), (0, unsized)]:
            if not targets:
                continue
            if block_size:
                hashes = self._hashes(request, block_size)
                total = len(hashes)
                most_blocks = max(most_blocks, total)
                hits = self.index.match(hashes, [t[2] for t in targets]) if total else [0] * len(targets)
            else:
                # No block size registered: nothing can be known cached there, so it pays for every
                # block (upstream charged it nothing, making it look like a perfect cache hit).
                total, hits, hashes = most_blocks, [0] * len(targets), []
            # Served there, events still on the way: as good as cached (see LANDED_TTL_S).
            if self.landed and hashes:
                now = self.clock()
                hits = [self._with_landed(key, hashes, hit, now) for (_, _, key), hit in zip(targets, hits)]
            # A prefix cached nowhere yet but being prefilled somewhere counts as held there: a
            # second conversation of it starting before the first one's events arrive follows it
            # instead of computing a duplicate. Only then: where a copy is already cached, the
            # cache decides, and a prefill in flight elsewhere must not outbid it.
            pending = hashes and not any(hits)
            for (w, rank, key), hit in zip(targets, hits):
                active = self.active.get(key)
                if pending and active and hashes[0] in active:
                    while hit < len(hashes) and hashes[hit] in active:
                        hit += 1
                load = len(active or ()) + self.recent.get(key, 0.0)
                cost = w_overlap * (total - hit) + load
                if w_mm:
                    affinity = self.mm_affinity.get(key)
                    cost += w_mm * sum(1 for k in mm_keys if not affinity or k not in affinity)
                held = block_count(key) if block_count is not None else 0
                score = (cost, load, held, (position - offset) % n_targets)
                position += 1
                if scored is not None:
                    scored.append(f"{key}:hit={hit},load={load:.1f},held={held},cost={cost:.1f}")
                if best is None or score < best[0]:
                    best = (score, w, rank, key, hit, total, block_size)
        assert best is not None, "pick() needs at least one candidate"
        _, worker, rank, key, hit, total, block_size = best

        if mm_keys:
            affinity = self.mm_affinity.setdefault(key, OrderedDict())
            for k in mm_keys:
                affinity[k] = None
                affinity.move_to_end(k)
            while len(affinity) > MM_AFFINITY_CAP:
                affinity.popitem(last=False)
        st = request.state
        st["charge"] = (self._charge(key, total - hit, total), self._picks)
        st["route_key"], st["dp_rank"], st["block_size"] = key, rank, block_size
        st["blocks"] = self._hashes(request, block_size) if block_size else []
        st["predicted_hit_blocks"] = hit
        if self.observer is not None:
            self.observer.record_pick(role, key, hit, total)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("pick policy=kv-aware role=%s retention=%s request_id=%s picked=%s cache_hits=%d "
                      "request_blocks=%d active_blocks=%d targets=[%s]", role, RETENTION_NAMES[hints.retention],
                      request.request_id, key, hit, total, len(self.active.get(key, ())), " ".join(scored or ()))
        return worker

    def _with_landed(self, key: str, hashes: list[int], hit: int, now: float) -> int:
        """``hit`` extended by blocks served on ``key`` that its events have not caught up with."""
        landed = self.landed.get(key)
        if not landed:
            return hit
        caught_up = self._events_made_until(key) if self._events_made_until is not None else 0.0
        while landed:
            finished, expiry = landed[next(iter(landed))]
            if finished > caught_up and expiry > now:
                break
            landed.popitem(last=False)
        while hit < len(hashes) and hashes[hit] in landed:
            hit += 1
        return hit

    def _charge(self, key: str, missed: int, total: int) -> float:
        # Decay per pick (not wall clock): bounded by the fleet size, not its history.
        self._picks += 1
        recent = self.recent
        for k in list(recent):
            v = recent[k] * RECENT_DECAY
            if v < 1e-3:
                del recent[k]
            else:
                recent[k] = v
        charge = 1.0 if total == 0 else float(missed)
        if charge:
            recent[key] = recent.get(key, 0.0) + charge
        return charge

    def on_started(self, worker: WorkerRecord, request: RoutedRequest) -> None:
        key = request.state.get("route_key")
        if key is None:
            return
        counts = self.active.setdefault(key, {})
        for h in request.state.get("blocks", ()):
            counts[h] = counts.get(h, 0) + 1

    def on_finished(self, worker: WorkerRecord, request: RoutedRequest) -> None:
        key = request.state.get("route_key")
        if key is None:
            return
        charge, at = request.state.pop("charge", (0.0, 0))
        if charge and key in self.recent:
            left = self.recent[key] - charge * RECENT_DECAY ** (self._picks - at)
            if left < 1e-3:
                del self.recent[key]
            else:
                self.recent[key] = left
        blocks = request.state.get("blocks", ())
        if blocks and request.state.get("served"):  # the worker answered: it computed the prompt
            landed = self.landed.setdefault(key, OrderedDict())
            stamp = (self.wall_clock(), self.clock() + LANDED_TTL_S)
            for h in blocks:
                landed[h] = stamp
                landed.move_to_end(h)
            while len(landed) > LANDED_CAP:
                landed.popitem(last=False)
        counts = self.active.get(key)
        if counts is None:
            return
        for h in blocks:
            n = counts.get(h, 0) - 1
            if n > 0:
                counts[h] = n
            else:
                counts.pop(h, None)

    def active_blocks(self, key: str) -> int:
        return len(self.active.get(key, ()))

    def forget(self, worker_id: str) -> None:
        prefix = worker_id + "#dp"
        for table in (self.active, self.recent, self.mm_affinity, self.landed):
            for k in [k for k in table if k == worker_id or k.startswith(prefix)]:
                del table[k]


def predicted_cached_tokens(hit_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """What the engine should report as cached: full hit blocks, but never the whole prompt
    (vLLM always recomputes at least the last prompt token, dropping that block's hit)."""
    if block_size <= 0 or prompt_tokens <= 0:
        return 0
    return min(hit_blocks * block_size, ((prompt_tokens - 1) // block_size) * block_size)
