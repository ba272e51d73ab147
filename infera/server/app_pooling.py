"""The server's pooling and utility routes: ``/v1/embeddings``, ``/v1/rerank``, ``/rerank``,
``/v2/rerank``, ``/score``, ``/v1/score``, ``/classify``, ``/tokenize``, ``/detokenize``.

Each is relayed as the engine answers it (status, body, errors) to a worker of the request's model
that serves the route's task (``infera.api.pooling``), picked by load by a ``TaskRouter``
(``infera.router.pooling``) that shares the chat router's transport, breaker and failover; the
request takes the steps every inference route takes (request id, size limit, the key's model check,
the fair queue, the trace, per-route metrics). A model no worker serves for the task is a 404
(unknown model) or a 400 naming the task. ``register_pooling_routes`` wires them into the app.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from infera.api.errors import ApiError
from infera.api.pooling import ROUTE_TASKS, request_model
from infera.discovery.record import WorkerRecord
from infera.router.policy import RoutedRequest
from infera.router.pooling import LeastLoadedPolicy, TaskRouter
from infera.server.app_state import (
    DIRECT_WORKER_HEADER,
    PERMIT_KEY,
    REQUEST_ID_HEADER,
    REQUEST_ID_KEY,
    STATE_KEY,
    USAGE_TOKENS_KEY,
    ServerState,
    _admit,
    _authorize_model,
    _check_client_request_id,
    _request_id,
    _trace,
)
from infera.server.tenant_limits import reply_tokens

# One router per task (None: tokenize/detokenize, any worker of the model), kept on the app.
TASK_ROUTERS_KEY = web.AppKey("pooling_task_routers", dict)


def build_task_routers(state: ServerState) -> dict[str | None, TaskRouter]:
    """The task routers, over the chat router's transport, metrics, breaker and retry settings,
    sharing one load policy (a worker serving several tasks is loaded by all of them)."""
    mixed = state.router.mixed
    policy = LeastLoadedPolicy()
    routers = {
        task: TaskRouter(
            task,
            state.fleet,
            policy,
            mixed.transport,
            mixed.metrics,
            max_retries=mixed.max_retries,
            direct=mixed.direct,
            breaker=mixed.breaker,
        )
        for task in set(ROUTE_TASKS.values())
    }

    def on_fleet_change(worker_id: str, record: WorkerRecord | None) -> None:
        if record is None or not record.is_active:
            policy.forget(worker_id)

    state.fleet.subscribe(on_fleet_change)
    return routers


def _make_handler(route: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    task = ROUTE_TASKS[route]

    async def handler(request: web.Request) -> web.Response:
        state: ServerState = request.app[STATE_KEY]
        started = time.perf_counter()
        request_id = _request_id(request)
        request[REQUEST_ID_KEY] = request_id
        _check_client_request_id(request)
        if request.content_length is not None and request.content_length > state.max_request_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=state.max_request_bytes, actual_size=request.content_length)
        body = await request.read()
        model = request_model(body)
        _authorize_model(request, model)
        await _admit(request, model)
        span, trace_headers = _trace(state, request, route, model, request_id)
        routed = RoutedRequest(
            route=route,
            body=body,
            parsed=None,
            model=model,
            stream=False,
            request_id=request_id,
            direct_worker=request.headers.get(DIRECT_WORKER_HEADER),
            trace_headers=trace_headers,
        )
        metrics = state.metrics
        try:
            reply = await request.app[TASK_ROUTERS_KEY][task].dispatch(routed)
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
        if reply.stream is not None:  # these routes answer in one body; close whatever came instead
            await reply.stream.aclose()
            raise ApiError(502, f"the engine answered {route} with a stream", "unexpected_stream")
        metrics.count_request(route, reply.status, reply.worker_id)
        metrics.observe_e2e(route, False, time.perf_counter() - started)
        if span is not None:
            span.finish(reply.status, routed.state, worker_id=reply.worker_id)
        if PERMIT_KEY in request:  # a tenant's tokens/min limit counts this reply's tokens
            request[USAGE_TOKENS_KEY] = reply_tokens(reply.body)
        return web.Response(
            status=reply.status,
            body=reply.body,
            headers={REQUEST_ID_HEADER: request_id},
            content_type=reply.content_type.split(";")[0],
        )

    return handler


def register_pooling_routes(app: web.Application) -> None:
    """Add the pooling and utility routes to the server's app (its state already under STATE_KEY)."""
    app[TASK_ROUTERS_KEY] = build_task_routers(app[STATE_KEY])
    for route in ROUTE_TASKS:
        app.router.add_post(route, _make_handler(route))
