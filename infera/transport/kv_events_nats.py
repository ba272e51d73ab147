"""KV events over NATS JetStream: the shared wire and the server-side subscriber (the worker-side
relay is ``infera.transport.kv_relay_nats``).

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

Resets carry a reason, as on ZMQ (``RESET_REASONS``): a relay's reset marker sent at its start, a
new epoch whose marker never came, or a seq going back is ``restart``; any other marker (the
relay lost continuity with its engine) or a seq gap is ``gap``; a first message past seq 0
(history trimmed by the stream's limits) is ``history``; a re-created stream is ``reconnect``.
``on_caught_up(key)``, when set, is called when a key's history has been delivered (``caught_up``
turns true). Per-key history fetches run at most ``history_concurrency`` at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import nats.errors
import nats.js.errors
from nats.js import api

from infera.runtime import wait_for
from infera.transport.kv_event_callbacks import (
    NO_SEQ,
    RESET_GAP,
    RESET_HISTORY,
    RESET_RECONNECT,
    RESET_RESTART,
    KvCallbacks,
    OnCaughtUp,
)
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
MARKER_RELAY_START = "relay-start"  # HDR_RESET of the marker a relay sends when it starts (a new engine)

# Per-key history fetches running at once: each is an ephemeral pull consumer on the broker. A
# server that adds a fleet's keys at once (after their history went by) would otherwise create one
# per worker together and, at 1,000 workers, hit nats-server's consumer limit and retry
# (bench/fleet_scale.py --mode nats).
HISTORY_CONCURRENCY = 32

_STREAM_IN_USE = 10058  # JetStream err_code: stream name already in use with a different configuration

OnBatch = Callable[[str, int, bytes], None]
OnReset = Callable[[str], None]


def kv_event_subject(worker_id: str, rank: int | None) -> str:
    return f"{SUBJECT_PREFIX}.{subject_token(worker_id)}.{rank or 0}"


def stream_config() -> api.StreamConfig:
    return api.StreamConfig(
        name=STREAM,
        subjects=list(STREAM_SUBJECTS),
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE,
        discard=api.DiscardPolicy.OLD,
        max_bytes=STREAM_MAX_BYTES,
        max_msgs=STREAM_MAX_MSGS,
    )


async def ensure_stream(js: Any) -> api.StreamInfo:
    """Create the stream unless it exists; one made elsewhere with other limits is used as it is."""
    try:
        return cast(api.StreamInfo, await js.add_stream(stream_config()))
    except nats.js.errors.APIError as exc:
        if exc.err_code != _STREAM_IN_USE:
            raise
        log.info("JetStream stream %s exists with other settings; using it as it is", STREAM)
        return cast(api.StreamInfo, await js.stream_info(STREAM))


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
    buffer: list[tuple[int, dict[str, str] | None, bytes]] = field(default_factory=list)
    clears: int = 0  # buffer overflows
    task: asyncio.Task[None] | None = None
    batches: int = 0
    markers: int = 0
    gaps: int = 0
    resets: int = 0
    reset_reasons: dict[str, int] = field(default_factory=dict)
    reset_reason: str | None = None
    restarts: int = 0
    replays: int = 0
    replay_failures: int = 0
    callback_errors: int = 0
    last_batch_at: float | None = None


class NatsKvEventSubscriber(KvCallbacks):
    """Server side: JetStream → ``on_batch(key, seq, payload)`` / ``on_reset(key)``; the interface of
    ``ZmqKvEventSubscriber``. ``add``'s endpoint is the key's subject (``kv_event_subject``)."""

    def __init__(
        self,
        nats: NatsConnection,
        on_batch: OnBatch,
        on_reset: OnReset,
        *,
        heartbeat_s: float = 1.0,
        api_timeout: float = 5.0,
        on_caught_up: OnCaughtUp | None = None,
        history_concurrency: int = HISTORY_CONCURRENCY,
    ) -> None:
        if history_concurrency < 1:
            raise ValueError("history_concurrency must be >= 1")
        self.nats = nats
        self._history_slots = asyncio.Semaphore(history_concurrency)
        self.on_batch = on_batch
        self.on_reset = on_reset
        self.on_caught_up = on_caught_up
        self.heartbeat_s = heartbeat_s  # the ordered consumer re-creates itself after 2 missed
        self.api_timeout = api_timeout
        self._keys: dict[str, _Key] = {}
        self._by_subject: dict[str, _Key] = {}
        # subject -> last stream seq handed by while no key was added for it
        self._passed: OrderedDict[str, int] = OrderedDict()
        self._passed_overflow = False
        self._sub: Any = None
        self._task: asyncio.Task[None] | None = None
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
            self._notify_caught_up(st)

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

    def stats(self, key: str) -> dict[str, Any]:
        st = self._keys[key]
        return {
            "key": st.key,
            "subject": st.subject,
            "transport": "nats",
            "connected": self._sub is not None and self.nats.connected,
            "last_seq": st.last_seq,
            "epoch": st.epoch,
            "stream_seq": st.floor,
            "batches": st.batches,
            "markers": st.markers,
            "gaps": st.gaps,
            "replays": st.replays,
            "replay_failures": st.replay_failures,
            "resets": st.resets,
            "reset_reasons": dict(st.reset_reasons),
            "restarts": st.restarts,
            "callback_errors": st.callback_errors,
            "last_batch_at": st.last_batch_at,
            "caught_up": self._caught_up(st),
        }

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
        recreated = self._stream_created is not None and (
            info.created != self._stream_created or info.state.last_seq < self._last_sseq
        )
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
                self._reset(st, RESET_RECONNECT)
            self._passed.clear()
            self._passed_overflow = False
            self._last_sseq = 0
        self._stream_created = info.created
        self._target = info.state.last_seq
        self._global_caught_up = False
        if info.state.messages == 0:
            self._mark_global_caught_up()
        self._sub = await js.subscribe(
            STREAM_SUBJECTS[0],
            stream=STREAM,
            cb=self._on_msg,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.ALL,
            idle_heartbeat=self.heartbeat_s,
            pending_msgs_limit=STREAM_MAX_MSGS + 100_000,
            pending_bytes_limit=STREAM_MAX_BYTES + 64 * 1024 * 1024,
        )
        log.info("KV events over NATS: following %s from its first message (%d stored)", STREAM, info.state.messages)

    async def _unsubscribe(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:  # also when disconnected: it stops the consumer's heartbeat watch
            try:
                await wait_for(sub.unsubscribe(), self.api_timeout)
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
        info = await wait_for(sub.consumer_info(), self.api_timeout)
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
        for st in list(self._keys.values()):
            if st.live and st.wait_global:
                st.caught_up = True
                st.wait_global = False
                self._notify_caught_up(st)

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
                async with self._history_slots:
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
        self._notify_caught_up(st)

    async def _fetch_once(self, st: _Key) -> None:
        if not await self.nats.wait_connected(self.api_timeout):
            raise ConnectionError("NATS not connected")
        st.replays += 1
        js = self.nats.js
        config = api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE, mem_storage=True, inactive_threshold=30.0, max_deliver=1
        )
        if st.floor:  # a retry: go on from what was delivered
            config.deliver_policy = api.DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = st.floor + 1
        else:
            config.deliver_policy = api.DeliverPolicy.ALL
        psub = await wait_for(js.pull_subscribe(st.subject, stream=STREAM, config=config), self.api_timeout)
        try:
            info = await wait_for(psub.consumer_info(), self.api_timeout)
            done = info.num_pending == 0
            while not done:
                clears = st.clears
                try:
                    msgs = await psub.fetch(_FETCH_BATCH, timeout=1.0)
                except (asyncio.TimeoutError, nats.errors.TimeoutError):
                    info = await wait_for(psub.consumer_info(), self.api_timeout)
                    done = info.num_pending == 0 and st.clears == clears
                    continue
                for m in msgs:
                    self._handle(st, m.metadata.sequence.stream, m.headers, m.data)
                # Done at the subject's end -- unless live messages were dropped from the buffer
                # meanwhile: those lie before the end of a read that starts after the drop.
                done = msgs[-1].metadata.num_pending == 0 and st.clears == clears
        finally:
            try:
                await wait_for(psub.unsubscribe(), self.api_timeout)
                if config.name:  # pull_subscribe named the ephemeral consumer in ``config``
                    await wait_for(js.delete_consumer(STREAM, config.name), self.api_timeout)
            except Exception as exc:  # it expires on its own (inactive_threshold)
                log.debug("KV events %s: history consumer cleanup: %s", st.key, exc)

    # -- sequence rules ---------------------------------------------------------------------------------
    def _handle(self, st: _Key, sseq: int, headers: dict[str, str] | None, data: bytes) -> None:
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
            restart = headers.get(HDR_RESET) == MARKER_RELAY_START
            st.restarts += restart
            self._reset(st, RESET_RESTART if restart else RESET_GAP)
            return
        if not first and epoch != st.epoch:
            # A new relay run or generation whose reset marker never reached us.
            st.restarts += 1
            st.last_seq = None
            self._reset(st, RESET_RESTART)
        st.epoch = epoch
        try:
            seq = int(headers.get(HDR_SEQ, NO_SEQ))
        except ValueError:
            seq = NO_SEQ
        if seq == NO_SEQ:
            self._emit(st, NO_SEQ, data)
            return
        if st.last_seq is None:
            if first and seq != 0:
                self._reset(st, RESET_HISTORY)  # the history before this batch is gone (stream limits)
        elif seq > st.last_seq + 1:
            st.gaps += 1
            log.info("KV events %s: seq gap %d..%d over NATS: resetting", st.key, st.last_seq + 1, seq - 1)
            self._reset(st, RESET_GAP)
        elif seq <= st.last_seq:
            st.restarts += 1
            log.info("KV events %s: seq went back from %d to %d: resetting", st.key, st.last_seq, seq)
            self._reset(st, RESET_RESTART)
        st.last_seq = seq
        self._emit(st, seq, data)


def _subject_for_key(key: str) -> str:
    worker_id, sep, rank = key.rpartition("#dp")
    if sep and rank.isdigit():
        return kv_event_subject(worker_id, int(rank))
    return kv_event_subject(key, None)
