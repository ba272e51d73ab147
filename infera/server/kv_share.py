"""One KV index per host (issue 30 item 4): the server processes' two roles under ``--workers N``.

* The **writer** (process 0) is a full server whose :class:`~infera.kv.index.NativeKvIndex` keeps
  its holder table in a shared arena: it subscribes to every engine's events and applies them, once
  for the host, and hands the arena and its targets' rows to its siblings
  (:class:`~infera.transport.kv_index_share.KvIndexShareServer`, rows from :func:`writer_rows`).
* A **reader** (every other process) subscribes to nothing: its :class:`SharedViewBridge` keeps the
  per-target state the policy, the self-check, the metrics and the cache view read, from the
  writer's rows, and its :class:`~infera.kv.index_shared.SharedKvIndex` matches against the arena.
  Until a writer is attached -- at start, or after the writer died, while the supervisor restarts
  it and it warms up -- every target is ``warming``: picks are by load, and the reader says so.

The event-stream series (batches, block events, gaps, resets, delay, event CPU, engine restarts)
are the writer's alone: a reader, which applies no event, leaves them out, so sums over processes
stay right and a scrape does not carry a reader's ~26 zero series per worker. The view's gauges
(blocks, caught up, degraded, staleness) come from every process.
Requests in flight and just served are still each process's own, shared by the replica sync.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.kv.bound import FALLBACK_HOST_BYTES, host_memory_bytes
from infera.kv.index_shared import SharedKvIndex, TargetRow
from infera.router.kv_aware import expand_targets
from infera.server.kv import KvEventsBridge
from infera.server.kv_state import _kv_identity, _TargetState
from infera.transport.kv_index_share import KvIndexShareClient

log = logging.getLogger(__name__)

WRITER_INDEX = 0  # the --workers process that applies the events
ARENA_SLACK_BYTES = 64 << 20


def arena_bytes(max_bytes: int) -> int:
    """The shared arena's size (sparse: only what is written takes memory): room for the holder
    table and sets under the index's byte bound twice over (they are part of what it counts), or
    the host's memory when the index is unbounded."""
    if max_bytes:
        return 2 * max_bytes + ARENA_SLACK_BYTES
    return (host_memory_bytes() or FALLBACK_HOST_BYTES) + ARENA_SLACK_BYTES


def writer_rows(bridge: KvEventsBridge) -> dict[str, Any]:
    """The writer's targets, as its readers are told them: per route key (bit, block size, blocks,
    events made until, last seq or -1, seconds since its last batch or -1, degraded reason or "",
    warming 0/1, entries its byte bound evicted, engine restarts found), and the view's size."""
    now = bridge.clock()
    warming = bridge.warming
    targets = bridge.targets
    rows = []
    for key, bit, block_size, blocks, made_until, evicted in bridge.index.target_rows():
        state = targets.get(key)
        if state is None:
            continue
        rows.append((key, bit, block_size, blocks, made_until, -1 if state.last_seq is None else state.last_seq,
                     -1.0 if state.last_batch_at is None else now - state.last_batch_at, state.degraded or "",
                     1 if key in warming else 0, evicted, state.restarts))
    return {"t": rows, "n": len(bridge.index)}


class SharedViewBridge(KvEventsBridge):
    """A reader process's KV views: the writer's, read from its rows and its arena (module
    docstring). No subscriptions."""

    applies_events = False  # (its metrics leave the event-stream series out: the module docstring)

    def __init__(self, fleet: Fleet, index: SharedKvIndex, share_path: str, *,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time) -> None:
        super().__init__(fleet, index, clock=clock, wall_clock=wall_clock)  # (its subscriber is never started)
        self.shared: SharedKvIndex = index
        self.client = KvIndexShareClient(share_path, self._attach, self._rows, self._lost)
        self._said_detached = False
        # the writer's count of engine restarts per key, as last told (a rise: a restart it found in
        # the stream; this process's policy drops what it credited there). Its own counters stay 0:
        # the writer's infera_kv_engine_restarts counts them once.
        self._writer_restarts: dict[str, int] = {}

    async def start(self) -> None:
        for record in self.fleet.all():
            self._on_fleet_change(record.worker_id, record)
        self.client.start()
        self._watchdog = asyncio.ensure_future(self._watch_silence())

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        await self.client.stop()

    # -- the fleet: which targets there are (the writer says what their views hold) -----------------------
    def _on_fleet_change(self, worker_id: str, record: WorkerRecord | None) -> None:
        old_keys = self._worker_keys.pop(worker_id, [])
        old_identity = self._identity.pop(worker_id, None)
        if record is None or not record.is_active or not record.kv_events_endpoint or not record.kv_block_size:
            for key in old_keys:
                self.targets.pop(key, None)
                self.warming.discard(key)
            return
        identity = _kv_identity(record)
        restarted = old_identity is not None and identity != old_identity
        keys = []
        for _rank, key in expand_targets(record):
            keys.append(key)
            state = self.targets.get(key)
            if state is None:
                self.targets[key] = state = _TargetState(worker_id, record.engine, self.clock())
            elif restarted:
                state.engine = record.engine
                state.last_seq, state.last_batch_at = None, None
                self._engine_restarted(key)  # this process's policy drops what it credited there
            row_warming = key not in self.shared or not self.client.connected
            if row_warming or restarted:
                self._set_warming(key, True)  # until the writer's rows say it caught up
        for key in old_keys:
            if key not in keys:
                self.targets.pop(key, None)
                self.warming.discard(key)
        self._worker_keys[worker_id] = keys
        self._identity[worker_id] = identity

    # -- the writer ------------------------------------------------------------------------------------------
    def _attach(self, fd: int, generation: int) -> None:
        self.shared.attach(fd, generation)
        log.info("KV index: reading the host's shared index (writer generation %d)", generation)
        self._said_detached = False

    def _lost(self) -> None:
        self.shared.detach()
        self._writer_restarts.clear()  # the next writer counts from 0
        for key in self.targets:
            self._set_warming(key, True)
        if not self._said_detached:
            self._said_detached = True
            log.warning("KV index: the process that applies the engines' events is gone; kv-aware picks are made "
                        "by load until it is back")

    def _rows(self, msg: Any) -> None:
        rows: dict[str, TargetRow] = {}
        now = self.clock()
        targets = self.targets
        seen = self._writer_restarts
        for key, bit, block_size, blocks, made_until, last_seq, age, degraded, warming, evicted, restarts in msg["t"]:
            rows[key] = TargetRow(bit, block_size, blocks, made_until, evicted)
            state = targets.get(key)
            if state is None:
                continue  # the writer knows a worker this process has not listed yet
            before = seen.get(key)
            seen[key] = restarts
            if before is not None and restarts > before:
                self._engine_restarted(key)
            seq = None if last_seq < 0 else last_seq
            if seq != state.last_seq:
                state.last_seq = seq
                state.unconfirmed_since = None  # events came: not silent
                state.silent = False
            state.last_batch_at = None if age < 0 else now - age
            state.degraded = degraded or None
            if warming:
                self._set_warming(key, True)
            else:
                self._on_caught_up(key)
        self.shared.update(rows, msg["n"])
        if len(seen) > len(rows):
            for key in [k for k in seen if k not in rows]:
                del seen[key]
        for key in targets:
            if key not in rows:
                self._set_warming(key, True)  # the writer has no view of it (yet)

    # -- what the subscriptions would say --------------------------------------------------------------------
    def stats(self, key: str) -> dict:
        return {"caught_up": key not in self.warming} if key in self.shared else {}

    def replaying(self, key: str) -> bool:
        return False

    def transport(self, key: str) -> str | None:
        return "shared" if key in self.shared else None
