"""A PD request's two legs and what each owes: ``_Leg`` charges its worker (the policy's in-flight
state, the in-flight gauge, the breaker's probe slot) when it is created, releases that once, and
gives the breaker one verdict against its own worker; ``PickedPair`` is a pair picked for a gateway
and sent by it. Also the small rules a pair follows: the failure reasons of
``infera_pd_bootstrap_failures_total``, the per-leg copy of a request, which prefill may pair with
which decode (``pd_kind``), and the bootstrap room a rank-pinned prefill needs (``align_room``).
The dispatch that drives the legs is ``infera.router.disagg``.
"""

from __future__ import annotations

from typing import Protocol

from infera.discovery.record import WorkerRecord
from infera.router.breaker import CircuitBreaker
from infera.router.metrics import RouterMetrics
from infera.router.policy import Policy, RoutedRequest
from infera.router.upstream import LegFailure


class LegOwner(Protocol):
    """What a leg charges and scores: the PD router's policy, metrics and breaker."""

    policy: Policy
    metrics: RouterMetrics
    breaker: CircuitBreaker


class _Leg:
    """One leg's worker, its own policy state, and its accounting (released exactly once), and its
    breaker verdict (given exactly once: the first one stands)."""

    __slots__ = ("_done", "_router", "_scored", "hold_engine_error", "req", "role", "worker")

    def __init__(
        self,
        router: LegOwner,
        role: str,
        worker: WorkerRecord,
        req: RoutedRequest,
        *,
        hold_engine_error: bool = False,
    ) -> None:
        self.role, self.worker, self.req, self._router = role, worker, req, router
        # an engine's 5xx is scored neutral here: the dispatch loop decides once another worker of
        # the role has had the request (see MixedRouter.dispatch)
        self.hold_engine_error = hold_engine_error
        self._done = False
        self._scored = False
        router.policy.on_started(worker, req)
        router.metrics.inflight_gauge(worker.worker_id).inc()
        # Created in the same loop step as the pick: on a half-open worker this leg is the probe
        # (every leg is scored, which frees the slot again).
        router.breaker.claim(worker.worker_id)

    @property
    def rank(self) -> int | None:
        return self.req.state.get("dp_rank")

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._router.metrics.inflight_gauge(self.worker.worker_id).dec()
            self._router.policy.on_finished(self.worker, self.req)

    # Each leg is scored against its own worker: a decode is not blamed for its prefill, nor the
    # reverse. Once per leg, so a later, vaguer outcome (the attempt unwinding) never overrides it.
    def score_success(self) -> None:
        self.req.state["served"] = True  # this leg's engine holds the prompt's KV now
        if not self._scored:
            self._scored = True
            self._router.breaker.record_success(self.worker.worker_id)

    def score_failure(self) -> None:
        if not self._scored:
            self._scored = True
            self._router.breaker.record_failure(self.worker.worker_id)

    def score_neutral(self) -> None:
        if not self._scored:
            self._scored = True
            self._router.breaker.record_neutral(self.worker.worker_id)


class PickedPair:
    """A pair picked but not sent (``DisaggRouter.pick``): each leg charged, released once."""

    __slots__ = ("decode", "prefill")

    def __init__(self, prefill: _Leg, decode: _Leg) -> None:
        self.prefill, self.decode = prefill, decode

    def finish(self, served: bool, *, failed: bool = False, blame: str | None = None) -> None:
        """The gateway's request ended: ``served`` (the engines answered < 400) marks the prompt as
        computed there; ``failed`` (5xx) counts against the leg whose worker is ``blame`` (default:
        the decode, the one the gateway called). Idempotent: the first call stands."""
        blamed = self.prefill if blame is not None and blame == self.prefill.worker.worker_id else self.decode
        for leg in (self.prefill, self.decode):
            if served:
                leg.score_success()
            elif failed and leg is blamed:
                leg.score_failure()
            else:
                leg.score_neutral()
            leg.release()


# A leg's failure reason (``LegFailure.reason``) → its kind in ``infera_pd_bootstrap_failures_total``
# (``<role>_<kind>``); any other reason is the protocol's, from a prefill reply without a usable handoff.
_LEG_FAILURE_KINDS = {
    "unreachable": "unreachable",
    "empty_stream": "unreachable",
    "timeout": "timeout",
    "admission": "busy",
    "body_too_large": "too_large",
    "upstream_reply_too_large": "too_large",
}


def bootstrap_failure_reason(exc: LegFailure) -> str:
    """``infera_pd_bootstrap_failures_total``'s reason for a leg that failed before the first byte:
    ``prefill_timeout``, ``<role>_4xx``/``_5xx`` (the engine's answer), ``<role>_unreachable``,
    ``_timeout``, ``_busy``, ``_too_large``, or ``handoff_extract_failed``."""
    if exc.reason == "prefill_timeout":
        return exc.reason
    if exc.reason.startswith("http_"):
        return f"{exc.role}_{'4xx' if exc.status < 500 else '5xx'}"
    kind = _LEG_FAILURE_KINDS.get(exc.reason)
    return f"{exc.role}_{kind}" if kind is not None else "handoff_extract_failed"


def _leg_request(req: RoutedRequest) -> RoutedRequest:
    """A per-leg copy: tokenization is shared, pick state (route key, rank, charges) is not."""
    return RoutedRequest(
        route=req.route,
        body=req.body,
        parsed=req.parsed,
        model=req.model,
        stream=req.stream,
        request_id=req.request_id,
        state=dict(req.state),
        trace_headers=req.trace_headers,
    )


def pd_kind(worker: WorkerRecord) -> tuple[str, str]:
    """(engine, protocol): what a prefill and its decode must share."""
    return worker.engine, str((worker.disagg_meta or {}).get("protocol"))


def align_room(room: int, prefill: WorkerRecord, rank: int | None) -> int:
    """``room mod dp_size == rank`` for a rank-pinned prefill (SGLang follows the room to the rank)."""
    size = prefill.dp_size or 1
    if rank is None or size <= 1:
        return room
    return room - room % size + rank
