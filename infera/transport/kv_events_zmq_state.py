"""The ZMQ KV-event subscriber's state per subscribed key (:class:`_KeyState`): its connection and
reader task, the live/slow-path handoff between the connection's reads and the task, the sequence
delivered last (and its payload's digest, to recognise a restarted engine), the digests of replayed batches
not yet seen live (to tell a duplicate from a restart), the warm-up and failure/backoff state, and
the counters ``ZmqKvEventSubscriber.stats`` reports. Part of :mod:`infera.transport.kv_events_zmq`.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import xxhash

from infera.transport.zmtp import ZmtpSubscription


def _digest(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def _expire(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(False)


class Wake:
    """What the key's task waits on between batches: ``set()`` wakes it, and a wait may time out.

    One waiter at a time, and a ``set()`` with none waiting is dropped: the task checks what the
    reads left it (``slow``, ``pending``, ``recheck``) before each wait, with no await between. Not
    an ``asyncio.Event`` under ``wait_for``: those kept an empty waiter deque (~0.8 KB) per worker,
    and each wait wrapped ``Event.wait`` in a task of its own (~1 KB); a fleet of 1,000 workers
    waits a thousand times at once, all the time."""

    __slots__ = ("_fut",)

    def __init__(self) -> None:
        self._fut: asyncio.Future[bool] | None = None

    def set(self) -> None:
        fut = self._fut
        if fut is not None and not fut.done():
            fut.set_result(True)

    async def wait(self, timeout: float | None) -> bool:
        """True when woken, False when ``timeout`` seconds (None: no limit) passed first."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        self._fut = fut
        timer = None if timeout is None else loop.call_later(timeout, _expire, fut)
        try:
            return await fut
        finally:
            self._fut = None
            if timer is not None:
                timer.cancel()


@dataclass(eq=False, slots=True)  # slots: one per worker, ~1 KB less than a __dict__
class _KeyState:
    key: str
    endpoint: str
    replay_endpoint: str | None
    conn: ZmtpSubscription | None = None  # the SUB connection (ZMTP on the loop)
    task: asyncio.Task | None = None
    # Live batches are delivered from the connection's reads (``_on_frames``); the task does what
    # must wait (first contact, gap repair, idle probes), the connection paused meanwhile.
    live: bool = False  # the reads may deliver (first contact done, no slow path running)
    slow: list[bytes] | None = None  # a message the reads left to the task
    pending: list[list[bytes]] = field(default_factory=list)  # read while not live, for the task
    wake: Wake | None = None
    last_seq: int | None = None  # last seq delivered (None: nothing since the last reset)
    # digest of the payload delivered as last_seq (a gap's replay checks it against its own); a digest,
    # not the payload: that was one batch (~4.5 KB) kept per worker for good
    last_digest: int | None = None
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
    reset_reasons: dict[str, int] = field(default_factory=dict)
    reset_reason: str | None = None  # the last one's
    restarts: int = 0
    reconnect_checks: int = 0  # probes asked because the SUB reconnected
    recheck: bool = False  # reconnected: probe the replay socket before delivering anything more
    replay_answers: int = 0  # replays that returned batches: an empty one then means "nothing that old"
    replay_answered: bool = False  # a replay was answered (its end marker came), batches or not
    warmup_failures: int = 0  # replays that failed before caught_up
    caught_up: bool = False  # the first-contact replay of the engine's history is done
    replaying: bool = False  # batches now delivered come from the replay socket (old ones)
    duplicates: int = 0
    callback_errors: int = 0
    last_batch_at: float | None = None
    failures: int = 0  # reader failures in a row (backoff), 0: healthy
    failed_at: float = 0.0  # monotonic time of the last one
    batches_at_failure: int = 0  # batches delivered when it happened: none since, no view to reset
    recovering: bool = False  # failed, and no reader has reached its steady state since

    def forget_replayed(self) -> None:
        self.replayed.clear()
        self.replayed_max = -1
