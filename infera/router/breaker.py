"""Circuit breaker: stop routing to a worker that keeps failing before its first byte, probe it
again after a cooldown, and take it back on the first success.

Per worker: ``closed`` (routed normally) → ``open`` after ``failure_threshold`` consecutive
failures (not routed until ``opens_until``) → ``half_open`` once the cooldown has passed (exactly
one request at a time, the probe, may go there) → ``closed`` again when a request succeeds, or
``open`` again with the cooldown doubled (capped at ``max_cooldown_s``) when the probe fails.

Only faults of the worker count: a 5xx or a transport error before the first byte (mixed dispatch
reports an engine's 5xx only once another worker has served the same request: one that fails on
two engines is the request's fault, and counts against neither; see ``MixedRouter.dispatch``). A 4xx or 429 is
the client's (``record_neutral``: no blame, and a probe slot it held is freed), and so is a client
that leaves before the first byte. The breaker never changes a worker's registered status and never
turns a partial outage into a 503: when every candidate is open, ``filter`` returns them all.

One event loop, so no locks; every call is O(1) except ``filter`` (one look-up per candidate), and
the state held is one entry per worker that has failed, dropped by ``forget`` when it leaves (and
never made again for a worker that left: a request it still had in flight may fail afterwards,
which ``is_member`` tells apart).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Sequence, TypeVar

from infera.discovery.record import WorkerRecord

log = logging.getLogger(__name__)

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
# The Prometheus encoding of the states (``infera_router_worker_breaker_state``).
STATE_CODES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}

W = TypeVar("W", bound=WorkerRecord)


class BreakerEntry:
    """One worker's breaker state."""

    __slots__ = ("consecutive_failures", "state", "opens_until", "next_cooldown", "probe_started_at", "trips")

    def __init__(self, cooldown: float) -> None:
        self.consecutive_failures = 0
        self.state = CLOSED
        self.opens_until = 0.0
        self.next_cooldown = cooldown
        self.probe_started_at: float | None = None  # when the half-open probe slot was claimed
        self.trips = 0


class CircuitBreaker:
    def __init__(self, failure_threshold: int = 3, cooldown_s: float = 5.0, max_cooldown_s: float = 60.0,
                 probe_timeout_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 is_member: Callable[[str], bool] | None = None) -> None:
        if failure_threshold > 0 and not 0 < cooldown_s <= max_cooldown_s:
            raise ValueError(f"breaker cooldown must satisfy 0 < cooldown ({cooldown_s:g}) <= max cooldown "
                             f"({max_cooldown_s:g})")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.probe_timeout_s = probe_timeout_s
        self._clock = clock
        # Is the worker still in the fleet? (None: every worker is.) Its failures after it left
        # create no entry, which nothing would ever drop.
        self._is_member = is_member
        self._entries: dict[str, BreakerEntry] = {}
        # Workers not closed: while empty (the normal case) ``filter`` returns its input untouched.
        self._not_closed: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.failure_threshold > 0

    # -- admission ---------------------------------------------------------------------------------
    def allows(self, worker_id: str) -> bool:
        """May a request go to ``worker_id`` now? In half-open this claims the one probe slot."""
        entry = self._entries.get(worker_id)
        if entry is None or entry.state == CLOSED or not self.enabled:
            return True
        now = self._clock()
        if not self._admits(entry, now):
            return False
        if entry.state == HALF_OPEN:
            entry.probe_started_at = now
        return True

    def filter(self, workers: Sequence[W]) -> Sequence[W]:
        """The workers a request may go to, in order; all of them when none may (a fleet whose
        every worker is open is better served by trying one than by a 503).

        Unlike ``allows`` this claims no probe slot: the policy picks among the survivors, and only
        the one it picks becomes the probe (``claim``). Claiming for every half-open candidate would
        hold the slots of the workers not picked until ``probe_timeout_s``, stalling their recovery.
        """
        if not self._not_closed or not self.enabled:
            return workers
        now = self._clock()
        entries = self._entries
        allowed = [w for w in workers if (e := entries.get(w.worker_id)) is None or self._admits(e, now)]
        return allowed if allowed else workers

    def claim(self, worker_id: str) -> None:
        """The router picked ``worker_id`` from ``filter``'s result: in half-open this request is
        the probe, so no other goes there until it is scored (or ``probe_timeout_s`` passes)."""
        entry = self._entries.get(worker_id)
        if entry is None or entry.state == CLOSED or not self.enabled:
            return
        now = self._clock()
        if self._admits(entry, now) and entry.state == HALF_OPEN:
            entry.probe_started_at = now

    def _admits(self, entry: BreakerEntry, now: float) -> bool:
        """``allows`` without claiming: open → half-open once the cooldown has passed; half-open
        admits while no probe is out (or the one out has run past ``probe_timeout_s``)."""
        if entry.state == OPEN:
            if now < entry.opens_until:
                return False
            entry.state = HALF_OPEN
            entry.probe_started_at = None
        started = entry.probe_started_at
        return started is None or now - started >= self.probe_timeout_s

    # -- outcomes ------------------------------------------------------------------------------------
    def record_failure(self, worker_id: str) -> None:
        """The worker failed before its first byte (5xx, transport error, PD prefill timeout or
        unusable handoff)."""
        if not self.enabled:
            return
        entry = self._entries.get(worker_id)
        if entry is None:
            if self._is_member is not None and not self._is_member(worker_id):
                return
            entry = self._entries[worker_id] = BreakerEntry(self.cooldown_s)
        entry.consecutive_failures += 1
        entry.probe_started_at = None
        if entry.state == HALF_OPEN:  # the probe failed: wait longer before the next one
            entry.next_cooldown = min(2 * entry.next_cooldown, self.max_cooldown_s)
        elif entry.consecutive_failures < self.failure_threshold:
            return
        now = self._clock()
        # Already open (a request sent before the trip failed late): the cooldown restarts, no new trip.
        tripped = entry.state != OPEN
        entry.state = OPEN
        entry.opens_until = now + entry.next_cooldown
        self._not_closed.add(worker_id)
        if tripped:
            entry.trips += 1
            log.warning("circuit breaker opened for worker %s after %d consecutive failures: no requests for "
                        "%gs (trip %d)", worker_id, entry.consecutive_failures, entry.next_cooldown, entry.trips)

    def record_success(self, worker_id: str) -> None:
        """The worker's first body byte arrived: closed, counters and cooldown reset."""
        entry = self._entries.get(worker_id)
        if entry is None:
            return
        if entry.state != CLOSED:
            log.info("circuit breaker closed for worker %s: a request succeeded", worker_id)
        entry.consecutive_failures = 0
        entry.state = CLOSED
        entry.next_cooldown = self.cooldown_s
        entry.probe_started_at = None
        self._not_closed.discard(worker_id)

    def record_neutral(self, worker_id: str) -> None:
        """No verdict on the worker (a 4xx/429, or the client left first): only frees the probe slot."""
        entry = self._entries.get(worker_id)
        if entry is not None:
            entry.probe_started_at = None

    def forget(self, worker_id: str) -> None:
        """The worker left the fleet."""
        self._entries.pop(worker_id, None)
        self._not_closed.discard(worker_id)

    # -- introspection (metrics, tests) --------------------------------------------------------------
    def state(self, worker_id: str) -> str:
        """The stored state: an open worker whose cooldown has passed reads ``open`` until a
        request is routed past it (the transition to half-open happens on admission)."""
        entry = self._entries.get(worker_id)
        return CLOSED if entry is None else entry.state

    def trips(self, worker_id: str) -> int:
        entry = self._entries.get(worker_id)
        return 0 if entry is None else entry.trips

    def entry(self, worker_id: str) -> BreakerEntry | None:
        return self._entries.get(worker_id)
