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
  delivered: ``on_reset(key)`` first, then as on first contact (replay from 0);
* an idle restart: each reconnect of the SUB (the engine's process went away and came back on the
  same ports) and each idle probe asks the replay socket from ``last`` (one batch early): a batch
  ``last`` that differs from ours, or none at all (the engine's newest batch is older than ours),
  is a restart, found without waiting for the new engine's first batch. Without a replay socket a
  restart shows with the new engine's first batch (seq back), and one that lands exactly on
  ``last + 1`` cannot be told from seq numbers.

Every ``on_reset`` has a reason (``stats(key)["reset_reasons"]``, and ``reset_reason(key)`` during
the callback): ``restart`` (the engine restarted: its cache started empty), ``gap`` (batches lost
mid-stream that replay could not bring back), ``history`` (first contact: older batches fell out of
the engine's replay buffer), ``reconnect`` (re-opened after ``stop()``, or a reader failed).
``caught_up`` turns true (and ``on_caught_up(key)``, when set, is called) once the first-contact
replay has been answered: the engine's buffered history is delivered. A replay socket that does
not answer is asked again by the probes, soon after each other; after ``_WARMUP_ATTEMPTS`` failures
the key is declared caught up all the same (a warning: its view starts from live events), so one
dead replay socket cannot hold a caller's warm-up forever. Without a replay socket, at once.

``on_batch(key, seq, payload)`` is called in seq order, at most once per seq between resets; the
payload is handed over undecoded (the caller picks the vLLM or SGLang decoder). ATOM v0.1.5's
publisher sends no sequence number: ``[topic, payload]``, or the payload alone when its topic is
empty (a SUB gets those only when subscribed to every topic, ``topic=""``); both are passed through
with seq -1 and no tracking. Callback exceptions are logged and counted, never kill a reader.

The SUB side is ``infera.transport.zmtp``: the ZMTP protocol on the caller's event loop, frames
parsed straight out of the TCP reads (libzmq's SUB cost ~100-150 us of CPU per batch in mailbox
syscalls, the largest part of kv-aware routing's CPU; bench/kv_path.py, "zmq"). Live batches in
sequence are delivered from the connection's reads; anything else (a gap, a restart, a first
batch to catch up to) pauses the connection and goes to the key's task, which resumes it when done:
what arrives meanwhile waits in the connection's buffer and the kernel's, in order. The replay
DEALER is pyzmq's (asked rarely; at most ``replay_concurrency`` at once, the other keys waiting
for a slot, see ``replay_load()``). Like a libzmq SUB the connection re-establishes itself; batches
published while it was down show as a gap.

Replay protocol (vLLM): the DEALER sends ``[b"", start_seq (8-byte BE)]`` and receives
``[b"", (topic,) seq, payload]`` per buffered batch with seq >= start_seq, then an end marker whose
seq is -1 (8-byte signed BE). Only the last two frames are read, so replies with or without the
topic frame both work.

This module owns the subscriber's lifecycle, its sockets and its live path (the connection's reads,
the per-key task, recovery from a failed reader); its neighbours own the callbacks every subscriber
shares (``kv_event_callbacks``), the per-key state (``kv_events_zmq_state``) and the replay side
(``kv_events_zmq_replay``).
"""

from __future__ import annotations

import asyncio
import logging
from time import monotonic as _monotonic
from typing import Any

import zmq
import zmq.asyncio

from infera.transport.backoff import retry_delay

# The subscriber's other concerns, in their own modules; their names are re-exported here, where
# callers imported them from.
from infera.transport.kv_event_callbacks import (  # noqa: F401
    NO_SEQ,
    RESET_GAP,
    RESET_HISTORY,
    RESET_REASONS,
    RESET_RECONNECT,
    RESET_RESTART,
    KvCallbacks,
    OnBatch,
    OnCaughtUp,
    OnReset,
)
from infera.transport.kv_events_zmq_replay import _END_SEQ, ZmqReplay  # noqa: F401
from infera.transport.kv_events_zmq_state import Wake, _digest, _KeyState
from infera.transport.zmtp import ZmtpSubscription

log = logging.getLogger("infera.transport.kv_events_zmq")

DEFAULT_TOPIC = "kv-events"
# Idle replay probes: soon after subscribing (the ZMQ slow-joiner window), then every few seconds
# of silence.
_FIRST_PROBE_S = 0.5  # (also the interval of the warm-up's retries)
_IDLE_PROBE_S = 5.0
_WARMUP_ATTEMPTS = 3  # failed replays before a key is caught up without its history
_STOP_WAIT_S = 5.0  # how long stop() waits for closing readers and connections
# Replay DEALERs open at once, per subscriber. A server that starts (or reconnects) against a
# fleet asks every engine for its history at the same moment; unbounded, 1,000 engines meant 1,000
# libzmq sockets at once (each ~50 KB of pipes, batch buffers and mailbox, one fd), a high-water
# mark that the allocator kept: ~50 KB of the server's memory per worker for good
# (bench/fleet_scale.py). The rest wait their turn; a dead replay socket holds its slot at most
# ``replay_timeout``.
REPLAY_CONCURRENCY = 32
# A reader that fails (fd exhaustion: "Too many open files" on the replay socket, a bug) restarts
# after a backoff doubling from _RECOVER_MIN_S to _RECOVER_MAX_S (+-25% jitter), not at once: a
# failure that repeats immediately spun 100k tracebacks (110 MB of log) in 30 s and reset the view
# each time. The failure count starts over once a reader has run _RECOVER_RESET_S without failing.
_RECOVER_MIN_S = 0.1
_RECOVER_MAX_S = 30.0
_RECOVER_RESET_S = 60.0


def endpoint_for_rank(endpoint: str, rank: int | None) -> str:
    """The publisher (or replay) endpoint of DP rank ``rank``: engines publish rank r on port + r."""
    if not rank:
        return endpoint
    host, port = endpoint.rsplit(":", 1)
    return f"{host}:{int(port) + rank}"


class ZmqKvEventSubscriber(ZmqReplay, KvCallbacks):
    """Subscribe to many engines' KV events; see the module docstring for the guarantees."""

    def __init__(
        self,
        on_batch: OnBatch,
        on_reset: OnReset,
        *,
        context: zmq.asyncio.Context | None = None,
        replay_timeout: float = 2.0,
        topic: str = DEFAULT_TOPIC,
        on_caught_up: OnCaughtUp | None = None,
        replay_concurrency: int = REPLAY_CONCURRENCY,
    ) -> None:
        if replay_timeout <= 0:
            raise ValueError("replay_timeout must be > 0")
        if replay_concurrency < 1:
            raise ValueError("replay_concurrency must be >= 1")
        self.on_batch = on_batch
        self.on_reset = on_reset
        self.on_caught_up = on_caught_up
        self.replay_timeout = replay_timeout
        self.replay_concurrency = replay_concurrency
        self._replay_slots = asyncio.Semaphore(replay_concurrency)
        self._replays_in_flight = 0
        self._replays_waiting = 0
        self.topic = topic.encode()
        self._ctx = context  # for the replay DEALERs
        self._own_ctx = context is None
        self._keys: dict[str, _KeyState] = {}
        self._closing: set[asyncio.Task[None]] = set()
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
        closing, self._closing = list(self._closing), set()
        if closing:
            # Bounded: a task that outlives its cancellation must not hold the server's shutdown.
            done, late = await asyncio.wait(closing, timeout=_STOP_WAIT_S)
            for task in done:
                if not task.cancelled():
                    task.exception()  # retrieved: a close that failed has nothing left to do
            if late:
                log.warning(
                    "KV events: %d task(s) still running %.0fs after stop; left behind", len(late), _STOP_WAIT_S
                )
        for st in self._keys.values():
            st.task = None
        if self._own_ctx and self._ctx is not None:
            self._ctx.destroy(linger=0)  # all closed by now; destroy() can't hang if one was not
            self._ctx = None

    def replaying(self, key: str) -> bool:
        """Whether the batch being delivered for ``key`` now is replayed history, not live."""
        st = self._keys.get(key)
        return st is not None and st.replaying

    def replay_load(self) -> dict[str, int]:
        """Replays asked now (DEALERs open, at most ``replay_concurrency``) and waiting for a slot."""
        return {
            "in_flight": self._replays_in_flight,
            "waiting": self._replays_waiting,
            "limit": self.replay_concurrency,
        }

    def stats(self, key: str) -> dict[str, Any]:
        """Counters and sequence state of one key (KeyError if not subscribed)."""
        st = self._keys[key]
        return {
            "key": st.key,
            "endpoint": st.endpoint,
            "replay_endpoint": st.replay_endpoint,
            "connected": st.conn is not None and st.conn.connected,  # handshake done (it reconnects on its own)
            "last_seq": st.last_seq,
            "batches": st.batches,
            "gaps": st.gaps,
            "replays": st.replays,
            "replay_failures": st.replay_failures,
            "probe_recoveries": st.probe_recoveries,
            "resets": st.resets,
            "reset_reasons": dict(st.reset_reasons),
            "restarts": st.restarts,
            "reconnect_checks": st.reconnect_checks,
            "replay_answers": st.replay_answers,
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
            self._reset(st, RESET_RECONNECT)
        loop = asyncio.get_running_loop()
        st.live, st.slow, st.wake, st.pending, st.recheck = False, None, Wake(), [], False
        st.conn = ZmtpSubscription(
            st.endpoint,
            self.topic,
            lambda frames: self._on_frames(st, frames),
            on_connect=lambda: self._on_connect(st),
            reconnect_s=0.1,
            reconnect_max_s=5.0,
        )
        st.conn.pause()  # until the task's first contact is done
        st.conn.start()
        st.task = loop.create_task(self._reader(st), name=f"kv-events-sub:{st.key}")

    def _close(self, st: _KeyState) -> None:
        task, st.task = st.task, None
        if task is not None and not task.done():
            task.cancel()
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        st.live = False
        st.slow, st.pending = None, []
        conn, st.conn = st.conn, None
        if conn is not None:
            closing = asyncio.get_running_loop().create_task(conn.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    # ------------------------------------------------------------------ reader

    def _on_connect(self, st: _KeyState) -> None:
        """The SUB (re)connected. After the first connection, the publisher may be a new engine on
        the same ports: hold delivery and let the task ask the replay socket (``_probe``) before
        anything else, so that a restarted engine's view is dropped now, not at its next batch."""
        conn = st.conn
        if conn is None or conn.connects <= 1 or not st.replay_endpoint or st.last_seq is None:
            return
        st.recheck = True
        st.live = False
        conn.pause()
        if st.wake is not None:
            st.wake.set()

    def _on_frames(self, st: _KeyState, frames: list[bytes]) -> None:
        """A message from the connection. The common case, the next batch in sequence, is delivered
        here (``_in_order``, ``_deliver`` and ``_emit`` inlined: this runs for every batch);
        anything else pauses the connection and goes to the task."""
        if st.conn is None:
            return
        try:
            if st.live and st.slow is None:
                if len(frames) == 3 and not st.replayed and st.last_seq is not None:
                    seq = frames[1]
                    if len(seq) == 8 and int.from_bytes(seq, "big") == st.last_seq + 1:
                        payload = frames[2]
                        st.last_seq += 1
                        st.last_digest = _digest(payload)
                        st.batches += 1
                        st.last_batch_at = _monotonic()
                        try:
                            self.on_batch(st.key, st.last_seq, payload)
                        except Exception:
                            st.callback_errors += 1
                            log.exception("KV events %s: on_batch failed for seq %d", st.key, st.last_seq)
                        return
                if self._in_order(st, frames):
                    return
                st.live = False
                st.slow = frames
                if st.wake is not None:
                    st.wake.set()
            else:
                st.pending.append(frames)
            st.conn.pause()
        except Exception:
            if st.task is not None:
                st.task.cancel()
            self._recover(st)

    async def _reader(self, st: _KeyState, delay: float = 0.0) -> None:
        """First contact (after ``delay`` s: a restarted reader's backoff), then whatever the
        connection's reads cannot do without waiting (a gap to repair, a restart, a first batch to
        catch up to) and the idle replay probes. Live batches in sequence never come here:
        ``_on_frames`` applies them as they are read."""
        assert st.conn is not None and st.wake is not None
        conn = st.conn
        try:
            if delay > 0:
                await asyncio.sleep(delay)
            if st.replay_endpoint:
                await self._catch_up(st, 0, None)  # blocks stored before we subscribed
            self._check_caught_up(st)
            if st.recovering:
                st.recovering = False
                log.info("KV events %s: reader recovered after %d failure(s)", st.key, st.failures)
            probe_after = _FIRST_PROBE_S
            # Closing the key (or re-opening it) replaces ``st.conn``: the loop ends then even if its
            # cancellation was lost on the way (3.11's wait_for can swallow one that lands as its
            # wait ends), so a removed worker is not probed forever and stop() is not held.
            while st.conn is conn:
                if not st.caught_up:
                    self._check_caught_up(st)
                frames, st.slow = st.slow, None
                if frames is not None:
                    await self._on_message(st, frames)
                while st.pending:  # what was read meanwhile, in order
                    frames = st.pending.pop(0)
                    if not self._in_order(st, frames):
                        await self._on_message(st, frames)
                if st.recheck:  # reconnected (see _on_connect): the new connection waits for this
                    st.recheck = False
                    st.reconnect_checks += 1
                    await self._probe(st)
                    continue
                st.live = True
                if st.conn is not None:
                    st.conn.resume()  # delivers what it holds; hands a message back via st.slow if it must
                if st.slow is not None or st.pending or st.recheck:
                    continue
                # the last message handled here would stay alive with this frame for as long as the
                # key is quiet or live: ~7 KB a worker at fleet size, a tenth of its index's bytes
                frames = None
                seen = st.batches
                woken = await st.wake.wait(probe_after if st.replay_endpoint else None)
                if not woken and st.batches == seen and st.slow is None and not st.recheck:
                    # Quiet: batches published while the SUB was still joining (the publisher
                    # drops them silently) would otherwise stay unknown until the next live batch.
                    st.live = False
                    if st.conn is not None:
                        st.conn.pause()
                    await self._probe(st)
                    probe_after = _IDLE_PROBE_S if st.caught_up else _FIRST_PROBE_S
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not silently end the subscription
            self._recover(st)

    def _check_caught_up(self, st: _KeyState) -> None:
        """Caught up once the engine's history has been had (see the module docstring)."""
        if st.caught_up:
            return
        if st.replay_endpoint and not st.replay_answered:
            if st.warmup_failures < _WARMUP_ATTEMPTS:
                return  # the probes ask again
            log.warning(
                "KV events %s: %d replays from %s failed: the view starts from live events, without "
                "the engine's earlier history",
                st.key,
                st.warmup_failures,
                st.replay_endpoint,
            )
        st.caught_up = True
        self._notify_caught_up(st)

    def _recover(self, st: _KeyState) -> None:
        """A reader failed: reset the view (unless nothing was delivered since the last failure)
        and start a new reader after a backoff. One ERROR line (with the traceback) when the key
        enters the failing state, DEBUG for the repeats, INFO when a reader recovers."""
        now = _monotonic()
        if st.failures and now - st.failed_at > _RECOVER_RESET_S:
            st.failures = 0  # the last failure is long past: a new episode
        st.failures += 1
        st.failed_at = now
        st.warmup_failures += not st.caught_up  # (a replay that could not even be asked failed too)
        delay = retry_delay(st.failures, _RECOVER_MIN_S, _RECOVER_MAX_S)
        if not st.recovering:
            st.recovering = True
            log.exception(  # noqa: LOG004 - called from the reader's exception handlers
                "KV events %s: reader failed; resetting the view, retrying with backoff (up to %.0f s)",
                st.key,
                _RECOVER_MAX_S,
            )
        else:
            log.debug(
                "KV events %s: reader failed again (%d in a row); retrying in %.2f s",
                st.key,
                st.failures,
                delay,
                exc_info=True,  # noqa: LOG014 - called from the reader's exception handlers
            )
        reset = st.failures == 1 or st.batches != st.batches_at_failure or st.last_seq is not None
        st.last_seq = None
        st.forget_replayed()
        if reset:
            self._reset(st, RESET_RECONNECT)
        st.batches_at_failure = st.batches
        st.slow, st.pending = None, []
        if self._keys.get(st.key) is st and st.conn is not None:
            st.live = False
            st.conn.pause()
            st.task = asyncio.get_running_loop().create_task(self._reader(st, delay), name=f"kv-events-sub:{st.key}")

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
            log.info("KV events %s: seq went back from %d to %d (engine restart?): resetting", st.key, st.last_seq, seq)
            st.last_seq = None
            st.forget_replayed()
            self._reset(st, RESET_RESTART)
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

    # ------------------------------------------------------------------ callbacks

    def _deliver(self, st: _KeyState, seq: int, payload: bytes, *, track: bool = True) -> None:
        if track:
            st.last_seq = seq
            st.last_digest = _digest(payload)
        self._emit(st, seq, payload)
