"""Topology per request (``--router-mode auto``): a model with both PD pools active goes to the
disaggregated router; one PD pool alone (and no mixed worker) is a 503 that names the missing pool;
anything else is mixed. The choice is made per request, so PD and mixed models share a server.

``--router-mode direct`` adds pinning by header: ``x-worker-instance-id`` alone pins a mixed
worker; with ``x-prefill-instance-id`` too, the pair (prefill, decode) is used exactly as named.
Roles are checked (400 otherwise): a decode worker pinned alone would run the client's body as
its decode leg (a client-chosen KV handoff: the engine pulls KV from whatever host it names),
and a prefill worker alone only ever prefills.
"""
from __future__ import annotations

from typing import Callable

from infera.api.errors import ApiError
from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.router.breaker import CircuitBreaker
from infera.router.disagg import DisaggRouter, PickedPair
from infera.router.dispatch import MixedRouter, Reply
from infera.router.policy import RoutedRequest

_RETRY = {"Retry-After": "1"}


class Picked:
    """``AutoRouter.pick``'s answer: where a gateway sends the request, charged like a dispatch.
    ``worker``: the mixed worker, or the decode of a PD pair (``prefill`` then names its prefill);
    ``dp_rank``: the rank the policy chose on a rank-multiplexed worker. Call ``finish`` once the
    reply has ended or broken (more calls do nothing)."""

    __slots__ = ("worker", "dp_rank", "prefill", "prefill_dp_rank", "_finish", "finished")

    def __init__(self, worker: WorkerRecord, dp_rank: int | None,
                 finish: Callable[[int | None, str | None], None], *, prefill: WorkerRecord | None = None, prefill_dp_rank: int | None = None) -> None:
        self.worker, self.dp_rank, self._finish = worker, dp_rank, finish
        self.prefill, self.prefill_dp_rank = prefill, prefill_dp_rank
        self.finished = False

    def finish(self, status: int | None, blame: str | None = None) -> None:
        """``status``: the reply's HTTP status (None: none came, e.g. the client left first).
        < 400: the worker computed the prompt (the policy counts it cached there), the breaker
        hears a success; 5xx: a failure, of ``blame`` when it names the pair's prefill (else of
        ``worker``); anything else: no verdict."""
        if not self.finished:
            self.finished = True
            self._finish(status, blame)


def _mixed_finish(breaker: CircuitBreaker, worker: WorkerRecord, req: RoutedRequest,
                  release: Callable[[], None]) -> Callable[[int | None, str | None], None]:
    def finish(status: int | None, blame: str | None) -> None:
        if status is not None and status < 400:
            req.state["served"] = True
            breaker.record_success(worker.worker_id)
        elif status is not None and status >= 500:
            breaker.record_failure(worker.worker_id)
        else:
            breaker.record_neutral(worker.worker_id)
        release()

    return finish


def _pair_finish(pair: PickedPair) -> Callable[[int | None, str | None], None]:
    def finish(status: int | None, blame: str | None) -> None:
        pair.finish(status is not None and status < 400, failed=status is not None and status >= 500, blame=blame)

    return finish


class AutoRouter:
    def __init__(self, fleet: Fleet, mixed: MixedRouter, disagg: DisaggRouter, *, direct: bool = False) -> None:
        self.fleet = fleet
        self.mixed = mixed
        self.disagg = disagg
        self.direct = direct

    async def dispatch(self, req: RoutedRequest) -> Reply:
        if self.direct and req.direct_prefill is not None:
            return await self._direct_pair(req)
        if self.direct and req.direct_worker is not None:
            self._check_lone_worker(req.direct_worker)
        else:
            if self.topology(req.model) == "pd":
                return await self.disagg.dispatch(req)
        return await self.mixed.dispatch(req)

    def topology(self, model: str) -> str:
        """``"pd"`` when both PD pools of ``model`` are active, else ``"mixed"``; the 503 of one PD pool
        alone without a mixed worker (as ``dispatch``)."""
        prefills = self.fleet.active(model, "prefill")
        decodes = self.fleet.active(model, "decode")
        if prefills and decodes:
            return "pd"
        if (prefills or decodes) and not self.fleet.active(model, "mixed"):
            present, missing = ("prefill", "decode") if prefills else ("decode", "prefill")
            raise ApiError(503, f"model {model!r} has active {present} workers but no active {missing} "
                           f"worker, and no mixed worker serves it: PD needs both pools; retry when a "
                           f"{missing} worker registers", f"no_{missing}_worker", headers=_RETRY)
        return "mixed"

    async def pick(self, req: RoutedRequest, exclude: frozenset[str] = frozenset()) -> Picked:
        """Pick only, for a gateway that sends the request itself (``infera.gaie``): the target(s)
        ``dispatch`` would try first, by the same topology rule and policy, charged in flight until
        ``Picked.finish``. ``exclude``: worker ids not to pick (a gateway's retry)."""
        if self.topology(req.model) == "pd":
            pair = await self.disagg.pick(req, exclude)
            return Picked(pair.decode.worker, pair.decode.rank, _pair_finish(pair), prefill=pair.prefill.worker,
                          prefill_dp_rank=pair.prefill.rank)
        worker, release = await self.mixed.pick(req, exclude)
        return Picked(worker, req.state.get("dp_rank"), _mixed_finish(self.mixed.breaker, worker, req, release))

    def _check_lone_worker(self, worker_id: str) -> None:
        """A worker pinned alone must be mixed (a missing one is MixedRouter's 503)."""
        worker = self.fleet.get(worker_id)
        if worker is None or not worker.is_active or worker.disagg_mode == "mixed":
            return
        if worker.disagg_mode == "decode":
            raise ApiError(400, f"x-worker-instance-id: worker {worker_id!r} is a decode worker: it serves only the "
                           "decode half of a PD pair; name its prefill worker with x-prefill-instance-id",
                           "worker_role_mismatch")
        raise ApiError(400, f"x-worker-instance-id: worker {worker_id!r} is a {worker.disagg_mode} worker: it "
                       "cannot serve a request alone; pin a mixed worker, or a decode worker with its prefill in "
                       "x-prefill-instance-id", "worker_role_mismatch")

    def _worker(self, worker_id: str, mode: str, header: str) -> WorkerRecord:
        worker = self.fleet.get(worker_id)
        if worker is None or not worker.is_active:
            raise ApiError(503, f"{header}: worker {worker_id!r} not found (stale gateway routing?)",
                           "worker_not_found", headers=_RETRY)
        if worker.disagg_mode != mode:
            raise ApiError(400, f"{header}: worker {worker_id!r} is a {worker.disagg_mode} worker, not {mode}",
                           "worker_role_mismatch")
        return worker

    async def _direct_pair(self, req: RoutedRequest) -> Reply:
        if req.direct_worker is None:
            raise ApiError(400, "x-prefill-instance-id needs x-worker-instance-id naming the decode worker",
                           "missing_decode_worker")
        try:
            prefill = self._worker(req.direct_prefill or "", "prefill", "x-prefill-instance-id")
            decode = self._worker(req.direct_worker, "decode", "x-worker-instance-id")
        except ApiError as exc:
            if exc.status == 503:  # the reference counts a named worker that is gone (stale gateway)
                self.disagg.metrics.count_pd_bootstrap_failure("direct_worker_missing")
            raise
        for w in (prefill, decode):
            if w.model_name != req.model:
                raise ApiError(400, f"worker {w.worker_id!r} serves {w.model_name!r}, not {req.model!r}",
                               "model_mismatch", param="model")
        return await self.disagg.dispatch_pair(req, prefill, decode)

    async def close(self) -> None:
        await self.disagg.close()
