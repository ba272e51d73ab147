"""Anthropic's Messages API on the server: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

Translation lives in ``infera.api.anthropic``; these handlers feed the translated body to the same
``router.dispatch`` as ``/v1/chat/completions`` (with the same key, queue, trace and cache-salt
steps) and write the answer back in Anthropic's shapes, errors included.

Passthrough: a mixed worker whose engine serves ``/v1/messages`` itself (its record's
``anthropic_messages``: vLLM 0.32) is sent the client's own request instead, and its reply or SSE
is relayed unchanged: the engine's own behaviour, one conversion less. The choice is made per
worker as the dispatch picks it (``RoutedRequest.body_for``): a mixed fleet passes through where it
can and translates elsewhere, a failover may land on either kind, and the routing itself (kv-aware
hashing over the rendered chat form, the salt) is the same both ways. PD pairs keep the
translation: the disaggregated router builds its legs from the chat body. Usage (tenant limits, the
kv self-check's cached tokens) is read from Anthropic's usage; ``infera_anthropic_messages_total``
counts requests by mode."""
from __future__ import annotations

import asyncio
import logging
import random
import time

from typing import Any, Callable, Iterator

import msgspec
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, Metric

from infera.api import anthropic as _anthropic
from infera.api import anthropic_passthrough as _passthrough
from infera.api.errors import ApiError
from infera.api.requests import parse_request
from infera.discovery.record import WorkerRecord
from infera.kv.prompt import DEFAULT_PREFIX_CHARS
from infera.router.lora import adapter_holders
from infera.router.policy import RoutedRequest
from infera.router.upstream import LegFailure, open_upstream, request_headers
from infera.server.app_state import (API_KEY_KEY, DIRECT_PREFILL_HEADER, DIRECT_WORKER_HEADER,
                                     PERMIT_KEY, REQUEST_ID_HEADER, REQUEST_ID_KEY, STATE_KEY, USAGE_TOKENS_KEY,
                                     ServerState, _account_stream_end, _admit, _authorize_model,
                                     _check_client_request_id, _json, _observe_first_byte, _request_id, _trace)
from infera.server.request_salt import CACHE_SALT_STATE, SALT_FIELD, salt_translated
from infera.server.tenant_limits import UsageMeter, reply_tokens
from infera.server.tracing import RequestSpan

log = logging.getLogger(__name__)

ANTHROPIC_PREFIX = "/v1/messages"
# RoutedRequest.state key: the worker sent the client's own request (absent: none was)
PASSTHROUGH_STATE = "anthropic_passthrough"
MODES = ("passthrough", "translated")


class AnthropicModes:
    """``infera_anthropic_messages_total{mode}``: /v1/messages requests answered by an engine's own
    Messages API (``passthrough``) or through the chat translation (``translated``). A collector on
    the server's registry: plain counters on the hot path, families built at scrape time."""

    def __init__(self, registry: Any = None) -> None:
        self.counts = dict.fromkeys(MODES, 0)
        if registry is not None:
            registry.register(self)

    def count(self, mode: str) -> None:
        self.counts[mode] += 1

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("infera_anthropic_messages", "Anthropic /v1/messages requests answered, by "
                                     "mode: passthrough (the engine's own Messages API) or translated (chat)",
                                     labels=["mode"])
        for mode, n in self.counts.items():
            family.add_metric([mode], n)
        yield family


ANTHROPIC_MODES_KEY = web.AppKey("anthropic_modes", AnthropicModes)


def install(app: web.Application, registry: Any) -> None:
    """The Messages API's routes on ``app``, and its counter on ``registry`` (the server's)."""
    app[ANTHROPIC_MODES_KEY] = AnthropicModes(registry)
    app.router.add_post(_anthropic.MESSAGES_ROUTE, _anthropic_messages)
    app.router.add_post(_anthropic.COUNT_TOKENS_ROUTE, _anthropic_count_tokens)


def serves_messages(worker: WorkerRecord) -> bool:
    """Whether ``worker`` is sent the client's own request: its engine serves /v1/messages, and it
    serves requests whole (a PD leg's body is built from the chat form)."""
    return worker.anthropic_messages and worker.disagg_mode == "mixed"


def passthrough_bodies(translated: _anthropic.TranslatedRequest, salt: str | None,
                       state: dict[str, Any]) -> Callable[[WorkerRecord], tuple[str, bytes] | None]:
    """``RoutedRequest.body_for``: for a worker that serves /v1/messages, the route and the client's
    body (built once, on the first such worker); None for the rest (the translated chat body).
    Which worker was last sent it is left in ``state`` under ``PASSTHROUGH_STATE``: the reply
    comes from the last worker tried, so the handler knows which shape it is in."""
    built: list[bytes] = []

    def body_for(worker: WorkerRecord) -> tuple[str, bytes] | None:
        if not serves_messages(worker):
            state.pop(PASSTHROUGH_STATE, None)
            return None
        if not built:
            built.append(_passthrough.passthrough_body(translated.source, salt))
        state[PASSTHROUGH_STATE] = worker.worker_id
        return _anthropic.MESSAGES_ROUTE, built[0]

    return body_for


def _request_salt(translated: _anthropic.TranslatedRequest, key: Any) -> str | None:
    """The salt the engine gets either way (the translation forwards a client's ``cache_salt`` as an
    engine extra, as the passthrough does): an isolated tenant's own, written into the chat body;
    else a usable one the client sent; None: none. The routing hashes under it."""
    salt = salt_translated(translated.body, key)
    if salt is None:
        given = translated.body.get(SALT_FIELD)
        salt = given if isinstance(given, str) and given else None
    return salt


# -- Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens) --------------------------------
# Translation lives in infera.api.anthropic; these handlers feed the translated body to the same
# router.dispatch as /v1/chat/completions and write the answer back in Anthropic's shapes.
def _anthropic_error(status: int, message: str, request_id: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=_anthropic.anthropic_error_body(status, message),
                        content_type="application/json", headers={REQUEST_ID_HEADER: request_id, **(headers or {})})


async def _anthropic_body(request: web.Request, state: ServerState) -> bytes:
    version = request.headers.get("anthropic-version")
    if version is not None and version != _anthropic.ANTHROPIC_VERSION:
        log.debug("anthropic-version %r (served as %s)", version, _anthropic.ANTHROPIC_VERSION)
    _check_client_request_id(request)
    if request.content_length is not None and request.content_length > state.max_request_bytes:
        raise web.HTTPRequestEntityTooLarge(max_size=state.max_request_bytes, actual_size=request.content_length)
    return await request.read()


async def _anthropic_messages(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE_KEY]
    route = _anthropic.MESSAGES_ROUTE
    started = time.perf_counter()
    request_id = _request_id(request)
    request[REQUEST_ID_KEY] = request_id
    metrics = state.metrics
    span: RequestSpan | None = None
    routed: RoutedRequest | None = None
    try:
        translated = _anthropic.translate_request(await _anthropic_body(request, state))
        _authorize_model(request, translated.model)
        await _admit(request, translated.model)
        salt = _request_salt(translated, request.get(API_KEY_KEY))  # an isolated tenant's cache_salt, or the client's
        body = _json.encode(translated.body)
        parsed = parse_request(_anthropic.CHAT_ROUTE, body,
                               allow_kv_transfer_params=state.allow_client_kv_transfer_params)
        span, trace_headers = _trace(state, request, route, translated.model, request_id)
        routed = RoutedRequest(route=_anthropic.CHAT_ROUTE, body=body, parsed=parsed, model=translated.model,
                               stream=translated.stream, request_id=request_id,
                               direct_worker=request.headers.get(DIRECT_WORKER_HEADER),
                               direct_prefill=request.headers.get(DIRECT_PREFILL_HEADER), trace_headers=trace_headers)
        if salt is not None:
            routed.state[CACHE_SALT_STATE] = salt
        routed.body_for = passthrough_bodies(translated, salt, routed.state)
        reply = await state.router.dispatch(routed)
    except ApiError as exc:
        metrics.count_request(route, exc.status, "none")
        if span is not None:
            span.finish(exc.status, routed.state if routed is not None else None,
                        error=exc.message if exc.status >= 500 else None)
        return _anthropic_error(exc.status, exc.message, request_id, exc.headers)
    except web.HTTPRequestEntityTooLarge:
        metrics.count_request(route, 413, "none")
        return _anthropic_error(413, f"request body larger than the {state.max_request_bytes}-byte limit", request_id)
    except asyncio.CancelledError:
        metrics.count_disconnect(route)
        if span is not None:
            span.finish(None, routed.state if routed is not None else None, error="the client disconnected")
        raise
    msg_id = _anthropic.message_id(request_id)
    headers = {REQUEST_ID_HEADER: request_id}
    passthrough = routed.state.get(PASSTHROUGH_STATE) == reply.worker_id  # the engine answered in Anthropic's shapes
    modes = request.app.get(ANTHROPIC_MODES_KEY)
    if modes is not None:
        modes.count("passthrough" if passthrough else "translated")
    if reply.stream is None:
        metrics.count_request(route, reply.status, reply.worker_id)
        metrics.observe_e2e(route, False, time.perf_counter() - started)
        if span is not None:
            span.finish(reply.status, routed.state, worker_id=reply.worker_id)
        if PERMIT_KEY in request:
            request[USAGE_TOKENS_KEY] = (_passthrough.usage_tokens(reply.body) if passthrough
                                         else reply_tokens(reply.body))
        if passthrough:  # relayed as the engine wrote it; an error in another shape is put in Anthropic's
            body = (reply.body or b"") if reply.status < 400 else _passthrough.error_reply_body(reply.status, reply.body)
            return web.Response(status=reply.status, body=body, content_type="application/json", headers=headers)
        if reply.status >= 400:  # the engine refused it: its message, in Anthropic's shape
            return _anthropic_error(reply.status, _anthropic.error_message_of(reply.body, reply.status), request_id)
        try:
            answer = msgspec.json.decode(reply.body or b"")
        except (msgspec.DecodeError, RecursionError):  # RecursionError: msgspec's, for JSON nested too deep
            log.warning("request %s: worker %s returned a body that is not JSON", request_id, reply.worker_id)
            return _anthropic_error(502, "the worker returned a body that is not JSON", request_id)
        message = _anthropic.translate_response(answer if isinstance(answer, dict) else {}, translated, msg_id)
        return web.Response(body=_json.encode(message), content_type="application/json", headers=headers)
    _observe_first_byte(request, metrics, route, started, reply)
    headers["Content-Type"] = "text/event-stream"
    headers["Cache-Control"] = "no-cache"
    resp = web.StreamResponse(status=200, headers=headers)
    chunks = reply.stream
    events = None if passthrough else _anthropic.StreamTranslator(translated.model, msg_id, translated.stop_sequences)
    broken: str | None = None
    meter: UsageMeter | _passthrough.PassthroughMeter | None = None
    if PERMIT_KEY in request:
        meter = _passthrough.PassthroughMeter() if passthrough else UsageMeter()
    try:
        await resp.prepare(request)
        async for chunk in chunks:  # read to the end even after [DONE]: the relay's usage tail feeds kv-aware
            if meter is not None:
                meter.feed(chunk)
            if events is None:  # the engine's own events, as they come; the router's error frame in Anthropic's shape
                await resp.write(_passthrough.router_error_event(chunk) or chunk)
                continue
            out = events.feed(chunk)
            if out:
                await resp.write(out)
        out = events.finish() if events is not None else b""
        if out:
            await resp.write(out)
        await resp.write_eof()
    except (ConnectionResetError, asyncio.CancelledError):
        metrics.count_disconnect(route)
        broken = "the client disconnected"
        raise
    finally:  # releases upstream on any exit, even before the first chunk
        await _account_stream_end(request, metrics, route, True, started, span, routed, reply, broken, meter)
    return resp


_COUNT_ATTEMPTS = 2  # count_tokens on engines: workers tried before the failure is the answer


def _router_cannot_count(state: ServerState, model: str) -> ApiError | None:
    """Why the router cannot count ``model``'s prompts with its own tokenizer (None: it can)."""
    if state.tokenizers is None:
        return ApiError(501, "count_tokens needs the router's tokenizer, which this server keeps only under "
                        "--router-policy kv-aware (or a worker whose engine serves the Messages API itself)",
                        "count_tokens_unavailable")
    status = state.tokenizers.model_status(model)
    if status["status"] == "degraded":  # the router's tokenizer may not be the engine's: no guess
        return ApiError(501, f"count_tokens is unavailable for model {model!r}: its router tokenizer "
                        f"is degraded ({'; '.join(status.get('reasons', []))})", "count_tokens_unavailable")
    if state.tokenizers.prompts_for(model) is None:
        return ApiError(503, f"the tokenizer of model {model!r} is still loading; retry shortly",
                        "tokenizer_loading", headers={"Retry-After": "1"})
    return None


async def _count_on_engine(state: ServerState, translated: _anthropic.TranslatedRequest, request_id: str,
                           holders: tuple[WorkerRecord, ...] = ()) -> web.Response | None:
    """The count of an engine that serves the Messages API itself (its own template renders the
    tools too), for a server that cannot count: its answer relayed, an error in Anthropic's shape.
    None: no worker of the model serves it. Any such worker will do (a tokenization, no generation):
    one the circuit breaker admits where there is one, and another if it fails before answering.
    ``holders``: for a LoRA adapter, the workers holding it (its engine counts under its name)."""
    pool = [w for w in holders or state.fleet.active(translated.model, "mixed") if serves_messages(w)]
    if not pool:
        return None
    mixed = state.router.mixed
    candidates = list(mixed.breaker.filter(pool))
    random.shuffle(candidates)
    body = _passthrough.passthrough_body(translated.source, None)
    failure: LegFailure | None = None
    for worker in candidates[:_COUNT_ATTEMPTS]:
        try:
            opened = await open_upstream(mixed.transport, worker, _anthropic.COUNT_TOKENS_ROUTE, body,
                                         request_headers(request_id, None), False)
        except LegFailure as exc:
            log.warning("request %s: count_tokens: %s", request_id, exc.detail)
            failure = exc
            continue
        break
    else:
        assert failure is not None
        raise ApiError(failure.status, failure.message, failure.reason)
    body = (opened.body or b"") if opened.status < 400 else _passthrough.error_reply_body(opened.status, opened.body)
    return web.Response(status=opened.status, body=body, content_type="application/json",
                        headers={REQUEST_ID_HEADER: request_id})


_COUNT_INLINE_CHARS = 4096  # count_tokens: smaller prompts are counted on the loop (a thread hop costs more)
_COUNT_BODY_FACTOR = 8  # count_tokens: bodies over this many times --router-prefix-chars are not read


async def _anthropic_count_tokens(request: web.Request) -> web.Response:
    """``{"input_tokens": N}`` with the model's tokenizer, where the router keeps one (kv-aware);
    else, where a worker's engine serves the Messages API itself, that engine's own count."""
    state: ServerState = request.app[STATE_KEY]
    request_id = _request_id(request)
    request[REQUEST_ID_KEY] = request_id
    try:
        # A body this much over the cap holds more than it in its messages whatever its escapes (at most 6
        # bytes a character): refused before it is read and decoded, which alone held the loop ~0.1 s a 30 MB.
        cap = (getattr(state.tokenizers, "_prompt_kwargs", {}).get("prefix_chars") or DEFAULT_PREFIX_CHARS)
        if request.content_length is not None and request.content_length > _COUNT_BODY_FACTOR * cap:
            raise ApiError(413, f"count_tokens counts prompts of up to {cap} characters (--router-prefix-chars); "
                           f"this body is over {_COUNT_BODY_FACTOR}x that", "prompt_too_large")
        translated = _anthropic.translate_request(await _anthropic_body(request, state), count_only=True)
        _authorize_model(request, translated.model)
        # A LoRA adapter counts with its base model's tokenizer (an adapter changes weights, not tokens).
        holders = () if state.fleet.knows_model(translated.model) else adapter_holders(state.fleet, translated.model)
        if not holders and not state.fleet.knows_model(translated.model):
            raise ApiError(404, f"The model `{translated.model}` does not exist. Available: "
                           f"{', '.join(state.fleet.models())}", "model_not_found")
        counted_model = holders[0].model_name if holders else translated.model
        unable = _router_cannot_count(state, counted_model)
        if unable is not None:  # an engine that serves the Messages API itself counts, else the reason
            counted = await _count_on_engine(state, translated, request_id, holders)
            if counted is not None:
                return counted
            raise unable
        prompts = state.tokenizers.prompts_for(counted_model)
        # The cap and the threads of routing (infera/kv/prompt.py): a prompt past --router-prefix-chars is
        # not tokenized whole here either (a 413: an estimate is no answer to "does it fit"; no served
        # context holds 512 KiB of text), and anything past a few KB goes to the tokenizer threads.
        size = len(_json.encode(translated.body["messages"])) + (len(_json.encode(translated.tools))
                                                                 if translated.tools else 0)
        if size > prompts.prefix_chars:
            raise ApiError(413, f"count_tokens counts prompts of up to {prompts.prefix_chars} characters (as JSON; "
                           "--router-prefix-chars); this one is longer", "prompt_too_large")
        if size > _COUNT_INLINE_CHARS:
            count = await asyncio.get_running_loop().run_in_executor(
                prompts._pool(), _anthropic.count_prompt_tokens, prompts.tokenizer, translated)
        else:
            count = _anthropic.count_prompt_tokens(prompts.tokenizer, translated)
    except ApiError as exc:
        return _anthropic_error(exc.status, exc.message, request_id, exc.headers)
    except web.HTTPRequestEntityTooLarge:
        return _anthropic_error(413, f"request body larger than the {state.max_request_bytes}-byte limit", request_id)
    return web.Response(body=_json.encode({"input_tokens": count}), content_type="application/json",
                        headers={REQUEST_ID_HEADER: request_id})
