"""The router's KV-event subscriber: one ZMQ SUB per (worker, DP rank), gap-free or reset.

Engines (vLLM, SGLang, the simulator) PUBlish multipart ``[topic, seq (8-byte BE), payload]`` with
``seq`` +1 per batch. PUB/SUB loses messages silently -- before the subscription reaches the
publisher (the "slow joiner"), at a high-water mark, across reconnects -- so every key's sequence
is tracked, and a caller's view of a worker is never allowed to drift silently:

* first contact: with a replay endpoint, the buffered batches are fetched from seq 0 right away
  (this recovers blocks stored before we subscribed, even if the engine then stays idle), and
  again when the first live batch is not the one expected; without one, ``on_reset`` unless the
  first batch is seq 0;
* a gap (``seq > last + 1``): replay from ``last + 1`` through a DEALER; if there is no replay
  endpoint, the replay fails (no answer within ``replay_timeout`` s of silence) or its buffer no
  longer reaches back far enough, ``on_reset(key)`` and continue from what is available;
* a restart: ``seq <= last`` and not a duplicate of a batch replay already delivered, or -- when
  the restarted engine has already published more batches than before -- a gap whose replay
  (asked from ``last``, one batch early) returns a different batch ``last`` than the one we
  delivered: ``on_reset(key)`` first, then as on first contact (replay from 0). A restart that
  lands exactly on ``last + 1`` cannot be told from seq numbers and goes unnoticed.

``on_batch(key, seq, payload)`` is called in seq order, at most once per seq between resets; the
payload is handed over undecoded (the caller picks the vLLM or SGLang decoder). ATOM v0.1.5's
publisher sends no sequence number: ``[topic, payload]``, or the payload alone when its topic is
empty (a SUB gets those only when subscribed to every topic, ``topic=""``); both are passed through
with seq -1 and no tracking. Callback exceptions are logged and counted, never kill a reader. All I/O is
``zmq.asyncio`` on the caller's loop. Live batches in sequence are drained straight from a reader
callback on the socket's FD (``_drain``): an engine sends one batch per scheduler step, ten or more
per request, and an awaited receive per batch cost several times the batch itself. A socket that
turns readable waits ``coalesce_s`` (2 ms) for the others, and one flush drains all of them: the
loop wakes once per flush, not once per batch, however many engines publish.

Replay protocol (vLLM): the DEALER sends ``[b"", start_seq (8-byte BE)]`` and receives
``[b"", (topic,) seq, payload]`` per buffered batch with seq >= start_seq, then an end marker whose
seq is -1 (8-byte signed BE). Only the last two frames are read, so replies with or without the
topic frame both work.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import xxhash
import zmq
import zmq.asyncio

log = logging.getLogger("infera.transport.kv_events_zmq")

DEFAULT_TOPIC = "kv-events"
NO_SEQ = -1
_END_SEQ = -1
# Idle replay probes: soon after subscribing (the ZMQ slow-joiner window), then every few seconds
# of silence.
_FIRST_PROBE_S = 0.5
_IDLE_PROBE_S = 5.0
# A burst of queued batches is applied for at most this long before the loop gets a turn.
_DRAIN_TURN_S = 0.002
# A socket that turns readable is drained this much later, together with every other socket that
# turned readable meanwhile: one loop wakeup for all of them instead of one per batch (engines send
# a batch per scheduler step; a wakeup of an idle loop cost several times the batch itself).
DEFAULT_COALESCE_S = 0.002

# pyzmq's flags as plain ints: its enums cost ~0.8 us per use on this path (``get(EVENTS) &
# POLLIN`` builds an IntFlag; an enum argument is converted on every recv), several per batch.
_NOBLOCK, _EVENTS, _POLLIN = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN)

OnBatch = Callable[[str, int, bytes], None]
OnReset = Callable[[str], None]


def endpoint_for_rank(endpoint: str, rank: int | None) -> str:
    """The publisher (or replay) endpoint of DP rank ``rank``: engines publish rank r on port + r."""
    if not rank:
        return endpoint
    host, port = endpoint.rsplit(":", 1)
    return f"{host}:{int(port) + rank}"


def _recv(sock: zmq.Socket) -> list[bytes]:
    """One queued message's frames, or ``zmq.Again``. ``recv_multipart`` asks the socket for
    RCVMORE after each frame (a getsockopt, 0.8 us); a frame knows whether more follow."""
    frame = sock.recv(_NOBLOCK, copy=False)
    frames = [frame.bytes]
    while frame.more:
        frame = sock.recv(_NOBLOCK, copy=False)
        frames.append(frame.bytes)
    return frames


def _digest(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


@dataclass(eq=False)
class _KeyState:
    key: str
    endpoint: str
    replay_endpoint: str | None
    sock: zmq.asyncio.Socket | None = None
    task: asyncio.Task | None = None
    # Live batches are drained by a reader callback on the socket's FD (``_drain``); the task does
    # what must wait (first contact, gap repair, idle probes). See ``_reader``.
    raw: zmq.Socket | None = None  # ``sock``, synchronous
    fd: int | None = None  # registered with ``loop``'s reader
    queued: bool = False  # readable, its reader removed: drained by the subscriber's next flush
    loop: asyncio.AbstractEventLoop | None = None
    live: bool = False  # the reader callback may deliver (first contact done, no slow path running)
    slow: list[bytes] | None = None  # a message the callback left to the task
    wake: asyncio.Event | None = None
    last_seq: int | None = None  # last seq delivered (None: nothing since the last reset)
    last_digest: int = 0  # of the payload delivered as last_seq
    # seq -> payload digest of batches delivered by replay and not yet seen live: a live copy of
    # one of them is a duplicate; anything else at seq <= last_seq means the engine restarted.
    replayed: dict[int, int] = field(default_factory=dict)
    replayed_max: int = -1
    batches: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    probe_recoveries: int = 0  # batches found by an idle probe that the live stream had dropped
    resets: int = 0
    restarts: int = 0
    caught_up: bool = False  # the first-contact replay of the engine's history is done
    replaying: bool = False  # batches now delivered come from the replay socket (old ones)
    duplicates: int = 0
    callback_errors: int = 0
    last_batch_at: float | None = None

    def forget_replayed(self) -> None:
        self.replayed.clear()
        self.replayed_max = -1


class KvCallbacks:
    """The callbacks every KV-event subscriber (ZMQ, NATS) drives, with the same bookkeeping on its
    per-key state (``key``, ``batches``, ``last_batch_at``, ``resets``, ``callback_errors``): a
    callback's exception is logged and counted, never kills a reader."""

    on_batch: OnBatch
    on_reset: OnReset

    def _emit(self, st, seq: int, payload: bytes) -> None:
        st.batches += 1
        st.last_batch_at = time.monotonic()
        try:
            self.on_batch(st.key, seq, payload)
        except Exception:
            st.callback_errors += 1
            log.exception("KV events %s: on_batch failed for seq %d", st.key, seq)

    def _reset(self, st) -> None:
        st.resets += 1
        try:
            self.on_reset(st.key)
        except Exception:
            st.callback_errors += 1
            log.exception("KV events %s: on_reset failed", st.key)


class ZmqKvEventSubscriber(KvCallbacks):
    """Subscribe to many engines' KV events; see the module docstring for the guarantees."""

    def __init__(self, on_batch: OnBatch, on_reset: OnReset, *, context: zmq.asyncio.Context | None = None,
                 replay_timeout: float = 2.0, topic: str = DEFAULT_TOPIC,
                 coalesce_s: float = DEFAULT_COALESCE_S) -> None:
        if replay_timeout <= 0:
            raise ValueError("replay_timeout must be > 0")
        if coalesce_s < 0:
            raise ValueError("coalesce_s must be >= 0")
        self.coalesce_s = coalesce_s  # 0: every readable socket drained at once
        self._queued: list[_KeyState] = []  # readable sockets waiting for the flush
        self._flush_at: asyncio.TimerHandle | None = None
        self.flushes = 0  # loop wakeups that drained queued sockets
        self.on_batch = on_batch
        self.on_reset = on_reset
        self.replay_timeout = replay_timeout
        self.topic = topic.encode()
        self._ctx = context
        self._own_ctx = context is None
        self._keys: dict[str, _KeyState] = {}
        self._closing: set[asyncio.Task] = set()
        self._started = False

    # ------------------------------------------------------------------ public

    def add(self, key: str, endpoint: str, replay_endpoint: str | None = None) -> None:
        """Subscribe ``key`` (a route key: ``"<worker_id>"`` or ``"<worker_id>#dp<rank>"``) to
        ``endpoint`` (and its replay socket). Adding an existing key replaces its subscription: fresh
        sequence state and counters, and (with a replay endpoint) a replay from seq 0 for a view
        rebuilt from scratch. Takes effect at ``start()``, or at once when already started."""
        if key in self._keys:
            self.remove(key)
        st = _KeyState(key, endpoint, replay_endpoint or None)
        self._keys[key] = st
        if self._started:
            self._open(st)

    def remove(self, key: str) -> None:
        """Unsubscribe ``key``: its SUB socket closes now, its reader task is cancelled (closing an
        in-flight replay's DEALER as it unwinds). Unknown keys are ignored."""
        st = self._keys.pop(key, None)
        if st is not None:
            self._close(st)

    def keys(self) -> list[str]:
        return list(self._keys)

    async def start(self) -> None:
        if self._started:
            return
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        self._started = True
        for st in self._keys.values():
            self._open(st)

    async def stop(self) -> None:
        self._started = False
        for st in self._keys.values():
            self._close(st)
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        self._queued.clear()
        closing, self._closing = list(self._closing), set()
        if closing:
            await asyncio.gather(*closing, return_exceptions=True)
        for st in self._keys.values():
            st.task = None
        if self._own_ctx and self._ctx is not None:
            self._ctx.destroy(linger=0)  # all closed by now; destroy() can't hang if one was not
            self._ctx = None

    def replaying(self, key: str) -> bool:
        """Whether the batch being delivered for ``key`` now is replayed history, not live."""
        st = self._keys.get(key)
        return st is not None and st.replaying

    def stats(self, key: str) -> dict:
        """Counters and sequence state of one key (KeyError if not subscribed)."""
        st = self._keys[key]
        return {
            "key": st.key,
            "endpoint": st.endpoint,
            "replay_endpoint": st.replay_endpoint,
            "connected": st.sock is not None and not st.sock.closed,  # SUB open (ZMQ reconnects on its own)
            "last_seq": st.last_seq,
            "batches": st.batches,
            "gaps": st.gaps,
            "replays": st.replays,
            "replay_failures": st.replay_failures,
            "probe_recoveries": st.probe_recoveries,
            "resets": st.resets,
            "restarts": st.restarts,
            "duplicates": st.duplicates,
            "callback_errors": st.callback_errors,
            "last_batch_at": st.last_batch_at,
            "caught_up": st.caught_up,
        }

    # ------------------------------------------------------------------ sockets

    def _open(self, st: _KeyState) -> None:
        assert self._ctx is not None
        if st.last_seq is not None:  # re-opened after stop(): continuity is lost, start over
            st.last_seq = None
            st.forget_replayed()
            self._reset(st)
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        sock.setsockopt(zmq.RCVHWM, 100000)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic)
        sock.connect(st.endpoint)
        loop = asyncio.get_running_loop()
        st.sock, st.raw, st.loop = sock, zmq.Socket.shadow(sock.underlying), loop
        st.live, st.slow, st.wake = False, None, asyncio.Event()
        st.fd = st.raw.FD
        st.queued = False
        loop.add_reader(st.fd, self._readable, st)
        st.task = loop.create_task(self._reader(st), name=f"kv-events-sub:{st.key}")

    def _close(self, st: _KeyState) -> None:
        task, st.task = st.task, None
        if task is not None and not task.done():
            task.cancel()
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        st.live = False
        if st.fd is not None and st.loop is not None and not st.queued:
            # Now, not when the task unwinds: a socket opened meanwhile may get the same FD number.
            st.loop.remove_reader(st.fd)
        st.queued = False  # (a queued one has no reader; the flush skips it)
        st.fd, st.raw, st.slow = None, None, None
        sock, st.sock = st.sock, None
        if sock is not None and not sock.closed:
            sock.close(linger=0)

    # ------------------------------------------------------------------ reader

    async def _reader(self, st: _KeyState) -> None:
        """First contact, then whatever the reader callback cannot do without waiting (a gap to
        repair, a restart, a first batch to catch up to) and the idle replay probes. Live batches
        in sequence never come here: ``_drain`` applies them from the FD callback, without a
        future, a poller or a task step each (an awaited recv per batch cost ~40 us of CPU;
        bench/kv_path.py, "zmq")."""
        assert st.sock is not None and st.wake is not None
        try:
            if st.replay_endpoint:
                await self._catch_up(st, 0, None)  # blocks stored before we subscribed
            st.caught_up = True
            probe_after = _FIRST_PROBE_S
            while True:
                frames, st.slow = st.slow, None
                if frames is not None:
                    await self._on_message(st, frames)
                st.live = True
                self._drain(st)  # what queued meanwhile; hands a message back via st.slow if it must
                if st.slow is not None:
                    continue
                seen = st.batches
                st.wake.clear()
                try:
                    await asyncio.wait_for(st.wake.wait(), probe_after if st.replay_endpoint else None)
                except asyncio.TimeoutError:
                    if st.batches == seen and st.slow is None:
                        # Quiet: batches published while the SUB was still joining (ZMQ drops them
                        # silently) would otherwise stay unknown until the next live batch.
                        st.live = False
                        await self._probe(st)
                        probe_after = _IDLE_PROBE_S
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not silently end the subscription
            self._recover(st)

    def _recover(self, st: _KeyState) -> None:
        log.exception("KV events %s: reader failed; resetting the view", st.key)
        st.last_seq = None
        st.forget_replayed()
        self._reset(st)
        st.slow = None
        if self._keys.get(st.key) is st and st.sock is not None:
            st.live = False
            st.task = asyncio.get_running_loop().create_task(self._reader(st), name=f"kv-events-sub:{st.key}")

    def _readable(self, st: _KeyState) -> None:
        """The FD callback: the socket has something (or ZMQ wants its EVENTS read). With
        coalescing, its reader is removed (the FD stays readable until drained) and it waits for
        the next flush with the others; without, it is drained now."""
        if not self.coalesce_s or st.loop is None or st.fd is None:
            self._drain(st)
            return
        st.loop.remove_reader(st.fd)
        st.queued = True
        self._queued.append(st)
        if self._flush_at is None:
            self._flush_at = st.loop.call_later(self.coalesce_s, self._flush)

    def _flush(self) -> None:
        """Drain every queued socket, each watched again first (what arrives while it drains
        wakes the next flush)."""
        self._flush_at = None
        queued, self._queued = self._queued, []
        self.flushes += 1
        for st in queued:
            if not st.queued:
                continue  # closed meanwhile
            st.queued = False
            if st.fd is None or st.loop is None or st.raw is None:
                continue
            st.loop.add_reader(st.fd, self._readable, st)
            self._drain(st)

    def _drain(self, st: _KeyState) -> None:
        """The FD callback (and the task's resume): every queued batch that is next in sequence is
        delivered now; anything else stops the drain and goes to the task (``st.slow``). The FD is
        edge-triggered: draining until EAGAIN re-arms it."""
        raw = st.raw
        if raw is None:
            return
        if not st.live or st.slow is not None:
            # The task drains later. Reading EVENTS resets the FD, which a level-triggered loop
            # would otherwise report readable again and again meanwhile.
            try:
                raw.get(_EVENTS)
            except zmq.ZMQError:
                pass
            return
        turn_ends = time.perf_counter() + _DRAIN_TURN_S
        try:
            while True:
                try:
                    frames = _recv(raw)
                except zmq.Again:
                    return
                if not self._in_order(st, frames):
                    st.live = False
                    st.slow = frames
                    if st.wake is not None:
                        st.wake.set()
                    return
                # Queue empty? (Reading EVENTS also re-arms the FD; a recv that finds nothing raises
                # zmq.Again, which costs twice as much.)
                if not raw.get(_EVENTS) & _POLLIN:
                    return
                if time.perf_counter() >= turn_ends and st.loop is not None:
                    st.loop.call_soon(self._drain, st)  # a long burst: the loop runs in between
                    return
        except zmq.ZMQError as exc:
            if raw.closed or st.raw is not raw:
                return
            log.warning("KV events %s: receive failed: %s", st.key, exc)
        except Exception:
            if st.task is not None:
                st.task.cancel()
            self._recover(st)

    def _in_order(self, st: _KeyState, frames: list[bytes]) -> bool:
        """The common case: the next batch in sequence, nothing replayed to check against; delivered
        here. False: ``_on_message`` decides."""
        if len(frames) <= 2:  # [topic, payload] or [payload] (ATOM): no sequence to track
            self._deliver(st, NO_SEQ, frames[-1], track=False)
            return True
        if len(frames) != 3 or st.last_seq is None or st.replayed or len(frames[1]) != 8:
            return False
        seq = int.from_bytes(frames[1], "big")
        if seq != st.last_seq + 1:
            return False
        self._deliver(st, seq, frames[2])
        return True

    async def _on_message(self, st: _KeyState, frames: list[bytes]) -> None:
        if len(frames) <= 2:  # [topic, payload] or [payload] (ATOM): no sequence to track
            self._deliver(st, NO_SEQ, frames[-1], track=False)
            return
        if len(frames[-2]) != 8:
            log.warning("KV events %s: ignoring a malformed message (%d frames)", st.key, len(frames))
            return
        seq = int.from_bytes(frames[-2], "big")
        payload = frames[-1]
        if st.last_seq is not None and seq <= st.last_seq:
            if st.replayed.get(seq) == _digest(payload):
                st.duplicates += 1  # replay already delivered it
                return
            # Sequence went backwards with new content: the engine (or its publisher) restarted.
            st.restarts += 1
            log.info("KV events %s: seq went back from %d to %d (engine restart?): resetting",
                     st.key, st.last_seq, seq)
            st.last_seq = None
            st.forget_replayed()
            self._reset(st)
        if st.last_seq is None:
            if seq != 0:
                await self._catch_up(st, 0, seq)
        elif seq != st.last_seq + 1:
            st.gaps += 1
            log.info("KV events %s: gap %d..%d", st.key, st.last_seq + 1, seq - 1)
            await self._repair_gap(st, seq)
        self._deliver(st, seq, payload)
        if st.replayed and seq >= st.replayed_max:
            st.forget_replayed()  # live has overtaken everything replay delivered

    async def _probe(self, st: _KeyState) -> None:
        """Ask the replay socket for anything newer than what was delivered (cheap when idle)."""
        start = 0 if st.last_seq is None else st.last_seq + 1
        batches = await self._fetch(st, start, counted=False)
        if batches:
            st.probe_recoveries += 1
            self._apply_replay(st, batches, start, None)

    async def _catch_up(self, st: _KeyState, start: int, upto: int | None) -> None:
        """Deliver the missing batches ``start .. upto-1`` by replay (``upto`` None: every buffered
        one, the proactive first-contact replay); ``on_reset`` when they cannot all be had."""
        batches = await self._fetch(st, start) if st.replay_endpoint else None
        if batches is None:
            if upto is not None:
                self._reset(st)
            return
        self._apply_replay(st, batches, start, upto)

    async def _repair_gap(self, st: _KeyState, upto: int) -> None:
        """Fill ``last_seq+1 .. upto-1``. The replay starts one batch early, at ``last_seq``: if the
        engine's batch there is not the one we delivered, the engine restarted and has simply
        published more batches than before -- reset and start over from its seq 0."""
        assert st.last_seq is not None
        last = st.last_seq
        batches = await self._fetch(st, last) if st.replay_endpoint else None
        if batches is None:
            self._reset(st)
            return
        anchor = next((p for s, p in batches if s == last), None)
        if anchor is not None and _digest(anchor) != st.last_digest:
            st.restarts += 1
            log.info("KV events %s: the replayed batch %d differs from the one delivered (engine restart?): "
                     "resetting", st.key, last)
            st.last_seq = None
            st.forget_replayed()
            self._reset(st)
            await self._catch_up(st, 0, upto)  # the new engine's batches from its seq 0
            return
        self._apply_replay(st, batches, last + 1, upto)

    def _apply_replay(self, st: _KeyState, batches: list[tuple[int, bytes]], start: int, upto: int | None) -> None:
        """Deliver replayed ``batches`` from ``start`` up to (excluding) ``upto``; ``on_reset`` first
        when they do not reach back to ``start`` or do not reach ``upto - 1``."""
        usable: list[tuple[int, bytes]] = []
        for seq, payload in sorted(batches, key=lambda b: b[0]):
            if seq < start or (upto is not None and seq >= upto) or (usable and seq == usable[-1][0]):
                continue
            usable.append((seq, payload))
        if upto is not None and (not usable or usable[-1][0] != upto - 1):
            self._reset(st)  # a hole right before the live batch: nothing here can be chained to it
            return
        if not usable:
            return  # first contact with an engine that has published nothing yet
        run = 0  # start of the last contiguous run: only that one connects to what comes next
        for i in range(1, len(usable)):
            if usable[i][0] != usable[i - 1][0] + 1:
                run = i
        if run > 0 or usable[0][0] != start:
            self._reset(st)  # older batches fell out of the engine's replay buffer
        st.replaying = True
        try:
            for seq, payload in usable[run:]:
                self._deliver(st, seq, payload)
                st.replayed[seq] = _digest(payload)
        finally:
            st.replaying = False
        st.replayed_max = max(st.replayed_max, usable[-1][0])

    async def _fetch(self, st: _KeyState, start: int, counted: bool = True) -> list[tuple[int, bytes]] | None:
        """Every buffered batch with seq >= start from the replay socket; None on failure."""
        assert self._ctx is not None and st.replay_endpoint
        if counted:
            st.replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            dealer.connect(st.replay_endpoint)
            await asyncio.wait_for(dealer.send_multipart([b"", start.to_bytes(8, "big")]), self.replay_timeout)
            while True:
                # The timeout is on silence, not the whole transfer: a big buffer may take a while.
                frames = await asyncio.wait_for(dealer.recv_multipart(), self.replay_timeout)
                if len(frames) < 2 or len(frames[-2]) != 8:
                    log.warning("KV events %s: malformed replay reply (%d frames)", st.key, len(frames))
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == _END_SEQ:
                    log.debug("KV events %s: replayed %d batch(es) from %d", st.key, len(out), start)
                    return out
                out.append((seq, frames[-1]))
        except asyncio.TimeoutError:
            st.replay_failures += 1
            log.warning("KV events %s: replay from %d via %s timed out after %.1fs", st.key, start,
                        st.replay_endpoint, self.replay_timeout)
            return None
        except zmq.ZMQError as exc:
            st.replay_failures += 1
            log.warning("KV events %s: replay from %d via %s failed: %s", st.key, start, st.replay_endpoint, exc)
            return None
        finally:
            dealer.close(linger=0)

    # ------------------------------------------------------------------ callbacks

    def _deliver(self, st: _KeyState, seq: int, payload: bytes, *, track: bool = True) -> None:
        if track:
            st.last_seq = seq
            st.last_digest = _digest(payload)
        self._emit(st, seq, payload)
