"""The ZMQ KV-event subscriber's replay side (:class:`ZmqReplay`, a base of
``ZmqKvEventSubscriber``): asking an engine's replay socket through a pyzmq DEALER for its buffered
batches (``_fetch``; the protocol is in :mod:`infera.transport.kv_events_zmq`'s docstring), and
what is done with the answer: catching up on first contact, repairing a gap, probing an idle or
reconnected key for batches the live stream dropped and for a restarted engine, and delivering
replayed batches in order, with ``on_reset`` first when they do not reach back far enough.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import zmq

from infera.runtime import wait_for
from infera.transport.kv_event_callbacks import RESET_GAP, RESET_HISTORY, RESET_RESTART
from infera.transport.kv_events_zmq_state import _digest, _KeyState

# (the logger's name is the one the replay side logged under before the split: log configurations name it)
log = logging.getLogger("infera.transport.kv_events_zmq")

_END_SEQ = -1  # the seq of a replay's end marker


class ZmqReplay:
    """Replay through the engine's DEALER socket (the subscriber sets the attributes below and
    provides ``_reset`` and ``_deliver``)."""

    _ctx: Any  # zmq.asyncio.Context | None: for the replay DEALERs
    replay_timeout: float
    _replay_slots: asyncio.Semaphore  # bounds the DEALERs open at once (REPLAY_CONCURRENCY)
    _replays_in_flight: int
    _replays_waiting: int

    if TYPE_CHECKING:  # (the subscriber's: declared for the type checker only, never shadowing them)

        def _reset(self, st: Any, reason: str) -> None: ...

        def _deliver(self, st: _KeyState, seq: int, payload: bytes, *, track: bool = True) -> None: ...

    async def _probe(self, st: _KeyState) -> None:
        """Ask the replay socket for anything newer than what was delivered (cheap when idle), from
        one batch early: the engine's batch ``last_seq`` must be ours, or the engine restarted."""
        last = st.last_seq
        batches = await self._fetch(st, 0 if last is None else last, counted=False)
        if batches is None:
            return  # no answer: the next live batch or probe tells
        if last is not None and st.last_seq == last:
            anchor = next((p for s, p in batches if s == last), None)
            ended = st.replay_answers > 0 and not any(s >= last for s, _ in batches)
            if (anchor is not None and _digest(anchor) != st.last_digest) or ended:
                # Our last batch is not the engine's, or the engine has not published that many: a
                # new engine (its buffer would still hold ``last`` otherwise, or newer ones). An
                # empty answer counts only from a replay socket that has answered with batches
                # before (one that buffers nothing would look restarted at every probe).
                await self._restarted(
                    st,
                    "the engine's replay "
                    + (f"differs at batch {last}" if anchor is not None else f"ends before batch {last}"),
                )
                return
        start = 0 if last is None else last + 1
        before = st.batches
        self._apply_replay(st, batches, start, None)
        if st.batches != before:
            st.probe_recoveries += 1

    async def _restarted(self, st: _KeyState, why: str) -> None:
        """The engine behind ``st`` restarted: reset, then its history from seq 0."""
        st.restarts += 1
        log.info("KV events %s: %s (engine restart): resetting", st.key, why)
        st.last_seq = None
        st.forget_replayed()
        self._reset(st, RESET_RESTART)
        await self._catch_up(st, 0, None)

    async def _catch_up(self, st: _KeyState, start: int, upto: int | None) -> None:
        """Deliver the missing batches ``start .. upto-1`` by replay (``upto`` None: every buffered
        one, the proactive first-contact replay); ``on_reset`` when they cannot all be had."""
        batches = await self._fetch(st, start) if st.replay_endpoint else None
        if batches is None:
            if upto is not None:
                self._reset(st, RESET_HISTORY)  # (nothing delivered since the last reset, if any)
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
            self._reset(st, RESET_GAP)
            return
        anchor = next((p for s, p in batches if s == last), None)
        if anchor is not None and _digest(anchor) != st.last_digest:
            st.restarts += 1
            log.info(
                "KV events %s: the replayed batch %d differs from the one delivered (engine restart?): resetting",
                st.key,
                last,
            )
            st.last_seq = None
            st.forget_replayed()
            self._reset(st, RESET_RESTART)
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
        # what is missing lies before anything delivered (first contact, or after a restart's reset):
        # older history; else batches lost mid-stream
        missing = RESET_GAP if st.last_seq is not None else RESET_HISTORY
        if upto is not None and (not usable or usable[-1][0] != upto - 1):
            self._reset(st, missing)  # a hole right before the live batch: nothing here can be chained to it
            return
        if not usable:
            return  # first contact with an engine that has published nothing yet
        run = 0  # start of the last contiguous run: only that one connects to what comes next
        for i in range(1, len(usable)):
            if usable[i][0] != usable[i - 1][0] + 1:
                run = i
        if run > 0 or usable[0][0] != start:
            self._reset(st, missing)  # older batches fell out of the engine's replay buffer
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
        if st.conn is None:  # closed: nothing to fetch for
            return None
        if counted:
            st.replays += 1
        self._replays_waiting += 1
        try:
            await self._replay_slots.acquire()
        finally:
            self._replays_waiting -= 1
        self._replays_in_flight += 1
        try:
            if st.conn is None:  # closed while waiting
                return None
            return await self._fetch_open(st, start)
        finally:
            self._replays_in_flight -= 1
            self._replay_slots.release()

    async def _fetch_open(self, st: _KeyState, start: int) -> list[tuple[int, bytes]] | None:
        """``_fetch`` with a slot held: one DEALER, asked once."""
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            dealer.connect(st.replay_endpoint)
            await wait_for(dealer.send_multipart([b"", start.to_bytes(8, "big")]), self.replay_timeout)
            while True:
                # The timeout is on silence, not the whole transfer: a big buffer may take a while.
                frames = await wait_for(dealer.recv_multipart(), self.replay_timeout)
                if len(frames) < 2 or len(frames[-2]) != 8:
                    log.warning("KV events %s: malformed replay reply (%d frames)", st.key, len(frames))
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == _END_SEQ:
                    st.replay_answered = True
                    if out:
                        st.replay_answers += 1
                    log.debug("KV events %s: replayed %d batch(es) from %d", st.key, len(out), start)
                    return out
                out.append((seq, frames[-1]))
        except asyncio.TimeoutError:
            st.replay_failures += 1
            st.warmup_failures += not st.caught_up
            log.warning(
                "KV events %s: replay from %d via %s timed out after %.1fs",
                st.key,
                start,
                st.replay_endpoint,
                self.replay_timeout,
            )
            return None
        except zmq.ZMQError as exc:
            st.replay_failures += 1
            st.warmup_failures += not st.caught_up
            log.warning("KV events %s: replay from %d via %s failed: %s", st.key, start, st.replay_endpoint, exc)
            return None
        finally:
            dealer.close(linger=0)
