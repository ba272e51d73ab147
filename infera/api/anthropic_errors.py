"""Anthropic's error replies, and the JSON codecs the Anthropic translation modules share. An error
is ``{"type":"error","error":{"type","message"}}`` with the type chosen by the HTTP status
(``anthropic_error_type``); a worker's or the router's error reply, in whatever shape it comes, is
reduced to its message (``error_message_of``). A worker's reply is decoded without ever raising
past ``_DecodeErrors``. Part of :mod:`infera.api.anthropic`, which re-exports these names.
"""
from __future__ import annotations

import msgspec

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.decode
# A worker's reply is read with these: msgspec refuses JSON nested past the recursion limit with
# RecursionError, not DecodeError, and a worker's odd reply must not fail ours with an exception.
_DecodeErrors = (msgspec.DecodeError, RecursionError)

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
