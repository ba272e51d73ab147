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
    REQUEST_ID_HEADER,
    REQUEST_ID_KEY,
    STATE_KEY,
    ServerState,
    _account_unary,
    _admit,
    _authorize_model,
    _check_client_request_id,
    _dispatch_accounted,
    _request_id,
    _trace,
)

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
        reply = await _dispatch_accounted(request.app[TASK_ROUTERS_KEY][task], routed, metrics, route, span)
        if reply.stream is not None:  # these routes answer in one body; close whatever came instead
            await reply.stream.aclose()
            raise ApiError(502, f"the engine answered {route} with a stream", "unexpected_stream")
        _account_unary(request, metrics, route, False, started, span, routed, reply)
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
