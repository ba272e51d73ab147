"""Fair queueing under overload (``--max-inflight-per-worker``): when a model's workers are all at
their admission bound, a request waits in a bounded queue instead of piling onto the engines, and
the queue serves tenants fairly, higher priority classes first.

**Capacity.** A model admits ``--max-inflight-per-worker`` × its active workers that hold a request
for its whole life (mixed and decode workers) at once. The kv-aware (or round-robin) pick happens
only when a request is admitted, so it is made with the fleet as it is then.

**Order.** Waiting requests are grouped by priority class (the tenant's ``priority`` in
``--api-keys-file``, higher first) and, within a class, by tenant; the next admitted is the oldest
request of the tenant that has been served least in that class for its weight (each admission
advances a tenant's virtual time by 1 / its ``weight``, 1 unless the keys file says otherwise; a
tenant that starts waiting is credited no less than the least-served tenant waiting, so idleness
does not bank credit; between tenants served alike, the one holding fewer slots for its weight goes
first, so that newcomer is next): with one heavy and one light tenant of equal weight, each gets
half of the freed slots while both wait (weights 3 and 1: three quarters and one), and a light
request never waits behind the heavy tenant's backlog. Without API keys every request is one
tenant's: first come, first served.

**Reserve.** ``--queue-reserve-per-worker`` R keeps R of each worker's slots for tenants holding
less than their fair share: a model with C slots over its workers and R × workers reserved admits
anyone while fewer than C − R × workers are in flight, and past that only a tenant that holds fewer
than its fair share, C × its weight / the weights of the tenants in flight or waiting there, while
another tenant is active. A
tenant that overloads the model on its own therefore never fills the reserve, and a light tenant's
request finds a slot at once instead of waiting for one to free, which a work-conserving queue makes
it do (bench/fairness.py, 2× overload, 90 % heavy: the light tenant's p99 TTFT 3.6× its unloaded
value with the queue alone, 1.4× with R = 2 of 8). The price: R × workers slots stay idle while one
tenant alone saturates the model (and always without API keys, where every request is one tenant's).

**Bounds.** At most ``--queue-max-waiting`` requests wait per model (more: 503 with Retry-After);
none waits longer than ``--queue-timeout`` (then 429 with Retry-After); a client that leaves while
waiting leaves the queue. Nothing is dropped silently.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from infera.api.errors import ApiError
from infera.runtime import wait_for

DEFAULT_QUEUE_TIMEOUT_S = 30.0
DEFAULT_MAX_WAITING = 1024
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass(slots=True)
class _Waiter:
    tenant: str
    priority: int
    future: asyncio.Future[None]
    since: float
    weight: float = 1.0


@dataclass(slots=True)
class _Class:
    """One priority class of one model: a FIFO per tenant and what each tenant was served (its
    virtual time: admissions / its weight)."""

    queues: dict[str, deque[_Waiter]] = field(default_factory=dict)
    served: dict[str, float] = field(default_factory=dict)

    def push(self, w: _Waiter) -> None:
        q = self.queues.get(w.tenant)
        if q is None:
            q = self.queues[w.tenant] = deque()
            floor = min((self.served.get(t, 0) for t in self.queues if t != w.tenant), default=None)
            if floor is not None:  # no credit banked while it was idle
                self.served[w.tenant] = max(self.served.get(w.tenant, 0), floor)
        q.append(w)

    def pop(self, eligible: Callable[[str], bool] | None = None, held: dict[str, int] | None = None) -> _Waiter | None:
        """The next request to admit (of a tenant ``eligible`` allows, when given), or None: the
        least-served tenant's oldest (for its weight); between tenants served alike, the one holding
        fewer slots for its weight (``held``: a tenant that just started waiting ties with the least
        served)."""
        best: tuple[float, float, float, str] | None = None
        held = held or {}
        for tenant, q in self.queues.items():
            if eligible is not None and not eligible(tenant):
                continue
            weight = q[0].weight
            key = (self.served.get(tenant, 0.0), held.get(tenant, 0) / weight, q[0].since, tenant)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        tenant = best[3]
        q = self.queues[tenant]
        w = q.popleft()
        if not q:
            del self.queues[tenant]
        self.served[tenant] = self.served.get(tenant, 0.0) + 1.0 / w.weight
        if not self.queues:
            self.served.clear()  # nobody waits: fairness starts over (the map stays bounded)
        return w

    def remove(self, w: _Waiter) -> None:
        q = self.queues.get(w.tenant)
        if q is not None and w in q:
            q.remove(w)
            if not q:
                del self.queues[w.tenant]


class Ticket:
    """An admitted request's slot: ``leave()`` once when its reply has ended (or broke)."""

    __slots__ = ("_left", "_queue", "model", "tenant")

    def __init__(self, queue: AdmissionQueue, model: str, tenant: str) -> None:
        self._queue, self.model, self.tenant, self._left = queue, model, tenant, False

    def leave(self) -> None:
        if not self._left:
            self._left = True
            self._queue._leave(self.model, self.tenant)


class _Model:
    __slots__ = ("classes", "held", "inflight", "waiting", "weights")

    def __init__(self) -> None:
        self.inflight = 0
        self.classes: dict[int, _Class] = {}
        self.waiting = 0
        self.held: dict[str, int] = {}  # tenant -> its requests in flight (tenants with none absent)
        # tenant -> its weight, for tenants in flight or waiting (the last their requests came with)
        self.weights: dict[str, float] = {}

    def take(self, tenant: str) -> None:
        self.inflight += 1
        self.held[tenant] = self.held.get(tenant, 0) + 1

    def give_back(self, tenant: str) -> None:
        self.inflight = max(0, self.inflight - 1)
        n = self.held.get(tenant, 0) - 1
        if n > 0:
            self.held[tenant] = n
        else:
            self.held.pop(tenant, None)
            self.forget_idle(tenant)

    def forget_idle(self, tenant: str) -> None:
        """Drop ``tenant``'s weight once it neither holds nor waits (the map stays bounded)."""
        if tenant not in self.held and not any(tenant in cls.queues for cls in self.classes.values()):
            self.weights.pop(tenant, None)

    def active_tenants(self, also: str | None = None) -> set[str]:
        """Tenants in flight or waiting (and ``also``)."""
        active = set(self.held)
        for cls in self.classes.values():
            active.update(cls.queues)
        if also is not None:
            active.add(also)
        return active

    def active_weight(self, also: str | None = None) -> tuple[int, float]:
        """How many tenants are in flight or waiting (and ``also``), and their weights' sum."""
        active = self.active_tenants(also)
        return len(active), sum(self.weights.get(t, 1.0) for t in active)


def reserved_slots(capacity: int, reserved_share: float) -> int:
    """Of ``capacity`` slots, those kept for tenants under their fair share (``capacity`` ×
    ``reserved_share``, which is R / --max-inflight-per-worker: R × workers exactly)."""
    return int(capacity * reserved_share + 1e-9) if reserved_share > 0 else 0


def may_take_reserved(
    held: int, capacity: int, active_tenants: int, weight: float = 1.0, active_weight: float | None = None
) -> bool:
    """Whether a tenant holding ``held`` of the model's ``capacity`` slots may take a reserved one:
    only below its fair share (capacity × its ``weight`` / the ``active_weight`` of the
    ``active_tenants``, itself included; equal weights: capacity / active_tenants), never alone."""
    total = float(active_tenants) if active_weight is None else active_weight
    return active_tenants >= 2 and held * total < capacity * weight


class AdmissionQueue:
    """``await enter(model, tenant, priority)`` → ``Ticket`` (at once while the model has room)."""

    def __init__(
        self,
        capacity: Callable[[str], int],
        *,
        timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S,
        max_waiting: int = DEFAULT_MAX_WAITING,
        reserved_share: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 <= reserved_share < 1.0:
            raise ValueError(
                "--queue-reserve-per-worker must be below --max-inflight-per-worker (some slots "
                "must be open to every tenant)"
            )
        self.capacity, self.timeout_s, self.max_waiting, self.clock = capacity, timeout_s, max_waiting, clock
        self.reserved_share = reserved_share
        self._models: dict[str, _Model] = {}
        self.admitted = 0
        self.queued = 0
        self.timeouts: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        self.wait_counts = [0] * (len(WAIT_BUCKETS) + 1)
        self.wait_total = 0.0

    def _model(self, model: str) -> _Model:
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = _Model()
        return m

    async def enter(self, model: str, tenant: str, priority: int = 0, weight: float = 1.0) -> Ticket:
        if not weight > 0:
            raise ValueError("a tenant's weight must be positive")
        m = self._model(model)
        m.weights[tenant] = weight
        self._admit_waiting(model, m)
        capacity = self.capacity(model)
        # No worker serves it (yet): nothing to wait for here; the router answers at once. Otherwise,
        # whoever still waits now cannot take a free slot, so one this tenant may take is its own.
        if capacity <= 0 or self._admissible(m, tenant, capacity, new=True):
            m.take(tenant)
            self.admitted += 1
            self._observe_wait(0.0)
            return Ticket(self, model, tenant)
        if m.waiting >= self.max_waiting:
            self.rejected[model] = self.rejected.get(model, 0) + 1
            raise ApiError(
                503,
                f"model {model!r} is at capacity and {m.waiting} requests already wait for it; retry shortly",
                "queue_full",
                headers={"Retry-After": "1"},
            )
        w = _Waiter(tenant, priority, asyncio.get_running_loop().create_future(), self.clock(), weight)
        cls = m.classes.get(priority)
        if cls is None:
            cls = m.classes[priority] = _Class()
        cls.push(w)
        m.waiting += 1
        self.queued += 1
        try:
            await wait_for(asyncio.shield(w.future), self.timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if w.future.done() and not w.future.cancelled():  # admitted as the wait ended: give it back
                self._leave(model, tenant)
            else:
                w.future.cancel()
                cls.remove(w)
                m.waiting -= 1
                m.forget_idle(tenant)
                self._admit_waiting(model, m)  # one tenant fewer waiting: the others' fair shares grow
            if isinstance(exc, asyncio.CancelledError):
                raise
            self.timeouts[model] = self.timeouts.get(model, 0) + 1
            raise ApiError(
                429,
                f"model {model!r} stayed at capacity for the {self.timeout_s:g} s this request may "
                "wait (--queue-timeout); retry later",
                "queue_timeout",
                headers={"Retry-After": str(max(1, round(self.timeout_s / 4)))},
            ) from None
        self._observe_wait(self.clock() - w.since)
        return Ticket(self, model, tenant)

    def _observe_wait(self, seconds: float) -> None:
        i = 0
        while i < len(WAIT_BUCKETS) and seconds > WAIT_BUCKETS[i]:
            i += 1
        self.wait_counts[i] += 1
        self.wait_total += seconds

    def _leave(self, model: str, tenant: str) -> None:
        m = self._model(model)
        m.give_back(tenant)
        self._admit_waiting(model, m)

    def _admissible(self, m: _Model, tenant: str, capacity: int, new: bool = False) -> bool:
        """Whether a request of ``tenant`` may take a slot now (``new``: one not counted as waiting)."""
        if m.inflight >= capacity:
            return False
        reserved = reserved_slots(capacity, self.reserved_share)
        if m.inflight < capacity - reserved:
            return True
        count, total = m.active_weight(tenant if new else None)
        return may_take_reserved(m.held.get(tenant, 0), capacity, count, m.weights.get(tenant, 1.0), total)

    def _admit_waiting(self, model: str, m: _Model) -> None:
        """Hand freed slots to waiting requests: the highest class first, fair among its tenants;
        reserved slots only to tenants under their fair share."""
        if not m.waiting:
            return
        capacity = self.capacity(model)
        while m.waiting and m.inflight < capacity:
            reserved = reserved_slots(capacity, self.reserved_share)
            eligible = None
            if m.inflight >= capacity - reserved:
                count, total = m.active_weight()

                def eligible(t: str) -> bool:
                    return may_take_reserved(m.held.get(t, 0), capacity, count, m.weights.get(t, 1.0), total)

            w = None
            for priority in sorted(m.classes, reverse=True):
                w = m.classes[priority].pop(eligible, m.held)
                if w is not None:
                    break
            if w is None:
                break
            m.waiting -= 1
            if w.future.done():  # gave up already
                m.forget_idle(w.tenant)
                continue
            m.take(w.tenant)
            self.admitted += 1
            w.future.set_result(None)

    def refresh(self) -> None:
        """The fleet changed (a worker joined): waiting requests may fit now."""
        for model, m in list(self._models.items()):
            self._admit_waiting(model, m)

    def view(self, model: str) -> dict[str, Any] | None:
        """The dashboard's line for ``model`` (``/v1/fleet``): None when no request came for it."""
        m = self._models.get(model)
        if m is None:
            return None
        now = self.clock()
        oldest = min((q[0].since for cls in m.classes.values() for q in cls.queues.values()), default=None)
        capacity = self.capacity(model)
        return {
            "waiting": m.waiting,
            "in_flight": m.inflight,
            "capacity": capacity,
            "reserved": reserved_slots(capacity, self.reserved_share),
            "tenants_waiting": len({t for cls in m.classes.values() for t in cls.queues}),
            "oldest_wait_s": None if oldest is None else round(now - oldest, 3),
            "timeouts_total": self.timeouts.get(model, 0),
            "rejected_total": self.rejected.get(model, 0),
        }

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {
            model: {"inflight": m.inflight, "waiting": m.waiting, "capacity": self.capacity(model)}
            for model, m in self._models.items()
        }


class AdmissionMetrics:
    def __init__(self, queue: AdmissionQueue) -> None:
        self.queue = queue

    def collect(self) -> Iterator[Metric]:
        q = self.queue
        g = GaugeMetricFamily("infera_queue_waiting", "Requests waiting for a free slot, per model", labels=["model"])
        a = GaugeMetricFamily(
            "infera_queue_admitted_inflight", "Admitted requests in flight, per model", labels=["model"]
        )
        for model, s in sorted(q.snapshot().items()):
            g.add_metric([model], s["waiting"])
            a.add_metric([model], s["inflight"])
        yield g
        yield a
        c = CounterMetricFamily("infera_queue_timeouts", "Requests that waited --queue-timeout (429)", labels=["model"])
        for model, n in sorted(q.timeouts.items()):
            c.add_metric([model], n)
        yield c
        c = CounterMetricFamily("infera_queue_rejected", "Requests refused with the queue full (503)", labels=["model"])
        for model, n in sorted(q.rejected.items()):
            c.add_metric([model], n)
        yield c
        h = HistogramMetricFamily("infera_queue_wait_seconds", "Time from arrival to admission")
        buckets, running = [], 0
        for bound, n in zip((*(repr(float(b)) for b in WAIT_BUCKETS), "+Inf"), q.wait_counts):
            running += n
            buckets.append((bound, running))
        h.add_metric([], buckets, q.wait_total)
        yield h
