"""PD dispatch: one prefill worker and one decode worker per request, legs shaped by the pair's
protocol (``infera.router.pd``), the client served from the decode leg only.

Per attempt: pick a prefill (role "prefill") and a decode (role "decode") separately, resolve the
pair's protocol, then

* **concurrent** protocols: both legs go out at once. The prefill reply is read and discarded in a
  task bounded by ``prefill_timeout``. Whichever leg fails first before the decode's first byte
  aborts the other (closing its connection makes the engine drop the request), and the attempt is
  retried on another pair;
* **serial** protocols: the prefill leg (one token, unstreamed) must answer within
  ``prefill_timeout``; its reply's handoff shapes the decode leg.

Unlike upstream (no PD failover at all), a leg that fails before the client's first byte — 5xx,
transport error, prefill timeout, a prefill reply without a usable handoff — is retried with another
pair up to ``max_retries`` times, excluding the worker that failed. A 4xx from either leg is the
client's: returned as is. After the first byte a broken decode stream ends with an SSE error event.
A prefill leg never outlives its bound: it is awaited, cancelled or timed out, never forgotten.

The circuit breaker filters the prefill and the decode pool each on its own, and scores each leg
against its own worker: a failed prefill (5xx, transport error, timeout, unusable handoff) never
counts against the decode it was paired with, nor the reverse.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Any

import msgspec

from infera.api.errors import ApiError
from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.router.breaker import CircuitBreaker
from infera.router.dispatch import Reply, RequestAccount, count_hints
from infera.router.engine_hints import EngineHints
from infera.router.metrics import RouterMetrics
from infera.router.pd import PdError, PdPair, PdProtocol, resolve_protocol
from infera.router.pd_legs import (
    PickedPair,
    _Leg,
    _leg_request,
    align_room,
    bootstrap_failure_reason,
    pd_kind,
)
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
from infera.runtime import wait_for
from infera.transport.request import RequestTransport

log = logging.getLogger(__name__)

DEFAULT_PREFILL_TIMEOUT = 120.0
_decode_json = msgspec.json.Decoder().decode
_encode_json = msgspec.json.Encoder().encode


class DisaggRouter:
    def __init__(
        self,
        fleet: Fleet,
        policy: Policy,
        transport: RequestTransport,
        metrics: RouterMetrics,
        protocols: dict[str, PdProtocol],
        *,
        max_retries: int = 1,
        prefill_timeout: float = DEFAULT_PREFILL_TIMEOUT,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.perf_counter,
        breaker: CircuitBreaker | None = None,
        engine_hints: EngineHints | None = None,
    ) -> None:
        self.fleet = fleet
        self.policy = policy
        self._prepare = getattr(policy, "prepare", None)
        self._prepare_cached = getattr(policy, "prepare_cached", None)  # the same, when no await is needed
        self.transport = transport
        self.metrics = metrics
        self.protocols = protocols
        self.max_retries = max_retries
        self.prefill_timeout = prefill_timeout
        self._rng = rng or random.Random()
        self._clock = clock
        # Shared with the mixed router; each pool is filtered on its own, each leg scored on its own.
        self.breaker = breaker or CircuitBreaker(failure_threshold=0)
        self._background: set[asyncio.Task[bytes]] = set()  # prefill legs still finishing after a commit
        # The cache retention each leg's engine is told, merged into the leg's body (PD params kept).
        self.engine_hints = engine_hints or EngineHints()

    # -- entry points ----------------------------------------------------------------------------
    async def dispatch(self, req: RoutedRequest) -> Reply:
        account = RequestAccount(self.metrics, "disagg", req)
        try:
            reply = await self._dispatch(req)
        except BaseException as exc:
            account.failed(exc)
            raise
        return account.replied(reply)

    async def _dispatch(self, req: RoutedRequest) -> Reply:
        prefills = self.fleet.active(req.model, "prefill")
        decodes = self.fleet.active(req.model, "decode")
        if not prefills or not decodes:  # the fleet changed since the topology check
            self.metrics.count_pd_bootstrap_failure("no_pd_workers")
            raise ApiError(
                503,
                f"no active {'prefill' if not prefills else 'decode'} worker for model {req.model!r}; retry shortly",
                "no_active_worker",
                headers={"Retry-After": "1"},
            )
        if self._prepare is not None and (self._prepare_cached is None or not self._prepare_cached(req)):
            await self._prepare(req)
        body = self._parse(req)
        failed: set[str] = set()
        failure: LegFailure | None = None
        # Per role, a worker whose engine answered 5xx, its breaker vote held until another worker of
        # that role has had the request: a success confirms it, a second engine 5xx in the role makes
        # it the request's fault (returned to the client, neither counted), as in MixedRouter.
        suspects: dict[str, str] = {}
        for attempt in range(1 + self.max_retries):
            p_pool = [w for w in prefills if w.worker_id not in failed]
            d_pool = [w for w in decodes if w.worker_id not in failed]
            if not p_pool or not d_pool:
                break
            prefill, p_req, decode, d_req = self.choose_pair(req, p_pool, d_pool, decodes)
            try:
                reply = await self._attempt(req, body, prefill, p_req, decode, d_req, hold_engine_error=True)
            except LegFailure as exc:
                self.metrics.count_pd_bootstrap_failure(bootstrap_failure_reason(exc))
                if not exc.retryable:
                    return Reply(exc.status, exc.content_type, exc.worker_id, body=exc.body)
                if is_engine_error(exc):
                    if exc.role in suspects:
                        raise repeated_engine_error(req.request_id, suspects[exc.role], exc) from None
                    suspects[exc.role] = exc.worker_id
                failure = exc
                failed.add(exc.worker_id)
                log.warning(
                    "request %s: PD %s leg on %s failed: %s (attempt %d)",
                    req.request_id,
                    exc.role,
                    exc.worker_id,
                    exc.detail,
                    attempt + 1,
                )
                self.metrics.count_retry(req.route, f"{exc.role}_{exc.reason}")
            else:
                for suspect in suspects.values():  # another worker of its role served it
                    self.breaker.record_failure(suspect)
                return reply
        for suspect in suspects.values():  # no other engine's answer to weigh it against
            self.breaker.record_failure(suspect)
        if failure is None:
            raise ApiError(
                503,
                f"no untried prefill/decode pair left for model {req.model!r}",
                "no_active_worker",
                headers={"Retry-After": "1"},
            )
        raise ApiError(
            failure.status, f"{failure.role} leg: {failure.message}", failure.reason, headers=failure.headers
        )

    def choose_pair(
        self,
        req: RoutedRequest,
        p_pool: Sequence[WorkerRecord],
        d_pool: Sequence[WorkerRecord],
        decodes: Sequence[WorkerRecord],
    ) -> tuple[WorkerRecord, RoutedRequest, WorkerRecord, RoutedRequest]:
        """The policy's pair among the pools (non-empty): (prefill, its leg request, decode, its leg
        request). ``decodes``: every active decode worker (named in the error when none matches)."""
        p_req, d_req = _leg_request(req), _leg_request(req)
        started = perf_counter()
        prefill = self.policy.pick(self.breaker.filter(p_pool), p_req, "prefill")
        self.metrics.observe_pick("prefill", perf_counter() - started)
        count_hints(self.metrics, p_req)
        # A pair never mixes engines or connectors: the decode comes from the prefill's kind.
        kind = pd_kind(prefill)
        d_pool = [w for w in d_pool if pd_kind(w) == kind]
        if not d_pool:
            log.error(
                "request %s: no decode worker for model %r speaks %r on %s like prefill worker %r (decode workers: %s)",
                req.request_id,
                req.model,
                kind[1],
                kind[0],
                prefill.worker_id,
                ", ".join(f"{w.worker_id}={pd_kind(w)[1]}" for w in decodes),
            )
            raise ApiError(
                500,
                f"no decode worker for model {req.model!r} speaks {kind[1]!r} on {kind[0]} like "
                "the prefill worker picked (see the server log)",
                "pd_protocol_mismatch",
            )
        # Filtered after the kind match, so an open decode is avoided only while a healthy one of
        # the same kind exists (and all of that kind are tried rather than none).
        started = perf_counter()
        decode = self.policy.pick(self.breaker.filter(d_pool), d_req, "decode")
        self.metrics.observe_pick("decode", perf_counter() - started)
        count_hints(self.metrics, d_req)
        return prefill, p_req, decode, d_req

    async def pick(self, req: RoutedRequest, exclude: frozenset[str] = frozenset()) -> PickedPair:
        """Pick only (a gateway sends the request to the decode's sidecar, which runs the pair):
        the pair ``dispatch`` would try first, both legs charged as ``dispatch`` charges them."""
        prefills = [w for w in self.fleet.active(req.model, "prefill") if w.worker_id not in exclude]
        decodes = self.fleet.active(req.model, "decode")
        d_pool = [w for w in decodes if w.worker_id not in exclude]
        if not prefills or not d_pool:
            raise ApiError(
                503,
                f"no active {'prefill' if not prefills else 'decode'} worker for model {req.model!r}; retry shortly",
                "no_active_worker",
                headers={"Retry-After": "1"},
            )
        if self._prepare is not None and (self._prepare_cached is None or not self._prepare_cached(req)):
            await self._prepare(req)
        prefill, p_req, decode, d_req = self.choose_pair(req, prefills, d_pool, decodes)
        return PickedPair(_Leg(self, "prefill", prefill, p_req), _Leg(self, "decode", decode, d_req))

    async def dispatch_pair(self, req: RoutedRequest, prefill: WorkerRecord, decode: WorkerRecord) -> Reply:
        """Direct mode (``x-prefill-instance-id`` + ``x-worker-instance-id``): exactly this pair, one
        attempt, no policy pick."""
        account = RequestAccount(self.metrics, "direct", req)
        try:
            reply = await self._dispatch_pair(req, prefill, decode)
        except BaseException as exc:
            account.failed(exc)
            raise
        return account.replied(reply)

    async def _dispatch_pair(self, req: RoutedRequest, prefill: WorkerRecord, decode: WorkerRecord) -> Reply:
        body = self._parse(req)
        try:
            return await self._attempt(req, body, prefill, _leg_request(req), decode, _leg_request(req))
        except LegFailure as exc:
            self.metrics.count_pd_bootstrap_failure(bootstrap_failure_reason(exc))
            if not exc.retryable:
                return Reply(exc.status, exc.content_type, exc.worker_id, body=exc.body)
            raise ApiError(
                exc.status, f"{exc.role} leg: {exc.message}", exc.reason, headers=unreachable_mark(exc)
            ) from None

    async def close(self) -> None:
        """Server stop: cancel prefill legs still draining in the background."""
        tasks = list(self._background)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _parse(req: RoutedRequest) -> dict[str, Any]:
        try:
            body = _decode_json(req.body)
        except msgspec.DecodeError as exc:  # parse_request accepted it, so this is not expected
            raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object", "invalid_request")
        return body

    async def _open(
        self,
        leg: _Leg,
        route: str,
        body: dict[str, Any],
        request_id: str,
        stream: bool,
        *,
        reply_proves_worker: bool = True,
    ) -> Opened:
        """One leg up to its first byte; a 4xx is the client's: a non-retryable ``LegFailure``.

        ``reply_proves_worker`` False: a 2xx is not yet a success for the breaker (a serial
        prefill's reply must still carry a usable handoff); the caller scores it."""
        body = self.engine_hints.apply_dict(body, leg.worker, leg.req)
        started = perf_counter()
        try:
            opened = await open_upstream(
                self.transport,
                leg.worker,
                route,
                _encode_json(body),
                request_headers(request_id, leg.rank, leg.req.trace_headers),
                stream,
                leg.role,
            )
        except LegFailure as exc:  # 5xx or transport error before the first byte (or a full NATS backlog)
            if exc.blames_worker and not (leg.hold_engine_error and is_engine_error(exc)):
                leg.score_failure()
            else:
                leg.score_neutral()
            raise
        if opened.status >= 400:
            leg.score_neutral()
            raise LegFailure(
                leg.worker.worker_id,
                opened.status,
                f"worker returned {opened.status}",
                f"http_{opened.status}",
                opened.body,
                role=leg.role,
                content_type=opened.content_type,
                retryable=False,
            )
        if reply_proves_worker:
            leg.score_success()
        if opened.resp is None:  # answered in full (a stream's legs are timed by the request)
            self.metrics.observe_pd_dispatch(leg.role, leg.worker.worker_id, perf_counter() - started)
        return opened

    # -- one attempt -----------------------------------------------------------------------------
    async def _attempt(
        self,
        req: RoutedRequest,
        body: dict[str, Any],
        prefill: WorkerRecord,
        p_req: RoutedRequest,
        decode: WorkerRecord,
        d_req: RoutedRequest,
        *,
        hold_engine_error: bool = False,
    ) -> Reply:
        try:
            protocol = resolve_protocol(prefill, decode, self.protocols)
            protocol.check_route(req.route)
        except PdError as exc:
            self.metrics.count_pd_bootstrap_failure("protocol_unresolved")
            raise ApiError(exc.status, exc.message, exc.code) from None
        req.state["prefill_worker"] = prefill.worker_id  # the request's trace span reports the pair
        p_leg = _Leg(self, "prefill", prefill, p_req, hold_engine_error=hold_engine_error)
        d_leg = _Leg(self, "decode", decode, d_req, hold_engine_error=hold_engine_error)
        committed = False
        try:
            pair = PdPair(
                prefill,
                decode,
                align_room(self._rng.getrandbits(63), prefill, p_leg.rank),
                prefill_rank=p_leg.rank,
                decode_rank=d_leg.rank,
            )
            try:
                request_id = protocol.leg_request_id(pair) or req.request_id
                p_body = protocol.prefill_body(body, pair)
            except PdError as exc:
                self.metrics.count_pd_bootstrap_failure("protocol_annotate_failed")
                raise ApiError(exc.status, exc.message, exc.code) from None
            if protocol.topology == "serial":
                reply = await self._serial(req, body, protocol, pair, p_leg, d_leg, p_body, request_id)
            else:
                reply = await self._concurrent(req, body, protocol, pair, p_leg, d_leg, p_body, request_id)
            committed = True
            return reply
        finally:
            if not committed:
                p_leg.release()
                d_leg.release()
                # A leg never reached, aborted because the other failed, or cancelled with the
                # client: no verdict, but a probe slot it held is freed.
                p_leg.score_neutral()
                d_leg.score_neutral()

    async def _run_prefill(
        self, leg: _Leg, route: str, body: dict[str, Any], request_id: str, *, handoff_checked_later: bool = False
    ) -> bytes:
        """The prefill leg to completion, bounded by the prefill timeout; its accounting ends here,
        and its breaker verdict too unless ``handoff_checked_later`` (serial: the reply must still
        carry a usable handoff)."""
        try:
            opened = await wait_for(
                self._open(leg, route, body, request_id, stream=False, reply_proves_worker=not handoff_checked_later),
                self.prefill_timeout,
            )
            return opened.body or b""
        except asyncio.TimeoutError:
            leg.score_failure()
            raise LegFailure(
                leg.worker.worker_id,
                504,
                f"the prefill did not finish within {self.prefill_timeout:g}s",
                "prefill_timeout",
                role="prefill",
                detail=f"prefill on {leg.worker.worker_id} did not finish within {self.prefill_timeout:g}s",
            ) from None
        except BaseException:
            # Cancelled: the decode failed first, the decode stream ended, or the client left.
            leg.score_neutral()
            raise
        finally:
            leg.release()

    def _reply(self, leg: _Leg, opened: Opened, prefill_task: asyncio.Task[bytes] | None) -> Reply:
        if opened.resp is None:
            leg.release()
            return Reply(200, opened.content_type, leg.worker.worker_id, body=opened.body)

        def done() -> None:
            leg.release()
            if prefill_task is not None and not prefill_task.done():
                # The client is gone or the decode ended first: the prefill has nothing left to feed.
                prefill_task.cancel()

        return Reply(
            200,
            opened.content_type,
            leg.worker.worker_id,
            stream=Relay(opened, leg.worker, self.metrics, done),
            first_byte_at=self._clock(),
        )

    async def _serial(
        self,
        req: RoutedRequest,
        body: dict[str, Any],
        protocol: PdProtocol,
        pair: PdPair,
        p_leg: _Leg,
        d_leg: _Leg,
        p_body: dict[str, Any],
        request_id: str,
    ) -> Reply:
        data = await self._run_prefill(p_leg, req.route, p_body, request_id, handoff_checked_later=True)
        try:
            reply = _decode_json(data)
            if not isinstance(reply, dict):
                raise ValueError("not a JSON object")
        except (msgspec.DecodeError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            p_leg.score_failure()
            raise LegFailure(
                p_leg.worker.worker_id,
                502,
                "the prefill reply is not a JSON object",
                "bad_prefill_reply",
                role="prefill",
                detail=f"prefill reply from {p_leg.worker.worker_id} is not a JSON object: {exc}",
            ) from None
        try:
            d_body = protocol.decode_body(body, pair, reply)
        except PdError as exc:
            if exc.status < 500:
                self.metrics.count_pd_bootstrap_failure("protocol_annotate_failed")
                raise ApiError(exc.status, exc.message, exc.code) from None  # scored neutral by _attempt
            p_leg.score_failure()  # a reply without a usable handoff
            raise LegFailure(p_leg.worker.worker_id, exc.status, exc.message, exc.code, role="prefill") from None
        p_leg.score_success()
        opened = await self._open(d_leg, req.route, d_body, request_id, req.stream)
        return self._reply(d_leg, opened, None)

    async def _concurrent(
        self,
        req: RoutedRequest,
        body: dict[str, Any],
        protocol: PdProtocol,
        pair: PdPair,
        p_leg: _Leg,
        d_leg: _Leg,
        p_body: dict[str, Any],
        request_id: str,
    ) -> Reply:
        try:
            d_body = protocol.decode_body(body, pair, None)
        except PdError as exc:
            self.metrics.count_pd_bootstrap_failure("protocol_annotate_failed")
            raise ApiError(exc.status, exc.message, exc.code) from None
        prefill_task = asyncio.create_task(self._run_prefill(p_leg, req.route, p_body, request_id))
        decode_task = asyncio.create_task(self._open(d_leg, req.route, d_body, request_id, req.stream))
        try:
            done, _ = await asyncio.wait((prefill_task, decode_task), return_when=asyncio.FIRST_COMPLETED)
            if prefill_task in done and prefill_task.exception() is not None:
                raise prefill_task.exception()  # type: ignore[misc]  # the decode would wait for KV forever
            opened = await decode_task
        except BaseException:
            for t in (prefill_task, decode_task):
                t.cancel()
            _, decoded = await asyncio.gather(prefill_task, decode_task, return_exceptions=True)
            if isinstance(decoded, Opened) and decoded.resp is not None:
                decoded.resp.release()  # the decode answered, but its prefill failed: abort it
            raise
        if not prefill_task.done():
            self._background.add(prefill_task)
            prefill_task.add_done_callback(self._prefill_done)
        else:
            self._prefill_done(prefill_task)
        return self._reply(d_leg, opened, prefill_task)

    def _prefill_done(self, task: asyncio.Task[bytes]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("PD prefill leg failed after the decode leg answered: %s", task.exception())
