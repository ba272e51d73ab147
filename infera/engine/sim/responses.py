"""The simulated engine's OpenAI Responses API (``POST /v1/responses``, ``GET /v1/responses/{id}``),
as vLLM 0.32 serves it for a model without a reasoning or tool parser.

The request is rendered as vLLM renders it (``instructions`` as the system message, ``input`` as
chat messages: ``infera.api.responses.chat_messages``) and run through the sim's own chat route over
loopback, so it is scheduled, cached and published like any chat request. The answer is in vLLM's
shapes: the response object of ``ResponsesResponse.from_request`` (``resp_`` ids, ``usage`` with
``input_tokens_details.cached_tokens``, ``status`` ``incomplete`` at the token limit), and for a
stream vLLM's SSE events in its order (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``…,
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``,
``response.completed``), each ``event: <type>`` / ``data: <json>`` with its ``sequence_number``.

Like vLLM, a stored response is kept by this engine only with ``VLLM_ENABLE_RESPONSES_API_STORE=1``
(here bounded to the last ``_STORE_ENTRIES``); without it ``store`` is ignored and every
``previous_response_id`` is a 404, which is why the router keeps conversations itself.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from infera.api import responses as _responses
from infera.api.errors import ApiError as RouterApiError

from .schemas import ENGINE_KEY, SSE_HEADERS, ApiError

SESSION_KEY = web.AppKey("responses_loopback", aiohttp.ClientSession)
STORE_KEY: web.AppKey[OrderedDict[str, Any]] = web.AppKey("responses_store")
_STORE_ENTRIES = 1024
_FORWARDED_HEADERS = ("X-Request-Id", "traceparent", "tracestate", "X-Data-Parallel-Rank")
_json_encode = msgspec.json.Encoder().encode


def _store_enabled() -> bool:
    return os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "").strip().lower() in ("1", "true")


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id")


def _response(
    req: dict[str, Any],
    response_id: str,
    model: str,
    created: int,
    output: list[dict[str, Any]],
    status: str,
    usage: dict[str, Any] | None,
    max_tokens: int | None,
) -> dict[str, Any]:
    """vLLM's ``ResponsesResponse.from_request`` for this request."""
    temperature = req.get("temperature")
    top_p = req.get("top_p")
    return {
        "id": response_id,
        "created_at": created,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.get("instructions"),
        "metadata": req.get("metadata"),
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": req.get("parallel_tool_calls", True),
        "temperature": 1.0 if temperature is None else temperature,
        "tool_choice": req.get("tool_choice", "auto"),
        "tools": req.get("tools") or [],
        "top_p": 1.0 if top_p is None else top_p,
        "background": bool(req.get("background")),
        "max_output_tokens": max_tokens,
        "max_tool_calls": req.get("max_tool_calls"),
        "previous_response_id": req.get("previous_response_id"),
        "prompt": req.get("prompt"),
        "reasoning": req.get("reasoning"),
        "service_tier": req.get("service_tier", "auto"),
        "status": status,
        "text": req.get("text"),
        "top_logprobs": None,
        "truncation": req.get("truncation", "disabled"),
        "usage": usage,
        "user": req.get("user"),
        "presence_penalty": req.get("presence_penalty"),
        "frequency_penalty": req.get("frequency_penalty"),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    u = chat_usage or {}
    prompt, completion = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": prompt,
        "output_tokens": completion,
        "total_tokens": prompt + completion,
        "input_tokens_details": {
            "cache_write_tokens": 0,
            "cached_tokens": cached,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": None}


def _message(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "content": [_text_part(text)] if text else [],
        "role": "assistant",
        "status": status,
        "type": "message",
    }


def _chat_body(req: dict[str, Any], messages: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": req.get("model"), "messages": messages, "stream": stream}
    if req.get("max_output_tokens") is not None:
        body["max_tokens"] = req["max_output_tokens"]
    for key in ("temperature", "top_p", "cache_salt", "ignore_eos", "seed"):
        if req.get(key) is not None:
            body[key] = req[key]
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


class _Events:
    """vLLM's SSE events of one streamed response, numbered in order."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, event: dict[str, Any]) -> bytes:
        event["sequence_number"] = self.seq
        self.seq += 1
        kind: str = event["type"]
        return b"event: " + kind.encode() + b"\ndata: " + _json_encode(event) + b"\n\n"


async def _create(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    try:
        req = _responses.decode_request(await request.read())
    except RouterApiError as exc:
        raise ApiError(400, exc.message) from None
    engine.check_model(req["model"])
    store = request.app[STORE_KEY]
    keep = _store_enabled() and req.get("store", True) is not False
    previous = req.get("previous_response_id")
    prior: list[dict[str, Any]] = []
    if previous is not None:  # vLLM: the stored messages (less system) and the previous output messages
        if not _store_enabled() or previous not in store:
            raise _not_found(previous)
        prev_messages, prev_response = store[previous]
        prior = [m for m in prev_messages if m.get("role") != "system"]
        for item in prev_response["output"]:
            if item.get("type") == "message":
                prior.extend({"role": "assistant", "content": part.get("text")} for part in item["content"])
    try:
        messages = _responses.chat_messages(req.get("instructions"), req["input"])
    except RouterApiError as exc:
        raise ApiError(400, exc.message) from None
    if prior:
        system = messages[:1] if messages and messages[0].get("role") == "system" and req.get("instructions") else []
        messages = system + prior + messages[len(system) :]
    stream = req.get("stream") is True
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    if not isinstance(sockname, tuple) or len(sockname) < 2:
        raise ApiError(500, "the engine cannot reach its own chat route", "InternalServerError")
    host = sockname[0] if ":" not in sockname[0] else f"[{sockname[0]}]"
    headers = {h: v for h in _FORWARDED_HEADERS if (v := request.headers.get(h)) is not None}
    response_id, created, model = f"resp_{uuid.uuid4().hex}", int(time.time()), engine.model_name
    session = request.app[SESSION_KEY]
    async with session.post(
        f"http://{host}:{sockname[1]}/v1/chat/completions",
        data=_json_encode(_chat_body(req, messages, stream)),
        headers={"Content-Type": "application/json", **headers},
    ) as chat:
        if chat.status >= 400:  # vLLM's error shape already
            return web.Response(status=chat.status, body=await chat.read(), content_type="application/json")
        if not stream:
            answer = msgspec.json.decode(await chat.read())
            choice = answer["choices"][0]
            text = choice["message"].get("content") or ""
            usage = _usage(answer.get("usage"))
            output = [_message(f"msg_{uuid.uuid4().hex}", text)] if text else []
            status = "incomplete" if choice.get("finish_reason") == "length" or not output else "completed"
            body = _response(
                req,
                response_id,
                model,
                created,
                output,
                status,
                usage,
                req.get("max_output_tokens") or engine.max_model_len - usage["input_tokens"],
            )
            if keep:
                _remember(store, response_id, messages, body)
            return web.Response(body=_json_encode(body), content_type="application/json")
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        event = _Events()
        initial = _response(req, response_id, model, created, [], "in_progress", None, req.get("max_output_tokens"))
        await resp.write(event({"type": "response.created", "response": initial}))
        await resp.write(event({"type": "response.in_progress", "response": initial}))
        item_id = f"msg_{uuid.uuid4().hex}"
        text, finish, chat_usage = "", None, None
        async for line in chat.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = msgspec.json.decode(line[6:])
            if chunk.get("usage"):
                chat_usage = chunk["usage"]
            for c in chunk.get("choices") or []:
                delta = (c.get("delta") or {}).get("content") or ""
                finish = c.get("finish_reason") or finish
                if not delta:
                    continue
                if not text:  # the message opens with its first text, as vLLM's processor does
                    await resp.write(
                        event(
                            {
                                "type": "response.output_item.added",
                                "output_index": 0,
                                "item": _message(item_id, "", "in_progress"),
                            }
                        )
                    )
                    await resp.write(
                        event(
                            {
                                "type": "response.content_part.added",
                                "output_index": 0,
                                "item_id": item_id,
                                "content_index": 0,
                                "part": {**_text_part(""), "logprobs": []},
                            }
                        )
                    )
                text += delta
                await resp.write(
                    event(
                        {
                            "type": "response.output_text.delta",
                            "content_index": 0,
                            "output_index": 0,
                            "item_id": item_id,
                            "delta": delta,
                            "logprobs": [],
                        }
                    )
                )
        output = []
        if text:
            await resp.write(
                event(
                    {
                        "type": "response.output_text.done",
                        "output_index": 0,
                        "content_index": 0,
                        "text": text,
                        "logprobs": [],
                        "item_id": item_id,
                    }
                )
            )
            await resp.write(
                event(
                    {
                        "type": "response.content_part.done",
                        "item_id": item_id,
                        "output_index": 0,
                        "content_index": 0,
                        "part": _text_part(text),
                    }
                )
            )
            output = [_message(item_id, text)]
            await resp.write(event({"type": "response.output_item.done", "output_index": 0, "item": output[0]}))
        usage = _usage(chat_usage)
        status = "incomplete" if finish == "length" or not output else "completed"
        final = _response(
            req,
            response_id,
            model,
            created,
            output,
            status,
            usage,
            req.get("max_output_tokens") or engine.max_model_len - usage["input_tokens"],
        )
        if keep:
            _remember(store, response_id, messages, final)
        await resp.write(event({"type": "response.completed", "response": final}))
        await resp.write_eof()
        return resp


def _remember(
    store: OrderedDict[str, Any], response_id: str, messages: list[dict[str, Any]], response: dict[str, Any]
) -> None:
    store[response_id] = (messages, response)
    while len(store) > _STORE_ENTRIES:
        store.popitem(last=False)


async def _retrieve(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    entry = request.app[STORE_KEY].get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return web.Response(body=_json_encode(entry[1]), content_type="application/json")


def install(app: web.Application) -> None:
    """The routes, and the loopback session they reach the chat route with (opened with the app)."""

    async def session_ctx(app: web.Application) -> AsyncIterator[None]:
        app[SESSION_KEY] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        yield
        await app[SESSION_KEY].close()

    app.cleanup_ctx.append(session_ctx)
    app[STORE_KEY] = OrderedDict()
    app.router.add_post(_responses.RESPONSES_ROUTE, _create)
    app.router.add_get(_responses.RESPONSE_ROUTE, _retrieve)
