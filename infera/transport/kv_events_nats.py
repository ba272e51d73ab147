"""KV events over NATS JetStream: a relay on the worker, a subscriber on the server.

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

Stream ``INFERA_KV_EVENTS`` (subjects ``infera.kv.events.>``, limits retention, file storage,
discard old, 256 MiB, 1,000,000 messages) is created idempotently by both sides. A relay that
stops purges its worker's subjects: the engine's cache dies with it, and the stream must not keep
dead workers' history.

Server side (``NatsKvEventSubscriber``): the same interface as ``ZmqKvEventSubscriber``. ONE ordered
push consumer on ``infera.kv.events.>`` with deliver policy ALL: a server started late (or
restarted) replays the history and rebuilds its views; the ordered consumer re-creates itself
after reconnects and broker restarts. Messages of keys not added are skipped, but remembered per
subject: a key added after its history went by fetches that subject's history again through a
short-lived filtered pull consumer, while its live messages are buffered (bounded), then hands
over to the shared consumer (stream sequences make the hand-over exact).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import nats.errors
import nats.js.errors
from nats.js import api

from infera.discovery.record import WorkerRecord
from infera.transport.kv_events_zmq import NO_SEQ, ZmqKvEventSubscriber, endpoint_for_rank
from infera.transport.nats_conn import NatsConnection, subject_token

log = logging.getLogger("infera.transport.kv_events_nats")

STREAM = "INFERA_KV_EVENTS"
SUBJECT_PREFIX = "infera.kv.events"
STREAM_SUBJECTS = [f"{SUBJECT_PREFIX}.>"]
STREAM_MAX_BYTES = 256 * 1024 * 1024
STREAM_MAX_MSGS = 1_000_000

HDR_SEQ = "Infera-Kv-Seq"
HDR_EPOCH = "Infera-Kv-Epoch"
HDR_RESET = "Infera-Kv-Reset"

_STREAM_IN_USE = 10058  # JetStream err_code: stream name already in use with a different configuration

OnBatch = Callable[[str, int, bytes], None]
OnReset = Callable[[str], None]


def kv_event_subject(worker_id: str, rank: int | None) -> str:
    return f"{SUBJECT_PREFIX}.{subject_token(worker_id)}.{rank or 0}"


def stream_config() -> api.StreamConfig:
    return api.StreamConfig(name=STREAM, subjects=list(STREAM_SUBJECTS), retention=api.RetentionPolicy.LIMITS,
                            storage=api.StorageType.FILE, discard=api.DiscardPolicy.OLD,
                            max_bytes=STREAM_MAX_BYTES, max_msgs=STREAM_MAX_MSGS)


async def ensure_stream(js: Any) -> api.StreamInfo:
    """Create the stream unless it exists; one made elsewhere with other limits is used as it is."""
    try:
        return await js.add_stream(stream_config())
    except nats.js.errors.APIError as exc:
        if exc.err_code != _STREAM_IN_USE:
            raise
        log.info("JetStream stream %s exists with other settings; using it as it is", STREAM)
        return await js.stream_info(STREAM)


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
            self._enqueue_marker(r, "relay-start")  # a new engine: whatever came before is void
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
                    await asyncio.wait_for(self._idle.wait(), self.flush_timeout)
            except asyncio.TimeoutError:
                log.warning("KV relay %s: %d batch(es) not flushed within %.0fs", self.worker_id, len(self._queue),
                            self.flush_timeout)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        # The engine's cache dies with it: its history must not stay in the stream.
        if self.nats.connected:
            try:
                await asyncio.wait_for(self.nats.js.purge_stream(STREAM, subject=f"{SUBJECT_PREFIX}.{self.token}.>"),
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
        while True:
            try:
                await self._publish_round()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not end the relay silently
                log.exception("KV relay %s: publisher failed; retrying", self.worker_id)
                await asyncio.sleep(0.5)

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
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass


# ====================================================================================== server side

_FETCH_BATCH = 256
_BUFFER_MAX = 10_000  # live messages held per key while its history is fetched
_PASSED_MAX = 65_536  # subjects remembered as "history went by"


@dataclass(eq=False)
class _Key:
    key: str
    subject: str
    live: bool = True  # False while its history is fetched (live messages are buffered meanwhile)
    wait_global: bool = True  # caught up when the shared consumer is
    caught_up: bool = False
    floor: int = 0  # stream seq of the last message handled: anything at or below it is a duplicate
    seen: bool = False  # any message since add (first contact rules)
    last_seq: int | None = None
    epoch: str | None = None
    buffer: list[tuple[int, dict | None, bytes]] = field(default_factory=list)
    clears: int = 0  # buffer overflows
    task: asyncio.Task | None = None
    batches: int = 0
    markers: int = 0
    gaps: int = 0
    resets: int = 0
    restarts: int = 0
    replays: int = 0
    replay_failures: int = 0
    callback_errors: int = 0
    last_batch_at: float | None = None


class NatsKvEventSubscriber:
    """Server side: JetStream → ``on_batch(key, seq, payload)`` / ``on_reset(key)``; the interface of
    ``ZmqKvEventSubscriber``. ``add``'s endpoint is the key's subject (``kv_event_subject``)."""

    def __init__(self, nats: NatsConnection, on_batch: OnBatch, on_reset: OnReset, *, heartbeat_s: float = 1.0,
                 api_timeout: float = 5.0) -> None:
        self.nats = nats
        self.on_batch = on_batch
        self.on_reset = on_reset
        self.heartbeat_s = heartbeat_s  # the ordered consumer re-creates itself after 2 missed
        self.api_timeout = api_timeout
        self._keys: dict[str, _Key] = {}
        self._by_subject: dict[str, _Key] = {}
        # subject -> last stream seq handed by while no key was added for it
        self._passed: OrderedDict[str, int] = OrderedDict()
        self._passed_overflow = False
        self._sub: Any = None
        self._task: asyncio.Task | None = None
        self._started = False
        self._global_caught_up = False
        self._target = 0  # stream's last seq when subscribed: caught up once delivered
        self._last_sseq = 0
        self._stream_created: Any = None
        self._check_stream = False
        self.messages = 0
        self.resubscribes = 0

    # -- public -----------------------------------------------------------------------------------
    def add(self, key: str, endpoint: str | None = None, replay_endpoint: str | None = None) -> None:
        """Follow ``key``'s subject (``endpoint``; derived from a route key when not given). Adding
        an existing key replaces it: fresh state, its view rebuilt from the stream's history."""
        subject = endpoint if endpoint and endpoint.startswith(SUBJECT_PREFIX + ".") else _subject_for_key(key)
        if key in self._keys:
            self.remove(key)
        st = _Key(key, subject)
        self._keys[key] = st
        self._by_subject[subject] = st
        if self._started and (subject in self._passed or self._passed_overflow):
            # Its history went by before it was added: fetch that subject's history again.
            self._passed.pop(subject, None)
            st.live = False
            st.wait_global = False
            st.task = asyncio.get_running_loop().create_task(self._fetch_history(st), name=f"kv-nats-hist:{key}")
        elif self._global_caught_up:
            st.wait_global = False
            st.caught_up = True  # nothing of it in the stream yet: live from here

    def remove(self, key: str) -> None:
        st = self._keys.pop(key, None)
        if st is None:
            return
        if self._by_subject.get(st.subject) is st:
            del self._by_subject[st.subject]
        if st.task is not None:
            st.task.cancel()
        if st.floor or not st.live:  # its history was consumed here: a re-add must fetch it again
            self._remember_passed(st.subject, st.floor)

    def keys(self) -> list[str]:
        return list(self._keys)

    async def start(self) -> None:
        """Returns at once: subscribing waits for the broker in the background."""
        if self._started:
            return
        self._started = True
        self.nats.on_reconnect(self._on_reconnect)
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        self._started = False
        tasks = [t for t in [self._task, *(st.task for st in self._keys.values())] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None
        for st in self._keys.values():
            st.task = None
        await self._unsubscribe()

    def replaying(self, key: str) -> bool:
        """Whether ``key``'s batches delivered now are history (before it caught up), not live."""
        st = self._keys.get(key)
        return st is not None and not self._caught_up(st)

    def stats(self, key: str) -> dict:
        st = self._keys[key]
        return {"key": st.key, "subject": st.subject, "transport": "nats",
                "connected": self._sub is not None and self.nats.connected,
                "last_seq": st.last_seq, "epoch": st.epoch, "stream_seq": st.floor,
                "batches": st.batches, "markers": st.markers, "gaps": st.gaps, "replays": st.replays,
                "replay_failures": st.replay_failures, "resets": st.resets, "restarts": st.restarts,
                "callback_errors": st.callback_errors, "last_batch_at": st.last_batch_at,
                "caught_up": self._caught_up(st)}

    # -- the shared consumer ------------------------------------------------------------------------
    async def _run(self) -> None:
        backoff = 0.2
        while self._started:
            if not await self.nats.wait_connected(1.0):
                continue
            try:
                if self._sub is None or self._check_stream:
                    await self._subscribe()
                    backoff = 0.2
                if not self._global_caught_up:
                    await self._probe_caught_up()
                await asyncio.sleep(0.25)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("KV events over NATS: subscribing to %s failed: %s; retrying", STREAM, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _subscribe(self) -> None:
        js = self.nats.js
        info = await ensure_stream(js)
        recreated = self._stream_created is not None and (info.created != self._stream_created
                                                         or info.state.last_seq < self._last_sseq)
        self._check_stream = False
        if self._sub is not None and not recreated:
            return  # reconnected to the same stream: the ordered consumer resumes by itself
        if recreated:
            # The broker lost its store: stream seqs restarted. Views start over from the new
            # stream, whose history begins with the relays' reset markers.
            log.warning("KV events over NATS: stream %s was re-created; rebuilding every view", STREAM)
            await self._unsubscribe()
            self.resubscribes += 1
            for st in self._keys.values():
                if st.task is not None:
                    st.task.cancel()
                    st.task = None
                st.live, st.wait_global, st.caught_up, st.buffer = True, True, False, []
                st.floor, st.seen, st.last_seq, st.epoch = 0, False, None, None
                self._reset(st)
            self._passed.clear()
            self._passed_overflow = False
            self._last_sseq = 0
        self._stream_created = info.created
        self._target = info.state.last_seq
        self._global_caught_up = False
        if info.state.messages == 0:
            self._mark_global_caught_up()
        self._sub = await js.subscribe(STREAM_SUBJECTS[0], stream=STREAM, cb=self._on_msg, ordered_consumer=True,
                                       deliver_policy=api.DeliverPolicy.ALL, idle_heartbeat=self.heartbeat_s,
                                       pending_msgs_limit=STREAM_MAX_MSGS + 100_000,
                                       pending_bytes_limit=STREAM_MAX_BYTES + 64 * 1024 * 1024)
        log.info("KV events over NATS: following %s from its first message (%d stored)", STREAM,
                 info.state.messages)

    async def _unsubscribe(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:  # also when disconnected: it stops the consumer's heartbeat watch
            try:
                await asyncio.wait_for(sub.unsubscribe(), self.api_timeout)
            except Exception as exc:
                log.debug("KV events over NATS: unsubscribe: %s", exc)

    def _on_reconnect(self) -> None:
        self._check_stream = True  # see _subscribe: same stream, or one re-created by a wiped broker

    async def _probe_caught_up(self) -> None:
        """For a stream whose last messages were deleted (purged workers) the marker message of
        ``num_pending == 0`` never comes: nothing pending and nothing arriving also means caught up."""
        sub = self._sub
        if sub is None:
            return
        before = self._last_sseq
        info = await asyncio.wait_for(sub.consumer_info(), self.api_timeout)
        if info.num_pending == 0 and sub.pending_msgs == 0:
            await asyncio.sleep(0.5)
            if self._last_sseq == before and sub.pending_msgs == 0 and not self._global_caught_up:
                self._mark_global_caught_up()

    async def _on_msg(self, msg: Any) -> None:
        try:
            meta = msg.metadata
            sseq, pending = meta.sequence.stream, meta.num_pending
        except Exception:
            log.warning("KV events over NATS: ignoring a message without JetStream metadata on %s", msg.subject)
            return
        self.messages += 1
        self._last_sseq = sseq
        st = self._by_subject.get(msg.subject)
        if st is None:
            self._remember_passed(msg.subject, sseq)
        elif not st.live:
            if len(st.buffer) >= _BUFFER_MAX:
                st.buffer.clear()  # the history fetch reads on past this point instead
                st.clears += 1
            st.buffer.append((sseq, msg.headers, msg.data))
        else:
            self._handle(st, sseq, msg.headers, msg.data)
        if not self._global_caught_up and (pending == 0 or sseq >= self._target):
            self._mark_global_caught_up()

    def _mark_global_caught_up(self) -> None:
        self._global_caught_up = True
        for st in self._keys.values():
            if st.live and st.wait_global:
                st.caught_up = True
                st.wait_global = False

    def _remember_passed(self, subject: str, sseq: int) -> None:
        self._passed[subject] = max(sseq, self._passed.pop(subject, 0))
        if len(self._passed) > _PASSED_MAX:
            self._passed.popitem(last=False)
            self._passed_overflow = True  # from now on every add fetches its history

    def _caught_up(self, st: _Key) -> bool:
        return st.caught_up or (st.live and st.wait_global and self._global_caught_up)

    # -- one key's history, fetched again ------------------------------------------------------------
    async def _fetch_history(self, st: _Key) -> None:
        backoff = 0.2
        while True:
            try:
                await self._fetch_once(st)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                st.replay_failures += 1
                log.warning("KV events %s: history fetch from %s failed: %s; retrying", st.key, STREAM, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
        # Hand over to the shared consumer: what it buffered meanwhile, then live (no await between).
        buffered, st.buffer = st.buffer, []
        for sseq, headers, data in buffered:
            self._handle(st, sseq, headers, data)
        st.live = True
        st.caught_up = True
        st.task = None

    async def _fetch_once(self, st: _Key) -> None:
        if not await self.nats.wait_connected(self.api_timeout):
            raise ConnectionError("NATS not connected")
        st.replays += 1
        js = self.nats.js
        config = api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, mem_storage=True, inactive_threshold=30.0,
                                    max_deliver=1)
        if st.floor:  # a retry: go on from what was delivered
            config.deliver_policy = api.DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = st.floor + 1
        else:
            config.deliver_policy = api.DeliverPolicy.ALL
        psub = await asyncio.wait_for(js.pull_subscribe(st.subject, stream=STREAM, config=config), self.api_timeout)
        try:
            info = await asyncio.wait_for(psub.consumer_info(), self.api_timeout)
            done = info.num_pending == 0
            while not done:
                clears = st.clears
                try:
                    msgs = await psub.fetch(_FETCH_BATCH, timeout=1.0)
                except (asyncio.TimeoutError, nats.errors.TimeoutError):
                    info = await asyncio.wait_for(psub.consumer_info(), self.api_timeout)
                    done = info.num_pending == 0 and st.clears == clears
                    continue
                for m in msgs:
                    self._handle(st, m.metadata.sequence.stream, m.headers, m.data)
                # Done at the subject's end -- unless live messages were dropped from the buffer
                # meanwhile: those lie before the end of a read that starts after the drop.
                done = msgs[-1].metadata.num_pending == 0 and st.clears == clears
        finally:
            try:
                await asyncio.wait_for(psub.unsubscribe(), self.api_timeout)
                # pull_subscribe named the ephemeral consumer in ``config``
                await asyncio.wait_for(js.delete_consumer(STREAM, config.name), self.api_timeout)
            except Exception as exc:  # it expires on its own (inactive_threshold)
                log.debug("KV events %s: history consumer cleanup: %s", st.key, exc)

    # -- sequence rules ---------------------------------------------------------------------------------
    def _handle(self, st: _Key, sseq: int, headers: dict | None, data: bytes) -> None:
        """One message of ``st``'s subject, in stream order."""
        if sseq <= st.floor:
            return  # delivered already (history fetch and shared consumer overlap)
        st.floor = sseq
        headers = headers or {}
        epoch = headers.get(HDR_EPOCH)
        first = not st.seen
        st.seen = True
        if HDR_RESET in headers:
            st.markers += 1
            st.last_seq, st.epoch = None, epoch
            self._reset(st)
            return
        if not first and epoch != st.epoch:
            # A new relay run or generation whose reset marker never reached us.
            st.restarts += 1
            st.last_seq = None
            self._reset(st)
        st.epoch = epoch
        try:
            seq = int(headers.get(HDR_SEQ, NO_SEQ))
        except ValueError:
            seq = NO_SEQ
        if seq == NO_SEQ:
            self._deliver(st, NO_SEQ, data)
            return
        if st.last_seq is None:
            if first and seq != 0:
                self._reset(st)  # the history before this batch is gone (stream limits)
        elif seq > st.last_seq + 1:
            st.gaps += 1
            log.info("KV events %s: seq gap %d..%d over NATS: resetting", st.key, st.last_seq + 1, seq - 1)
            self._reset(st)
        elif seq <= st.last_seq:
            st.restarts += 1
            log.info("KV events %s: seq went back from %d to %d: resetting", st.key, st.last_seq, seq)
            self._reset(st)
        st.last_seq = seq
        self._deliver(st, seq, data)

    def _deliver(self, st: _Key, seq: int, payload: bytes) -> None:
        st.batches += 1
        st.last_batch_at = time.monotonic()
        try:
            self.on_batch(st.key, seq, payload)
        except Exception:
            st.callback_errors += 1
            log.exception("KV events %s: on_batch failed for seq %d", st.key, seq)

    def _reset(self, st: _Key) -> None:
        st.resets += 1
        try:
            self.on_reset(st.key)
        except Exception:
            st.callback_errors += 1
            log.exception("KV events %s: on_reset failed", st.key)


def _subject_for_key(key: str) -> str:
    worker_id, sep, rank = key.rpartition("#dp")
    if sep and rank.isdigit():
        return kv_event_subject(worker_id, int(rank))
    return kv_event_subject(key, None)
