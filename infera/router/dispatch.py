"""Mixed dispatch: pick a worker, send, fail over before the first byte, relay the rest.

Candidates pass the circuit breaker before the policy picks (``infera.router.breaker``), and every
attempt's outcome up to the first byte is scored there.

The router hands the server a ``Reply``: a unary body, or a stream whose first chunk has already
arrived (that is the commit point: before it we may retry elsewhere, after it never).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter

import msgspec

from infera.api.cache_hints import RETENTION_NAMES
from infera.api.errors import ApiError
from infera.api.pooling import GENERATE, WorkersForTask, task_unserved
from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.router.breaker import CircuitBreaker
from infera.router.engine_hints import EngineHints
from infera.router.lora import adapter_holders, adapter_models, knows_adapter, mark_adapter
from infera.router.lora_loading import AdapterLoader
from infera.router.metrics import InflightGauge, RouterMetrics
from infera.router.migration import MigratingRelay, StreamTracker, request_for_migration
from infera.router.policy import Policy, RoutedRequest
from infera.router.upstream import (
    LegFailure,
    Opened,
    Relay,
    is_engine_error,
    open_upstream,
    repeated_engine_error,
    request_headers,
    unreachable_mark,
)
from infera.transport.request import RequestTransport

log = logging.getLogger(__name__)

# OpenAI's usage.prompt_tokens_details.cached_tokens; Anthropic's usage.cache_read_input_tokens (an
# engine's own /v1/messages reply, passed through: vLLM writes its cached_tokens there).
_CACHED_TOKENS = re.compile(rb'"(?:cached_tokens|cache_read_input_tokens)"\s*:\s*(\d+)')
_CACHED_KEYS = (b'"cached_tokens"', b'"cache_read_input_tokens"')

# (worker, request, engine-reported cached prompt tokens or None) after a 200 reply completes.
UsageObserver = Callable[[WorkerRecord, RoutedRequest, "int | None"], None]


def reported_cached_tokens(data: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` from a reply body or a stream's tail: the last
    one (usage comes last), found from the end rather than by scanning the whole body."""
    for key in _CACHED_KEYS:  # a reply carries one of the two shapes
        at = data.rfind(key)
        while at >= 0:
            m = _CACHED_TOKENS.match(data, at)
            if m is not None:
                return int(m.group(1))
            at = data.rfind(key, 0, at)  # (e.g. "cached_tokens": null) an earlier one
    return None


@dataclass(slots=True)
class Reply:
    status: int
    content_type: str
    worker_id: str
    body: bytes | None = None  # unary reply
    stream: Relay | MigratingRelay | None = None  # a stream (first chunk included); aclose() it when done
    first_byte_at: float | None = None


def outcome_of(status: int) -> str:
    """A reply's ``outcome`` label: ``ok`` below 400; 429, 502 and 503 as themselves (load shed, a
    worker unreachable, none available); any other status by its class."""
    if status < 400:
        return "ok"
    if status in (429, 502, 503):
        return str(status)
    return "4xx" if status < 500 else "5xx"


def count_hints(metrics: RouterMetrics, req: RoutedRequest) -> None:
    """A pick made with the request's cache hints in hand (a policy that reads them, kv-aware, has
    parsed them by then): its retention, and whether prompt overlap was ignored (multimodal)."""
    hints = req.state.get("hints")
    if hints is not None:
        metrics.count_cache_control(RETENTION_NAMES[hints.retention])
        if hints.multimodal:
            metrics.count_cache_locality_skipped("multimodal")


class RequestAccount:
    """One request through a router: in flight (``infera_request_inflight{router}``) from the
    dispatch until the reply, or its stream, has ended; then its duration, by outcome. Ends once."""

    __slots__ = ("_gauge", "_metrics", "_req", "_router", "_started")

    def __init__(self, metrics: RouterMetrics, router: str, req: RoutedRequest) -> None:
        self._metrics, self._router, self._req = metrics, router, req
        self._started = perf_counter()
        gauge = metrics.request_inflight_gauge(router)
        gauge.inc()
        self._gauge: InflightGauge | None = gauge

    def end(self, outcome: str) -> None:
        gauge = self._gauge
        if gauge is not None:
            self._gauge = None
            gauge.dec()
            req = self._req
            self._metrics.observe_request(self._router, outcome, req.route, req.stream, perf_counter() - self._started)

    def replied(self, reply: Reply) -> Reply:
        """The dispatch's reply: a unary one ends the request now, a stream when it is closed."""
        if reply.stream is None:
            self.end(outcome_of(reply.status))
        else:
            reply.stream.on_end(self.end)
        return reply

    def failed(self, exc: BaseException) -> None:
        """The dispatch raised: the client's error status, or the client gone."""
        if isinstance(exc, ApiError):
            self.end(outcome_of(exc.status))
        else:
            self.end("client_gone" if isinstance(exc, asyncio.CancelledError) else "error")


class MixedRouter:
    """Routes to mixed (non-disaggregated) workers of the requested model."""

    def __init__(
        self,
        fleet: Fleet,
        policy: Policy,
        transport: RequestTransport,
        metrics: RouterMetrics,
        *,
        max_retries: int = 1,
        direct: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        usage_observer: UsageObserver | None = None,
        breaker: CircuitBreaker | None = None,
        migration_limit: int = 0,
        engine_hints: EngineHints | None = None,
        lora_loader: AdapterLoader | None = None,
    ) -> None:
        self.fleet = fleet
        # --lora-dynamic-loading: an adapter no worker holds is loaded on one first (router/lora_loading.py).
        self.lora_loader = lora_loader
        self.policy = policy
        self._prepare = getattr(policy, "prepare", None)  # async per-request setup (tokenize once)
        self._prepare_cached = getattr(policy, "prepare_cached", None)  # the same, when no await is needed
        self._on_first_byte = getattr(policy, "on_first_byte", None)
        self.usage_observer = usage_observer
        self.transport = transport
        self.metrics = metrics
        self.max_retries = max_retries
        self.direct = direct
        self._clock = clock
        # Shared with the PD router (one verdict per worker whatever it serves); disabled by default.
        self.breaker = breaker or CircuitBreaker(failure_threshold=0)
        # --migration-limit: moves of a broken stream to another worker (0: a break ends the stream).
        self.migration_limit = migration_limit
        # The cache retention each engine is told (priority, kvd retention): added per worker, in _open.
        self.engine_hints = engine_hints or EngineHints()
        # A pooling worker (its record's tasks: embed, classify, ...) serves no chat or completions.
        self._generative = WorkersForTask(GENERATE)

    # -- candidate selection ---------------------------------------------------------------------
    def candidates(self, model: str) -> Sequence[WorkerRecord]:
        active = self.fleet.active(model, "mixed")
        workers = self._generative(model, active)
        if workers:
            return workers
        if not active:  # a LoRA adapter's requests go only to the workers holding it (router/lora.py)
            holders = adapter_holders(self.fleet, model)
            if holders:
                return holders
        if active:  # only pooling workers serve the model: a 400 naming the task (503 while one may come back)
            raise task_unserved(self.fleet, model, GENERATE, active)
        if not self.fleet.active():
            raise ApiError(
                503, "no active worker in the fleet; retry shortly", "no_active_worker", headers={"Retry-After": "1"}
            )
        if not self.fleet.knows_model(model) and not knows_adapter(self.fleet, model):
            available = [*self.fleet.models(), *(name for name, _ in adapter_models(self.fleet))]
            raise ApiError(
                404,
                f"The model `{model}` does not exist. Available: {', '.join(available)}",
                "model_not_found",
                param="model",
            )
        raise ApiError(
            503,
            f"no active mixed worker for model {model!r}; retry shortly",
            "no_active_worker",
            headers={"Retry-After": "1"},
        )

    async def candidates_loading(self, model: str) -> Sequence[WorkerRecord]:
        """``candidates``; with dynamic LoRA loading, a model no worker serves is an adapter to load."""
        try:
            return self.candidates(model)
        except ApiError as exc:
            if self.lora_loader is None or exc.status != 404:
                raise
        return await self.lora_loader.holders(model)

    # -- dispatch ----------------------------------------------------------------------------------
    async def dispatch(self, req: RoutedRequest) -> Reply:
        account = RequestAccount(
            self.metrics, "direct" if self.direct and req.direct_worker is not None else "mixed", req
        )
        try:
            reply = await self._dispatch(req)
        except BaseException as exc:
            account.failed(exc)
            raise
        return account.replied(reply)

    async def _dispatch(self, req: RoutedRequest) -> Reply:
        if self.direct and req.direct_worker is not None:
            worker = self.fleet.get(req.direct_worker)
            if worker is None or not worker.is_active:
                raise ApiError(
                    503,
                    f"worker {req.direct_worker!r} not found (stale gateway routing?)",
                    "worker_not_found",
                    headers={"Retry-After": "1"},
                )
            if worker.model_name != req.model:
                raise ApiError(
                    400,
                    f"worker {worker.worker_id!r} serves {worker.model_name!r}, not {req.model!r}",
                    "model_mismatch",
                    param="model",
                )
            try:
                return await self._attempt(worker, req)
            except LegFailure as exc:
                raise ApiError(exc.status, exc.message, exc.reason, headers=unreachable_mark(exc)) from None

        candidates = await self.candidates_loading(req.model)
        await self.prepare(req, candidates)
        tried: set[str] = set()
        failure: LegFailure | None = None
        # A worker whose engine answered 5xx, its breaker vote held until another worker has been
        # tried: a success there confirms it; a second engine 5xx makes it the request's fault.
        suspect: str | None = None
        for attempt in range(1 + self.max_retries):
            pool = candidates if not tried else [w for w in candidates if w.worker_id not in tried]
            if not pool:
                break
            worker = self.choose(pool, req)
            tried.add(worker.worker_id)
            req.state["attempts"] = attempt + 1  # the request's trace span reports it
            try:
                reply = await self._attempt(worker, req, hold_engine_error=True)
            except LegFailure as exc:
                failure = exc
                if not exc.retryable:
                    break
                if is_engine_error(exc):
                    if suspect is not None:
                        raise repeated_engine_error(req.request_id, suspect, exc) from None
                    suspect = worker.worker_id
            else:
                if suspect is not None and reply.status < 400:
                    self.breaker.record_failure(suspect)  # another worker served it: the 5xx was the worker's
                return reply
            log.warning("request %s: %s (attempt %d)", req.request_id, failure.detail, attempt + 1)
            self.metrics.count_retry(req.route, failure.reason)
        if suspect is not None:
            self.breaker.record_failure(suspect)  # no other engine's answer to weigh it against
        assert failure is not None
        raise ApiError(failure.status, failure.message, failure.reason, headers=failure.headers)

    async def _attempt(self, worker: WorkerRecord, req: RoutedRequest, *, hold_engine_error: bool = False) -> Reply:
        """One worker; ``LegFailure`` if it failed before the first byte. A 4xx is the client's
        fault: returned as is, never retried elsewhere. The breaker hears the outcome either way,
        except an engine's 5xx with ``hold_engine_error`` (scored neutral: the caller decides)."""
        tracker = None
        route, body = req.route, req.body
        own = req.body_for(worker) if req.body_for is not None else None
        if own is not None:  # the engine's own API: its stream is not the chat stream a tracker follows
            route, body = own
        elif self.migration_limit > 0 and req.stream and req.direct_worker is None:
            route, body, tracker = self._tracked(worker, req)
        sent = self._clock()
        opened, release = await self._open(worker, req, route, body, hold_engine_error=hold_engine_error)
        observer = self.usage_observer
        if opened.resp is None:
            release()
            if opened.status == 200 and observer is not None:
                observer(worker, req, reported_cached_tokens(opened.body or b""))
            return Reply(opened.status, opened.content_type, worker.worker_id, body=opened.body)
        on_tail = None if observer is None else (lambda tail: observer(worker, req, reported_cached_tokens(tail)))
        stream: Relay
        if tracker is not None:
            stream = MigratingRelay(
                opened,
                worker,
                tracker,
                lambda t, tried: self._migrate(req, t, tried),
                self.metrics,
                release,
                on_tail,
                self.migration_limit,
            )
            # Read to its end, it ended well if the generation did (every break moved on, or only
            # the [DONE] was lost); otherwise the client got an error event.
            stream.judge_by(lambda: tracker.done or tracker.finished)
        else:
            stream = Relay(opened, worker, self.metrics, release, on_tail)
        first_byte_at = self._clock()
        if self._on_first_byte is not None:  # the stream's time to first byte, for the policy to learn from
            self._on_first_byte(req, first_byte_at - sent)
        return Reply(200, opened.content_type, worker.worker_id, stream=stream, first_byte_at=first_byte_at)

    def _tracked(self, worker: WorkerRecord, req: RoutedRequest) -> tuple[str, bytes, StreamTracker | None]:
        """The body a migratable stream starts with (token ids asked for where the engine
        reports them) and its tracker; the request's own body when it cannot be tracked."""
        original = req.state.get("migration_body")
        if original is None:
            try:
                original = req.state["migration_body"] = msgspec.json.decode(req.body)
            except msgspec.DecodeError:
                return req.route, req.body, None
        if not isinstance(original, dict):
            return req.route, req.body, None
        first, strip = request_for_migration(req.route, original, worker.engine)
        body = req.body if first is original else msgspec.json.encode(first)
        return req.route, body, StreamTracker(req.route, original, strip_ids=strip)

    async def _migrate(
        self, req: RoutedRequest, tracker: StreamTracker, tried: set[str]
    ) -> tuple[WorkerRecord, Opened, Callable[[], None]]:
        """Open the continuation of a broken stream on another mixed worker (never one already
        tried), failing over before its first byte like a new request."""
        failure: LegFailure | None = None
        for _ in range(1 + self.max_retries):
            pool = [
                w
                for w in self._generative(req.model, self.fleet.active(req.model, "mixed"))
                if w.worker_id not in tried
            ]
            if not pool:
                break
            worker = self.policy.pick(self.breaker.filter(pool), req)
            tried.add(worker.worker_id)
            req.state["migrations"] = req.state.get("migrations", 0) + 1  # the request's trace span reports it
            route, body = tracker.continuation(worker.engine)
            try:
                opened, release = await self._open(worker, req, route, body)
            except LegFailure as exc:
                failure = exc
                continue
            if opened.resp is None:  # refused (4xx) or unary: no stream to continue with
                release()
                failure = LegFailure(
                    worker.worker_id,
                    opened.status,
                    f"the worker answered {opened.status} to the continuation",
                    "continuation_refused",
                    detail=f"worker {worker.worker_id} answered {opened.status} to the continuation",
                )
                continue
            return worker, opened, release
        if failure is not None:
            raise failure
        raise LegFailure("", 503, "no other worker to continue the stream on", "no_candidate")

    def charge(self, worker: WorkerRecord, req: RoutedRequest) -> Callable[[], None]:
        """Charge a picked worker with ``req`` (policy in flight, the in-flight gauge, the breaker's
        probe slot); returns the release, which undoes the first two once however often called.
        The caller scores the breaker (every outcome frees the probe slot)."""
        policy = self.policy
        inflight = self.metrics.inflight_gauge(worker.worker_id)
        policy.on_started(worker, req)
        inflight.inc()
        # Still the pick's loop step: on a half-open worker this request is the probe.
        self.breaker.claim(worker.worker_id)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                inflight.dec()
                policy.on_finished(worker, req)

        return release

    async def prepare(self, req: RoutedRequest, candidates: Sequence[WorkerRecord] = ()) -> None:
        """The policy's per-request work (tokenizing, on the tokenizer threads), once; a request for
        a LoRA adapter (``candidates`` hold it) is marked as one first (its own hash space)."""
        mark_adapter(req, candidates)
        if self._prepare is not None and (self._prepare_cached is None or not self._prepare_cached(req)):
            await self._prepare(req)

    def choose(self, pool: Sequence[WorkerRecord], req: RoutedRequest) -> WorkerRecord:
        """The policy's pick among ``pool`` (non-empty) after the breaker's filter, timed."""
        started = perf_counter()
        worker = self.policy.pick(self.breaker.filter(pool), req)
        self.metrics.observe_pick("mixed", perf_counter() - started)
        count_hints(self.metrics, req)
        return worker

    async def pick(
        self, req: RoutedRequest, exclude: frozenset[str] = frozenset()
    ) -> tuple[WorkerRecord, Callable[[], None]]:
        """Pick only (a gateway sends the request, e.g. the GAIE endpoint picker): the worker
        ``dispatch`` would try first, charged as ``dispatch`` charges it, and its release."""
        candidates = await self.candidates_loading(req.model)
        await self.prepare(req, candidates)
        pool = [w for w in candidates if w.worker_id not in exclude] if exclude else candidates
        if not pool:
            raise ApiError(
                503,
                f"no untried mixed worker left for model {req.model!r}; retry shortly",
                "no_active_worker",
                headers={"Retry-After": "1"},
            )
        worker = self.choose(pool, req)
        return worker, self.charge(worker, req)

    async def _open(
        self, worker: WorkerRecord, req: RoutedRequest, route: str, body: bytes, *, hold_engine_error: bool = False
    ) -> tuple[Opened, Callable[[], None]]:
        """Send to one worker up to its first byte, with the policy, in-flight and breaker
        accounting; returns the answer and the release to call when done with it.
        ``hold_engine_error``: an engine's 5xx is scored neutral here (the caller scores it)."""
        body = self.engine_hints.apply_bytes(body, worker, req)
        breaker = self.breaker
        release = self.charge(worker, req)
        headers = request_headers(req.request_id, req.state.get("dp_rank"), req.trace_headers)
        try:
            opened = await open_upstream(self.transport, worker, route, body, headers, req.stream)
        except LegFailure as exc:  # 5xx or transport error before the first byte: the worker's fault
            release()
            if exc.blames_worker and not (hold_engine_error and is_engine_error(exc)):
                breaker.record_failure(worker.worker_id)
            else:
                breaker.record_neutral(worker.worker_id)
            raise
        except BaseException:  # cancelled (client gone): no verdict, but a probe slot it held is freed
            release()
            breaker.record_neutral(worker.worker_id)
            raise
        # The first body byte arrived (a stream's first chunk, or a whole unary body).
        if opened.status < 400:
            breaker.record_success(worker.worker_id)
            req.state["served"] = True  # the engine computed the prompt: the policy may count it cached
        else:
            breaker.record_neutral(worker.worker_id)  # 4xx/429: the client's error
        return opened, release
