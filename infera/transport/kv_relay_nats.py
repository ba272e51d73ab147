"""KV events over NATS JetStream, worker side: the relay from the engine's ZMQ publisher.

Worker side (``KvEventNatsRelay``, run by the launcher): tails the engine's ZMQ publisher of every DP
rank through ``ZmqKvEventSubscriber`` -- so gaps are repaired from the engine's replay socket and
engine restarts detected right there, next to the engine -- and republishes each batch payload
VERBATIM (no decoding: the server decodes per engine format) into JetStream subject
``infera.kv.events.<subject_token(worker_id)>.<rank or 0>``.

Message headers:

* ``Infera-Kv-Seq``: the engine's batch seq (absent: an untracked two-frame batch, e.g. ATOM's);
* ``Infera-Kv-Epoch``: ``<relay run id>.<generation>``; the generation grows with every reset
  marker, so a server that lost a marker still sees that continuity broke;
* ``Infera-Kv-Reset``: present (the reason) on a reset marker, whose payload is empty. Published
  when the relay starts (a new engine under a possibly reused worker id: history before it is
  void), when the ZMQ side resets (gap it could not repair, engine restart), and when batches were
  lost on the NATS side (queue overflow, failed publishes, a long broker outage).

After losing batches on the NATS side the relay publishes the marker and then re-reads the
engine's replay buffer from seq 0 (when the engine has a replay socket), so a server rebuilds the
view instead of merely restarting it empty. Publishing never blocks the ZMQ reader: batches go into
a bounded queue drained by one publisher task that pipelines a window of JetStream publishes and
then awaits their acks.

Shared wire (stream, subjects, headers): ``infera.transport.kv_events_nats``.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import nats.errors
import nats.js.errors

from infera.discovery.record import WorkerRecord
from infera.runtime import wait_for
from infera.transport.backoff import retry_delay
from infera.transport.kv_events_nats import (HDR_EPOCH, HDR_RESET, HDR_SEQ, MARKER_RELAY_START, STREAM,
                                             SUBJECT_PREFIX, ensure_stream, kv_event_subject)
from infera.transport.kv_events_zmq import NO_SEQ, ZmqKvEventSubscriber, endpoint_for_rank
from infera.transport.nats_conn import NatsConnection, subject_token

log = logging.getLogger(__name__)

PUBLISH_RETRY_MAX_S = 30.0  # cap of the publisher's retry backoff


def _ranks(record: WorkerRecord) -> list[int | None]:
    # As ``expand_targets`` in router/kv_aware.py (not imported: the launcher would load the router).
    if record.dp_size and record.dp_size > 1 and record.dp_rank is None:
        return list(range(record.dp_size))
    return [None]


# ====================================================================================== worker side


@dataclass(eq=False)
class _Rank:
    key: str  # the ZMQ subscriber's key
    rank: int | None
    subject: str
    endpoint: str
    replay_endpoint: str | None
    gen: int = 0
    dirty: bool = False  # batches were lost on the NATS leg: marker (+ resync) before anything else
    last_resync: float = float("-inf")
    published: int = 0
    markers: int = 0
    dropped: int = 0
    failures: int = 0
    resyncs: int = 0


@dataclass(eq=False)
class _Out:
    rank: _Rank
    headers: dict[str, str]
    payload: bytes
    marker: bool


class KvEventNatsRelay:
    """Engine ZMQ → JetStream, for one worker (every DP rank). See the module docstring."""

    def __init__(self, nats: NatsConnection, record: WorkerRecord, *, queue_max_msgs: int = 100_000,
                 queue_max_bytes: int = 64 * 1024 * 1024, window: int = 256, ack_timeout: float = 5.0,
                 flush_timeout: float = 5.0, start_timeout: float = 5.0, max_outage_s: float = 30.0,
                 resync_interval_s: float = 5.0, replay_timeout: float = 2.0) -> None:
        if not record.kv_events_endpoint:
            raise ValueError(f"worker {record.worker_id} publishes no KV events")
        self.nats = nats
        self.worker_id = record.worker_id
        self.token = subject_token(record.worker_id)
        self.queue_max_msgs = queue_max_msgs
        self.queue_max_bytes = queue_max_bytes
        self.window = window
        self.ack_timeout = ack_timeout
        self.flush_timeout = flush_timeout
        self.start_timeout = start_timeout
        self.max_outage_s = max_outage_s
        self.resync_interval_s = resync_interval_s
        self.run_id = uuid.uuid4().hex[:12]
        self.ranks: dict[str, _Rank] = {}
        for rank in _ranks(record):
            key = f"dp{rank or 0}"
            replay = record.kv_events_replay_endpoint
            self.ranks[key] = _Rank(key, rank, kv_event_subject(record.worker_id, rank),
                                    endpoint_for_rank(record.kv_events_endpoint, rank),
                                    endpoint_for_rank(replay, rank) if replay else None)
        self.zmq = ZmqKvEventSubscriber(self._on_batch, self._on_reset, replay_timeout=replay_timeout)
        self._queue: deque[_Out] = deque()
        self._queued_bytes = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # nothing queued and nothing in flight
        self._idle.set()
        self._down = asyncio.Event()  # the connection is lost: stop waiting for acks
        self._check_stream = True
        self._stream_created: Any = None
        self._down_since: float | None = None
        self._task: asyncio.Task | None = None
        self._stopped = False

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        self.nats.on_disconnect(self._on_disconnect)
        self.nats.on_reconnect(self._on_reconnect)
        for r in self.ranks.values():
            self._enqueue_marker(r, MARKER_RELAY_START)  # a new engine: whatever came before is void
        self._task = asyncio.ensure_future(self._publisher())
        for r in self.ranks.values():
            self.zmq.add(r.key, r.endpoint, r.replay_endpoint)
        await self.zmq.start()
        # Bounded: the markers out and the engines' buffers read once (the SUB sockets have joined
        # by then) before the worker registers. A slow broker is not fatal: the queue holds on.
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._idle.is_set() and all(self.zmq.stats(k)["caught_up"] for k in self.ranks):
                break
            await asyncio.sleep(0.02)
        else:
            log.warning("KV relay %s: not settled after %.0fs (NATS slow?); continuing", self.worker_id,
                        self.start_timeout)
        log.info("relaying KV events of %s (%d rank(s)) to JetStream %s.%s.*", self.worker_id, len(self.ranks),
                 SUBJECT_PREFIX, self.token)

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        await self.zmq.stop()  # nothing more comes in
        if self._task is not None:
            try:  # flush what is queued, bounded (nothing can go while the broker is away)
                if self.nats.connected:
                    await wait_for(self._idle.wait(), self.flush_timeout)
            except asyncio.TimeoutError:
                log.warning("KV relay %s: %d batch(es) not flushed within %.0fs", self.worker_id, len(self._queue),
                            self.flush_timeout)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        # The engine's cache dies with it: its history must not stay in the stream.
        if self.nats.connected:
            try:
                await wait_for(self.nats.js.purge_stream(STREAM, subject=f"{SUBJECT_PREFIX}.{self.token}.>"),
                                       self.ack_timeout)
            except Exception as exc:
                log.warning("KV relay %s: could not purge its subjects from %s: %s", self.worker_id, STREAM, exc)

    def stats(self) -> dict:
        return {"queued": len(self._queue), "queued_bytes": self._queued_bytes,
                "ranks": {r.key: {"subject": r.subject, "published": r.published, "markers": r.markers,
                                  "dropped": r.dropped, "failures": r.failures, "resyncs": r.resyncs,
                                  "dirty": r.dirty, "epoch": self._epoch(r)} for r in self.ranks.values()}}

    # -- ZMQ side (sync callbacks: never block) --------------------------------------------------
    def _on_batch(self, key: str, seq: int, payload: bytes) -> None:
        r = self.ranks[key]
        if r.dirty:
            r.dropped += 1  # superseded: the marker and the resync come first
            return
        headers = {HDR_EPOCH: self._epoch(r)}
        if seq != NO_SEQ:
            headers[HDR_SEQ] = str(seq)
        self._push(_Out(r, headers, payload, False))

    def _on_reset(self, key: str) -> None:
        r = self.ranks[key]
        if not r.dirty:  # a dirty rank publishes its marker on recovery anyway
            self._enqueue_marker(r, "engine")

    def _enqueue_marker(self, r: _Rank, reason: str) -> None:
        r.gen += 1
        self._push(_Out(r, {HDR_EPOCH: self._epoch(r), HDR_RESET: reason}, b"", True))

    def _epoch(self, r: _Rank) -> str:
        return f"{self.run_id}.{r.gen}"

    def _push(self, out: _Out) -> None:
        if len(self._queue) >= self.queue_max_msgs or self._queued_bytes + len(out.payload) > self.queue_max_bytes:
            log.warning("KV relay %s: queue full (NATS slow or down): dropping %s; its view is reset and "
                        "rebuilt once NATS keeps up", self.worker_id, out.rank.subject)
            self._mark_dirty(out.rank)
            out.rank.dropped += 1
            return
        self._queue.append(out)
        self._queued_bytes += len(out.payload)
        self._idle.clear()
        self._wake.set()

    def _mark_dirty(self, r: _Rank) -> None:
        if not r.dirty:
            r.dirty = True
            # What is queued for the rank follows the loss: the resync brings it again.
            kept = deque(o for o in self._queue if o.rank is not r)
            r.dropped += len(self._queue) - len(kept)
            self._queue = kept
            self._queued_bytes = sum(len(o.payload) for o in kept)
        self._wake.set()

    # -- NATS side ---------------------------------------------------------------------------------
    def _on_disconnect(self) -> None:
        self._down.set()

    def _on_reconnect(self) -> None:
        self._down.clear()
        self._check_stream = True  # a restarted broker may have lost it
        self._wake.set()

    async def _publisher(self) -> None:
        # A round that keeps failing (a bug, fd exhaustion) is retried after a jittered backoff up to
        # PUBLISH_RETRY_MAX_S, logged once when it starts failing (with the traceback), at DEBUG while
        # it goes on and once when a round succeeds again: it logged a traceback every 0.5 s, forever.
        failures = 0
        while True:
            try:
                await self._publish_round()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not end the relay silently
                failures += 1
                delay = retry_delay(failures, 0.5, PUBLISH_RETRY_MAX_S)
                if failures == 1:
                    log.exception("KV relay %s: publisher failed; retrying with backoff (up to %.0f s)",
                                  self.worker_id, PUBLISH_RETRY_MAX_S)
                else:
                    log.debug("KV relay %s: publisher failed again (%d in a row); retrying in %.2f s",
                              self.worker_id, failures, delay, exc_info=True)
                await asyncio.sleep(delay)
                continue
            if failures:
                log.info("KV relay %s: publisher recovered after %d failed round(s)", self.worker_id, failures)
                failures = 0

    async def _publish_round(self) -> None:
        if not self.nats.connected:
            now = time.monotonic()
            if self._down_since is None:
                self._down_since = now
            elif now - self._down_since > self.max_outage_s and (self._queue or not all(
                    r.dirty for r in self.ranks.values())):
                # Down too long: drop the backlog, reset the views once NATS is back.
                log.warning("KV relay %s: NATS down for %.0fs: dropping %d queued batch(es)", self.worker_id,
                            now - self._down_since, len(self._queue))
                for r in self.ranks.values():
                    self._mark_dirty(r)
            await self._sleep_or_wake(0.1)
            return
        self._down_since = None
        if self._check_stream:
            await self._ensure_stream()
        if any(r.dirty for r in self.ranks.values()):
            await self._recover()
        if not self._queue:
            if not any(r.dirty for r in self.ranks.values()):
                self._idle.set()
            await self._sleep_or_wake(1.0)
            return
        n = min(self.window, len(self._queue))
        batch = [self._queue.popleft() for _ in range(n)]
        self._queued_bytes -= sum(len(o.payload) for o in batch)
        js = self.nats.js
        acks: list[tuple[_Out, asyncio.Future | None]] = []
        for out in batch:  # sequential awaits: the broker gets them in order
            try:
                acks.append((out, await js.publish_async(out.rank.subject, out.payload, headers=dict(out.headers))))
            except Exception as exc:
                log.warning("KV relay %s: publish to %s failed: %s", self.worker_id, out.rank.subject, exc)
                acks.append((out, None))
        futs = [f for _, f in acks if f is not None]
        if futs:
            # Every ack, or the connection lost (those acks will not come), or the deadline.
            all_acks = asyncio.gather(*futs, return_exceptions=True)
            down = asyncio.ensure_future(self._down.wait())
            try:
                await asyncio.wait({all_acks, down}, timeout=self.ack_timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                down.cancel()
        for out, fut in acks:
            ok = fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None
            if fut is not None and not fut.done():
                fut.cancel()  # an ack that did not come: releases publish_async's slot
            if ok:
                out.rank.published += 1
                out.rank.markers += out.marker
                continue
            out.rank.failures += 1
            if fut is not None and fut.done() and not fut.cancelled() and isinstance(
                    fut.exception(), nats.js.errors.NoStreamResponseError):
                self._check_stream = True
            self._mark_dirty(out.rank)

    async def _ensure_stream(self) -> None:
        try:
            info = await ensure_stream(self.nats.js)
        except Exception as exc:
            log.warning("KV relay %s: cannot create JetStream stream %s: %s", self.worker_id, STREAM, exc)
            await self._sleep_or_wake(0.5)
            return
        self._check_stream = False
        if self._stream_created is not None and info.created != self._stream_created:
            log.warning("KV relay %s: stream %s was re-created (broker lost its store): resending", self.worker_id,
                        STREAM)
            for r in self.ranks.values():
                self._mark_dirty(r)
        self._stream_created = info.created

    async def _recover(self) -> None:
        """Dirty ranks: reset marker, then (with a replay socket) re-read the engine's buffer."""
        now = time.monotonic()
        for r in self.ranks.values():
            if not r.dirty or now - r.last_resync < self.resync_interval_s:
                continue  # resyncs are spaced: a resync that overflows again must not spin
            r.gen += 1
            try:
                await self.nats.js.publish(r.subject, b"", timeout=self.ack_timeout,
                                           headers={HDR_EPOCH: self._epoch(r), HDR_RESET: "nats"})
            except Exception as exc:
                r.failures += 1
                log.info("KV relay %s: reset marker for %s not published yet: %s", self.worker_id, r.subject, exc)
                if isinstance(exc, nats.js.errors.NoStreamResponseError):
                    self._check_stream = True
                continue
            r.published += 1
            r.markers += 1
            r.dirty = False
            r.last_resync = now
            if r.replay_endpoint and not self._stopped:
                r.resyncs += 1
                self.zmq.add(r.key, r.endpoint, r.replay_endpoint)  # fresh state: replays from seq 0
            log.info("KV relay %s: %s reset%s", self.worker_id, r.subject,
                     " and resent from the engine's buffer" if r.replay_endpoint else "")
        if any(r.dirty for r in self.ranks.values()):
            await self._sleep_or_wake(0.2)

    async def _sleep_or_wake(self, timeout: float) -> None:
        self._wake.clear()
        try:
            await wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass


# ====================================================================================== server side

