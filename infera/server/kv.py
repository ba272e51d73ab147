"""KV-aware wiring on the server: fleet → KV-event subscriptions → index, plus the self-check.

* Subscriptions follow the fleet: one per worker (per DP rank) that registered a KV-event
  endpoint and a block size; removed with the worker. A worker whose launcher relays its events to
  JetStream (record ``kv_event_transport == "nats"``) is followed there when this server has NATS;
  otherwise on the engine's ZMQ publisher, which every worker keeps (mixed planes work).
* Each batch is decoded by the worker's engine format and applied to the index (the index
  re-hashes token ids into the router's own hash space).
* Self-check, which no peer router has: every 200 reply's engine-reported cached prompt tokens
  are compared with what the router predicted when it picked the worker. The error is exported,
  and a warning is logged once when predictions diverge (block-size, hash-seed or chat-template
  mismatch) or a worker's events fall silent.

Self-healing: a view never keeps crediting an engine with blocks it may have lost, and says when
it may be missing some.

* Engine restart: a worker that registers again with another KV-event identity (engine, block
  size, event or replay endpoint, transport: launchers pick fresh event ports per start), or whose
  stream shows a new engine (seq back, a replayed batch that differs, a replay that ends before our
  last batch: ``infera.transport.kv_events_zmq``), has its view dropped at once and rebuilt from
  the new engine's seq 0. Counted in ``infera_kv_engine_restarts``, one INFO line each.
* Warm-up: a target's view is ``caught_up`` once its subscription has delivered the history it
  can get (the engine's replay buffer on ZMQ, the JetStream history on NATS). Until then its key is
  in ``warming``, which the kv-aware policy reads: a pick with a warming candidate is made by load
  only (no target credited with a partial view's hits, none blamed for the blocks its view has not
  caught up with yet), and a reply whose cached tokens that pick could not predict is left out of
  the self-check. ``infera_kv_view_caught_up``
  per target, ``caught_up`` in the cache view, and INFO lines when the first warm-up starts and
  when every view has caught up.
* Degraded: a view that may lack blocks its engine holds -- batches lost mid-stream that replay
  could not bring back, or history older than the engine's replay buffer -- is ``degraded``
  (``infera_kv_view_degraded``, and its reason in the cache view). Such a view is reset when the
  loss is found, so it holds only what was stored since: it under-predicts, it cannot predict a
  hit the engine lacks. It stays in use (its hits are real; routing by load instead would lose
  them too). It is whole again -- not degraded -- once the engine says its cache is empty
  (AllBlocksCleared), the engine restarts, or a resubscription replays from the engine's seq 0.
* Staleness: ``infera_kv_view_staleness_seconds``, the age of the last applied batch (or of the
  subscription, before any), computed at scrape time from one stored timestamp.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from time import thread_time
from typing import Any, Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.kv.events import Cleared, KvEventDecodeError, decoder_for
from infera.kv.index import KvIndex, lower_tier
from infera.router.kv_aware import expand_targets, predicted_cached_tokens
from infera.router.policy import RoutedRequest
from infera.server.metrics import Histogram
from infera.transport.kv_events_nats import NatsKvEventSubscriber, kv_event_subject
from infera.transport.kv_events_zmq import RESET_RESTART, ZmqKvEventSubscriber, endpoint_for_rank
from infera.transport.nats_conn import NatsConnection

log = logging.getLogger(__name__)

BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
ERROR_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
assert BLOCK_BUCKETS[0] == ERROR_BUCKETS[0] == 0  # a 0 is counted in slot 0 directly on the hot path
DELAY_SMOOTHING = 0.2  # weight of the newest batch in the cache view's delay_ms
# A worker that got requests whose blocks it must have stored, yet sent no event batch for
# this long, is "silent".
SILENT_AFTER_S = 10.0
# Predictions have diverged when most of the last DIVERGENCE_WINDOW informative replies (the engine
# reported, or the router predicted, a cached block) were off by more than one block. A mismatched
# tokenizer, chat template, block size or hash seed gets nearly every such reply wrong; races
# (an eviction or a prefill still running between the pick and the engine's schedule) get a few.
DIVERGENCE_WINDOW = 20


_endpoint_for_rank = endpoint_for_rank  # engines publish rank r on port + r


def _kv_identity(record: WorkerRecord) -> tuple:
    """What names one engine instance's event stream: a re-registration that changes it is a new
    engine (launchers bind fresh event ports per start), whose cache starts empty."""
    return (record.engine, record.kv_block_size, record.kv_events_endpoint, record.kv_events_replay_endpoint,
            record.kv_event_transport)


class _TargetState:
    __slots__ = ("worker_id", "engine", "batches", "events", "decode_errors", "last_batch_at", "last_seq",
                 "unconfirmed_since", "silent", "errors", "abs_error_sum", "observations", "exact", "verdicts",
                 "wrong", "over", "under", "delays", "delay_ewma", "cpu_s", "prompt_tokens", "predicted_tokens",
                 "reported_prompt_tokens", "reported_cached_tokens", "added_at", "fresh", "degraded", "restarts")

    def __init__(self, worker_id: str, engine: str, added_at: float) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.added_at = added_at  # (monotonic) the staleness of a view no batch has reached yet
        # No batch applied since the view was (re)built: the first one says whether it starts at
        # the engine's seq 0 (whole) or later (blocks stored before it are unknown: degraded).
        self.fresh = True
        self.degraded: str | None = None  # why the view may lack blocks (a reset reason), None: whole
        self.restarts = 0  # engine restarts found (re-registration or stream)
        self.batches = 0
        self.events = 0
        self.cpu_s = 0.0  # this thread's CPU in decoding and applying this target's batches
        self.decode_errors = 0
        self.last_batch_at: float | None = None
        self.last_seq: int | None = None
        self.unconfirmed_since: float | None = None  # first routed miss not yet followed by a batch
        self.silent = False
        self.errors: deque[int] = deque()  # recent |predicted − reported| in blocks
        self.abs_error_sum = 0
        self.observations = 0
        self.exact = 0
        # Replies off by more than one block, by direction: "over" (predicted hits the engine no
        # longer had: a stale view, or an eviction between pick and schedule) and "under" (it had
        # more: a prefill finishing meanwhile, or events that have not arrived).
        self.over = 0
        self.under = 0
        # Engine batch timestamp → applied here (wall clocks: same host, or NTP between hosts).
        # Events that lag a reply leave the next turn routed on a view without that reply's blocks.
        self.delays = Histogram()  # the server's latency buckets, 1 ms to 300 s
        self.delay_ewma: float | None = None
        self.verdicts: deque[bool] = deque()  # recent informative replies: off by more than one block?
        self.wrong = 0
        # Hit-rate counters (tokens), over every completed 200 reply routed here, with or without usage:
        # the router's prompt tokens and its predicted cached share; and, of the replies whose usage
        # carried ``cached_tokens``, the same prompt tokens and the engine's reported cached tokens.
        self.prompt_tokens = 0
        self.predicted_tokens = 0
        self.reported_prompt_tokens = 0
        self.reported_cached_tokens = 0


class KvEventsBridge:
    def __init__(self, fleet: Fleet, index: KvIndex, *, subscriber: ZmqKvEventSubscriber | None = None,
                 nats: NatsConnection | None = None, nats_subscriber: NatsKvEventSubscriber | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time) -> None:
        self.fleet = fleet
        self.index = index
        self.clock = clock
        self.wall_clock = wall_clock
        self.subscriber = subscriber or ZmqKvEventSubscriber(self._on_batch, self._on_reset,
                                                             on_caught_up=self._on_caught_up)
        # JetStream, for workers whose launcher relays their events there (None: ZMQ for all).
        self.nats_subscriber = nats_subscriber or (
            NatsKvEventSubscriber(nats, self._on_batch, self._on_reset, on_caught_up=self._on_caught_up)
            if nats is not None else None)
        for sub in (self.subscriber, self.nats_subscriber):
            if sub is not None and getattr(sub, "on_caught_up", None) is None:
                sub.on_caught_up = self._on_caught_up  # (one handed in: the watchdog would poll it too)
        self._key_sub: dict[str, Any] = {}  # route key -> the subscriber that holds it
        self.targets: dict[str, _TargetState] = {}
        # Route keys whose view has not caught up with its engine's history yet (see the module
        # docstring); the kv-aware policy reads this set (its observer's ``warming``).
        self.warming: set[str] = set()
        self._warming_since: float | None = None  # when ``warming`` last became non-empty
        # Called with a route key whose engine restarted (the kv-aware policy drops what it credits
        # there beyond the view: blocks of requests served just before).
        self.on_engine_restart: list[Callable[[str], None]] = []
        self._caught_up_once = False
        self._decoders: dict[str, Callable[[bytes], Any]] = {}
        self._worker_keys: dict[str, list[str]] = {}
        self._identity: dict[str, tuple] = {}  # worker id -> _kv_identity of the record subscribed
        self._warned: set[tuple[str, str]] = set()
        self._picks = 0
        self.pick_hits: dict[str, Histogram] = {}
        self.pick_blocks: dict[str, Histogram] = {}
        self.picks: dict[tuple[str, str], int] = {}
        self.prediction_error = Histogram(ERROR_BUCKETS)
        # The policy's distinct blocks in flight per route key (KvAwarePolicy.active_blocks), set by
        # the server once the policy exists: exported as infera_policy_active_blocks.
        self.active_blocks: Callable[[str], int] | None = None
        # The policy's TtftBalance (what a request in flight weighs): infera_policy_inflight_weight.
        self.balance: Any = None
        self._watchdog: asyncio.Task | None = None
        fleet.subscribe(self._on_fleet_change)

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.subscriber.start()
        if self.nats_subscriber is not None:
            await self.nats_subscriber.start()  # returns at once; subscribes once the broker is up
        for record in self.fleet.all():
            self._on_fleet_change(record.worker_id, record)
        self._watchdog = asyncio.ensure_future(self._watch_silence())

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        await self.subscriber.stop()
        if self.nats_subscriber is not None:
            await self.nats_subscriber.stop()

    # -- which subscriber holds a key --------------------------------------------------------------
    def _subscriber_for(self, record: WorkerRecord) -> Any:
        if self.nats_subscriber is not None and record.kv_event_transport == "nats":
            return self.nats_subscriber
        return self.subscriber

    def stats(self, key: str) -> dict:
        """The subscription counters of ``key`` (empty when not subscribed)."""
        sub = self._key_sub.get(key)
        return sub.stats(key) if sub is not None else {}

    def replaying(self, key: str) -> bool:
        sub = self._key_sub.get(key)
        replaying = getattr(sub, "replaying", None)
        return bool(replaying(key)) if replaying is not None else False

    def transport(self, key: str) -> str | None:
        sub = self._key_sub.get(key)
        if sub is None:
            return None
        return "nats" if sub is self.nats_subscriber else "zmq"

    # -- fleet → subscriptions -----------------------------------------------------------------------
    def _on_fleet_change(self, worker_id: str, record: WorkerRecord | None) -> None:
        old_keys = self._worker_keys.pop(worker_id, [])
        old_identity = self._identity.pop(worker_id, None)
        if record is None or not record.is_active:
            for key in old_keys:
                self._drop(key)
            return
        if not record.kv_events_endpoint or not record.kv_block_size:
            if not record.kv_events_endpoint:
                self._warn_once(worker_id, "no_events", "worker %s registered no KV-event endpoint: kv-aware routing "
                                "sees no cache there and routes it by load only", worker_id)
            else:
                self._warn_once(worker_id, "no_block_size", "worker %s registered no KV block size: its events "
                                "cannot be hashed; routed by load only", worker_id)
            for key in old_keys:
                self._drop(key)
            return
        keys = []
        sub = self._subscriber_for(record)
        identity = _kv_identity(record)
        restarted = old_identity is not None and identity != old_identity
        if restarted:
            log.info("worker %s registered again with a new KV-event stream (engine restart): its cached blocks "
                     "are dropped from the router's view, rebuilt from the new engine's events", worker_id)
        for rank, key in expand_targets(record):
            keys.append(key)
            if key in old_keys and self.index.has_target(key) and self._key_sub.get(key) is sub and not restarted:
                continue  # unchanged record: keep the subscription and the view
            old_sub = self._key_sub.get(key)
            if old_sub is not None and old_sub is not sub:
                old_sub.remove(key)  # the worker moved to the other transport
            self.index.add_target(key, record.kv_block_size)
            state = self.targets.get(key) if key in old_keys else None
            if state is None:
                self.targets[key] = _TargetState(worker_id, record.engine, self.clock())
            else:  # the same target, a new engine: its counters go on, its view starts over
                self.index.reset(key)
                state.engine = record.engine
                state.restarts += 1
                state.last_seq, state.fresh, state.degraded = None, True, None
                state.added_at, state.last_batch_at = self.clock(), None
                self._engine_restarted(key)
            self._set_warming(key, True)  # until the new subscription says it caught up
            if record.engine not in self._decoders:
                self._decoders[record.engine] = decoder_for(record.engine)
            self._key_sub[key] = sub
            if sub is self.nats_subscriber:
                sub.add(key, kv_event_subject(worker_id, rank))
            else:
                replay = record.kv_events_replay_endpoint
                sub.add(key, _endpoint_for_rank(record.kv_events_endpoint, rank),
                        _endpoint_for_rank(replay, rank) if replay else None)
        for key in old_keys:
            if key not in keys:
                self._drop(key)
        self._worker_keys[worker_id] = keys
        self._identity[worker_id] = identity
        for key in keys:  # (a subscription may have caught up as it was added: NATS, nothing to fetch)
            if key in self.warming and self.stats(key).get("caught_up"):
                self._on_caught_up(key)

    def _drop(self, key: str) -> None:
        sub = self._key_sub.pop(key, None)
        if sub is not None:
            sub.remove(key)
        self.index.remove_target(key)
        self.targets.pop(key, None)
        self._set_warming(key, False)

    # -- warm-up ---------------------------------------------------------------------------------------
    def _set_warming(self, key: str, warming: bool) -> None:
        if warming:
            if not self.warming:
                self._warming_since = self.clock()
                if not self._caught_up_once:
                    log.info("KV views warming up from the engines' replay buffers or JetStream history: kv-aware "
                             "picks are made by load until they have caught up")
            self.warming.add(key)
        else:
            self.warming.discard(key)

    def _on_caught_up(self, key: str) -> None:
        """``key``'s subscription delivered the history it could get: its view is used from now."""
        if key not in self.warming:
            return
        self.warming.discard(key)
        log.debug("KV view of %s caught up", key)
        if not self.warming:
            took = self.clock() - self._warming_since if self._warming_since is not None else 0.0
            if not self._caught_up_once:
                self._caught_up_once = True
                log.info("KV views caught up: %d target(s) rebuilt from their engines' replay buffers or "
                         "JetStream history in %.1fs; kv-aware routing now uses them (it routed by load until "
                         "then)", len(self.targets), took)
            else:
                log.debug("KV views caught up again after %.1fs", took)

    # -- events ----------------------------------------------------------------------------------------
    def _on_batch(self, key: str, seq: int, payload: bytes) -> None:
        state = self.targets.get(key)
        if state is None:
            return
        # What events cost the router, apart from requests (bench/kv_routing.py divides it by the
        # block events): the loop thread's CPU clock around the batch.
        started = thread_time()
        try:
            # The common batch (GPU stores and removals, map form) is applied from its bytes; the
            # index says None for anything else, decoded and applied as events (the same result).
            if state.fresh:  # the first batch of this view: does it start at the engine's first batch?
                state.fresh = False
                if seq == 0:
                    state.degraded = None  # the engine's every batch since its start: whole
                elif seq > 0 and state.degraded is None:
                    self._degrade(key, state, "history")
            done = self.index.apply_payload(key, payload)
            if done is not None:
                applied, ts = done
            else:
                try:
                    batch = self._decoders[state.engine](payload)
                except KvEventDecodeError as exc:
                    state.decode_errors += 1
                    self._warn_once(key, "decode", "cannot decode KV events from %s (engine %s): %s", key,
                                    state.engine, exc)
                    return
                applied, ts = self.index.apply(key, batch), batch.ts
                if state.degraded is not None and any(type(ev) is Cleared and lower_tier(ev.medium) is None
                                                      for ev in batch.events):
                    # the engine's cache is empty now, and so is the view: whole again
                    state.degraded = None
                    log.info("KV view of %s is whole again (the engine cleared its cache)", key)
            state.events += applied
            sub = self._key_sub.get(key)
            if sub is None or not sub.replaying(key):  # replayed history is old by design: not a delay
                delay = self.wall_clock() - ts
                if delay < 0.0:
                    delay = 0.0  # clock skew between hosts
                state.delays.observe(delay)
                ewma = state.delay_ewma
                state.delay_ewma = delay if ewma is None else ewma + DELAY_SMOOTHING * (delay - ewma)
            state.batches += 1
            state.last_seq = seq
            state.last_batch_at = self.clock()
            state.unconfirmed_since = None
            if state.silent:
                state.silent = False
                log.info("KV events from %s resumed", key)
        finally:
            state.cpu_s += thread_time() - started

    def _on_reset(self, key: str) -> None:
        """A gap with no replay, or an engine restart: the view can't be trusted; start over."""
        state = self.targets.get(key)
        if state is None:
            return
        sub = self._key_sub.get(key)
        reason_of = getattr(sub, "reset_reason", None)
        reason = (reason_of(key) if reason_of is not None else None) or "gap"
        blocks = self.index.block_count(key)
        self.index.reset(key)
        state.fresh = True
        if reason == RESET_RESTART:
            # A new engine: its cache started empty, like the view now (whole; its first batch
            # decides, if it does not start at seq 0).
            state.restarts += 1
            state.degraded = None
            log.info("KV events of %s: the engine restarted; its %d cached block(s) are dropped from the "
                     "router's view", key, blocks)
            self._engine_restarted(key)
        elif state.batches:
            self._degrade(key, state, reason)
            log.warning("KV event stream of %s lost continuity (%s): its cache view is reset and marked degraded "
                        "(it under-predicts until the engine clears its cache or restarts)", key, reason)
        else:
            # First contact with a long-running engine whose replay buffer no longer reaches its
            # first batch: nothing was lost here, blocks stored earlier are simply unknown until
            # stored again. (Every new server replica would otherwise warn.)
            self._degrade(key, state, reason)
            log.info("KV events of %s: history before the engine's replay buffer is unknown", key)

    def _engine_restarted(self, key: str) -> None:
        for callback in self.on_engine_restart:
            try:
                callback(key)
            except Exception:  # a listener's bug must not stop the view's own reset
                log.exception("engine-restart listener failed for %s", key)

    @staticmethod
    def _degrade(key: str, state: _TargetState, reason: str) -> None:
        if state.degraded is None:
            log.debug("KV view of %s degraded (%s)", key, reason)
        state.degraded = reason

    # -- picks and the self-check ---------------------------------------------------------------------
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
        key = st.get("route_key")
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
        state.observations += 1
        errors = state.errors
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
        state.verdicts.append(wrong)
        state.wrong += wrong
        if len(state.verdicts) > DIVERGENCE_WINDOW:
            state.wrong -= state.verdicts.popleft()
        if len(state.verdicts) == DIVERGENCE_WINDOW and 2 * state.wrong > DIVERGENCE_WINDOW:
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

    def collect(self) -> Iterator[Metric]:
        # Names and labels follow the reference (AMD Infera) where it has the series: worker_id
        # carries the route key (``<worker_id>#dp<rank>`` for a rank of a DP-attention worker).
        fam = CounterMetricFamily("infera_router_picks", "KV-aware picks", labels=["role", "worker_id"])
        for (role, key), n in sorted(self.picks.items()):
            fam.add_metric([role, key], n)
        yield fam
        for name, table, doc in (("infera_router_pick_cache_hits", self.pick_hits, "Predicted cached blocks per pick"),
                                 ("infera_router_pick_request_blocks", self.pick_blocks, "Full blocks per request")):
            hist = HistogramMetricFamily(name, doc, labels=["role"])
            for role, h in sorted(table.items()):
                hist.add_metric([role], h.cumulative(), h.total)
            yield hist
        hist = HistogramMetricFamily("infera_kv_prediction_error_tokens", "|engine-reported − router-predicted| "
                                     "cached prompt tokens per reply")
        hist.add_metric([], self.prediction_error.cumulative(), self.prediction_error.total)
        yield hist
        label = ["worker_id"]
        batches = CounterMetricFamily("infera_kv_event_batches", "KV-event batches applied", labels=label)
        events = CounterMetricFamily("infera_kv_block_events", "Block events applied", labels=label)
        gaps = CounterMetricFamily("infera_kv_event_gaps", "Sequence gaps (replayed or reset)", labels=label)
        resets = CounterMetricFamily("infera_kv_view_resets", "Cache views reset after lost continuity", labels=label)
        silent = GaugeMetricFamily("infera_kv_events_silent", "1 when a worker's KV events fell silent", labels=label)
        blocks = GaugeMetricFamily("infera_policy_cache_view_size", "Blocks in the router's view of a worker's cache",
                                   labels=label)
        delay = HistogramMetricFamily("infera_kv_event_delay_seconds", "Engine batch timestamp to applied here",
                                      labels=label)
        cpu = CounterMetricFamily("infera_kv_event_cpu_seconds", "Router CPU spent decoding and applying a "
                                  "worker's KV-event batches (the socket read excluded)", labels=label)
        off = CounterMetricFamily("infera_kv_predictions_off", "Replies whose cached tokens the router predicted "
                                  "wrong by more than one block: over (predicted more) or under (fewer)",
                                  labels=["worker_id", "direction"])
        prompt = CounterMetricFamily("infera_kv_prompt_tokens", "Prompt tokens (router's tokenizer) of the completed "
                                     "replies routed to a worker, with or without usage", labels=label)
        predicted = CounterMetricFamily("infera_kv_predicted_cached_tokens", "Of those, the tokens the router "
                                        "predicted cached when it picked the worker", labels=label)
        reported_prompt = CounterMetricFamily("infera_kv_reported_prompt_tokens", "Prompt tokens (router's "
                                              "tokenizer) of the replies whose usage reported cached tokens",
                                              labels=label)
        reported = CounterMetricFamily("infera_kv_reported_cached_tokens", "Cached prompt tokens the engine "
                                       "reported in those replies' usage", labels=label)
        caught_up = GaugeMetricFamily("infera_kv_view_caught_up", "1 once a worker's view has caught up with its "
                                      "engine's history (replay or JetStream); 0 while warming up, when the "
                                      "kv-aware policy routes its picks by load", labels=label)
        degraded = GaugeMetricFamily("infera_kv_view_degraded", "1 while a worker's view may lack blocks its engine "
                                     "holds (events lost beyond replay, or history older than the replay "
                                     "buffer): it under-predicts until the engine clears its cache or restarts",
                                     labels=label)
        staleness = GaugeMetricFamily("infera_kv_view_staleness_seconds", "Seconds since a worker's view last "
                                      "applied an event batch (or since it was subscribed, before any)",
                                      labels=label)
        restarts = CounterMetricFamily("infera_kv_engine_restarts", "Engine restarts found (a new KV-event "
                                       "stream registered, or the stream started over): the view was dropped",
                                       labels=label)
        now = self.clock()
        warming = self.warming
        active = GaugeMetricFamily("infera_policy_active_blocks", "Distinct prompt blocks of the requests in flight "
                                   "on a worker (the kv-aware policy's load term)", labels=label)
        active_blocks = self.active_blocks
        for key, state in sorted(self.targets.items()):
            sub = self.stats(key)
            batches.add_metric([key], state.batches)
            events.add_metric([key], state.events)
            cpu.add_metric([key], state.cpu_s)
            gaps.add_metric([key], sub.get("gaps", 0))
            resets.add_metric([key], sub.get("resets", 0))
            silent.add_metric([key], 1 if state.silent else 0)
            caught_up.add_metric([key], 0 if key in warming else 1)
            degraded.add_metric([key], 0 if state.degraded is None else 1)
            since = state.last_batch_at if state.last_batch_at is not None else state.added_at
            staleness.add_metric([key], max(0.0, now - since))
            restarts.add_metric([key], state.restarts)
            blocks.add_metric([key], self.index.block_count(key))
            delay.add_metric([key], state.delays.cumulative(), state.delays.total)
            off.add_metric([key, "over"], state.over)
            off.add_metric([key, "under"], state.under)
            prompt.add_metric([key], state.prompt_tokens)
            predicted.add_metric([key], state.predicted_tokens)
            reported_prompt.add_metric([key], state.reported_prompt_tokens)
            reported.add_metric([key], state.reported_cached_tokens)
            if active_blocks is not None:
                active.add_metric([key], active_blocks(key))
        yield from (batches, events, cpu, gaps, resets, silent, blocks, delay, off, prompt, predicted,
                    reported_prompt, reported, caught_up, degraded, staleness, restarts)
        if active_blocks is not None:
            yield active
        if self.balance is not None:
            weight = GaugeMetricFamily("infera_policy_inflight_weight", "What one request in flight on a worker "
                                       "weighs in the kv-aware load, in missed blocks (learned unless fixed)")
            weight.add_metric([], self.balance.ratio)
            yield weight

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
