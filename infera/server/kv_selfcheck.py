"""The server's KV self-check (``infera.server.kv`` has the overview): picks recorded, every 200
reply's engine-reported cached prompt tokens compared with what the router predicted at the pick,
the silence watchdog, and what a view says about itself (``cache_view``, ``hit_totals``).

Under the index's byte bound (``--kv-index-max-bytes``) the router may evict blocks an engine still
holds; a reply with more cached than predicted on a view that lost entries to the bound is such a
possible under-prediction, counted apart (``evicted_under``, ``infera_kv_predictions_evicted``) and
not as drift: it does not enter the errors, the verdicts behind the divergence warning, nor
``infera_kv_predictions_off``. An over-prediction is never the bound's doing and counts as before.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from infera.discovery.record import WorkerRecord
from infera.router.kv_aware import predicted_cached_tokens
from infera.router.policy import RoutedRequest
from infera.server.kv_state import BLOCK_BUCKETS, DIVERGENCE_WINDOW, SILENT_AFTER_S, _TargetState
from infera.server.metrics import Histogram

__all__ = ["SelfCheck"]

log = logging.getLogger("infera.server.kv")  # (the bridge's logger, whichever file says it)


class SelfCheck:
    """The self-check half of :class:`infera.server.kv.KvEventsBridge` (a mixin: the bridge holds
    the state it reads)."""

    targets: dict[str, _TargetState]
    index: Any
    picks: dict[tuple[str, str], int]
    pick_hits: dict[str, Histogram]
    pick_blocks: dict[str, Histogram]
    prediction_error: Histogram
    warming: set[str]
    clock: Callable[[], float]
    _warned: set[tuple[str, str]]
    _worker_keys: dict[str, list[str]]

    if TYPE_CHECKING:  # the bridge's (declared for the type checker only, never shadowing them)

        def stats(self, key: str) -> dict[str, Any]: ...

        def transport(self, key: str) -> str | None: ...

        def _on_caught_up(self, key: str) -> None: ...

    def _evicted_from(self, key: str) -> int:
        """(block, worker) entries the index's byte bound evicted from ``key``'s view."""
        evicted = getattr(self.index, "evicted_entries", None)
        return evicted(key) if evicted is not None else 0

    def record_pick(self, role: str, key: str, hit_blocks: int, request_blocks: int) -> None:
        picked = (role, key)
        picks = self.picks
        picks[picked] = picks.get(picked, 0) + 1
        h = self.pick_hits.get(role)
        if h is None:
            h = self.pick_hits[role] = Histogram(BLOCK_BUCKETS)
            self.pick_blocks[role] = Histogram(BLOCK_BUCKETS)
        if request_blocks:
            h.observe(hit_blocks)
            self.pick_blocks[role].observe(request_blocks)
            if request_blocks > hit_blocks:
                state = self.targets.get(key)
                if state is not None and state.unconfirmed_since is None:
                    state.unconfirmed_since = self.clock()  # it must store new blocks: expect events
        else:  # (a prompt under one block: both are 0, the first bucket)
            h.counts[0] += 1
            self.pick_blocks[role].counts[0] += 1

    def observe_usage(self, worker: WorkerRecord, request: RoutedRequest, cached_tokens: int | None) -> None:
        """A completed 200 reply (``cached_tokens`` None: it carried no usage, e.g. a stream without
        ``stream_options.include_usage``, which is what the SDKs send by default)."""
        st = request.state
        key: str = st.get("route_key") or ""
        state = self.targets.get(key) if key else None
        if state is None:
            return
        # The whole prompt: past the tokenization horizon its length is estimated (kv_aware.prepare).
        tokens = st.get("tokens")
        prompt_tokens = (len(tokens) if tokens else 0) + st.get("more_tokens", 0)
        hit = st.get("predicted_hit_blocks", 0)
        if hit:
            block_size = st.get("block_size") or 0
            predicted = predicted_cached_tokens(hit, block_size, prompt_tokens)
        else:
            predicted = 0
        # Counted for every reply, usage or not: engine_scrape.py compares these with the engine's
        # own prefix-cache counters, which see every request too.
        state.prompt_tokens += prompt_tokens
        state.predicted_tokens += predicted
        if cached_tokens is None:
            return
        state.reported_prompt_tokens += prompt_tokens
        state.reported_cached_tokens += cached_tokens
        if cached_tokens != predicted and st.get("kv_load_only"):
            # Picked by load while a view warmed up: the view was not asked, so it is not blamed
            # (a cold reply, nothing cached either way, counts as any other).
            return
        if cached_tokens > predicted and self._evicted_from(key):
            block_size = st.get("block_size") or 0
            if block_size and (cached_tokens - predicted) // block_size > 1:
                # The engine had blocks the view lacked, and the bound evicted entries from that view:
                # possibly the same blocks (the engine keeps what the router let go). Not drift.
                state.evicted_under += 1
                return
        state.observations += 1
        errors = state.errors
        if errors is None:
            errors = state.errors = deque()
        if cached_tokens == predicted:  # (the common case: none of the work below)
            self.prediction_error.counts[0] += 1  # (its first bound is 0)
            state.exact += 1
            errors.append(0)
            if len(errors) > DIVERGENCE_WINDOW:
                state.abs_error_sum -= errors.popleft()
            if not predicted:
                return  # nothing cached either way: says nothing about the hash spaces agreeing
            blocks_off = 0
        else:
            if not hit:
                block_size = st.get("block_size") or 0
            error = abs(cached_tokens - predicted)
            self.prediction_error.observe(error)
            blocks_off = error // block_size if block_size else 0
            if blocks_off > 1:
                if predicted > cached_tokens:
                    state.over += 1
                else:
                    state.under += 1
            errors.append(blocks_off)
            state.abs_error_sum += blocks_off
            if len(errors) > DIVERGENCE_WINDOW:
                state.abs_error_sum -= errors.popleft()
        wrong = blocks_off > 1
        verdicts = state.verdicts
        if verdicts is None:
            verdicts = state.verdicts = deque()
        verdicts.append(wrong)
        state.wrong += wrong
        if len(verdicts) > DIVERGENCE_WINDOW:
            state.wrong -= verdicts.popleft()
        if len(verdicts) == DIVERGENCE_WINDOW and 2 * state.wrong > DIVERGENCE_WINDOW:
            self._warn_once(key, "diverged", "router predictions for %s disagree with the engine's reported cached "
                            "tokens (%d of the last %d replies with cached blocks were off by more than one "
                            "block): check that the router tokenizer (--router-tokenizer-path) and chat template "
                            "match the engine's, and that the registered block size is the engine's", key,
                            state.wrong, DIVERGENCE_WINDOW)


    async def _watch_silence(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for key in [k for k in self.warming if self.stats(k).get("caught_up")]:
                self._on_caught_up(key)  # (a subscriber that does not call back)
            now = self.clock()
            for key, state in self.targets.items():
                if state.unconfirmed_since is not None and now - state.unconfirmed_since > SILENT_AFTER_S:
                    if not state.silent:
                        state.silent = True
                        self._warn_once(key, "silent", "no KV events from %s for %.0fs although it was sent "
                                        "requests that store new blocks: its cache view is going stale", key,
                                        now - state.unconfirmed_since)

    def _warn_once(self, key: str, what: str, msg: str, *args: Any) -> None:
        if (key, what) not in self._warned:
            self._warned.add((key, what))
            log.warning(msg, *args)

    # -- visibility ------------------------------------------------------------------------------------
    def cache_view(self, worker_id: str, dp_rank: int | None) -> dict | None:
        key = worker_id if dp_rank is None else f"{worker_id}#dp{dp_rank}"
        state = self.targets.get(key)
        if state is None:
            return None
        sub = self.stats(key)
        now = self.clock()
        since = state.last_batch_at if state.last_batch_at is not None else state.added_at
        return {"worker_id": worker_id, "dp_rank": dp_rank, "route_key": key, "engine": state.engine,
                "block_count": self.index.block_count(key), "last_event_seq": state.last_seq,
                "lag_s": None if state.last_batch_at is None else round(now - state.last_batch_at, 3),
                "delay_ms": None if state.delay_ewma is None else round(state.delay_ewma * 1000, 1),
                "batches": state.batches, "block_events": state.events, "decode_errors": state.decode_errors,
                "gaps": sub.get("gaps", 0), "replays": sub.get("replays", 0), "resets": sub.get("resets", 0),
                "events_silent": state.silent, "caught_up": key not in self.warming,
                "degraded": state.degraded is not None, "degraded_reason": state.degraded,
                "staleness_s": round(now - since, 3), "engine_restarts": state.restarts,
                "transport": self.transport(key),
                "prediction": {"observations": state.observations, "exact": state.exact,
                               "over": state.over, "under": state.under,
                               "mean_error_blocks": (state.abs_error_sum / len(state.errors)) if state.errors else None}}

    def hit_totals(self, worker_id: str) -> tuple[int, int]:
        """(predicted cached tokens, prompt tokens) so far over ``worker_id``'s route keys (every
        DP rank): what engine_scrape.py compares with the engine's own prefix-cache counters."""
        predicted = prompt = 0
        for key in self._worker_keys.get(worker_id, ()):
            state = self.targets.get(key)
            if state is not None:
                predicted += state.predicted_tokens
                prompt += state.prompt_tokens
        return predicted, prompt
