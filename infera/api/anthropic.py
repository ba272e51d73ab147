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

This module owns the routes and counting a request's prompt tokens (``count_tokens``); the
translation lives by concern in ``anthropic_request`` (requests), ``anthropic_response`` (unary
replies), ``anthropic_stream`` (SSE) and ``anthropic_errors`` (error replies), whose names are
re-exported here.
"""
from __future__ import annotations

from typing import Any

from infera.api.anthropic_errors import (  # noqa: F401
    _decode, _DecodeErrors, _encode, anthropic_error_body, anthropic_error_type, error_message_of)
from infera.api.anthropic_request import TranslatedRequest, translate_messages, translate_request  # noqa: F401
from infera.api.anthropic_response import (  # noqa: F401
    message_id, stop_reason_of, tool_input, translate_response, usage_of)
from infera.api.anthropic_stream import StreamTranslator, sse_event  # noqa: F401
from infera.api.errors import ApiError
from infera.kv.tokenizer import ChatTemplateError

MESSAGES_ROUTE = "/v1/messages"
COUNT_TOKENS_ROUTE = "/v1/messages/count_tokens"
CHAT_ROUTE = "/v1/chat/completions"
ANTHROPIC_VERSION = "2023-06-01"

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
