"""The simulated engine's Anthropic Messages API, as vLLM 0.32 serves it (``--serve-anthropic``):
``POST /v1/messages`` and ``/v1/messages/count_tokens``, so sim fleets exercise the router's
passthrough to engines that speak Anthropic themselves.

Built as vLLM builds it: the request becomes a chat request (``infera.api.anthropic``'s
translation, vLLM's ``to_chat_completion_request`` in kind; a stream asks for
``include_usage`` and ``continuous_usage_stats`` as vLLM's does), that request runs through this
engine's own ``/v1/chat/completions`` (over loopback: the same scheduler, cache, salt and events as
any chat request), and the answer comes back in Anthropic's shapes with vLLM's marks: the message
id is the chat completion's (``chatcmpl-…``), ``usage.input_tokens`` excludes the
``cache_read_input_tokens`` the engine reports, and errors are ``{"type":"error","error":{"type",
"message"}}`` with vLLM's error type names (``BadRequestError``, ``NotFoundError``). Fields vLLM's
request model does not define are ignored, as its pydantic model ignores them: an engine extra
such as ``ignore_eos``, which the chat route takes, does nothing through ``/v1/messages``.
"""
from __future__ import annotations

import logging
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from infera.api import anthropic as _anthropic
from infera.api.errors import ApiError as RouterApiError
from infera.kv.tokenizer import ChatTemplateError

from .schemas import ENGINE_KEY, SSE_HEADERS, ApiError, _request_id

log = logging.getLogger("infera.engine.sim.server")

SESSION_KEY = web.AppKey("anthropic_loopback", aiohttp.ClientSession)
_json_encode = msgspec.json.Encoder().encode
# Sent on to the chat request: the request id (the sim's ids follow it) and the trace context.
_FORWARDED_HEADERS = ("X-Request-Id", "traceparent", "tracestate", "X-Data-Parallel-Rank")
_VLLM_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}
# vLLM 0.32's AnthropicMessagesRequest and AnthropicCountTokensRequest fields (vllm/entrypoints/anthropic/protocol.py)
_COUNT_FIELDS = frozenset({"model", "messages", "output_config", "system", "thinking", "tool_choice", "tools",
                           "chat_template_kwargs"})
_MESSAGES_FIELDS = _COUNT_FIELDS | {"max_tokens", "metadata", "stop_sequences", "stream", "temperature", "top_k",
                                    "top_p", "mm_payload", "return_mm_kwargs", "cache_salt", "watermarking",
                                    "kv_transfer_params", "ec_transfer_params", "vllm_xargs"}


def _error(status: int, message: str, err_type: str | None = None) -> web.Response:
    """vLLM's ``translate_error_response``: its ErrorResponse's type and message, Anthropic's envelope."""
    body = {"type": "error", "error": {"type": err_type or _VLLM_ERROR_TYPES.get(status, "BadRequestError"),
                                       "message": message}}
    return web.Response(status=status, body=_json_encode(body), content_type="application/json")


def _chat_error(status: int, raw: bytes) -> web.Response:
    """The chat path's vLLM-shaped error (``{"error":{message,type}}``) in Anthropic's envelope."""
    try:
        doc = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        doc = None
    err = doc.get("error") if isinstance(doc, dict) else None
    err = err if isinstance(err, dict) else {}
    message, err_type = err.get("message"), err.get("type")
    return _error(status, message if isinstance(message, str) else raw.decode("utf-8", "replace")[:500],
                  err_type if isinstance(err_type, str) else None)


def _vllm_usage(usage: dict[str, Any]) -> dict[str, int]:
    """vLLM's ``_build_anthropic_usage``: cache_read only when the engine reported cached tokens."""
    out = _anthropic.usage_of(usage)
    out.pop("cache_creation_input_tokens", None)
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    if not isinstance(details, dict) or details.get("cached_tokens") is None:
        out.pop("cache_read_input_tokens", None)
    return out


def _vllm_fields(raw: bytes, count_only: bool) -> bytes:
    """The request as vLLM's pydantic model reads it: fields it does not define are ignored (an
    engine extra such as ``ignore_eos``, which its chat route would take, does nothing here)."""
    try:
        doc = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return raw  # the translation answers it with its 400
    if not isinstance(doc, dict):
        return raw
    known = _COUNT_FIELDS if count_only else _MESSAGES_FIELDS
    return _json_encode({k: v for k, v in doc.items() if k in known})


async def _translated(request: web.Request, count_only: bool) -> _anthropic.TranslatedRequest | web.Response:
    try:
        translated = _anthropic.translate_request(_vllm_fields(await request.read(), count_only),
                                                  count_only=count_only)
        request.app[ENGINE_KEY].check_model(translated.model)
    except RouterApiError as exc:
        return _error(exc.status, exc.message)
    except ApiError as exc:
        return _error(exc.status, exc.message, exc.err_type)
    return translated


async def _messages(request: web.Request) -> web.StreamResponse:
    translated = await _translated(request, count_only=False)
    if isinstance(translated, web.Response):
        return translated
    body = translated.body
    if translated.stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    if not isinstance(sockname, tuple) or len(sockname) < 2:
        return _error(500, "the engine cannot reach its own chat route")
    host = sockname[0] if ":" not in sockname[0] else f"[{sockname[0]}]"
    headers = {h: v for h in _FORWARDED_HEADERS if (v := request.headers.get(h)) is not None}
    headers["X-Request-Id"] = request_id = _request_id(request)  # the chat's id is chatcmpl-<it>, the message's too
    msg_id = f"chatcmpl-{request_id}"
    session = request.app[SESSION_KEY]
    async with session.post(f"http://{host}:{sockname[1]}/v1/chat/completions", data=_json_encode(body),
                            headers={"Content-Type": "application/json", **headers}) as chat:
        if chat.status >= 400:
            return _chat_error(chat.status, await chat.read())
        if not translated.stream:
            answer = msgspec.json.decode(await chat.read())
            message = _anthropic.translate_response(answer, translated, msg_id)
            message["usage"] = _vllm_usage(answer.get("usage") or {})
            return web.Response(body=_json_encode(message), content_type="application/json")
        events = _anthropic.StreamTranslator(translated.model, msg_id, translated.stop_sequences)
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        async for data in chat.content.iter_any():
            out = events.feed(data)
            if out:
                await resp.write(out)
        out = events.finish()
        if out:
            await resp.write(out)
        await resp.write_eof()
        return resp


async def _count_tokens(request: web.Request) -> web.Response:
    translated = await _translated(request, count_only=True)
    if isinstance(translated, web.Response):
        return translated
    engine = request.app[ENGINE_KEY]
    try:
        count = await engine.run_tokenizer(request.content_length or 0, _anthropic.count_prompt_tokens,
                                           engine.tokenizer, translated)
    except (RouterApiError, ChatTemplateError) as exc:
        return _error(400, str(exc))
    return web.Response(body=_json_encode({"input_tokens": count}), content_type="application/json")


def install(app: web.Application) -> None:
    """The routes, and the loopback session they reach the chat route with (opened with the app)."""

    async def session_ctx(app: web.Application):
        app[SESSION_KEY] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        yield
        await app[SESSION_KEY].close()

    app.cleanup_ctx.append(session_ctx)
    app.router.add_post(_anthropic.MESSAGES_ROUTE, _messages)
    app.router.add_post(_anthropic.COUNT_TOKENS_ROUTE, _count_tokens)
