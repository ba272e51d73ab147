"""OpenAI's Responses API on the server: ``POST /v1/responses`` (unary and SSE), ``GET`` and
``DELETE /v1/responses/{id}``.

A request is relayed to a mixed worker as the engine answers it (status, body, SSE bytes), with the
steps every inference route takes (request id, size limit, the key's model check, the fair queue,
the trace, a tenant's salt, per-route metrics). It is routed as the equivalent chat request: the
chat messages vLLM renders ``instructions`` + ``input`` to (``infera.api.responses``), so kv-aware
routing hashes the prompt the engine will cache, while the worker is sent the Responses body itself
(``RoutedRequest.body_for``).

Conversations live in the router, not in an engine: a response the client asked to store
(``store`` is true by default) is kept in the server's ``ResponsesStore`` (its expanded input and the
response object); a follow-up naming ``previous_response_id`` is expanded from it into one
self-contained request that any worker can serve, and engines are asked not to keep their own copy
(``store: false``; vLLM's own store is per engine and never frees). GET and DELETE are answered from
the store, 404 in OpenAI's shape for an unknown id (or another tenant's)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
from aiohttp import web

from infera.api import responses as _responses
from infera.api.errors import ApiError
from infera.api.requests import parse_request
from infera.router.policy import RoutedRequest
from infera.server.app_state import (
    API_KEY_KEY,
    DIRECT_WORKER_HEADER,
    PERMIT_KEY,
    REQUEST_ID_HEADER,
    REQUEST_ID_KEY,
    STATE_KEY,
    ServerState,
    _account_stream_end,
    _account_unary,
    _admit,
    _authorize_model,
    _check_client_request_id,
    _dispatch_accounted,
    _json,
    _observe_first_byte,
    _request_id,
    _trace,
)
from infera.server.request_salt import CACHE_SALT_STATE, salt_translated
from infera.server.responses_store import ResponsesStore, ResponsesStoreLike, decode_entry, encode_entry
from infera.server.tenant_limits import UsageMeter

log = logging.getLogger(__name__)

CHAT_ROUTE = "/v1/chat/completions"
ROUTE = _responses.RESPONSES_ROUTE
_NO_PREVIOUS = b'"previous_response_id":null'
RESPONSES_STORE_KEY = web.AppKey("responses_store", ResponsesStoreLike)  # local, sibling-shared or NATS-shared
# Routes an --api-keys-file key opens (app.py's API_KEY_ROUTES takes them in).
API_KEY_ROUTES = frozenset({_responses.RESPONSES_ROUTE, _responses.RESPONSE_ROUTE})


def install(app: web.Application, store: ResponsesStoreLike | None = None) -> None:
    """The Responses routes on ``app``, with ``store`` (a default in-memory one if None; the server
    puts the one its flags build under ``RESPONSES_STORE_KEY`` before it starts)."""
    app[RESPONSES_STORE_KEY] = store if store is not None else ResponsesStore()
    app.router.add_post(_responses.RESPONSES_ROUTE, _create)
    app.router.add_get(_responses.RESPONSE_ROUTE, _retrieve)
    app.router.add_delete(_responses.RESPONSE_ROUTE, _delete)


def _tenant(request: web.Request) -> str:
    key = request.get(API_KEY_KEY)
    return key.tenant if key is not None else ""


async def _stored(request: web.Request, response_id: str) -> tuple[list[Any], dict[str, Any]]:
    """(input items, response object) of a stored response of this request's tenant, or the 404."""
    value = await request.app[RESPONSES_STORE_KEY].get(response_id)
    entry = decode_entry(value) if value is not None else None
    if entry is None or entry[1].get("_tenant", "") != _tenant(request):
        raise _responses.not_found(response_id)
    return entry


def _public(response: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in response.items() if k != "_tenant"}


async def _keep(request: web.Request, input_items: list[Any], response: dict[str, Any] | None) -> None:
    """Store a completed response (its id the engine's) with the input that led to it."""
    if response is None or not isinstance(response.get("id"), str):
        return
    response = {**response, "_tenant": _tenant(request)}
    if not await request.app[RESPONSES_STORE_KEY].put(response["id"], encode_entry(input_items, response)):
        log.info("response %s not stored: larger than --responses-store-max-bytes", response["id"])


async def _create(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE_KEY]
    started = time.perf_counter()
    request_id = _request_id(request)
    request[REQUEST_ID_KEY] = request_id
    _check_client_request_id(request)
    if request.content_length is not None and request.content_length > state.max_request_bytes:
        raise web.HTTPRequestEntityTooLarge(max_size=state.max_request_bytes, actual_size=request.content_length)
    doc = _responses.decode_request(await request.read())
    model = doc["model"]
    _authorize_model(request, model)
    previous = doc.get("previous_response_id")
    if previous is not None:  # the conversation so far, from the router's store: any worker can serve it
        prior_input, prior_response = await _stored(request, previous)
        doc = _responses.expand(doc, prior_input, prior_response.get("output"))
    if "kv_transfer_params" in doc and not state.allow_client_kv_transfer_params:  # as parse_request refuses it
        raise ApiError(
            400,
            "kv_transfer_params is set by the router; start the server with "
            "--allow-client-kv-transfer-params to let clients send their own",
            "invalid_request",
            param="kv_transfer_params",
        )
    keep = doc.get("store", True) is not False
    doc["store"] = False  # the router keeps it; an engine's own store is per engine and never frees
    salt = salt_translated(doc, request.get(API_KEY_KEY))  # an isolated tenant's own cache_salt
    engine_body = _json.encode(doc)
    chat = _json.encode(_responses.chat_body(doc))
    parsed = parse_request(CHAT_ROUTE, chat, allow_kv_transfer_params=True)
    await _admit(request, model)
    stream = doc.get("stream") is True
    span, trace_headers = _trace(state, request, ROUTE, model, request_id)
    routed = RoutedRequest(
        route=CHAT_ROUTE,
        body=chat,
        parsed=parsed,
        model=model,
        stream=stream,
        request_id=request_id,
        direct_worker=request.headers.get(DIRECT_WORKER_HEADER),
        trace_headers=trace_headers,
        body_for=lambda worker: (ROUTE, engine_body),
    )
    given = doc.get("cache_salt")
    salt = salt if salt is not None else (given if isinstance(given, str) and given else None)
    if salt is not None:  # the kv-aware policy hashes the prompt from the same salted root
        routed.state[CACHE_SALT_STATE] = salt
    input_items = _responses.input_items(doc["input"])
    metrics = state.metrics
    # Mixed workers only: a PD pair's legs are built from a chat body, not the Responses one.
    router = getattr(state.router, "mixed", state.router)
    reply = await _dispatch_accounted(router, routed, metrics, ROUTE, span)
    headers = {REQUEST_ID_HEADER: request_id}
    if reply.stream is None:
        _account_unary(request, metrics, ROUTE, False, started, span, routed, reply)
        body = reply.body
        if reply.status == 200 and (keep or previous is not None):
            response = _responses.response_object(body)
            if response is not None and previous is not None:  # as the engine would echo it, had it expanded it
                response["previous_response_id"] = previous
                body = _json.encode(response)
            if keep:
                await _keep(request, input_items, response)
        return web.Response(
            status=reply.status, body=body, headers=headers, content_type=reply.content_type.split(";")[0]
        )
    _observe_first_byte(request, metrics, ROUTE, started, reply)
    headers["Content-Type"] = "text/event-stream"
    headers["Cache-Control"] = "no-cache"
    resp = web.StreamResponse(status=200, headers=headers)
    chunks = reply.stream
    completed = _responses.CompletedEvent(request.app[RESPONSES_STORE_KEY].max_bytes) if keep else None
    meter = UsageMeter() if PERMIT_KEY in request else None
    # the events' response objects name the previous response, as the engine's would (quotes inside a
    # JSON string are escaped, so only the field itself matches)
    echo = b'"previous_response_id":' + _json.encode(previous) if previous is not None else None
    broken: str | None = None
    events = 0
    try:
        await resp.prepare(request)
        async for chunk in chunks:
            if completed is not None:
                completed.feed(chunk)
            if meter is not None:
                meter.feed(chunk)
            failed = _responses.router_error_event(chunk, events)
            if failed is not None:  # the worker was lost mid-stream: the Responses API's error event
                await resp.write(failed)
                continue
            events += chunk.count(b"\ndata: ")  # one data line per engine event, after its event line
            await resp.write(chunk if echo is None else chunk.replace(_NO_PREVIOUS, echo))
        if completed is not None:  # stored before the stream ends: the client's follow-up may come at once
            response = completed.response()
            if response is not None and previous is not None:
                response["previous_response_id"] = previous
            await _keep(request, input_items, response)
        await resp.write_eof()
    except (ConnectionResetError, asyncio.CancelledError):
        metrics.count_disconnect(ROUTE)
        broken = "the client disconnected"
        raise
    finally:
        await _account_stream_end(request, metrics, ROUTE, True, started, span, routed, reply, broken, meter)
    return resp


async def _retrieve(request: web.Request) -> web.Response:
    request[REQUEST_ID_KEY] = request_id = _request_id(request)
    _, response = await _stored(request, request.match_info["response_id"])
    return web.Response(
        body=msgspec.json.encode(_public(response)),
        content_type="application/json",
        headers={REQUEST_ID_HEADER: request_id},
    )


async def _delete(request: web.Request) -> web.Response:
    request[REQUEST_ID_KEY] = request_id = _request_id(request)
    response_id = request.match_info["response_id"]
    await _stored(request, response_id)  # another tenant's is not found, and stays
    if not await request.app[RESPONSES_STORE_KEY].delete(response_id):
        raise _responses.not_found(response_id)
    return web.Response(
        body=_responses.deleted_body(response_id),
        content_type="application/json",
        headers={REQUEST_ID_HEADER: request_id},
    )
