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
* Bounded by bytes: the index evicts its coldest blocks past ``--kv-index-max-bytes``; the
  self-check does not count the under-predictions that can cause as drift (``kv_selfcheck``), and
  the metrics show the bytes held and the entries evicted (``kv_metrics``).

Split by concern: this file (subscriptions and events), ``kv_state`` (per-target state and the
self-check's constants), ``kv_selfcheck`` and ``kv_metrics`` (the bridge's mixins); the names other
modules import from here (``KvEventsBridge``, ``DIVERGENCE_WINDOW``, ...) still are.
"""
from __future__ import annotations

import asyncio
import logging
import time
from time import thread_time
from typing import Any, Callable

from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.kv.events import Cleared, KvEventDecodeError, decoder_for
from infera.kv.index import KvIndex, lower_tier
from infera.router.kv_aware import expand_targets
from infera.server.kv_metrics import KvViewMetrics
from infera.server.kv_selfcheck import SelfCheck
from infera.server.kv_state import (BLOCK_BUCKETS, DELAY_SMOOTHING, DIVERGENCE_WINDOW, ERROR_BUCKETS,  # noqa: F401
                                    SILENT_AFTER_S, _kv_identity, _TargetState)
from infera.server.metrics import Histogram
from infera.transport.kv_events_nats import NatsKvEventSubscriber, kv_event_subject
from infera.transport.kv_events_zmq import RESET_RESTART, ZmqKvEventSubscriber, endpoint_for_rank
from infera.transport.nats_conn import NatsConnection

log = logging.getLogger(__name__)


_endpoint_for_rank = endpoint_for_rank  # engines publish rank r on port + r


class KvEventsBridge(SelfCheck, KvViewMetrics):
    """Fleet -> KV-event subscriptions -> the index, with warm-up, restarts and degraded views;
    the self-check (:class:`SelfCheck`) and the metrics (:class:`KvViewMetrics`) are its mixins."""

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
        # own, writer or reader of the host's shared index (infera/server/kv_share.py; the routing stack sets it)
        self.index_role = "own"
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
                delays = state.delays
                if delays is None:
                    delays = state.delays = Histogram()
                delays.observe(delay)
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

