"""The server's KV-view metrics (``infera.server.kv``'s bridge, a prometheus collector): per target
the event stream (batches, block events, gaps, resets, delay, CPU), the view (size, caught up,
degraded, staleness, engine restarts), the self-check (prediction errors, hit-rate counters), the
kv-aware policy's load terms, the replays asked and waiting (``infera_kv_event_replays``), and
the index's byte bound: ``infera_kv_index_bytes`` (held, by the
model of ``infera.kv.bound``), ``infera_kv_index_max_bytes`` and
``infera_kv_index_evicted_entries_total`` (the (block, worker) entries the bound evicted).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from infera.server.kv_state import _TargetState
from infera.server.metrics import Histogram

__all__ = ["KvViewMetrics"]


class KvViewMetrics:
    """The collector half of :class:`infera.server.kv.KvEventsBridge` (a mixin)."""

    targets: dict[str, _TargetState]
    index: Any
    # False in a process that reads the host's shared index (infera/server/kv_share.py): it applies
    # no event, so it leaves out the event-stream series (the writer's carry them): at 1,000 workers
    # ~26,000 series that were all zero, the per-worker delay histogram most of them.
    applies_events: bool = True
    picks: dict[tuple[str, str], int]
    pick_hits: dict[str, Histogram]
    pick_blocks: dict[str, Histogram]
    prediction_error: Histogram
    warming: set[str]
    clock: Callable[[], float]
    active_blocks: Callable[[str], int] | None
    balance: Any
    subscriber: Any  # the ZMQ subscriber (its replay_load)

    if TYPE_CHECKING:  # the bridge's (declared for the type checker only, never shadowing it)

        def stats(self, key: str) -> dict[str, Any]: ...

    def collect(self) -> Iterator[Metric]:
        # Names and labels follow the reference (AMD Infera) where it has the series: worker_id
        # carries the route key (``<worker_id>#dp<rank>`` for a rank of a DP-attention worker).
        fam = CounterMetricFamily("infera_router_picks", "KV-aware picks", labels=["role", "worker_id"])
        for (role, key), n in sorted(self.picks.items()):
            fam.add_metric([role, key], n)
        yield fam
        for name, table, doc in (
            ("infera_router_pick_cache_hits", self.pick_hits, "Predicted cached blocks per pick"),
            ("infera_router_pick_request_blocks", self.pick_blocks, "Full blocks per request"),
        ):
            hist = HistogramMetricFamily(name, doc, labels=["role"])
            for role, h in sorted(table.items()):
                hist.add_metric([role], h.cumulative(), h.total)
            yield hist
        hist = HistogramMetricFamily(
            "infera_kv_prediction_error_tokens", "|engine-reported − router-predicted| cached prompt tokens per reply"
        )
        hist.add_metric([], self.prediction_error.cumulative(), self.prediction_error.total)
        yield hist
        label = ["worker_id"]
        batches = CounterMetricFamily("infera_kv_event_batches", "KV-event batches applied", labels=label)
        events = CounterMetricFamily("infera_kv_block_events", "Block events applied", labels=label)
        gaps = CounterMetricFamily("infera_kv_event_gaps", "Sequence gaps (replayed or reset)", labels=label)
        resets = CounterMetricFamily("infera_kv_view_resets", "Cache views reset after lost continuity", labels=label)
        silent = GaugeMetricFamily("infera_kv_events_silent", "1 when a worker's KV events fell silent", labels=label)
        blocks = GaugeMetricFamily(
            "infera_policy_cache_view_size", "Blocks in the router's view of a worker's cache", labels=label
        )
        delay = HistogramMetricFamily(
            "infera_kv_event_delay_seconds", "Engine batch timestamp to applied here", labels=label
        )
        cpu = CounterMetricFamily(
            "infera_kv_event_cpu_seconds",
            "Router CPU spent decoding and applying a worker's KV-event batches (the socket read excluded)",
            labels=label,
        )
        evicted_under = CounterMetricFamily(
            "infera_kv_predictions_evicted",
            "Replies with more blocks cached than "
            "predicted, on a view the index's byte bound evicted from: possibly "
            "what it evicted, not counted as drift (predictions_off)",
            labels=label,
        )
        off = CounterMetricFamily(
            "infera_kv_predictions_off",
            "Replies whose cached tokens the router predicted "
            "wrong by more than one block: over (predicted more) or under (fewer)",
            labels=["worker_id", "direction"],
        )
        prompt = CounterMetricFamily(
            "infera_kv_prompt_tokens",
            "Prompt tokens (router's tokenizer) of the completed replies routed to a worker, with or without usage",
            labels=label,
        )
        predicted = CounterMetricFamily(
            "infera_kv_predicted_cached_tokens",
            "Of those, the tokens the router predicted cached when it picked the worker",
            labels=label,
        )
        reported_prompt = CounterMetricFamily(
            "infera_kv_reported_prompt_tokens",
            "Prompt tokens (router's tokenizer) of the replies whose usage reported cached tokens",
            labels=label,
        )
        reported = CounterMetricFamily(
            "infera_kv_reported_cached_tokens",
            "Cached prompt tokens the engine reported in those replies' usage",
            labels=label,
        )
        caught_up = GaugeMetricFamily(
            "infera_kv_view_caught_up",
            "1 once a worker's view has caught up with its "
            "engine's history (replay or JetStream); 0 while warming up, when the "
            "kv-aware policy routes its picks by load",
            labels=label,
        )
        degraded = GaugeMetricFamily(
            "infera_kv_view_degraded",
            "1 while a worker's view may lack blocks its engine "
            "holds (events lost beyond replay, or history older than the replay "
            "buffer): it under-predicts until the engine clears its cache or restarts",
            labels=label,
        )
        staleness = GaugeMetricFamily(
            "infera_kv_view_staleness_seconds",
            "Seconds since a worker's view last applied an event batch (or since it was subscribed, before any)",
            labels=label,
        )
        restarts = CounterMetricFamily(
            "infera_kv_engine_restarts",
            "Engine restarts found (a new KV-event "
            "stream registered, or the stream started over): the view was dropped",
            labels=label,
        )
        now = self.clock()
        warming = self.warming
        active = GaugeMetricFamily(
            "infera_policy_active_blocks",
            "Distinct prompt blocks of the requests in flight on a worker (the kv-aware policy's load term)",
            labels=label,
        )
        active_blocks = self.active_blocks
        applies = self.applies_events
        for key, state in sorted(self.targets.items()):
            if applies:
                sub = self.stats(key)
                batches.add_metric([key], state.batches)
                events.add_metric([key], state.events)
                cpu.add_metric([key], state.cpu_s)
                gaps.add_metric([key], sub.get("gaps", 0))
                resets.add_metric([key], sub.get("resets", 0))
                restarts.add_metric([key], state.restarts)
                delay.add_metric([key], state.delays.cumulative(), state.delays.total)
            silent.add_metric([key], 1 if state.silent else 0)
            caught_up.add_metric([key], 0 if key in warming else 1)
            degraded.add_metric([key], 0 if state.degraded is None else 1)
            since = state.last_batch_at if state.last_batch_at is not None else state.added_at
            staleness.add_metric([key], max(0.0, now - since))
            blocks.add_metric([key], self.index.block_count(key))
            off.add_metric([key, "over"], state.over)
            off.add_metric([key, "under"], state.under)
            evicted_under.add_metric([key], state.evicted_under)
            prompt.add_metric([key], state.prompt_tokens)
            predicted.add_metric([key], state.predicted_tokens)
            reported_prompt.add_metric([key], state.reported_prompt_tokens)
            reported.add_metric([key], state.reported_cached_tokens)
            if active_blocks is not None:
                active.add_metric([key], active_blocks(key))
        if applies:
            yield from (batches, events, cpu, gaps, resets, delay, restarts)
        yield from (
            silent,
            blocks,
            off,
            evicted_under,
            prompt,
            predicted,
            reported_prompt,
            reported,
            caught_up,
            degraded,
            staleness,
        )
        yield from self._index_bound()
        yield from self._index_share()
        replay_load = getattr(self.subscriber, "replay_load", None)
        if replay_load is not None:
            load = replay_load()
            replays = GaugeMetricFamily(
                "infera_kv_event_replays",
                "Replays of engines' buffered KV events over "
                "ZMQ: asked now (in_flight, at most limit at once) and waiting for a slot",
                labels=["state"],
            )
            for slot in ("in_flight", "waiting", "limit"):
                replays.add_metric([slot], load[slot])
            yield replays
        if active_blocks is not None:
            yield active
        if self.balance is not None:
            weight = GaugeMetricFamily(
                "infera_policy_inflight_weight",
                "What one request in flight on a worker "
                "weighs in the kv-aware load, in missed blocks (learned unless fixed)",
            )
            weight.add_metric([], self.balance.ratio)
            yield weight

    def _index_share(self) -> Iterator[Metric]:
        """This process's part in the host's KV index (infera/server/kv_share.py)."""
        role = getattr(self, "index_role", "own")
        fam = GaugeMetricFamily(
            "infera_kv_index_role",
            "This process's part in the KV index: own (it applies every event to its own index), writer "
            "(it applies them to the host's shared index), reader (it reads that index)",
            labels=["role"],
        )
        fam.add_metric([role], 1)
        yield fam
        yield CounterMetricFamily(
            "infera_kv_index_unanswered",
            "A reader's matches answered 'nothing held' (route by load): no writer attached, or the shared "
            "table changing under every read (0 where the process applies the events)",
            value=getattr(self.index, "unanswered", 0),
        )

    def _index_bound(self) -> Iterator[Metric]:
        """The index's byte bound: bytes held, the bound, entries evicted (none for an index
        without one)."""
        bound_stats = getattr(self.index, "bound_stats", None)
        if bound_stats is None:
            return
        b = bound_stats()
        held = GaugeMetricFamily(
            "infera_kv_index_bytes",
            "Bytes the router's KV index holds (its model of the C "
            "view's tables: blocks and (block, worker) entries; infera/kv/bound.py)",
        )
        held.add_metric([], b.bytes_held)
        cap = GaugeMetricFamily(
            "infera_kv_index_max_bytes", "The KV index's byte bound (--kv-index-max-bytes; 0: unbounded)"
        )
        cap.add_metric([], b.max_bytes)
        evicted = CounterMetricFamily(
            "infera_kv_index_evicted_entries",
            "(block, worker) entries the KV index evicted at its byte bound, coldest blocks first",
        )
        evicted.add_metric([], b.evicted_entries)
        yield from (held, cap, evicted)
