"""Mixed dispatch: pick a worker, send, fail over before the first byte, relay the rest.

The router hands the server a ``Reply``: a unary body, or a stream whose first chunk has already
arrived (that is the commit point: before it we may retry elsewhere, after it never).
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

from infera.api.errors import ApiError, sse_error_event
from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.router.policy import Policy, RoutedRequest
from infera.server.metrics import ServerMetrics
from infera.transport.http import HttpTransport, UpstreamError, UpstreamResponse

log = logging.getLogger(__name__)

DP_RANK_HEADER = "X-Data-Parallel-Rank"
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')

# (worker, request, engine-reported cached prompt tokens or None) after a 200 reply completes.
UsageObserver = Callable[[WorkerRecord, RoutedRequest, "int | None"], None]


def reported_cached_tokens(data: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` from a reply body or a stream's tail."""
    found = _CACHED_TOKENS.findall(data)
    return int(found[-1]) if found else None


@dataclass(slots=True)
class Reply:
    status: int
    content_type: str
    worker_id: str
    body: bytes | None = None  # unary reply
    stream: "AsyncIterator[bytes] | None" = None  # streaming reply (first chunk included)
    first_byte_at: float | None = None


@dataclass(slots=True)
class _Failure:
    """An attempt that failed before the first byte; retryable on another worker."""

    status: int
    message: str
    reason: str
    body: bytes | None = None


class MixedRouter:
    """Routes to mixed (non-disaggregated) workers of the requested model."""

    def __init__(self, fleet: Fleet, policy: Policy, transport: HttpTransport, metrics: ServerMetrics,
                 *, max_retries: int = 1, direct: bool = False, clock: Callable[[], float] = time.perf_counter,
                 usage_observer: UsageObserver | None = None) -> None:
        self.fleet = fleet
        self.policy = policy
        self._prepare = getattr(policy, "prepare", None)  # async per-request setup (tokenize once)
        self.usage_observer = usage_observer
        self.transport = transport
        self.metrics = metrics
        self.max_retries = max_retries
        self.direct = direct
        self._clock = clock

    # -- candidate selection ---------------------------------------------------------------------
    def candidates(self, model: str) -> Sequence[WorkerRecord]:
        workers = self.fleet.active(model, "mixed")
        if workers:
            return workers
        if not self.fleet.active():
            raise ApiError(503, "no active worker in the fleet; retry shortly", "no_active_worker",
                           headers={"Retry-After": "1"})
        if not self.fleet.knows_model(model):
            raise ApiError(404, f"The model `{model}` does not exist. Available: {', '.join(self.fleet.models())}",
                           "model_not_found", param="model")
        raise ApiError(503, f"no active mixed worker for model {model!r}; retry shortly", "no_active_worker",
                       headers={"Retry-After": "1"})

    # -- dispatch ----------------------------------------------------------------------------------
    async def dispatch(self, req: RoutedRequest) -> Reply:
        if self.direct and req.direct_worker is not None:
            worker = self.fleet.get(req.direct_worker)
            if worker is None or not worker.is_active:
                raise ApiError(503, f"worker {req.direct_worker!r} not found (stale gateway routing?)",
                               "worker_not_found", headers={"Retry-After": "1"})
            if worker.model_name != req.model:
                raise ApiError(400, f"worker {worker.worker_id!r} serves {worker.model_name!r}, not {req.model!r}",
                               "model_mismatch", param="model")
            result = await self._attempt(worker, req)
            return self._finish(result, req)

        candidates = self.candidates(req.model)
        if self._prepare is not None:
            await self._prepare(req)
        tried: set[str] = set()
        result: Reply | _Failure | None = None
        for attempt in range(1 + self.max_retries):
            pool = candidates if not tried else [w for w in candidates if w.worker_id not in tried]
            if not pool:
                break
            worker = self.policy.pick(pool, req)
            tried.add(worker.worker_id)
            result = await self._attempt(worker, req)
            if isinstance(result, Reply):
                return result
            log.warning("request %s: %s (attempt %d)", req.request_id, result.message, attempt + 1)
            self.metrics.count_retry(req.route, result.reason)
        return self._finish(result, req)

    @staticmethod
    def _finish(result: "Reply | _Failure | None", req: RoutedRequest) -> Reply:
        if isinstance(result, Reply):
            return result
        assert result is not None
        raise ApiError(result.status, result.message, result.reason)

    async def _attempt(self, worker: WorkerRecord, req: RoutedRequest) -> "Reply | _Failure":
        transport = self.transport
        policy = self.policy
        inflight = self.metrics.inflight_gauge(worker.worker_id)
        policy.on_started(worker, req)
        inflight.inc()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                inflight.dec()
                policy.on_finished(worker, req)

        resp: UpstreamResponse | None = None
        try:
            host, port = transport.address(worker.url)
            rank = req.state.get("dp_rank")
            headers = (("X-Request-Id", req.request_id),) if rank is None else (
                ("X-Request-Id", req.request_id), (DP_RANK_HEADER, str(rank)))
            resp = await transport.post(host, port, req.route, req.body, headers)
            status = resp.status
            if status >= 500:
                body = await resp.read()
                resp.release()
                release()
                return _Failure(status, f"worker {worker.worker_id} returned {status}", f"http_{status}", body)
            if not req.stream or status != 200:
                # A 4xx is the client's fault: returned as is, never retried elsewhere.
                body = await resp.read()
                resp.release()
                release()
                if status == 200 and self.usage_observer is not None:
                    self.usage_observer(worker, req, reported_cached_tokens(body))
                return Reply(status, resp.content_type, worker.worker_id, body=body)
            first = await resp.next_chunk()
            if not first:
                resp.release()
                release()
                return _Failure(502, f"worker {worker.worker_id} closed the stream before the first byte", "empty_stream")
        except UpstreamError as exc:
            if resp is not None:
                resp.release()
            release()
            return _Failure(502, f"worker {worker.worker_id} unreachable: {exc}", "unreachable")
        except BaseException:  # cancelled (client gone): closing upstream makes the engine abort
            if resp is not None:
                resp.release()
            release()
            raise
        return Reply(200, resp.content_type, worker.worker_id, stream=self._relay(first, resp, worker, req, release),
                     first_byte_at=self._clock())

    async def _relay(self, first: bytes, resp: UpstreamResponse, worker: WorkerRecord, req: RoutedRequest,
                     release: Callable[[], None]) -> AsyncIterator[bytes]:
        observer = self.usage_observer
        tail = first[-2048:] if observer is not None else b""
        try:
            yield first
            while True:
                chunk = await resp.next_chunk()
                if not chunk:
                    break
                if observer is not None:  # the usage chunk comes last: keep a short tail
                    tail = (tail + chunk)[-2048:]
                yield chunk
            if observer is not None:
                observer(worker, req, reported_cached_tokens(tail))
        except UpstreamError as exc:
            log.warning("worker %s failed mid-stream: %s", worker.worker_id, exc)
            self.metrics.count_midstream_failure(worker.worker_id)
            yield sse_error_event(f"worker {worker.worker_id} failed mid-stream", 502, "worker_failed_midstream")
        finally:
            # Fully read: the connection goes back to the pool. Otherwise (client gone, error)
            # it is closed, so the engine sees the abort and frees the slot.
            resp.release()
            release()
