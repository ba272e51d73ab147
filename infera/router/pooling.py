"""Routing of the pooling and utility endpoints (embeddings, rerank, score, classify, tokenize,
detokenize): to the active mixed workers of the model that serve the route's task, picked by load.

One ``TaskRouter`` per task is a ``MixedRouter`` whose candidates are the workers serving that
task, with the mixed router's transport, metrics and circuit breaker (one verdict per worker,
whatever it serves), so failover before the first byte, the breaker and the in-flight gauges work
as for chat. They share one ``LeastLoadedPolicy``: no prompt hashing (a pooling request leaves no
KV cache behind to come back to), the worker with the fewest of these requests in flight, ties
taken in turn.
"""

from __future__ import annotations

from collections.abc import Sequence

from infera.api.pooling import WorkersForTask, task_unserved
from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.router.breaker import CircuitBreaker
from infera.router.dispatch import MixedRouter
from infera.router.metrics import RouterMetrics
from infera.router.policy import RoutedRequest
from infera.transport.request import RequestTransport

# Models whose filtered candidate tuple is kept (recomputed when the fleet's tuple changes).
CANDIDATE_CACHE_CAP = 1024


class LeastLoadedPolicy:
    """The candidate with the fewest requests in flight through this policy; among equals, each
    in turn (a per-set counter would be fairer still, but ties are rare under load and an idle
    fleet only needs spreading)."""

    name = "least-loaded"

    def __init__(self) -> None:
        self._inflight: dict[str, int] = {}
        self._turn = 0

    def load(self, worker_id: str) -> int:
        return self._inflight.get(worker_id, 0)

    def pick(self, candidates: Sequence[WorkerRecord], request: RoutedRequest, role: str = "mixed") -> WorkerRecord:
        if len(candidates) == 1:
            return candidates[0]
        inflight = self._inflight
        least = min(inflight.get(w.worker_id, 0) for w in candidates)
        tied = [w for w in candidates if inflight.get(w.worker_id, 0) == least]
        self._turn += 1
        return tied[self._turn % len(tied)]

    def on_started(self, worker: WorkerRecord, request: RoutedRequest) -> None:
        self._inflight[worker.worker_id] = self._inflight.get(worker.worker_id, 0) + 1

    def on_finished(self, worker: WorkerRecord, request: RoutedRequest) -> None:
        n = self._inflight.get(worker.worker_id, 0) - 1
        if n > 0:
            self._inflight[worker.worker_id] = n
        else:
            self._inflight.pop(worker.worker_id, None)

    def forget(self, worker_id: str) -> None:
        self._inflight.pop(worker_id, None)


class TaskRouter(MixedRouter):
    """A mixed router over the workers of a model that serve ``task`` (None: every worker)."""

    def __init__(
        self,
        task: str | None,
        fleet: Fleet,
        policy: LeastLoadedPolicy,
        transport: RequestTransport,
        metrics: RouterMetrics,
        *,
        max_retries: int = 1,
        direct: bool = False,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        super().__init__(fleet, policy, transport, metrics, max_retries=max_retries, direct=direct, breaker=breaker)
        self.task = task
        self._serving = WorkersForTask(task, CANDIDATE_CACHE_CAP)

    def candidates(self, model: str) -> Sequence[WorkerRecord]:
        workers = self.fleet.active(model, "mixed")
        serving = self._serving(model, workers)
        if serving:
            return serving
        if not workers:
            return super().candidates(model)  # no active worker, unknown model, none active: its errors
        raise task_unserved(self.fleet, model, self.task, workers)
