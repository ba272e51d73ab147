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

from infera.api.errors import ApiError
from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.router.disagg import DisaggRouter
from infera.router.dispatch import MixedRouter, Reply
from infera.router.policy import RoutedRequest

_RETRY = {"Retry-After": "1"}


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
            model = req.model
            prefills = self.fleet.active(model, "prefill")
            decodes = self.fleet.active(model, "decode")
            if prefills and decodes:
                return await self.disagg.dispatch(req)
            if (prefills or decodes) and not self.fleet.active(model, "mixed"):
                present, missing = ("prefill", "decode") if prefills else ("decode", "prefill")
                raise ApiError(503, f"model {model!r} has active {present} workers but no active {missing} "
                               f"worker, and no mixed worker serves it: PD needs both pools; retry when a "
                               f"{missing} worker registers", f"no_{missing}_worker", headers=_RETRY)
        return await self.mixed.dispatch(req)

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
        prefill = self._worker(req.direct_prefill or "", "prefill", "x-prefill-instance-id")
        decode = self._worker(req.direct_worker, "decode", "x-worker-instance-id")
        for w in (prefill, decode):
            if w.model_name != req.model:
                raise ApiError(400, f"worker {w.worker_id!r} serves {w.model_name!r}, not {req.model!r}",
                               "model_mismatch", param="model")
        return await self.disagg.dispatch_pair(req, prefill, decode)

    async def close(self) -> None:
        await self.disagg.close()
