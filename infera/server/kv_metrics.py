"""The server's KV-view metrics (``infera.server.kv``'s bridge, a prometheus collector): per target
the event stream (batches, block events, gaps, resets, delay, CPU), the view (size, caught up,
degraded, staleness, engine restarts), the self-check (prediction errors, hit-rate counters), the
kv-aware policy's load terms, the replays asked and waiting (``infera_kv_event_replays``), and
the index's byte bound: ``infera_kv_index_bytes`` (held, by the
model of ``infera.kv.bound``), ``infera_kv_index_max_bytes`` and
``infera_kv_index_evicted_entries_total`` (the (block, worker) entries the bound evicted).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from infera.server.keyed_family import KeyedFamily
from infera.server.kv_state import _TargetState
from infera.server.metrics import LATENCY_LABELS, Histogram

__all__ = ["KvViewMetrics"]

NO_DELAYS = (0,) * (len(LATENCY_LABELS) + 1)  # a target with no batch yet


class _Stream(NamedTuple):
    """A target's event stream, as the process that applies it counts it."""

    batches: int
    events: int
    cpu_s: float
    gaps: int
    resets: int
    restarts: int
    delay_counts: Sequence[int]
    delay_total: float


class _TargetRow(NamedTuple):
    """A target's series, copied on the loop."""

    key: str
    stream: _Stream | None  # None in a process that reads the shared index
    silent: int
    caught_up: int
    degraded: int
    staleness_s: float
    blocks: int
    over: int
    under: int
    evicted_under: int
    prompt_tokens: int
    predicted_tokens: int
    reported_prompt_tokens: int
    reported_cached_tokens: int
    active_blocks: int


@dataclass(frozen=True, slots=True)
class _KvSnapshot:
    """What :meth:`KvViewMetrics.families` shows, copied on the loop."""

    picks: list[tuple[tuple[str, str], int]]
    pick_hits: list[tuple[str, list[tuple[str, int]], float]]
    pick_blocks: list[tuple[str, list[tuple[str, int]], float]]
    prediction_error: tuple[list[tuple[str, int]], float]
    rows: list[_TargetRow]
    applies: bool
    active: bool
    small: list[Metric]  # the fleet-size-free families, built on the loop


def _row_key(row: _TargetRow) -> str:
    return row.key


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
        for family in self.families(self.snapshot()):
            yield family.to_metric() if isinstance(family, KeyedFamily) else family

    def snapshot(self) -> _KvSnapshot:
        """On the loop: the live state the families show, copied (a tuple per target; a few ms at
        1,000 workers), so that :meth:`families` can build them in a thread."""
        now = self.clock()
        warming = self.warming
        active_blocks = self.active_blocks
        applies = self.applies_events
        block_count = self.index.block_count
        rows = []
        for key, state in self.targets.items():
            stream = None
            if applies:
                sub = self.stats(key)
                delays = state.delays
                stream = _Stream(
                    state.batches,
                    state.events,
                    state.cpu_s,
                    sub.get("gaps", 0),
                    sub.get("resets", 0),
                    state.restarts,
                    NO_DELAYS if delays is None else list(delays.counts),
                    0.0 if delays is None else delays.total,
                )
            since = state.last_batch_at if state.last_batch_at is not None else state.added_at
            rows.append(
                _TargetRow(
                    key,
                    stream,
                    silent=1 if state.silent else 0,
                    caught_up=0 if key in warming else 1,
                    degraded=0 if state.degraded is None else 1,
                    staleness_s=max(0.0, now - since),
                    blocks=block_count(key),
                    over=state.over,
                    under=state.under,
                    evicted_under=state.evicted_under,
                    prompt_tokens=state.prompt_tokens,
                    predicted_tokens=state.predicted_tokens,
                    reported_prompt_tokens=state.reported_prompt_tokens,
                    reported_cached_tokens=state.reported_cached_tokens,
                    active_blocks=active_blocks(key) if active_blocks is not None else 0,
                )
            )
        small = [*self._index_bound(), *self._index_share(), *self._replays(), *self._weight()]
        return _KvSnapshot(
            picks=list(self.picks.items()),
            pick_hits=[(role, h.cumulative(), h.total) for role, h in self.pick_hits.items()],
            pick_blocks=[(role, h.cumulative(), h.total) for role, h in self.pick_blocks.items()],
            prediction_error=(self.prediction_error.cumulative(), self.prediction_error.total),
            rows=rows,
            applies=applies,
            active=active_blocks is not None,
            small=small,
        )

    @staticmethod
    def families(snap: _KvSnapshot) -> Iterator[Metric | KeyedFamily]:
        """The families of a :meth:`snapshot`: reads nothing else, so it runs in any thread."""
        # Names and labels follow the reference (AMD Infera) where it has the series: worker_id
        # carries the route key (``<worker_id>#dp<rank>`` for a rank of a DP-attention worker).
        fam = KeyedFamily("infera_router_picks", "counter", "KV-aware picks", labels=["role", "worker_id"])
        for (role, key), n in sorted(snap.picks):
            fam.add((role, key), n)
        yield fam
        for name, table, doc in (
            ("infera_router_pick_cache_hits", snap.pick_hits, "Predicted cached blocks per pick"),
            ("infera_router_pick_request_blocks", snap.pick_blocks, "Full blocks per request"),
        ):
            hist = HistogramMetricFamily(name, doc, labels=["role"])
            for role, buckets, total in sorted(table):
                hist.add_metric([role], buckets, total)
            yield hist
        hist = HistogramMetricFamily(
            "infera_kv_prediction_error_tokens", "|engine-reported − router-predicted| cached prompt tokens per reply"
        )
        hist.add_metric([], *snap.prediction_error)
        yield hist
        label = ["worker_id"]
        batches = KeyedFamily("infera_kv_event_batches", "counter", "KV-event batches applied", labels=label)
        events = KeyedFamily("infera_kv_block_events", "counter", "Block events applied", labels=label)
        gaps = KeyedFamily("infera_kv_event_gaps", "counter", "Sequence gaps (replayed or reset)", labels=label)
        resets = KeyedFamily(
            "infera_kv_view_resets", "counter", "Cache views reset after lost continuity", labels=label
        )
        silent = KeyedFamily(
            "infera_kv_events_silent", "gauge", "1 when a worker's KV events fell silent", labels=label
        )
        blocks = KeyedFamily(
            "infera_policy_cache_view_size", "gauge", "Blocks in the router's view of a worker's cache", labels=label
        )
        delay = KeyedFamily(
            "infera_kv_event_delay_seconds",
            "histogram",
            "Engine batch timestamp to applied here",
            labels=label,
            bounds=LATENCY_LABELS,
        )
        cpu = KeyedFamily(
            "infera_kv_event_cpu_seconds",
            "counter",
            "Router CPU spent decoding and applying a worker's KV-event batches (the socket read excluded)",
            labels=label,
        )
        evicted_under = KeyedFamily(
            "infera_kv_predictions_evicted",
            "counter",
            "Replies with more blocks cached than "
            "predicted, on a view the index's byte bound evicted from: possibly "
            "what it evicted, not counted as drift (predictions_off)",
            labels=label,
        )
        off = KeyedFamily(
            "infera_kv_predictions_off",
            "counter",
            "Replies whose cached tokens the router predicted "
            "wrong by more than one block: over (predicted more) or under (fewer)",
            labels=["worker_id", "direction"],
        )
        prompt = KeyedFamily(
            "infera_kv_prompt_tokens",
            "counter",
            "Prompt tokens (router's tokenizer) of the completed replies routed to a worker, with or without usage",
            labels=label,
        )
        predicted = KeyedFamily(
            "infera_kv_predicted_cached_tokens",
            "counter",
            "Of those, the tokens the router predicted cached when it picked the worker",
            labels=label,
        )
        reported_prompt = KeyedFamily(
            "infera_kv_reported_prompt_tokens",
            "counter",
            "Prompt tokens (router's tokenizer) of the replies whose usage reported cached tokens",
            labels=label,
        )
        reported = KeyedFamily(
            "infera_kv_reported_cached_tokens",
            "counter",
            "Cached prompt tokens the engine reported in those replies' usage",
            labels=label,
        )
        caught_up = KeyedFamily(
            "infera_kv_view_caught_up",
            "gauge",
            "1 once a worker's view has caught up with its "
            "engine's history (replay or JetStream); 0 while warming up, when the "
            "kv-aware policy routes its picks by load",
            labels=label,
        )
        degraded = KeyedFamily(
            "infera_kv_view_degraded",
            "gauge",
            "1 while a worker's view may lack blocks its engine "
            "holds (events lost beyond replay, or history older than the replay "
            "buffer): it under-predicts until the engine clears its cache or restarts",
            labels=label,
        )
        staleness = KeyedFamily(
            "infera_kv_view_staleness_seconds",
            "gauge",
            "Seconds since a worker's view last applied an event batch (or since it was subscribed, before any)",
            labels=label,
        )
        restarts = KeyedFamily(
            "infera_kv_engine_restarts",
            "counter",
            "Engine restarts found (a new KV-event "
            "stream registered, or the stream started over): the view was dropped",
            labels=label,
        )
        active = KeyedFamily(
            "infera_policy_active_blocks",
            "gauge",
            "Distinct prompt blocks of the requests in flight on a worker (the kv-aware policy's load term)",
            labels=label,
        )
        for row in sorted(snap.rows, key=_row_key):
            worker = (row.key,)
            stream = row.stream
            if stream is not None:
                batches.add(worker, stream.batches)
                events.add(worker, stream.events)
                cpu.add(worker, stream.cpu_s)
                gaps.add(worker, stream.gaps)
                resets.add(worker, stream.resets)
                restarts.add(worker, stream.restarts)
                delay.add(worker, stream.delay_counts, stream.delay_total)
            silent.add(worker, row.silent)
            caught_up.add(worker, row.caught_up)
            degraded.add(worker, row.degraded)
            staleness.add(worker, row.staleness_s)
            blocks.add(worker, row.blocks)
            off.add((row.key, "over"), row.over)
            off.add((row.key, "under"), row.under)
            evicted_under.add(worker, row.evicted_under)
            prompt.add(worker, row.prompt_tokens)
            predicted.add(worker, row.predicted_tokens)
            reported_prompt.add(worker, row.reported_prompt_tokens)
            reported.add(worker, row.reported_cached_tokens)
            if snap.active:
                active.add(worker, row.active_blocks)
        if snap.applies:
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
        if snap.active:
            yield active
        yield from snap.small

    def _replays(self) -> Iterator[Metric]:
        replay_load = getattr(self.subscriber, "replay_load", None)
        if replay_load is None:
            return
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

    def _weight(self) -> Iterator[Metric]:
        if self.balance is None:
            return
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
