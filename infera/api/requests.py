"""Parse and validate OpenAI request bodies once, at the door.

Only the fields the router reads are typed strictly; everything else passes through to the
engine untouched (the original bytes are forwarded, never re-encoded).
"""
from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

from infera.api.errors import ApiError


class StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    include_usage: Optional[bool] = None


class _Common(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    model: Optional[str] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[int] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    user: Optional[str] = None
    # cache hints (OpenAI prompt caching): steer how hard the router favours cache locality
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    images: Optional[list[Any]] = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None


class CompletionRequest(_Common, kw_only=True):
    # str | list[str] | list[int] | list[list[int]] (msgspec allows one array type per union)
    prompt: Union[str, list[Union[int, str, list[int]]]]


_decoders = {
    "/v1/chat/completions": msgspec.json.Decoder(ChatCompletionRequest),
    "/v1/completions": msgspec.json.Decoder(CompletionRequest),
}


def parse_request(route: str, body: bytes) -> ChatCompletionRequest | CompletionRequest:
    """Decode + validate; any problem is a 400 in the OpenAI error shape."""
    if not body:
        raise ApiError(400, "request body is empty; expected a JSON object", "invalid_json")
    try:
        req = _decoders[route].decode(body)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid request: {exc}", "invalid_request") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"malformed JSON body: {exc}", "invalid_json") from None
    if req.max_tokens is not None and req.max_tokens < 1:
        raise ApiError(400, "max_tokens must be at least 1", "invalid_request", param="max_tokens")
    if not req.model:
        raise ApiError(400, "'model' is required", "invalid_request", param="model")
    return req
