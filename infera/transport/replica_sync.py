"""Replica sync: kv-aware server replicas share what only each of them knows.

Every replica reads every engine's KV events, so all agree on what is cached. Each one alone
knows its requests in flight and the requests it just served whose KV events have not arrived yet
(:class:`infera.kv.replica_share.ReplicaShare`). :class:`ReplicaSync` carries those between
replicas; it holds the whole protocol, and a transport subclass only moves bytes on subjects, one
file each (``--replica-sync``):

* ``nats`` (:mod:`infera.transport.replica_sync_nats`): server replicas anywhere, over the broker;
* ``local`` (:mod:`infera.transport.replica_sync_local`): the processes of one
  ``python -m infera.server --workers N``, over a ZMQ proxy in their supervisor (no broker).

Subject: ``infera.replicas.<subject_token(model)>``, one per model (a replica subscribes
``infera.replicas.*``). Payload: one msgpack array (msgspec), :class:`ReplicaMsg`::

    [v, replica, seq, started, finished, live, want, bye]
    started  = [[rid, route_key, blocks, charge], ...]  requests that started
        blocks: the request's first ≤ SYNC_BLOCKS_PER_REQUEST block hashes, u64 little-endian,
        packed as bytes; charge: the missed blocks its pick charged there
    finished = [[rid, finished_at], ...]  wall time the served request finished; 0.0: not served
    live     = [rid, ...] | nil           heartbeat: everything the sender has in flight for the
                                          model (the receiver drops what is not listed)
    want     = [replica, ...]             replicas whose full state the sender asks for
    bye      = true                       the sender stops: drop what it had

``rid`` numbers a sender's requests; ``seq`` its messages on the subject (1, 2, …). A receiver
that sees a gap in ``seq`` (a message lost: slow consumer, reconnect), a replica first heard with
``seq`` > 1 (a newcomer, or one heard again after a timeout), or a heartbeat naming requests it
does not know, asks for that replica's full state (``want``); the replica answers with all its
in-flight requests (``started``; starts are idempotent) and a ``live`` list. A heartbeat goes out
every ``heartbeat_s`` (1 s) for each model the replica recently had traffic for, so a lost finish
is cleared within a second, and a replica not heard for ``PEER_TIMEOUT_S`` (3 s) is dropped.

Deltas are drained from the policy's outbox ``flush_interval_s`` (1 ms) after the first one, so a
burst travels as one message per model; a message stays under ``max_message_bytes``. While the
transport is down nothing is published (deltas are dropped and counted); after a reconnect the
full state goes out again, and the others' gaps make them ask for theirs. Own messages are
ignored (replica id).
"""
from __future__ import annotations

import abc
import asyncio
import logging
import sys
import time
import uuid
from array import array
from typing import Callable, Sequence

import msgspec

from infera.kv.replica_share import PEER_TIMEOUT_S, SYNC_BLOCKS_PER_REQUEST, ReplicaShare
from infera.runtime import cancel_and_wait
from infera.transport.backoff import retry_delay
from infera.transport.nats_conn import subject_token, token_to_worker_id

log = logging.getLogger(__name__)

SUBJECT_PREFIX = "infera.replicas."
VERSION = 1
MODELS_CAP = 256  # models a replica heartbeats / tracks sequences for
MODEL_IDLE_S = 10.0  # heartbeats for a model continue this long after its last request
SNAPSHOT_MIN_INTERVAL_S = 0.25  # full states of one model, at most this often


class Started(msgspec.Struct, array_like=True):
    rid: int
    key: str
    blocks: bytes
    charge: float = 0.0


class Finished(msgspec.Struct, array_like=True):
    rid: int
    finished_at: float


class ReplicaMsg(msgspec.Struct, array_like=True):
    v: int
    replica: str
    seq: int
    started: list[Started] = []
    finished: list[Finished] = []
    live: list[int] | None = None
    want: list[str] = []
    bye: bool = False


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(ReplicaMsg).decode


def pack_blocks(blocks: Sequence[int]) -> bytes:
    buf = array("Q", blocks[:SYNC_BLOCKS_PER_REQUEST])
    if sys.byteorder != "little":
        buf.byteswap()
    return buf.tobytes()


def unpack_blocks(data: bytes) -> array:
    """The block hashes as an ``array('Q')``, as the policy carries chains."""
    buf = array("Q")
    buf.frombytes(data[: len(data) - len(data) % 8])
    if sys.byteorder != "little":
        buf.byteswap()
    return buf


EMPTY_MODEL_TOKEN = "_"  # no base64 token is one character long
# Side channels: other replica-shared state (the tenant limits) on subjects under the same prefix, so
# they ride the same subscription and links; "~" never occurs in a model's base64url token.
SIDE_PREFIX = SUBJECT_PREFIX + "~"


def subject_for(model: str) -> str:
    return SUBJECT_PREFIX + (subject_token(model) if model else EMPTY_MODEL_TOKEN)


def model_of(subject: str) -> str:
    token = subject[len(SUBJECT_PREFIX):]
    if token == EMPTY_MODEL_TOKEN:
        return ""
    if not token:
        raise ValueError("no model token in the subject")
    return token_to_worker_id(token)


def bye_message(replica_id: str) -> tuple[str, bytes]:
    """(subject, payload) telling the others that ``replica_id`` is gone: they drop what it had.
    A replica sends it on its way out; a supervisor sends it for a child that died."""
    return subject_for(""), _encode(ReplicaMsg(VERSION, replica_id, 0, bye=True))


RETRY_MAX_S = 10.0  # cap of the retry backoffs below


class ReplicaSync(abc.ABC):
    """One server replica's end of the sync, transport-agnostic. ``attach`` (by the kv-aware
    policy), then ``start``; ``stop`` says goodbye.

    A transport implements :attr:`connected`, :meth:`_open` (subscribe to ``SUBJECT_PREFIX``,
    calling :meth:`receive` for every message; return once what is published reaches the others,
    raise to be retried), :meth:`_send` (raise when it could not) and :meth:`_close`."""

    transport = "?"

    def __init__(self, *, replica_id: str | None = None, flush_interval_s: float = 0.001,
                 heartbeat_s: float = 1.0, peer_timeout_s: float = PEER_TIMEOUT_S,
                 max_message_bytes: int = 256 * 1024, clock: Callable[[], float] = time.monotonic) -> None:
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self.flush_interval_s = flush_interval_s
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.max_message_bytes = max_message_bytes
        self.clock = clock
        self.share: ReplicaShare | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.subscribed = False  # our subscription is in place (tests wait on it)
        self._subjects: dict[str, str] = {}  # model → subject
        self._models_by_subject: dict[str, str] = {}  # subject → model (incoming)
        self._seq: dict[str, int] = {}  # model → last seq sent
        self._models: dict[str, float] = {}  # model → last time it had traffic here (heartbeats go on)
        self._seen: dict[tuple[str, str], int] = {}  # (replica, model) → last seq heard
        self._want: dict[str, set[str]] = {}  # model → replicas whose full state to ask for
        self._owe: set[str] = set()  # models whose full state was asked of us
        self._last_snapshot: dict[str, float] = {}
        self._resend_all = False  # our deltas may have been lost: send the full state of every model
        self._side: dict[str, Callable[[bytes], None]] = {}  # subject → receiver (add_side_channel)
        self._beat_due = False
        self._beat_timer: asyncio.TimerHandle | None = None
        # counters
        self.messages_sent = 0
        self.bytes_sent = 0
        self.messages_received = 0
        self.bytes_received = 0
        self.deltas_dropped = 0  # not published: transport down, or a publish failed
        self.decode_errors = 0
        self.gaps = 0
        self.snapshots_sent = 0

    # -- transport -----------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def connected(self) -> bool:
        """Whether published messages can reach the other replicas now."""

    @abc.abstractmethod
    async def _open(self) -> None:
        """Subscribe to ``SUBJECT_PREFIX`` (every message to :meth:`receive`); raise to be retried."""

    @abc.abstractmethod
    async def _send(self, subject: str, data: bytes) -> None:
        """Publish ``data`` on ``subject``; raise when it could not."""

    async def _close(self) -> None:
        """Flush what was published (the goodbyes), then unsubscribe; best effort."""

    def _watch(self) -> None:
        """Called once by :meth:`start` (e.g. to hear of reconnects)."""

    def _on_reconnect(self) -> None:
        self._resend_all = True  # what we published while the link was down is lost
        self._wake.set()

    # -- side channels -------------------------------------------------------------------------
    def add_side_channel(self, name: str, receive: Callable[[bytes], None]) -> str:
        """Messages on ``SIDE_PREFIX + name`` go to ``receive`` (own ones included: the receiver
        tells them apart); returns the subject to ``publish_side`` on."""
        subject = SIDE_PREFIX + name
        self._side[subject] = receive
        return subject

    async def publish_side(self, subject: str, data: bytes) -> bool:
        """Best effort (the side channels' messages supersede each other): False when not sent."""
        if not (self.connected and self.subscribed):
            return False
        try:
            await self._send(subject, data)
        except Exception as exc:  # noqa: BLE001 - down, or its buffer full: the next one follows
            log.debug("replica sync (%s): side publish failed: %s", self.transport, exc)
            return False
        self.messages_sent += 1
        self.bytes_sent += len(data)
        return True

    # -- wiring --------------------------------------------------------------------------------
    def attach(self, share: ReplicaShare) -> None:
        self.share = share
        share.wake = self._wake.set

    async def start(self) -> None:
        if self._task is None:
            self._watch()
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._beat_timer is not None:
            self._beat_timer.cancel()
            self._beat_timer = None
        await cancel_and_wait(self._task)
        self._task = None
        if self.connected:
            for model in list(self._models):  # the others drop our state now, not after a timeout
                await self._publish(model, ReplicaMsg(VERSION, self.replica_id, self._next_seq(model), bye=True))
        await self._close()
        log.info("replica sync %s (%s) stopped: %s", self.replica_id, self.transport, self.stats())

    def stats(self) -> dict[str, int]:
        share = self.share
        out = {"messages_sent": self.messages_sent, "bytes_sent": self.bytes_sent,
               "messages_received": self.messages_received, "bytes_received": self.bytes_received,
               "deltas_dropped": self.deltas_dropped, "decode_errors": self.decode_errors, "gaps": self.gaps,
               "snapshots_sent": self.snapshots_sent}
        if share is not None:
            out.update(peers=len(share.peers), remote_in_flight=sum(len(p.entries) for p in share.peers.values()),
                       remote_blocks=share.remote_blocks, remote_started=share.remote_started,
                       remote_finished=share.remote_finished, remote_expired=share.remote_expired,
                       remote_rejected=share.remote_rejected, peers_dropped=share.peers_dropped,
                       outbox_dropped=share.outbox_dropped, live=len(share.live), live_overflow=share.live_overflow)
        return out

    async def _run(self) -> None:
        # Both loops retry with an exponential backoff (jittered) and log once per state change:
        # a failure that repeats at once (fd exhaustion) must not flood the log.
        failures = 0
        while True:
            try:
                await self._open()
                self.subscribed = True
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the transport is not there (yet): retry
                failures += 1
                (log.warning if failures == 1 else log.debug)(
                    "replica sync (%s): cannot subscribe yet (%s); retrying with backoff", self.transport, exc)
                await asyncio.sleep(retry_delay(failures, 0.5, RETRY_MAX_S))
        if failures:
            log.info("replica sync (%s): subscribed after %d failed attempt(s)", self.transport, failures)
        self._beat()
        failures = 0
        while True:
            try:
                await self._wake.wait()  # a delta, a request of another replica, or the heartbeat
                await asyncio.sleep(self.flush_interval_s)  # a burst travels as one message
                self._wake.clear()
                beat, self._beat_due = self._beat_due, False
                await self.tick(self.clock(), heartbeat=beat)
                if failures:
                    log.info("replica sync ticks again after %d failure(s)", failures)
                    failures = 0
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not end the sync: log it, carry on
                failures += 1
                if failures == 1:
                    log.exception("replica sync tick failed; retrying with backoff")
                else:
                    log.debug("replica sync tick failed again (%d in a row)", failures, exc_info=True)
                await asyncio.sleep(retry_delay(failures, 0.1, RETRY_MAX_S))

    def _beat(self) -> None:
        self._beat_due = True
        self._wake.set()
        self._beat_timer = asyncio.get_running_loop().call_later(self.heartbeat_s, self._beat)

    # -- outgoing ------------------------------------------------------------------------------
    async def tick(self, now: float, heartbeat: bool = False) -> None:
        """Publish the outbox's deltas, the full states owed, the wants, and (``heartbeat``) the
        live lists; drop silent replicas. The background task calls it; tests call it directly."""
        share = self.share
        if share is None:
            return
        deltas = share.drain()
        if heartbeat:
            for replica in share.expire(now, self.peer_timeout_s):
                self._forget_replica(replica)
        if not self.connected:
            self.deltas_dropped += len(deltas)
            self._resend_all = True
            return
        if share.lossy:
            share.lossy = False
            self._resend_all = True
        started: dict[str, list[Started]] = {}
        finished: dict[str, list[Finished]] = {}
        for d in deltas:
            if len(d) == 5:
                rid, model, key, blocks, charge = d
                started.setdefault(model, []).append(Started(rid, key, pack_blocks(blocks), charge))
            else:
                rid, model, finished_at = d
                finished.setdefault(model, []).append(Finished(rid, finished_at))
        live: dict[str, list[tuple[int, str, Sequence[int], float]]] | None = None
        snapshot: set[str] = set()
        if heartbeat or self._resend_all or self._owe:
            live = {}
            for rid, (model, key, blocks, charge) in share.live.items():
                live.setdefault(model, []).append((rid, key, blocks, charge))
            for model in live:
                self._touch(model, now)
            if self._resend_all:  # every model with something in flight or recent traffic
                snapshot.update(live)
                snapshot.update(self._models)
                self._resend_all = False
            for model in list(self._owe):
                if now - self._last_snapshot.get(model, -1e9) >= SNAPSHOT_MIN_INTERVAL_S:
                    snapshot.add(model)
                    self._owe.discard(model)
        for model in (*started, *finished):
            self._touch(model, now)
        models = set(started) | set(finished) | set(self._want) | snapshot
        if heartbeat:
            for model, last in list(self._models.items()):
                if now - last > MODEL_IDLE_S and not (live and model in live):
                    # idle, nothing in flight (its last heartbeats said so): forget it; a later
                    # message on it starts again at seq 1
                    del self._models[model]
                    for table in (self._seq, self._last_snapshot, self._subjects):
                        table.pop(model, None)
                else:
                    models.add(model)
        for model in models:
            await self._send_model(model, started.get(model, []), finished.get(model, []),
                                   live.get(model, []) if live is not None else [],
                                   full=model in snapshot, beat=heartbeat or model in snapshot)

    async def _send_model(self, model: str, started: list[Started], finished: list[Finished],
                          live: list[tuple[int, str, Sequence[int], float]], *, full: bool, beat: bool) -> None:
        if full:  # every request in flight, the new ones included (starts are idempotent)
            self.snapshots_sent += 1
            self._last_snapshot[model] = self.clock()
            known = {s.rid for s in started}
            started = started + [Started(rid, key, pack_blocks(blocks), charge) for rid, key, blocks, charge in live
                                 if rid not in known]
        want = sorted(self._want.pop(model, ()))
        # Split the starts to stay under the size cap; the last part carries the rest.
        budget = self.max_message_bytes - 64
        part: list[Started] = []
        size = 0
        for s in started:
            n = 16 + len(s.key) + len(s.blocks)
            if part and size + n > budget:
                await self._publish(model, ReplicaMsg(VERSION, self.replica_id, self._next_seq(model), started=part))
                part, size = [], 0
            part.append(s)
            size += n
        msg = ReplicaMsg(VERSION, self.replica_id, self._next_seq(model), started=part, finished=finished,
                         live=[rid for rid, *_ in live] if beat else None, want=want)
        await self._publish(model, msg)

    async def _publish(self, model: str, msg: ReplicaMsg) -> None:
        data = _encode(msg)
        try:
            await self._send(self._subject(model), data)
        except Exception as exc:  # noqa: BLE001 - down, or its buffer full: the full state follows later
            self.deltas_dropped += len(msg.started) + len(msg.finished)
            self._resend_all = True
            log.debug("replica sync (%s): publish failed: %s", self.transport, exc)
            return
        self.messages_sent += 1
        self.bytes_sent += len(data)

    def _next_seq(self, model: str) -> int:
        seq = self._seq.get(model, 0) + 1
        self._seq[model] = seq
        return seq

    def _subject(self, model: str) -> str:
        subject = self._subjects.get(model)
        if subject is None:
            if len(self._subjects) >= MODELS_CAP:
                self._subjects.clear()
            subject = self._subjects[model] = subject_for(model)
        return subject

    def _touch(self, model: str, now: float) -> None:
        if model not in self._models and len(self._models) >= MODELS_CAP:
            oldest = min(self._models, key=self._models.__getitem__)
            del self._models[oldest]
        self._models[model] = now

    # -- incoming ------------------------------------------------------------------------------
    def receive(self, subject: str, data: bytes) -> None:
        """Apply one message (the transport's receive path; tests call it directly)."""
        side = self._side.get(subject)
        if side is not None:
            self.messages_received += 1
            self.bytes_received += len(data)
            side(data)
            return
        share = self.share
        if share is None:
            return
        try:
            m = _decode(data)
            # A NaN charge would poison the policy's recent-charge sums for good (no comparison
            # drops it), a NaN time claim nothing sensible: no sender writes one, the message is bad.
            if any(s.charge != s.charge for s in m.started) or any(f.finished_at != f.finished_at for f in m.finished):
                raise ValueError("NaN in a replica sync message")
            model = self._models_by_subject.get(subject)
            if model is None:  # a base64 decode per message is a quarter of applying one: cached
                model = model_of(subject)
                if len(self._models_by_subject) >= MODELS_CAP:
                    self._models_by_subject.clear()
                self._models_by_subject[subject] = model
        # RecursionError: msgspec's for a value nested past the recursion limit (in an extra
        # trailing item, which it skips), a malformed message like the others
        except (msgspec.DecodeError, ValueError, UnicodeDecodeError, RecursionError):
            self.decode_errors += 1
            return
        if m.replica == self.replica_id or m.v != VERSION:
            return
        self.messages_received += 1
        self.bytes_received += len(data)
        if m.bye:
            share.drop_peer(m.replica)
            self._forget_replica(m.replica)
            return
        peer = share.heard(m.replica, self.clock())
        if peer is None:
            return
        ask = False
        k = (m.replica, model)
        last = self._seen.get(k)
        if m.seq != 1 and m.seq != (1 if last is None else last + 1):  # 1: its first (again)
            self.gaps += 1
            ask = True
        if last is None and len(self._seen) >= MODELS_CAP * 64:
            self._seen.clear()
        self._seen[k] = m.seq
        for s in m.started:
            share.remote_start(peer, s.rid, model, s.key, unpack_blocks(s.blocks), s.charge)
        for f in m.finished:
            share.remote_finish(peer, f.rid, f.finished_at)
        if m.live is not None and share.remote_live(peer, model, set(m.live)) and share.can_take(peer):
            ask = True  # it has requests in flight whose start we missed
        if ask and len(self._want) < MODELS_CAP:
            self._want.setdefault(model, set()).add(m.replica)
            self._wake.set()
        if m.want and (self.replica_id in m.want or "*" in m.want):
            self._owe.add(model)
            self._wake.set()

    def _forget_replica(self, replica: str) -> None:
        for k in [k for k in self._seen if k[0] == replica]:
            del self._seen[k]
