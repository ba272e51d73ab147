"""Anthropic Messages API (``POST /v1/messages``) over the workers' OpenAI chat API.

Pure translation, no I/O: an Anthropic request becomes an OpenAI chat body (which then takes the
chat route's whole dispatch path: routing, failover, PD), and the worker's answer comes back as an
Anthropic message, or, streamed, as Anthropic's SSE events (``StreamTranslator``).

What does not translate is refused with a 400 naming the block, never dropped silently: document
blocks, media inside a ``tool_result``, server tools. Images become OpenAI ``image_url`` parts, so
a multimodal request is routed by image affinity like any other (``infera.api.cache_hints``).
Thinking blocks of earlier turns are dropped (engines take no reasoning input). ``cache_control``
markers become ``prompt_cache_retention`` (ttl 1h → "1h", else "5m"), the OpenAI hint the router
already reads.

Usage follows Anthropic's accounting: ``input_tokens`` are the prompt tokens *not* read from the
cache; ``cache_read_input_tokens`` the engine's ``prompt_tokens_details.cached_tokens``.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import msgspec

from infera.api.errors import ApiError
from infera.api.requests import json_structure_problem
from infera.kv.tokenizer import ChatTemplateError

log = logging.getLogger(__name__)

MESSAGES_ROUTE = "/v1/messages"
COUNT_TOKENS_ROUTE = "/v1/messages/count_tokens"
CHAT_ROUTE = "/v1/chat/completions"
ANTHROPIC_VERSION = "2023-06-01"

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.decode
# A worker's reply is read with these: msgspec refuses JSON nested past the recursion limit with
# RecursionError, not DecodeError, and a worker's odd reply must not fail ours with an exception.
_DecodeErrors = (msgspec.DecodeError, RecursionError)

# -- errors ---------------------------------------------------------------------------------------------
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error_body(status: int, message: str) -> bytes:
    """``{"type":"error","error":{"type","message"}}``, the type chosen by the HTTP status."""
    return _encode({"type": "error", "error": {"type": anthropic_error_type(status), "message": message}})


def error_message_of(body: bytes | None, status: int) -> str:
    """The message of an error reply in any shape a worker or the router writes (OpenAI's
    ``{"error":{"message"}}``, ``{"error":"..."}``, FastAPI's ``{"detail"}``), else its text."""
    try:
        payload = _decode(body or b"")
    except _DecodeErrors:
        text = (body or b"").decode("utf-8", "replace").strip()
        return text[:500] or f"worker answered HTTP {status}"
    if isinstance(payload, dict):
        err = payload.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        if isinstance(payload.get("detail"), str):
            return payload["detail"]
        if isinstance(payload.get("message"), str):
            return payload["message"]
    return f"worker answered HTTP {status}"


# -- request --------------------------------------------------------------------------------------------
# Anthropic-only request fields with no engine meaning: not forwarded.
_NOT_FORWARDED = frozenset({"thinking", "service_tier", "container", "mcp_servers", "context_management",
                            "betas", "anthropic_version", "anthropic_beta"})
# Fields translated below; every other key is forwarded as an engine extra (extra_body), like top_k.
_TRANSLATED = frozenset({"model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature",
                         "top_p", "top_k", "metadata", "tools", "tool_choice"})
_LONG_TTLS = frozenset({"1h", "1hr", "60m", "3600s", "long"})
_MEDIA_BLOCKS = frozenset({"document", "audio", "video", "file", "input_audio", "search_result"})


@dataclass(slots=True)
class TranslatedRequest:
    """An Anthropic request as the OpenAI chat body sent to workers, and what the answer needs."""

    body: dict[str, Any]
    model: str
    stream: bool
    stop_sequences: tuple[str, ...] = ()
    tools: list[dict[str, Any]] = field(default_factory=list)  # the OpenAI tools (count_tokens adds them)


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request", param=param)


def _decode_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise ApiError(400, "request body is empty; expected a JSON object", "invalid_json")
    problem = json_structure_problem(raw)
    if problem is not None:
        raise ApiError(400, problem, "json_too_complex")
    try:
        body = _decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"malformed JSON body: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    return body


def _text_of(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _bad(f"{where}: a text block needs a string 'text'", where)
    return text


def _retention(block: Any, current: str | None) -> str | None:
    """The longer of ``current`` and the retention a block's ``cache_control`` asks for."""
    if not isinstance(block, dict):
        return current
    cc = block.get("cache_control")
    if not isinstance(cc, dict) or cc.get("type") != "ephemeral":
        return current
    ttl = cc.get("ttl")
    wanted = "1h" if isinstance(ttl, str) and ttl.strip().lower() in _LONG_TTLS else "5m"
    return "1h" if "1h" in (current, wanted) else wanted


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict):
        raise _bad(f"{where}: an image block needs a 'source' object", where)
    kind = source.get("type")
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str) or not isinstance(data, str) or not data:
            raise _bad(f"{where}: a base64 image source needs 'media_type' and 'data' strings", where)
        url = f"data:{media};base64,{data}"
    elif kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise _bad(f"{where}: a url image source needs a 'url' string", where)
    else:
        raise _bad(f"{where}: image source type {kind!r} is not supported (use 'base64' or 'url')", where)
    return {"type": "image_url", "image_url": {"url": url}}


def _unsupported(kind: Any, where: str) -> ApiError:
    if kind in _MEDIA_BLOCKS:
        return _bad(f"{where}: {kind} blocks are not supported by this server's engines (text, image, tool_use "
                    "and tool_result blocks are)", where)
    return _bad(f"{where}: unknown content block type {kind!r}", where)


def _tool_result_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of text blocks", where)
    texts = []
    for j, block in enumerate(content):
        inner = f"{where}.content[{j}]"
        if not isinstance(block, dict):
            raise _bad(f"{inner} must be an object", inner)
        if block.get("type") != "text":
            raise _bad(f"{inner}: a tool_result may hold only text blocks here, not {block.get('type')!r}", inner)
        texts.append(_text_of(block, inner))
    return "\n".join(texts)


def _user_messages(content: list[Any], where: str, hints: list[str | None]) -> list[dict[str, Any]]:
    """Tool results first (each its own ``tool`` message: they answer the assistant turn just
    before), then the user's text and images as one user message."""
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        inner = f"{where}.content[{j}]"
        if not isinstance(block, dict):
            raise _bad(f"{inner} must be an object", inner)
        hints[0] = _retention(block, hints[0])
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": _text_of(block, inner)})
        elif kind == "image":
            parts.append(_image_part(block, inner))
        elif kind == "tool_result":
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str) or not tool_use_id:
                raise _bad(f"{inner}: a tool_result needs its 'tool_use_id'", inner)
            tools.append({"role": "tool", "tool_call_id": tool_use_id,
                          "content": _tool_result_text(block.get("content"), inner)})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise _unsupported(kind, inner)
    if parts and all(p["type"] == "text" for p in parts):
        tools.append({"role": "user", "content": "\n".join(p["text"] for p in parts)})
    elif parts:
        tools.append({"role": "user", "content": parts})
    elif not tools:
        tools.append({"role": "user", "content": ""})
    return tools


def _assistant_message(content: list[Any], where: str, hints: list[str | None]) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        inner = f"{where}.content[{j}]"
        if not isinstance(block, dict):
            raise _bad(f"{inner} must be an object", inner)
        hints[0] = _retention(block, hints[0])
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_of(block, inner))
        elif kind == "tool_use":
            name = block.get("name")
            if not isinstance(name, str) or not name:
                raise _bad(f"{inner}: a tool_use block needs a 'name'", inner)
            call_id = block.get("id")
            if not isinstance(call_id, str) or not call_id:
                call_id = "call_" + os.urandom(12).hex()
            args = block.get("input")
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": _encode(args if args is not None else {}).decode()}})
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise _unsupported(kind, inner)
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _system_text(system: Any, hints: list[str | None]) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        return system or None
    if not isinstance(system, list):
        raise _bad("'system' must be a string or a list of text blocks", "system")
    texts = []
    for i, block in enumerate(system):
        where = f"system[{i}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            raise _bad(f"{where} must be a text block", where)
        hints[0] = _retention(block, hints[0])
        texts.append(_text_of(block, where))
    return "\n".join(texts) or None


def translate_messages(body: dict[str, Any], hints: list[str | None]) -> list[dict[str, Any]]:
    """``system`` + ``messages`` as OpenAI chat messages (``hints[0]``: the retention asked for)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    system = _system_text(body.get("system"), hints)
    if system is not None:
        out.append({"role": "system", "content": system})
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(f"{where} must be an object", where)
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role must be 'user' or 'assistant', not {role!r} (the system prompt goes in "
                       "the top-level 'system')", f"{where}.role")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            if role == "user":
                out.extend(_user_messages(content, where, hints))
            else:
                out.append(_assistant_message(content, where, hints))
        else:
            raise _bad(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
    return out


def _tools(tools: Any, hints: list[str | None]) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(f"{where} must be an object", where)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise _bad(f"{where}: server tool {kind!r} is not supported; only custom tools (name, description, "
                       "input_schema) are", where)
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise _bad(f"{where} needs a 'name'", where)
        schema = tool.get("input_schema")
        if schema is not None and not isinstance(schema, dict):
            raise _bad(f"{where}.input_schema must be a JSON schema object", where)
        hints[0] = _retention(tool, hints[0])
        function: dict[str, Any] = {"name": name, "parameters": schema or {}}
        if isinstance(tool.get("description"), str) and tool["description"]:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any, body: dict[str, Any]) -> None:
    """Sets ``tool_choice`` (and ``parallel_tool_calls``) on the OpenAI ``body``."""
    if choice is None:
        return
    if not isinstance(choice, dict):
        raise _bad("'tool_choice' must be an object like {\"type\": \"auto\"}", "tool_choice")
    kind = choice.get("type")
    if kind == "auto":
        body["tool_choice"] = "auto"
    elif kind == "any":
        body["tool_choice"] = "required"
    elif kind == "none":
        body["tool_choice"] = "none"
    elif kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise _bad("tool_choice of type 'tool' needs the tool's 'name'", "tool_choice")
        body["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise _bad(f"tool_choice type {kind!r} is not one of auto, any, tool, none", "tool_choice")
    if choice.get("disable_parallel_tool_use") is True and kind != "none":
        body["parallel_tool_calls"] = False


def _number(body: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
        raise _bad(f"'{name}' must be a number", name)
    return value


def translate_request(raw: bytes, *, count_only: bool = False) -> TranslatedRequest:
    """An Anthropic Messages request → the OpenAI chat body; any problem is an ``ApiError`` 400.

    ``count_only``: a ``count_tokens`` body (no ``max_tokens``; nothing is generated)."""
    body = _decode_object(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required", "model")
    hints: list[str | None] = [None]
    messages = translate_messages(body, hints)
    tools = _tools(body.get("tools"), hints)
    out: dict[str, Any] = {"model": model, "messages": messages}
    max_tokens = body.get("max_tokens")
    if not count_only:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise _bad("'max_tokens' is required: an integer of at least 1", "max_tokens")
        out["max_tokens"] = max_tokens
    for name in ("temperature", "top_p"):
        value = _number(body, name, (int, float))
        if value is not None:
            out[name] = value
    top_k = _number(body, "top_k", int)
    if top_k is not None:
        out["top_k"] = top_k  # an engine extra (vLLM and SGLang take it)
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _bad("'stop_sequences' must be a list of strings", "stop_sequences")
        if stops:
            out["stop"] = stops
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        out["user"] = metadata["user_id"]
    if tools:
        out["tools"] = tools
        _tool_choice(body.get("tool_choice"), out)  # without tools there is nothing to choose
    stream = body.get("stream") is True
    if stream and not count_only:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}  # the final usage feeds message_delta
    if hints[0] is not None:
        out["prompt_cache_retention"] = hints[0]
    for key, value in body.items():  # engine extras (extra_body): the client's own choice
        if key not in _TRANSLATED and key not in _NOT_FORWARDED:
            out.setdefault(key, value)
    return TranslatedRequest(out, model, stream and not count_only, tuple(stops or ()), tools)


# -- response -------------------------------------------------------------------------------------------
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use",
                 "content_filter": "end_turn", "abort": "end_turn"}


def stop_reason_of(finish_reason: Any, matched: Any, stop_sequences: tuple[str, ...],
                   has_tool_calls: bool) -> tuple[str | None, str | None]:
    """(Anthropic stop_reason, stop_sequence) for an OpenAI finish. ``matched`` is the stop string
    the engine reports (vLLM's ``stop_reason``, SGLang's ``matched_stop``)."""
    if finish_reason is None:
        return None, None
    if not isinstance(finish_reason, str):  # a worker's odd value (a list is no dict key)
        finish_reason = "stop"
    if isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    if has_tool_calls and finish_reason in ("stop", "tool_calls", "function_call"):
        return "tool_use", None  # a forced tool choice may finish with "stop"
    return _STOP_REASONS.get(finish_reason, "end_turn"), None


def _matched_stop(choice: dict[str, Any]) -> Any:
    matched = choice.get("stop_reason")
    return matched if matched is not None else choice.get("matched_stop")


def _tokens(value: Any) -> int:
    """A token count of a worker's usage: a non-negative int, else 0 (a string or a list there
    made the arithmetic below raise TypeError, a 500 for a reply the worker had served)."""
    return value if type(value) is int and value > 0 else 0


def usage_of(usage: Any) -> dict[str, int]:
    """OpenAI usage → Anthropic's (input_tokens excludes the tokens read from the cache)."""
    usage = usage if isinstance(usage, dict) else {}
    prompt = _tokens(usage.get("prompt_tokens"))
    details = usage.get("prompt_tokens_details")
    cached = _tokens(details.get("cached_tokens")) if isinstance(details, dict) else 0
    cached = min(cached, prompt)
    return {"input_tokens": prompt - cached, "output_tokens": _tokens(usage.get("completion_tokens")),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def tool_input(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments as the object Anthropic's ``input`` is ({} when not an object)."""
    if isinstance(arguments, dict):
        return arguments
    if isinstance(arguments, str) and arguments:
        try:
            value = _decode(arguments)
        except _DecodeErrors:
            return {}
        return value if isinstance(value, dict) else {}
    return {}


def message_id(request_id: str) -> str:
    return "msg_" + request_id[:24]


def translate_response(openai_body: dict[str, Any], request: TranslatedRequest, msg_id: str) -> dict[str, Any]:
    """An OpenAI chat completion → an Anthropic message."""
    choices = openai_body.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
    content: list[dict[str, Any]] = []
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    calls = message.get("tool_calls") or []
    for call in calls if isinstance(calls, list) else []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            call_id = "toolu_" + os.urandom(10).hex()
        content.append({"type": "tool_use", "id": call_id, "name": function.get("name") or "",
                        "input": tool_input(function.get("arguments"))})
    if not content:
        content.append({"type": "text", "text": ""})
    has_tools = any(block["type"] == "tool_use" for block in content)
    stop_reason, stop_sequence = stop_reason_of(choice.get("finish_reason"), _matched_stop(choice),
                                                request.stop_sequences, has_tools)
    return {"id": msg_id, "type": "message", "role": "assistant", "content": content, "model": request.model,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage_of(openai_body.get("usage"))}


# -- streaming ------------------------------------------------------------------------------------------
def sse_event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _encode(data) + b"\n\n"


class StreamTranslator:
    """OpenAI chat SSE bytes (split anywhere) in, Anthropic SSE events out.

    ``feed`` takes whatever bytes arrive and returns the events they complete; ``finish`` ends the
    message if the input ended without ``[DONE]``. Blocks are sequential as Anthropic's are: text,
    or one tool call at a time (a block is stopped when the next starts). A tool call's block opens
    once its name is known; argument fragments become ``input_json_delta``. An error frame (the
    router's mid-stream failure) becomes Anthropic's ``error`` event, which ends the stream.
    """

    def __init__(self, model: str, msg_id: str, stop_sequences: tuple[str, ...] = ()) -> None:
        self.model = model
        self.msg_id = msg_id
        self.stop_sequences = stop_sequences
        self.started = False
        self.done = False
        self._buffer = b""
        self._next_index = 0
        self._open: tuple[str, Any, int] | None = None  # ("text", None, block) | ("tool", openai index, block)
        self._tools: dict[int, dict[str, Any]] = {}  # openai tool index -> {id, name, pending, block, closed}
        self._any_block = False
        self._any_tool = False
        self._finish_reason: Any = None
        self._matched: Any = None
        self._usage: dict[str, Any] | None = None

    # -- input ---------------------------------------------------------------------------------------
    def feed(self, data: bytes) -> bytes:
        if self.done:
            return b""
        self._buffer += data.replace(b"\r\n", b"\n")
        out: list[bytes] = []
        while not self.done:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                break
            frame, self._buffer = self._buffer[:end], self._buffer[end + 2:]
            lines = [line[5:].removeprefix(b" ") for line in frame.split(b"\n") if line.startswith(b"data:")]
            if lines:
                self._on_data(b"\n".join(lines), out)
        return b"".join(out)

    def finish(self) -> bytes:
        """End of input: a started message is closed (a trailing frame without its blank line
        is still read)."""
        out: list[bytes] = []
        if not self.done and self._buffer.strip():
            out.append(self.feed(b"\n\n"))
        if not self.done and self.started:
            self._close(out)
        return b"".join(out)

    def _on_data(self, data: bytes, out: list[bytes]) -> None:
        if data.strip() == b"[DONE]":
            if self.started:
                self._close(out)
            self.done = True
            return
        try:
            chunk = _decode(data)
        except _DecodeErrors:
            return  # not a frame of ours: ignored, as SSE clients do
        if not isinstance(chunk, dict):
            return
        if "error" in chunk:
            self._error(chunk, out)
            return
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return
        if not self.started:
            self._start(out)
        for choice in choices:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self._on_choice(choice, out)

    def _on_choice(self, choice: dict[str, Any], out: list[bytes]) -> None:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text = delta.get("content")
            if isinstance(text, str) and text:
                if self._open is None or self._open[0] != "text":
                    self._open_block(("text", None), {"type": "text", "text": ""}, out)
                out.append(sse_event("content_block_delta", {"type": "content_block_delta", "index": self._open[2],
                                                             "delta": {"type": "text_delta", "text": text}}))
            calls = delta.get("tool_calls")
            if isinstance(calls, list):
                for call in calls:
                    if isinstance(call, dict):
                        self._on_tool_delta(call, out)
        if choice.get("finish_reason") is not None:
            self._finish_reason = choice["finish_reason"]
            self._matched = _matched_stop(choice)

    def _on_tool_delta(self, call: dict[str, Any], out: list[bytes]) -> None:
        index = call.get("index", 0)
        if type(index) is not int:
            return  # not a tool call delta of OpenAI's shape (a list index is no dict key): ignored
        tool = self._tools.get(index)
        if tool is None:
            tool = self._tools[index] = {"id": None, "name": None, "pending": "", "block": None, "closed": False}
        if isinstance(call.get("id"), str) and call["id"] and tool["id"] is None:
            tool["id"] = call["id"]
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        if isinstance(function.get("name"), str) and function["name"] and tool["name"] is None:
            tool["name"] = function["name"]
        fragment = function.get("arguments")
        if isinstance(fragment, str) and fragment:
            tool["pending"] += fragment
        if tool["closed"]:
            if tool["pending"]:
                log.warning("stream %s: arguments for tool call %s after its block closed; dropped", self.msg_id, index)
                tool["pending"] = ""
            return
        if tool["block"] is None:
            if tool["name"] is None:
                return  # opened once its name is known; fragments wait
            self._open_block(("tool", index), {"type": "tool_use", "id": tool["id"] or "toolu_" + os.urandom(10).hex(),
                                               "name": tool["name"], "input": {}}, out)
            tool["block"] = self._open[2]
            self._any_tool = True
        elif self._open is None or self._open[:2] != ("tool", index):
            return  # keep pending until the block is current again (it is not: closed blocks stay closed)
        if tool["pending"]:
            out.append(sse_event("content_block_delta", {"type": "content_block_delta", "index": tool["block"],
                                                         "delta": {"type": "input_json_delta",
                                                                   "partial_json": tool["pending"]}}))
            tool["pending"] = ""

    # -- output --------------------------------------------------------------------------------------
    def _start(self, out: list[bytes]) -> None:
        self.started = True
        usage = usage_of(self._usage)
        usage["output_tokens"] = 0
        out.append(sse_event("message_start", {"type": "message_start", "message": {
            "id": self.msg_id, "type": "message", "role": "assistant", "content": [], "model": self.model,
            "stop_reason": None, "stop_sequence": None, "usage": usage}}))
        out.append(sse_event("ping", {"type": "ping"}))

    def _open_block(self, key: tuple[str, Any], block: dict[str, Any], out: list[bytes]) -> None:
        self._close_open(out)
        index = self._next_index
        self._next_index += 1
        self._open = (key[0], key[1], index)
        self._any_block = True
        out.append(sse_event("content_block_start", {"type": "content_block_start", "index": index,
                                                     "content_block": block}))

    def _close_open(self, out: list[bytes]) -> None:
        if self._open is None:
            return
        kind, tool_index, index = self._open
        if kind == "tool":
            self._tools[tool_index]["closed"] = True
        out.append(sse_event("content_block_stop", {"type": "content_block_stop", "index": index}))
        self._open = None

    def _close(self, out: list[bytes]) -> None:
        self._close_open(out)
        if not self._any_block:  # as a unary reply: at least one (empty) text block
            self._open_block(("text", None), {"type": "text", "text": ""}, out)
            self._close_open(out)
        stop_reason, stop_sequence = stop_reason_of(self._finish_reason or "stop", self._matched,
                                                    self.stop_sequences, self._any_tool)
        out.append(sse_event("message_delta", {"type": "message_delta",
                                               "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                               "usage": usage_of(self._usage)}))
        out.append(sse_event("message_stop", {"type": "message_stop"}))
        self.done = True

    def _error(self, chunk: dict[str, Any], out: list[bytes]) -> None:
        err = chunk["error"]
        status, message = 502, "the worker failed mid-stream"
        if isinstance(err, dict):
            message = err.get("message") if isinstance(err.get("message"), str) else message
            code = err.get("code")
            # isascii: str.isdigit() is true of "²", which int() refuses; 3 digits: an HTTP status
            if isinstance(code, int) or (isinstance(code, str) and code.isascii() and code.isdigit()
                                         and len(code) <= 3):
                status = int(code)
        elif isinstance(err, str):
            message = err
        out.append(sse_event("error", {"type": "error", "error": {"type": anthropic_error_type(status),
                                                                  "message": message}}))
        self.done = True


__all__ = ["ANTHROPIC_VERSION", "COUNT_TOKENS_ROUTE", "MESSAGES_ROUTE", "StreamTranslator", "TranslatedRequest",
           "anthropic_error_body", "anthropic_error_type", "error_message_of", "message_id", "translate_request",
           "translate_response", "usage_of"]


# -- count_tokens ---------------------------------------------------------------------------------------
def count_prompt_tokens(tokenizer: Any, request: TranslatedRequest) -> int:
    """Tokens of the prompt a worker would see: the messages rendered with the model's chat
    template, plus the tool definitions as JSON text (the router's renderer takes no ``tools``, so
    for a template that renders tools this is an estimate of their share). Blocking; messages the
    template refuses are a 400."""
    try:
        count = len(tokenizer.encode_chat(request.body["messages"]))
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), "invalid_request") from None
    if request.tools:
        count += len(tokenizer.encode(_encode(request.tools).decode(), add_special_tokens=False))
    return count
