"""The simulated engine's HTTP face: vLLM's OpenAI-compatible routes (``/v1/chat/completions``,
``/v1/completions``, ``/tokenize``, ``/v1/models``, ``/metrics``, ``/health``, ``/version``,
``/reset_prefix_cache``, the profiler's), the unary and SSE response bodies in vLLM's shapes, the
middleware that turns errors into vLLM's (and FastAPI's) bodies, and :func:`build_app`, which
wires them, the P/D role's routes and the forced tool calls into an ``aiohttp`` application that
starts and stops the engine with it. The request schemas and checks are in ``schemas.py``; the
engine the handlers drive is in ``engine.py``.
"""
from __future__ import annotations

import argparse
import logging
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import anthropic, lora, pooling, responses, tool_calls
from .engine import SimEngine
from .pd import LegError, LegPlan
from .scheduler import FINISH_STOP, Sequence
from .schemas import (ENGINE_KEY, SSE_HEADERS, ApiError, ChatCompletionRequest, CompletionRequest, StartProfileRequest,
                      TokenizeRequest, _check_sampling, _completion_prompt_ids, _decode_body, _request_id,
                      _resolve_max_tokens, _SamplingRequest, _stop_strings, _usage)
from .stop_strings import StopStringMatcher
from infera.kv.tokenizer import ChatTemplateError

log = logging.getLogger("infera.engine.sim.server")  # the name the engine has always logged under

SIM_VERSION = "0.0.0+infera.sim"

_json_encode = msgspec.json.Encoder().encode


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": SIM_VERSION})


async def _models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    data = [
        {
            "id": name,
            "object": "model",
            "created": engine.created,
            "owned_by": "vllm",
            "root": engine.model_path,
            "parent": None,
            "max_model_len": engine.max_model_len,
            "permission": [{
                "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": engine.created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False,
            }],
        }
        for name in engine.served_model_names
    ]
    data += engine.lora.cards(engine.model_name, engine.created)  # adapters, their base as parent (vLLM)
    return web.Response(body=_json_encode({"object": "list", "data": data}), content_type="application/json")


async def _metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.Response(body=generate_latest(engine.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _reset_prefix_cache(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not engine.cache.reset_prefix_cache():
        return ApiError(500, "Failed to reset prefix cache: blocks are in use.", "InternalServerError").response()
    if engine.kv_events is not None:
        engine.kv_events.flush()  # AllBlocksCleared now (vLLM sends it with the next step's batch)
    return web.Response(status=200)


async def _tokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    req = await _decode_body(request, TokenizeRequest)
    engine.check_model(req.model)
    tok = engine.tokenizer
    try:
        if req.messages is not None:
            tokens = await engine.run_tokenizer(request.content_length or 0, tok.encode_chat, req.messages)
        elif isinstance(req.prompt, str):
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            tokens = await engine.run_tokenizer(len(req.prompt), tok.encode, req.prompt, add_special)
        else:
            raise ApiError(400, "Either `prompt` (a string) or `messages` is required.")
    except ChatTemplateError as e:
        raise ApiError(400, str(e)) from None
    return web.Response(
        body=_json_encode({"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens,
                           "token_strs": None}),
        content_type="application/json")


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    req = await _decode_body(request, ChatCompletionRequest)
    engine.check_model(req.model)
    _check_sampling(req)
    try:
        prompt_ids = await engine.run_tokenizer(request.content_length or 0, engine.tokenizer.encode_chat,
                                                req.messages)
    except ChatTemplateError as e:
        raise ApiError(400, str(e)) from None
    # vLLM: max_completion_tokens wins over the deprecated max_tokens.
    requested, param = ((req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens is not None
                        else (req.max_tokens, "max_tokens"))
    max_tokens = _resolve_max_tokens(engine, len(prompt_ids), requested, param)
    return await _generate(request, engine, req, prompt_ids, max_tokens, chat=True,
                           request_id=f"chatcmpl-{_request_id(request)}")


async def _completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    req = await _decode_body(request, CompletionRequest)
    engine.check_model(req.model)
    _check_sampling(req)
    text, prompt_ids = _completion_prompt_ids(req.prompt)
    if prompt_ids is None:
        prompt_ids = await engine.run_tokenizer(len(text), engine.tokenizer.encode, text, True)
    if not prompt_ids:
        raise ApiError(400, "The decoder prompt cannot be empty")
    max_tokens = _resolve_max_tokens(engine, len(prompt_ids), req.max_tokens, "max_tokens")
    return await _generate(request, engine, req, prompt_ids, max_tokens, chat=False,
                           request_id=f"cmpl-{_request_id(request)}")


def _reply_model(engine: SimEngine, req: _SamplingRequest) -> str:
    """The model a reply names: the adapter a request ran under (vLLM), else the served name."""
    return req.model if engine.lora.holds(req.model) else engine.model_name


def _local_addr(request: web.Request) -> tuple[str, int] | None:
    """The (host, port) this request reached us at: a concrete address even on a wildcard bind."""
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    if isinstance(sockname, tuple) and len(sockname) >= 2:
        return sockname[0], sockname[1]
    return None


async def _generate(request: web.Request, engine: SimEngine, req: _SamplingRequest, prompt_ids: list[int],
                    max_tokens: int, *, chat: bool, request_id: str) -> web.StreamResponse:
    plan = LegPlan()
    if engine.disagg is not None:
        try:
            plan = await engine.disagg.admit(req, prompt_ids, request_id)
        except LegError as e:
            raise ApiError(e.status, e.message, e.err_type) from None
        if plan.max_tokens is not None:
            max_tokens = plan.max_tokens
    try:
        seq = engine.scheduler.submit(prompt_ids, max_tokens, ignore_eos=bool(req.ignore_eos), request_id=request_id,
                                      kv_hold=plan.kv_hold, kv_import=plan.kv_import,
                                      cache_salt=engine.lora.scope(req.model, req.cache_salt)
                                      if engine.salts_cache else None)
    except ValueError as e:
        if engine.disagg is not None:
            engine.disagg.discard(plan)
        raise ApiError(400, str(e)) from None
    try:
        if req.stream:
            return await _stream_response(request, engine, req, seq, chat=chat, request_id=request_id)
        return await _full_response(engine, req, seq, chat=chat, request_id=request_id, plan=plan,
                                    local_addr=_local_addr(request))
    finally:
        # Normal end: no-op. Client gone (handler cancelled / write failed): free the slot now.
        engine.scheduler.abort(seq)


async def _full_response(engine: SimEngine, req: _SamplingRequest, seq: Sequence, *, chat: bool,
                         request_id: str, plan: LegPlan, local_addr: tuple[str, int] | None) -> web.Response:
    text = StopStringMatcher(_stop_strings(req.stop), hold_back=False)
    finish_reason: str | None = None
    async for token_id, finish_reason in seq.stream():
        if token_id is not None:
            text.add(engine.tokenizer.output_text(token_id))
            if text.matched is not None:
                engine.scheduler.finish(seq, FINISH_STOP)
                finish_reason = FINISH_STOP
                break
    created = int(time.time())
    kv_transfer_params = (engine.disagg.reply_kv_transfer_params(plan, local_addr)
                          if engine.disagg is not None else None)
    if chat:
        body = {
            "id": request_id, "object": "chat.completion", "created": created, "model": _reply_model(engine, req),
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text.text, "refusal": None, "tool_calls": [],
                            "reasoning_content": None},
                "logprobs": None, "finish_reason": finish_reason, "stop_reason": text.matched,
                "token_ids": list(seq.output_token_ids) if req.return_token_ids else None,
            }],
            "usage": _usage(seq), "prompt_logprobs": None,
            "prompt_token_ids": list(seq.prompt_token_ids) if req.return_token_ids else None,
            "kv_transfer_params": kv_transfer_params,
        }
    else:
        body = {
            "id": request_id, "object": "text_completion", "created": created, "model": _reply_model(engine, req),
            "choices": [{
                "index": 0, "text": text.text, "logprobs": None, "finish_reason": finish_reason,
                "stop_reason": text.matched, "prompt_logprobs": None,
                "prompt_token_ids": list(seq.prompt_token_ids) if req.return_token_ids else None,
                "token_ids": list(seq.output_token_ids) if req.return_token_ids else None,
            }],
            "usage": _usage(seq), "kv_transfer_params": kv_transfer_params,
        }
    return web.Response(body=_json_encode(body), content_type="application/json")


async def _stream_response(request: web.Request, engine: SimEngine, req: _SamplingRequest, seq: Sequence, *,
                           chat: bool, request_id: str) -> web.StreamResponse:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous_usage = include_usage and bool(req.stream_options.continuous_usage_stats)
    created = int(time.time())
    model = _reply_model(engine, req)
    obj = "chat.completion.chunk" if chat else "text_completion"
    text = StopStringMatcher(_stop_strings(req.stop), hold_back=True)

    def frame(choices: list[dict], usage: dict | None = None, extra: dict | None = None) -> bytes:
        chunk: dict[str, Any] = {"id": request_id, "object": obj, "created": created, "model": model,
                                 "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        if extra:
            chunk.update(extra)
        return b"data: " + _json_encode(chunk) + b"\n\n"

    # vLLM's return_token_ids placement: chat puts the prompt's ids on the role chunk (top level),
    # completions in the first chunk's choice; every content choice carries its tokens' ids.
    ids = bool(req.return_token_ids)
    first_choice = True

    def choice(delta: str, finish_reason: str | None, stop_reason: str | None, token_ids: list[int]) -> dict:
        nonlocal first_choice
        if chat:
            c: dict[str, Any] = {"index": 0, "delta": {"content": delta}, "logprobs": None,
                                 "finish_reason": finish_reason}
            if finish_reason is not None:
                c["stop_reason"] = stop_reason
        else:
            c = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason,
                 "stop_reason": stop_reason}
            if ids:
                c["prompt_token_ids"] = list(seq.prompt_token_ids) if first_choice else None
        if ids:
            c["token_ids"] = token_ids
        first_choice = False
        return c

    resp: web.StreamResponse | None = None
    try:
        async for token_id, finish_reason in seq.stream():
            delta = ""
            token_ids = [token_id] if token_id is not None else []
            if token_id is not None:
                delta = text.add(engine.tokenizer.output_text(token_id))
                if text.matched is not None:
                    engine.scheduler.finish(seq, FINISH_STOP)
                    finish_reason = FINISH_STOP
            if finish_reason is not None:
                delta += text.flush()
            if resp is None:
                # Like vLLM, headers and the role chunk go out with the first token.
                resp = web.StreamResponse(headers=SSE_HEADERS)
                await resp.prepare(request)
                if chat:
                    role = frame([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}],
                                 _usage(seq) if continuous_usage else None,
                                 {"prompt_token_ids": list(seq.prompt_token_ids), "prompt_text": None} if ids else None)
                    await resp.write(role)
            if delta or finish_reason is not None or (ids and token_ids):
                await resp.write(frame([choice(delta, finish_reason, text.matched, token_ids)],
                                       _usage(seq) if continuous_usage else None))
            if finish_reason is not None:
                break
        if include_usage:
            await resp.write(frame([], _usage(seq)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        log.debug("client of %s disconnected mid-stream", request_id)
    return resp


async def _start_profile(request: web.Request) -> web.Response:
    """vLLM's (and SGLang's) ``POST /start_profile``: recorded, answered 200 with no body."""
    raw = await request.read()
    options: dict[str, Any] = {}
    if raw.strip():
        try:
            msgspec.json.decode(raw, type=StartProfileRequest)
            options = msgspec.json.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise ApiError(400, f"Invalid profile request: {e}") from None
    request.app[ENGINE_KEY].profile_calls.append(("start", options))
    return web.Response(status=200)


async def _stop_profile(request: web.Request) -> web.Response:
    request.app[ENGINE_KEY].profile_calls.append(("stop", {}))
    return web.Response(status=200)


@web.middleware
async def _errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status in (404, 405):
            # Unknown route / wrong method: FastAPI's (hence vLLM's) body is {"detail": reason}.
            return web.Response(status=e.status, body=_json_encode({"detail": e.reason}),
                                content_type="application/json", headers={k: v for k, v in e.headers.items()
                                                                          if k == "Allow"})
        raise


def build_app(args: argparse.Namespace, engine: SimEngine | None = None) -> web.Application:
    """The aiohttp app; the scheduler starts on app startup and stops (aborting leftovers) on shutdown."""
    engine = engine if engine is not None else SimEngine(args)
    # vLLM accepts large prompts; aiohttp's 1 MiB default would reject long contexts.
    app = web.Application(middlewares=[_errors_middleware], client_max_size=64 * 1024 * 1024)
    app[ENGINE_KEY] = engine

    async def start_engine(_app: web.Application) -> None:
        if engine.kv_events is not None:
            await engine.kv_events.start()  # bound before the first request can store a block
        if engine.disagg is not None:
            await engine.disagg.start()
        engine.scheduler.start()

    async def stop_engine(_app: web.Application) -> None:
        # Ends in-flight generations (finish_reason "abort") so handlers return promptly.
        await engine.scheduler.stop()
        if engine.disagg is not None:
            await engine.disagg.stop()
        if engine.kv_events is not None:
            await engine.kv_events.stop()

    app.on_startup.append(start_engine)
    app.on_shutdown.append(stop_engine)
    app.router.add_get("/health", _health)
    app.router.add_get("/ping", _health)
    app.router.add_post("/ping", _health)
    app.router.add_get("/version", _version)
    app.router.add_get("/v1/models", _models)
    if engine.metrics_flavor is not None:
        app.router.add_get("/metrics", _metrics)
    if pooling.pooling_task(args) is None:  # a pooling model serves no generation (404, as vLLM)
        app.router.add_post("/v1/chat/completions", _chat_completions)
        app.router.add_post("/v1/completions", _completions)
        if getattr(args, "serve_anthropic", False):  # vLLM's own /v1/messages (anthropic.py)
            anthropic.install(app)
        responses.install(app)  # vLLM's Responses API (responses.py)
    pooling.install(app, args)  # --runner pooling's routes, /detokenize, /openapi.json
    lora.install(app, engine.lora)  # /v1/load_lora_adapter, /v1/unload_lora_adapter (runtime updating)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/reset_prefix_cache", _reset_prefix_cache)
    app.router.add_post("/start_profile", _start_profile)
    app.router.add_post("/stop_profile", _stop_profile)
    if engine.disagg is not None:
        engine.disagg.add_routes(app)
    tool_calls.install(app)  # a forced tool_choice is answered with a tool call, as engines do
    return app
