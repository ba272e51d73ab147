"""Anthropic Messages request → OpenAI chat body (part of :mod:`infera.api.anthropic`, which
re-exports :func:`translate_request` and :class:`TranslatedRequest`). Validates the request as
Anthropic does, translates messages, system prompt, tools and tool choice, turns ``cache_control``
markers into ``prompt_cache_retention`` and images into ``image_url`` parts, forwards unknown
fields as engine extras, and refuses with a 400 naming the block what does not translate
(documents, media inside a ``tool_result``, server tools), never dropping it silently.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import msgspec

from infera.api.anthropic_errors import _decode, _encode
from infera.api.errors import ApiError
from infera.api.requests import json_structure_problem

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
    # The client's request as decoded: what an engine serving /v1/messages itself is sent (passthrough)
    source: dict[str, Any] = field(default_factory=dict)


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
    return TranslatedRequest(out, model, stream and not count_only, tuple(stops or ()), tools, body)
