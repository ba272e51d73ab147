"""OpenAI chat completion → Anthropic message, unary (part of :mod:`infera.api.anthropic`, which
re-exports these names): the stop reason and matched stop sequence, the usage in Anthropic's
accounting (``input_tokens`` exclude the tokens read from the cache), tool calls as ``tool_use``
blocks. The streamed form (``anthropic_stream``) reuses these pieces per event.
"""
from __future__ import annotations

import os
from typing import Any

from infera.api.anthropic_errors import _decode, _DecodeErrors
from infera.api.anthropic_request import TranslatedRequest

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
