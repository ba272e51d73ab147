"""The server's aiohttp application: endpoints wired to the router, fleet and metrics.

No routing logic lives here: handlers parse, call ``router.dispatch`` and write the reply. This
module holds the middlewares (errors, admin token, API keys, the fair queue's slot), the OpenAI
routes, the observer and admin endpoints and ``build_app``; what handlers share is in
``app_state.py``, Anthropic's Messages API in ``app_anthropic.py``, a tenant's cache salt in
``request_salt.py`` (their names are importable from here as before).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any, Awaitable, Callable

from aiohttp import web

from infera.api import anthropic as _anthropic
from infera.api.errors import ApiError, error_bytes
from infera.api.pooling import POOLING_ROUTES
from infera.api.requests import parse_request
from infera.discovery.record import record_to_dict
from infera.router.lora import adapter_models
from infera.router.policy import RoutedRequest
from infera.server import dashboard as _dashboard
from infera.server import kv_tiers as _kv_tiers
from infera.server import profiling as _profiling
from infera.server import scaling as _scaling
from infera.server.app_pooling import register_pooling_routes
from infera.server import app_responses as _responses
# (re-exported: what handlers share, and the Anthropic handlers, lived here before the split)
from infera.server.app_anthropic import install as _install_anthropic
from infera.server.app_anthropic import (ANTHROPIC_PREFIX, _anthropic_count_tokens, _anthropic_error,  # noqa: F401
                                         _anthropic_messages)
from infera.server.app_state import (API_KEY_KEY, DIRECT_PREFILL_HEADER, DIRECT_WORKER_HEADER,  # noqa: F401
                                     FLEET_VIEW_KEY, PERMIT_KEY, REQUEST_ID_HEADER, REQUEST_ID_KEY, STATE_KEY,
                                     TICKET_KEY, USAGE_TOKENS_KEY, RequestIds, ServerState, _account_stream_end,
                                     _account_unary, _admit, _authorize_model, _check_client_request_id,
                                     _error_response, _json, _dispatch_accounted, _observe_first_byte,
                                     _request_id, _trace)
from infera.server.fleet_view import FleetView, RecentWorkerStats
from infera.server.request_salt import CACHE_SALT_STATE, salt_request
from infera.server.tenant_limits import UsageMeter
from infera.runtime import cancel_and_wait

log = logging.getLogger(__name__)


@web.middleware
async def _errors_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """Every error leaves in the OpenAI error shape with the request id (404/405/413 included)."""
    try:
        return await handler(request)
    except ApiError as exc:
        error = exc
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status)
        message = exc.reason if exc.status != 404 else f"no route {request.method} {request.path}"
        if exc.status == 413:
            message = f"request body larger than the {request.app[STATE_KEY].max_request_bytes}-byte limit"
        error = ApiError(exc.status, message, code)
    request_id = request.get(REQUEST_ID_KEY) or _request_id(request)
    if request.path.startswith(ANTHROPIC_PREFIX):  # refused before its handler (size, bytes in flight): its shape
        return _anthropic_error(error.status, error.message, request_id, error.headers)
    return _error_response(error, request_id)


ADMIN_PREFIX = "/v1/admin"


@web.middleware
async def _admin_auth_middleware(request: web.Request,
                                 handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """``/v1/admin/*`` (unknown paths under it included): off without ``--admin-token``, else
    ``Authorization: Bearer <token>``, compared in constant time."""
    path = request.path
    resource = request.match_info.route.resource  # the route matched, whatever spelling reached it
    canonical = resource.canonical if resource is not None else ""
    if path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/") or canonical.startswith(ADMIN_PREFIX + "/"):
        token = request.app[STATE_KEY].admin_token
        if not token:
            raise ApiError(403, "admin endpoints are disabled: start the server with --admin-token (or "
                           "INFERA_ADMIN_TOKEN) and send 'Authorization: Bearer <token>'", "admin_disabled")
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        # bytes: compare_digest refuses non-ASCII str, and header values may hold any byte
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"),
                                                                 token.encode("utf-8")):
            raise ApiError(401, "admin endpoints need 'Authorization: Bearer <the --admin-token>'",
                           "invalid_admin_token", headers={"WWW-Authenticate": 'Bearer realm="infera-admin"'})
    return await handler(request)


# The routes an --api-keys-file key opens (the rest have their own tokens, or are open: /health).
API_KEY_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", _anthropic.MESSAGES_ROUTE,
                            _anthropic.COUNT_TOKENS_ROUTE, *POOLING_ROUTES, *_responses.API_KEY_ROUTES})


async def take_tenant_permit(request: Any, key: Any, limiter: Any) -> Any:
    """The tenant's in-flight slot under its key's limits (429 here), or None when it has none.
    Shared by ``_api_key_middleware`` and the fast path (``fast_http.py``)."""
    if not key.limit or limiter is None:
        return None
    permit = request[PERMIT_KEY] = await limiter.admit(key.tenant, key.limit)
    return permit


def settle_api_key(request: Any, keys: Any, key: Any, permit: Any, status: int | None) -> None:
    """The reply ended, broke or never came: the permit is in flight no more, and the answer is
    counted for the key's tenant (``status`` None: a bug's 500 or a cancelled request, uncounted)."""
    if permit is not None:
        permit.finish(request.get(USAGE_TOKENS_KEY))
    if status is not None:
        keys.count(key.tenant, status)


def release_ticket(request: Any) -> None:
    """Gives the fair queue's slot back (taken by the handler once the model is known: ``_admit``)."""
    ticket = request.get(TICKET_KEY)
    if ticket is not None:
        ticket.leave()


@web.middleware
async def _api_key_middleware(request: web.Request,
                              handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """With ``--api-keys-file``: the inference routes need a key (401 before the body is read), and
    every answer is counted for its tenant. Models are checked by each handler once it knows the
    model (``_authorize_model``: 403)."""
    keys = request.app[STATE_KEY].api_keys
    resource = request.match_info.route.resource
    if keys is None or resource is None or resource.canonical not in API_KEY_ROUTES:
        return await handler(request)
    key = request[API_KEY_KEY] = keys.authenticate(request.headers)
    permit = None
    status: int | None = None
    try:
        if resource.canonical != "/v1/models":
            permit = await take_tenant_permit(request, key, request.app[STATE_KEY].limiter)
        response = await handler(request)
        status = response.status
        return response
    except (ApiError, web.HTTPException) as exc:
        status = exc.status
        raise
    finally:
        settle_api_key(request, keys, key, permit, status)


@web.middleware
async def _admission_middleware(request: web.Request,
                                handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """The fair queue's slot is given back when the reply has ended, broken or never come."""
    try:
        return await handler(request)
    finally:
        release_ticket(request)


class AiohttpReplyWriter:
    """Writes an inference reply through aiohttp's response objects (the fast path has its own:
    ``infera/server/fast_http.py``)."""

    __slots__ = ("request", "resp")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.resp: web.StreamResponse | None = None

    def unary(self, status: int, body: bytes | None, headers: dict[str, str], content_type: str) -> web.Response:
        return web.Response(status=status, body=body, headers=headers, content_type=content_type)

    async def open_stream(self, headers: dict[str, str]) -> None:
        self.resp = web.StreamResponse(status=200, headers=headers)
        await self.resp.prepare(self.request)

    async def write(self, chunk: bytes) -> None:
        await self.resp.write(chunk)  # type: ignore[union-attr]

    async def end_stream(self) -> web.StreamResponse | None:
        await self.resp.write_eof()  # type: ignore[union-attr]
        return self.resp


async def serve_inference(request: Any, route: str, out: Any) -> Any:
    """One OpenAI inference request: parse, admit, dispatch, reply through ``out`` (an
    :class:`AiohttpReplyWriter`, or the fast path's writer with its light request)."""
    state: ServerState = request.app[STATE_KEY]
    started = time.perf_counter()
    request_id = _request_id(request)
    request[REQUEST_ID_KEY] = request_id
    _check_client_request_id(request)  # the 400 goes out under the fresh id
    if request.content_length is not None and request.content_length > state.max_request_bytes:
        raise web.HTTPRequestEntityTooLarge(max_size=state.max_request_bytes, actual_size=request.content_length)
    body = await request.read()  # aiohttp enforces client_max_size for chunked bodies too
    parsed = parse_request(route, body, allow_kv_transfer_params=state.allow_client_kv_transfer_params)
    _authorize_model(request, parsed.model)
    await _admit(request, parsed.model)
    stream = bool(parsed.stream)
    span, trace_headers = _trace(state, request, route, parsed.model, request_id)
    # an isolated tenant's own cache_salt, or the client's
    body, salt = salt_request(body, request.get(API_KEY_KEY), parsed.cache_salt)
    headers = request.headers
    routed = RoutedRequest(route=route, body=body, parsed=parsed, model=parsed.model, stream=stream,
                           request_id=request_id, direct_worker=headers.get(DIRECT_WORKER_HEADER),
                           direct_prefill=headers.get(DIRECT_PREFILL_HEADER), trace_headers=trace_headers)
    if salt is not None:  # the kv-aware policy hashes the prompt from the same salted root
        routed.state[CACHE_SALT_STATE] = salt
    metrics = state.metrics
    reply = await _dispatch_accounted(state.router, routed, metrics, route, span)
    reply_headers = {REQUEST_ID_HEADER: request_id}
    metered = PERMIT_KEY in request  # a tenant limit counts this reply's tokens
    if reply.stream is None:
        _account_unary(request, metrics, route, stream, started, span, routed, reply)
        return out.unary(reply.status, reply.body, reply_headers, reply.content_type.split(";")[0])
    _observe_first_byte(request, metrics, route, started, reply)
    reply_headers["Content-Type"] = "text/event-stream"
    reply_headers["Cache-Control"] = "no-cache"
    chunks = reply.stream
    broken: str | None = None
    meter = UsageMeter() if metered else None
    try:
        await out.open_stream(reply_headers)
        async for chunk in chunks:
            if meter is not None:
                meter.feed(chunk)
            await out.write(chunk)
        return await out.end_stream()
    except (ConnectionResetError, asyncio.CancelledError):
        metrics.count_disconnect(route)
        broken = "the client disconnected"
        raise
    finally:  # releases upstream on any exit, even before the first chunk
        await _account_stream_end(request, metrics, route, stream, started, span, routed, reply, broken, meter)


def _make_inference_handler(route: str):
    async def handler(request: web.Request) -> web.StreamResponse:
        return await serve_inference(request, route, AiohttpReplyWriter(request))

    return handler


async def _models(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    now = int(time.time())
    models = state.fleet.models()
    adapters = adapter_models(state.fleet)  # LoRA adapters, each with its base model as vLLM lists them
    if state.api_keys is not None:  # a key sees the models it may use
        key = request[API_KEY_KEY]
        models = [m for m in models if key.allows(m)]
        adapters = [(a, base) for a, base in adapters if key.allows(a)]
    data = [{"id": m, "object": "model", "created": now, "owned_by": "infera"} for m in models]
    data += [{"id": a, "object": "model", "created": now, "owned_by": "infera", "parent": base}
             for a, base in adapters]
    return web.Response(body=_json.encode({"object": "list", "data": data}), content_type="application/json")


def _bearer_matches(request: web.Request, *tokens: str | None) -> bool:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    raw = given.strip().encode("utf-8", "surrogateescape")
    # every configured token compared (constant time each), so timing does not say which one matched
    return any([hmac.compare_digest(raw, t.encode("utf-8")) for t in tokens if t])


def _observer_authorized(request: web.Request) -> bool:
    """``/metrics``, ``/v1/workers`` and the detailed ``/health``: open when no token is configured
    at all (dev mode); else the admin or the metrics token as a Bearer header."""
    state: ServerState = request.app[STATE_KEY]
    if not state.admin_token and not state.metrics_token:
        return True
    return _bearer_matches(request, state.admin_token, state.metrics_token)


def _observer_denied(path: str) -> ApiError:
    return ApiError(401, f"{path} needs 'Authorization: Bearer <the --metrics-token or --admin-token>'",
                    "invalid_token", headers={"WWW-Authenticate": 'Bearer realm="infera-metrics"'})


async def _workers(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    if not _observer_authorized(request):  # every engine's URL, event endpoints, tokenizer and kvd paths
        raise _observer_denied("/v1/workers")
    reasons = state.fleet.unroutable_reasons
    workers = []
    for r in state.fleet.all():
        d = record_to_dict(r)
        reason = reasons.get(r.worker_id)
        d["routable"] = reason is None and r.is_active
        if reason is not None:
            d["unroutable_reason"] = f"it {reason}"
        if state.tokenizers is not None:  # kv-aware: can its prompts be hashed as its engine does?
            d["kv_routing"], why = state.tokenizers.worker_status(r)
            if why is not None:
                d["kv_routing_reason"] = why
        workers.append(d)
    return web.Response(body=_json.encode({"workers": workers}), content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    body = {"status": "ok", "active_workers": len(state.fleet.active()), "workers": len(state.fleet)}
    if state.nats is not None:  # still "ok": HTTP workers are served while the broker is away
        body["nats"] = "connected" if state.nats.connected else "disconnected"
    if not _observer_authorized(request):  # a token is set: what a load balancer needs, no paths or pids
        return web.Response(body=_json.encode(body), content_type="application/json")
    if state.tokenizers is not None:  # still "ok": a degraded model is served, routed by load
        body["kv_routing"] = state.tokenizers.health()
    if state.process is not None:  # one of a --workers N server's processes: which one answered
        body["process"] = state.process
    return web.Response(body=_json.encode(body), content_type="application/json")


async def _metrics(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    if not _observer_authorized(request):  # per-worker series name every worker's address
        raise _observer_denied("/metrics")
    # a --workers N child answers for every process (each series labelled process="<i>")
    if state.metrics_gather is not None:
        body = await state.metrics_gather.render()
    else:  # built and formatted off the loop (a large fleet's page is ~25,000 series)
        body = await state.metrics.render_off_loop()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _cache_view(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    if state.kv is None:
        raise ApiError(503, "KV-aware routing is disabled (--router-policy round-robin)", "kv_aware_disabled")
    worker_id = request.match_info["worker_id"]
    rank_s = request.query.get("dp_rank")
    try:
        rank = int(rank_s) if rank_s not in (None, "") else None
    except ValueError:
        raise ApiError(400, f"dp_rank must be an integer, not {rank_s!r}", "invalid_request", param="dp_rank") from None
    view = state.kv.cache_view(worker_id, rank)
    if view is None:
        raise ApiError(404, f"no KV cache view for worker {worker_id!r}" + (f" rank {rank}" if rank is not None else ""),
                       "worker_not_found")
    return web.Response(body=_json.encode(view), content_type="application/json")


# -- fleet view and dashboard: GET /v1/fleet, GET|POST /dashboard ------------------------------------
# Open without --admin-token; with one, a Bearer header or the dashboard cookie (infera/server/dashboard.py).
DASHBOARD_PAGE_KEY = web.AppKey("dashboard_page", bytes)


def _fleet_view_for(state: ServerState) -> FleetView:
    mixed = getattr(state.router, "mixed", None)  # its breaker is shared with PD dispatch, its policy too
    return FleetView(state.fleet, state.metrics, RecentWorkerStats(state.fleet),
                     breaker=getattr(mixed, "breaker", None), kv=state.kv, tokenizers=state.tokenizers,
                     process=state.process, policy=getattr(getattr(mixed, "policy", None), "name", None),
                     admission=state.admission)


async def _fleet_sampler(app: web.Application):
    """The fleet view's rate sampler, for the app's lifetime (cleanup_ctx)."""
    task = asyncio.create_task(app[FLEET_VIEW_KEY].run_sampler())
    yield
    await cancel_and_wait(task)


def _dashboard_authorized(request: web.Request) -> bool:
    return _dashboard.authorized(request.app[STATE_KEY].admin_token, request.headers.get("Authorization"),
                                 request.cookies.get(_dashboard.COOKIE_NAME))


async def _fleet(request: web.Request) -> web.Response:
    if not _dashboard_authorized(request):
        raise ApiError(401, "/v1/fleet needs 'Authorization: Bearer <the --admin-token>' (or the /dashboard cookie)",
                       "invalid_admin_token", headers={"WWW-Authenticate": 'Bearer realm="infera-admin"'})
    return web.Response(body=_json.encode(request.app[FLEET_VIEW_KEY].build()), content_type="application/json",
                        headers={"Cache-Control": "no-store"})


async def _dashboard_page(request: web.Request) -> web.Response:
    token = request.app[STATE_KEY].admin_token
    given: str | None = None
    if request.method == "POST":  # the sign-in form
        if request.content_length is not None and request.content_length > 64 * 1024:
            raise web.HTTPRequestEntityTooLarge(max_size=64 * 1024, actual_size=request.content_length)
        given = str((await request.post()).get("token", ""))
    # (no ?token=: a URL lands in access logs, proxies and browser history; a stale link just gets the form)
    headers = {"Cache-Control": "no-store", "Content-Security-Policy": _dashboard.CONTENT_SECURITY_POLICY,
               "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff"}
    if token and given is not None:
        if not _dashboard.token_matches(given, token):
            return web.Response(status=401, body=_dashboard.login_page("That is not the admin token."),
                                content_type="text/html", headers=headers)
        # to the bare page: the token leaves the address bar (and a reload does not post it again)
        headers.update({"Location": "dashboard", "Set-Cookie": _dashboard.cookie_header(
            token, request.secure, request.app[STATE_KEY].dashboard_session_s)})
        return web.Response(status=303, headers=headers)
    if not _dashboard_authorized(request):
        return web.Response(status=401, body=_dashboard.login_page("This server has an admin token: enter it."),
                            content_type="text/html", headers=headers)
    return web.Response(body=request.app[DASHBOARD_PAGE_KEY], content_type="text/html", headers=headers)


# -- engine profiler fan-out: POST /v1/admin/profile/start, /stop (infera/server/profiling.py) -------------
def _make_profile_handler(action: str):
    async def handler(request: web.Request) -> web.Response:
        state: ServerState = request.app[STATE_KEY]
        return await _profiling.handle(request, state.fleet, action, enabled=state.enable_profiling)

    return handler


# -- scaling API: GET|POST /v1/admin/scale (infera/server/scaling.py) ------------------------------------
async def _scale(request: web.Request) -> web.Response:
    return await _scaling.handle(request, request.app[STATE_KEY].scaler)


# -- lower KV tiers: GET /v1/kv-stats, POST /v1/cache/prewarm (infera/server/kv_tiers.py) ------------------
async def _kv_stats(request: web.Request) -> web.Response:
    if not _dashboard_authorized(request):  # as /v1/fleet: it shows what every worker caches
        raise ApiError(401, "/v1/kv-stats needs 'Authorization: Bearer <the --admin-token>' (or the /dashboard "
                            "cookie)", "invalid_admin_token", headers={"WWW-Authenticate": 'Bearer realm="infera-admin"'})
    state: ServerState = request.app[STATE_KEY]
    index = state.kv.index if state.kv is not None else None
    body = await _kv_tiers.handle_kv_stats(state.fleet.all(), index, state.kvd_socket_path)
    return web.Response(body=body, content_type="application/json", headers={"Cache-Control": "no-store"})


async def _prewarm(request: web.Request) -> web.Response:
    # it makes the kvd load blocks: an admin action (open without --admin-token, as /v1/kv-stats and /v1/fleet)
    token = request.app[STATE_KEY].admin_token
    if token and not _bearer_matches(request, token):
        raise ApiError(401, f"{_kv_tiers.PREWARM_ROUTE} needs 'Authorization: Bearer <the --admin-token>'",
                       "invalid_admin_token", headers={"WWW-Authenticate": 'Bearer realm="infera-admin"'})
    state: ServerState = request.app[STATE_KEY]
    body = await _kv_tiers.handle_prewarm(await request.read(), state.kvd_socket_path, state.fleet.get)
    return web.Response(status=202, body=body, content_type="application/json")


def build_app(state: ServerState) -> web.Application:
    middlewares = [_errors_middleware, _admin_auth_middleware]
    # each middleware is a coroutine frame around every request: only those the flags call for
    if state.api_keys is not None:
        middlewares.append(_api_key_middleware)
    if state.admission is not None:
        middlewares.append(_admission_middleware)
    app = web.Application(middlewares=middlewares, client_max_size=state.max_request_bytes)
    app[STATE_KEY] = state
    app.router.add_post("/v1/chat/completions", _make_inference_handler("/v1/chat/completions"))
    app.router.add_post("/v1/completions", _make_inference_handler("/v1/completions"))
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/workers", _workers)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/admin/cache-view/{worker_id}", _cache_view)
    _install_anthropic(app, state.metrics.registry)  # Anthropic Messages API (+ its passthrough counter)
    register_pooling_routes(app)  # embeddings, rerank, score, classify, tokenize (app_pooling.py)
    _responses.install(app)  # OpenAI Responses API, conversations kept by the router (app_responses.py)
    app[FLEET_VIEW_KEY] = _fleet_view_for(state)  # fleet view + dashboard (GET /v1/fleet, /dashboard)
    app[DASHBOARD_PAGE_KEY] = _dashboard.load_page()
    app.cleanup_ctx.append(_fleet_sampler)
    app.router.add_get("/v1/fleet", _fleet)
    app.router.add_get("/dashboard", _dashboard_page)
    app.router.add_post("/dashboard", _dashboard_page)
    for action in _profiling.ACTIONS:  # --enable-profiling (404 without), behind the admin token
        app.router.add_post(f"/v1/admin/profile/{action}", _make_profile_handler(action))
    app.router.add_get(_scaling.SCALE_ROUTE, _scale)  # --enable-scaling-api (404 without), behind the admin token
    app.router.add_post(_scaling.SCALE_ROUTE, _scale)
    app.router.add_get(_kv_tiers.KV_STATS_ROUTE, _kv_stats)  # lower KV tiers (infera/server/kv_tiers.py)
    app.router.add_post(_kv_tiers.PREWARM_ROUTE, _prewarm)
    return app


__all__ = ["ServerState", "build_app", "REQUEST_ID_HEADER", "error_bytes"]
