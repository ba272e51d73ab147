"""What every handler of the server's application shares: the server's state (``ServerState``,
under ``STATE_KEY``), the keys handlers and middlewares leave on a request, request ids, and the
per-request steps every inference route takes in the same order (the key's model check, the fair
queue, the trace). The handlers live in ``app.py`` (OpenAI routes, observers, admin) and
``app_anthropic.py`` (Anthropic's Messages API)."""
from __future__ import annotations

import asyncio
import itertools
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from infera.api.errors import ApiError
from infera.discovery.fleet import Fleet
from infera.router.auto import AutoRouter
from infera.router.dispatch import Reply
from infera.router.policy import RoutedRequest
from infera.server import dashboard as _dashboard
from infera.server.fleet_view import FleetView
from infera.server.metrics import ServerMetrics
from infera.server.tenant_limits import reply_tokens
from infera.server.tracing import RequestSpan, client_trace_headers

REQUEST_ID_HEADER = "X-Infera-Request-Id"
DIRECT_WORKER_HEADER = "x-worker-instance-id"
DIRECT_PREFILL_HEADER = "x-prefill-instance-id"
_json = msgspec.json.Encoder()
REQUEST_ID_KEY = web.RequestKey("request_id", str) if hasattr(web, "RequestKey") else "request_id"


@dataclass
class ServerState:
    fleet: Fleet
    router: AutoRouter
    metrics: ServerMetrics
    max_request_bytes: int
    request_ids: "RequestIds" = field(default_factory=lambda: RequestIds())
    kv: Any = None  # KvEventsBridge under the kv-aware policy
    nats: Any = None  # NatsConnection on the NATS plane
    tokenizers: Any = None  # RouterTokenizers under the kv-aware policy
    admin_token: str | None = None  # --admin-token: /v1/admin/* needs it as a Bearer token; None: they are off
    allow_client_kv_transfer_params: bool = False  # --allow-client-kv-transfer-params
    process: dict | None = None  # a --workers N child: which one answers /health (index, count, pid, restarts)
    metrics_gather: Any = None  # a --workers N child: ProcessMetrics, /metrics of every process
    enable_profiling: bool = False  # --enable-profiling: POST /v1/admin/profile/{start,stop}
    kvd_socket_path: str | None = None  # --kvd-socket-path: POST /v1/cache/prewarm, kvd stats in /v1/kv-stats
    metrics_token: str | None = None  # --metrics-token: opens /metrics, /v1/workers, detailed /health (scrapers)
    dashboard_session_s: float = _dashboard.DEFAULT_SESSION_S  # --dashboard-session-s: the cookie's server-side life
    scaler: Any = None  # --enable-scaling-api: a DeploymentScaler for GET/POST /v1/admin/scale; None: off (404)
    api_keys: Any = None  # --api-keys-file: ApiKeys (infera/server/api_keys.py); None: the API is open
    tracer: Any = None  # --otlp-traces-endpoint: RequestTracer (infera/server/tracing.py); None: off
    limiter: Any = None  # --api-keys-file limits: TenantLimiter (infera/server/tenant_limits.py)
    admission: Any = None  # --max-inflight-per-worker: AdmissionQueue (infera/server/admission.py); None: off


STATE_KEY = web.AppKey("state", ServerState)


class RequestIds:
    """32-hex request ids: a random per-process prefix + a counter.

    Unique across replicas and restarts without paying for uuid4 (os.urandom) per request.
    """

    def __init__(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._counter = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter):016x}"


# A client's request id reaches our logs, our reply headers and every engine (X-Request-Id): only
# a plain token is taken. Anything else is a 400 rather than silently replaced, so a client that
# correlates by its own id learns why it was not used.
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def _request_id(request: web.Request) -> str:
    """The client's X-Infera-Request-Id when well-formed, else a fresh one (never raises: error
    replies carry it too, and a malformed one would not even encode as a header)."""
    raw = request.headers.get(REQUEST_ID_HEADER)
    if raw and _CLIENT_REQUEST_ID.fullmatch(raw):
        return raw
    return request.app[STATE_KEY].request_ids.next()


def _check_client_request_id(request: web.Request) -> None:
    raw = request.headers.get(REQUEST_ID_HEADER)
    if raw and not _CLIENT_REQUEST_ID.fullmatch(raw):
        raise ApiError(400, f"{REQUEST_ID_HEADER} must be 1 to 128 characters from A-Z a-z 0-9 . _ : - "
                       "(or absent: the server then assigns one)", "invalid_request_id")


def _error_response(exc: ApiError, request_id: str) -> web.Response:
    headers = {REQUEST_ID_HEADER: request_id, **exc.headers}
    return web.Response(status=exc.status, body=exc.body(), content_type="application/json", headers=headers)


API_KEY_KEY = web.RequestKey("api_key", object) if hasattr(web, "RequestKey") else "api_key"
# Set by a handler when its tenant's tokens/min limit needs the reply's tokens (a TenantLimiter's Permit)
USAGE_TOKENS_KEY = web.RequestKey("usage_tokens", object) if hasattr(web, "RequestKey") else "usage_tokens"
PERMIT_KEY = web.RequestKey("permit", object) if hasattr(web, "RequestKey") else "permit"
TICKET_KEY = web.RequestKey("ticket", object) if hasattr(web, "RequestKey") else "ticket"
# The fleet view (GET /v1/fleet, the dashboard) is kept on the app under this key.
FLEET_VIEW_KEY = web.AppKey("fleet_view", FleetView)


async def _admit(request: web.Request, model: str) -> None:
    """With ``--max-inflight-per-worker``: wait for a slot of ``model`` (fair among tenants,
    higher priority first; 429 after ``--queue-timeout``, 503 when too many wait)."""
    queue = request.app[STATE_KEY].admission
    if queue is None or request.headers.get(DIRECT_WORKER_HEADER):  # a gateway's pick is not queued
        return
    key = request.get(API_KEY_KEY)
    tenant, priority, weight = (key.tenant, key.priority, key.weight) if key is not None else ("", 0, 1.0)
    request[TICKET_KEY] = await queue.enter(model, tenant, priority, weight)


def _authorize_model(request: web.Request, model: str | None) -> None:
    keys = request.app[STATE_KEY].api_keys
    if keys is not None:
        keys.authorize(request[API_KEY_KEY], model)


async def _dispatch_accounted(router: Any, routed: RoutedRequest, metrics: ServerMetrics, route: str,
                              span: RequestSpan | None) -> Reply:
    """``router.dispatch(routed)``; a refusal (ApiError) or a client that leaves while it runs is
    counted and ends the request's span before it propagates."""
    try:
        reply: Reply = await router.dispatch(routed)
    except ApiError as exc:
        metrics.count_request(route, exc.status, "none")
        if span is not None:
            span.finish(exc.status, routed.state, error=exc.message if exc.status >= 500 else None)
        raise
    except asyncio.CancelledError:
        metrics.count_disconnect(route)
        if span is not None:
            span.finish(None, routed.state, error="the client disconnected")
        raise
    return reply


def _account_unary(request: web.Request, metrics: ServerMetrics, route: str, stream: bool, started: float,
                   span: RequestSpan | None, routed: RoutedRequest, reply: Reply) -> None:
    """A reply in one body, counted: the request series, its end-to-end time, the span's end, and
    (under a tokens/min limit) its tokens for the tenant."""
    metrics.count_request(route, reply.status, reply.worker_id)
    metrics.observe_e2e(route, stream, time.perf_counter() - started)
    if span is not None:
        span.finish(reply.status, routed.state, worker_id=reply.worker_id)
    if PERMIT_KEY in request:  # a tenant's tokens/min limit counts this reply's tokens
        request[USAGE_TOKENS_KEY] = reply_tokens(reply.body)


def _observe_first_byte(request: web.Request, metrics: ServerMetrics, route: str, started: float,
                        reply: Reply) -> None:
    """A stream's time to its first byte: for the route, and for its worker (``/v1/fleet``)."""
    first = (reply.first_byte_at or time.perf_counter()) - started
    metrics.observe_ttft(route, first)
    request.app[FLEET_VIEW_KEY].recent.observe_ttft(reply.worker_id, first)


async def _account_stream_end(request: web.Request, metrics: ServerMetrics, route: str, stream: bool,
                              started: float, span: RequestSpan | None, routed: RoutedRequest, reply: Reply,
                              broken: str | None, meter: Any) -> None:
    """A relayed stream's end, however it came (done, broken, the client gone, or before its first
    chunk): the upstream released, the request series, its end-to-end time, the span's end and
    (under a tokens/min limit) its tokens for the tenant."""
    if reply.stream is not None:
        await reply.stream.aclose()
    metrics.count_request(route, 200, reply.worker_id)
    metrics.observe_e2e(route, stream, time.perf_counter() - started)
    if span is not None:
        span.finish(200, routed.state, worker_id=reply.worker_id, error=broken)
    if meter is not None:
        request[USAGE_TOKENS_KEY] = meter.tokens()


def _trace(state: ServerState, request: web.Request, route: str, model: str | None,
           request_id: str) -> tuple[RequestSpan | None, tuple[tuple[str, str], ...]]:
    """The request's span (tracing on) and the trace headers every engine leg gets: the span's
    context, or (tracing off) the client's own ``traceparent`` unchanged."""
    if state.tracer is None:
        return None, client_trace_headers(request.headers)
    key = request.get(API_KEY_KEY)
    span = state.tracer.start(route, request.headers, model=model, request_id=request_id,
                              tenant=key.tenant if key is not None else None)
    return span, span.headers
