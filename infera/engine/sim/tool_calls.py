"""Forced tool calls for the simulated engine, in the OpenAI chat wire format vLLM streams them in
(the call's id, type and name in its first delta, then ``arguments`` fragments; unary: one
``message.tool_calls`` entry with the whole arguments string, ``content`` null).

A chat request with ``tools`` whose ``tool_choice`` forces a call (``"required"``: the first tool;
``{"type":"function","function":{"name"}}``: that one) is answered with one tool call, as an engine
with guided decoding does; any other request goes to the sim's own handler unchanged (``"auto"``
would need a model that decides, so the sim answers with text, as a model that chose none).

The arguments are "written" by the sim's scheduler like any output: every property the schema
lists gets a placeholder of its type, and the last string property (if any) receives the
generated words, so a stream carries them as many small ``arguments`` fragments, split inside JSON
strings, with the timing, usage and prompt cache of an ordinary generation. The JSON is always
closed, also when ``max_tokens`` ends it (finish_reason "length"): a simplification, a real
engine's arguments would be cut there.

``install(app)`` adds it to a sim app before it starts (``SimServer(args).app``).
"""
from __future__ import annotations

import os
import time
from typing import Any, Awaitable, Callable

import msgspec
from aiohttp import web

from infera.engine.sim.schemas import (ENGINE_KEY, SSE_HEADERS, ApiError, ChatCompletionRequest, _check_sampling,
                                       _request_id, _resolve_max_tokens, _usage)
from infera.kv.tokenizer import ChatTemplateError

_encode = msgspec.json.Encoder().encode
_PLACEHOLDERS = {"integer": 0, "number": 0, "boolean": False, "array": [], "object": {}, "null": None}


class _ToolRequest(ChatCompletionRequest, kw_only=True):
    tools: list[Any] | None = None
    tool_choice: Any = None


def forced_tool(tools: Any, tool_choice: Any) -> dict[str, Any] | None:
    """The OpenAI function definition a request forces a call to, or None."""
    if not isinstance(tools, list) or not tools:
        return None
    functions = [t["function"] for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    if tool_choice == "required":
        return functions[0] if functions else None
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        for function in functions:
            if function.get("name") == name:
                return function
        raise ApiError(400, f"tool_choice names function {name!r}, which is not among the request's tools")
    return None


def argument_frame(parameters: Any) -> tuple[str, str, bool]:
    """(prefix, suffix, takes_text): the arguments JSON around the generated text. Non-string
    properties get a placeholder of their type; the last string property holds the text."""
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(properties, dict) or not properties:
        return "{}", "", False
    text_key = None
    fixed: dict[str, Any] = {}
    for key, schema in properties.items():
        kind = schema.get("type") if isinstance(schema, dict) else None
        if kind == "string" or kind is None:
            if text_key is not None:
                fixed[text_key] = ""
            text_key = key
        else:
            fixed[key] = _PLACEHOLDERS.get(kind if isinstance(kind, str) else "", None)
    if text_key is None:
        return _encode(fixed).decode(), "", False
    head = _encode(fixed).decode()[:-1]  # without its closing brace
    head = head + ("," if fixed else "") + _encode(text_key).decode() + ':"'
    return head, '"}', True


def _json_text(text: str) -> str:
    """``text`` escaped for the inside of a JSON string."""
    return _encode(text).decode()[1:-1]


async def _answer(request: web.Request, req: _ToolRequest, function: dict[str, Any]) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    engine.check_model(req.model)
    _check_sampling(req)
    try:
        prompt_ids = await engine.run_tokenizer(request.content_length or 0, engine.tokenizer.encode_chat, req.messages)
    except ChatTemplateError as e:
        raise ApiError(400, str(e)) from None
    requested, param = ((req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens is not None
                        else (req.max_tokens, "max_tokens"))
    max_tokens = _resolve_max_tokens(engine, len(prompt_ids), requested, param)
    request_id = f"chatcmpl-{_request_id(request)}"
    seq = engine.scheduler.submit(prompt_ids, max_tokens, ignore_eos=bool(req.ignore_eos), request_id=request_id,
                                  cache_salt=req.cache_salt if engine.salts_cache else None)
    call_id = "chatcmpl-tool-" + os.urandom(16).hex()
    name = function.get("name") or ""
    head, tail, takes_text = argument_frame(function.get("parameters"))
    created, model = int(time.time()), engine.model_name
    try:
        if not req.stream:
            words = []
            finish = None
            async for token_id, finish in seq.stream():
                if token_id is not None:
                    words.append(engine.tokenizer.output_text(token_id))
            arguments = head + (_json_text("".join(words)) if takes_text else "") + tail
            body = {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "refusal": None,
                                                         "tool_calls": [{"id": call_id, "type": "function",
                                                                         "function": {"name": name,
                                                                                      "arguments": arguments}}],
                                                         "reasoning_content": None},
                                 "logprobs": None, "finish_reason": "length" if finish == "length" else "tool_calls",
                                 "stop_reason": None}],
                    "usage": _usage(seq), "prompt_logprobs": None}
            return web.Response(body=_encode(body), content_type="application/json")
        return await _stream(request, req, engine, seq, request_id, created, call_id, name, head, tail, takes_text)
    finally:
        engine.scheduler.abort(seq)  # no-op when finished; frees the slot when the client left


async def _stream(request: web.Request, req: _ToolRequest, engine: Any, seq: Any, request_id: str, created: int,
                  call_id: str, name: str, head: str, tail: str, takes_text: bool) -> web.StreamResponse:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def frame(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        chunk: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                                 "model": engine.model_name, "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        return b"data: " + _encode(chunk) + b"\n\n"

    def arguments(fragment: str, **extra: Any) -> bytes:
        call = {"index": 0, **extra, "function": {**({"name": name} if extra else {}), "arguments": fragment}}
        return frame([{"index": 0, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None}])

    resp: web.StreamResponse | None = None
    finish = None
    async for token_id, finish in seq.stream():
        if resp is None:  # like vLLM: headers, the role chunk and the call's opening go out with the first token
            resp = web.StreamResponse(headers=SSE_HEADERS)
            await resp.prepare(request)
            await resp.write(frame([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]))
            await resp.write(arguments("", id=call_id, type="function"))
            await resp.write(arguments(head))
        if token_id is not None and takes_text:
            await resp.write(arguments(_json_text(engine.tokenizer.output_text(token_id))))
        if finish is not None:
            break
    assert resp is not None
    if tail:
        await resp.write(arguments(tail))
    await resp.write(frame([{"index": 0, "delta": {}, "logprobs": None,
                             "finish_reason": "length" if finish == "length" else "tool_calls", "stop_reason": None}]))
    if include_usage:
        await resp.write(frame([], _usage(seq)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


@web.middleware
async def tool_call_middleware(request: web.Request,
                               handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    if request.method != "POST" or request.path != "/v1/chat/completions":
        return await handler(request)
    body = await request.read()  # read() is cached for the handler
    if b'"tool_choice"' not in body:  # no tool forced (a substring scan, not a decode, per request)
        return await handler(request)
    try:
        req = msgspec.json.decode(body, type=_ToolRequest)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return await handler(request)  # the sim's own handler words the 400
    function = forced_tool(req.tools, req.tool_choice)
    if function is None:
        return await handler(request)
    return await _answer(request, req, function)


def install(app: web.Application) -> None:
    """Answer forced tool calls on this sim app (call before it starts: middlewares freeze then).
    Inside the sim's error middleware, so its ``ApiError``s leave in vLLM's shape."""
    app.middlewares.append(tool_call_middleware)
