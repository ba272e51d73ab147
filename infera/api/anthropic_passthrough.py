"""Anthropic's Messages API passed through to an engine that serves ``/v1/messages`` itself (vLLM
0.32 does; its record says so: ``anthropic_messages``). Pure bytes work, no I/O: the body the engine
is sent, and what the server reads back from the engine's own Anthropic replies.

The body is the client's request as decoded (so a key given twice or spelled with escapes reaches
the engine as the router read it), with the ``cache_salt`` the routing hashed under. The engine's
reply is relayed unchanged; only what is not already in Anthropic's shape is put in it: an error
body in another shape (a framework's ``{"detail"}``, OpenAI's ``{"error":{...}}``) and the router's
own mid-stream error frame. The tokens a reply used (for tenant limits) are read from Anthropic's
usage: ``input_tokens + cache_read_input_tokens + cache_creation_input_tokens + output_tokens``.
"""

from __future__ import annotations

import re
from typing import Any

from infera.api.anthropic_errors import (
    _decode,
    _DecodeErrors,
    _encode,
    anthropic_error_body,
    anthropic_error_type,
    error_message_of,
)
from infera.api.anthropic_stream import sse_event

SALT_FIELD = "cache_salt"
# A stream's usage comes in its last events (message_delta): this much of its tail is kept.
_TAIL_BYTES = 4096
_USAGE_KEYS = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens", "output_tokens")
_USAGE = re.compile(rb'"usage"\s*:\s*\{[^{}]*\}')
# The router's own frame ending a stream its worker broke (infera.api.errors.sse_error_event):
# OpenAI-shaped, where an Anthropic engine's data lines are events with a "type".
_ROUTER_ERROR_PREFIX = b'data: {"error"'


def passthrough_body(source: dict[str, Any], salt: str | None) -> bytes:
    """The client's request for the engine's own ``/v1/messages``; ``salt``: the ``cache_salt`` the
    routing hashed the prompt under (the translated body carries the same), None: as sent."""
    if salt is not None and source.get(SALT_FIELD) != salt:
        source = {**source, SALT_FIELD: salt}
    return _encode(source)


def is_anthropic_error(body: bytes | None) -> bool:
    """``{"type":"error","error":{"type","message"}}``, as vLLM's Anthropic routes write errors."""
    try:
        doc = _decode(body or b"")
    except _DecodeErrors:
        return False
    return (
        isinstance(doc, dict)
        and doc.get("type") == "error"
        and isinstance(doc.get("error"), dict)
        and isinstance(doc["error"].get("message"), str)
    )


def error_reply_body(status: int, body: bytes | None) -> bytes:
    """An engine's error reply in Anthropic's shape: its own when it already is, else its message
    in one (FastAPI's validation errors and the OpenAI-shaped ones are not)."""
    if is_anthropic_error(body):
        return body or b""
    return anthropic_error_body(status, error_message_of(body, status))


def usage_tokens(data: bytes | None) -> int | None:
    """The tokens of the last Anthropic ``usage`` object in a reply body or a stream's tail (None:
    there is none): every input token, cached or not, and the output."""
    if not data:
        return None
    for m in reversed(list(_USAGE.finditer(data))):
        try:
            usage = _decode(m.group(0)[m.group(0).index(b"{") :])
        except _DecodeErrors:
            continue
        if isinstance(usage, dict):
            return sum(v for k in _USAGE_KEYS if isinstance(v := usage.get(k), int) and not isinstance(v, bool))
    return None


def router_error_event(chunk: bytes) -> bytes | None:
    """The router's mid-stream error frame as Anthropic's ``error`` event (None: ``chunk`` is the
    engine's own bytes, relayed as they are)."""
    if not chunk.startswith(_ROUTER_ERROR_PREFIX):
        return None
    try:
        err = _decode(chunk[len(b"data: ") :].strip())["error"]
    except (*_DecodeErrors, KeyError, TypeError):
        return None
    status, message = 502, "the worker failed mid-stream"
    if isinstance(err, dict):
        message = err["message"] if isinstance(err.get("message"), str) else message
        code = err.get("code")
        if isinstance(code, str) and code.isascii() and code.isdigit() and len(code) == 3:
            status = int(code)
    return sse_event("error", {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}})


class PassthroughMeter:
    """The tokens of a passed-through stream: its last usage (vLLM's ``message_delta`` carries the
    whole count), else one per content delta."""

    __slots__ = ("deltas", "tail")

    def __init__(self) -> None:
        self.tail = b""
        self.deltas = 0

    def feed(self, chunk: bytes) -> None:
        self.deltas += chunk.count(b"event: content_block_delta")
        self.tail = (self.tail + chunk)[-_TAIL_BYTES:]

    def tokens(self) -> int:
        found = usage_tokens(self.tail)
        return found if found is not None else self.deltas
