"""OpenAI's Responses API (``/v1/responses``) as the router reads it: the request checks it makes at
the door, the expansion of a follow-up (``previous_response_id``) into one self-contained request,
the chat messages a request renders to (what kv-aware routing hashes), and the reading of a reply
(the response object, unary or the ``response.completed`` event of a stream).

The rendering mirrors vLLM 0.32's ``construct_input_messages``: ``instructions`` become the system
message and never carry over to a follow-up; a string ``input`` is one user message; input items
become chat messages (role items as they are, an output message as the assistant's text, a function
call as the assistant's tool call, its output as a tool message). A follow-up is expanded as vLLM
expands it from its own store: the previous request's (expanded) input, then the previous
response's output messages and function calls (reasoning left out, as vLLM leaves it out), then the
new input. The expanded request no longer names ``previous_response_id``, so any worker serves it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from infera.api.errors import ApiError

RESPONSES_ROUTE = "/v1/responses"
RESPONSE_ROUTE = "/v1/responses/{response_id}"
# Output item types a follow-up carries on (vLLM skips reasoning when it expands a follow-up).
_CARRIED_OUTPUT_TYPES = frozenset({"message", "function_call", "custom_tool_call"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
# At a line's start (JSON escapes a newline inside a string, so text cannot fake it); never the first event.
_COMPLETED = b"\nevent: response.completed\n"

_decode = msgspec.json.decode


def decode_request(body: bytes) -> dict[str, Any]:
    """The request as a JSON object, with the fields the router reads checked (400s otherwise)."""
    if not body:
        raise ApiError(400, "request body is empty; expected a JSON object", "invalid_json")
    try:
        doc = _decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}", "invalid_json") from None
    if not isinstance(doc, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_request")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required", "invalid_request", param="model")
    given = doc.get("input")
    if not isinstance(given, (str, list)):
        raise ApiError(400, "'input' is required: a string or a list of input items", "invalid_request", param="input")
    if isinstance(given, list) and not all(isinstance(item, dict) for item in given):
        raise ApiError(400, "every input item must be an object", "invalid_request", param="input")
    previous = doc.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise ApiError(
            400, "'previous_response_id' must be a response id", "invalid_request", param="previous_response_id"
        )
    instructions = doc.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "'instructions' must be a string", "invalid_request", param="instructions")
    if doc.get("background") is True:  # it would be polled from one engine's store, which the router does not use
        raise ApiError(
            400,
            "background responses are not served through the router; send the request without 'background'",
            "unsupported_parameter",
            param="background",
        )
    return doc


def input_items(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's ``input`` as a list of items (a string is one user message)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    return list(given)


def carried_output(output: Any) -> list[dict[str, Any]]:
    """The items of a response's ``output`` that a follow-up's input carries on."""
    if not isinstance(output, list):
        return []
    return [item for item in output if isinstance(item, dict) and item.get("type") in _CARRIED_OUTPUT_TYPES]


def expand(request: dict[str, Any], prior_input: list[dict[str, Any]], prior_output: Any) -> dict[str, Any]:
    """``request`` (a follow-up) as one self-contained request: the conversation so far, then its own
    input; ``previous_response_id`` removed. ``request`` itself is left as it was."""
    expanded = {k: v for k, v in request.items() if k != "previous_response_id"}
    expanded["input"] = [*prior_input, *carried_output(prior_output), *input_items(request["input"])]
    return expanded


def _text_of(content: Any) -> Any:
    """Content parts in the chat form: Responses' ``input_text``/``output_text`` as ``text``."""
    if not isinstance(content, list):
        return content
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") in _TEXT_PARTS:
            parts.append({"type": "text", "text": part.get("text", "")})
        else:
            parts.append(part)
    return parts


def _first_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        return text if isinstance(text, str) else None
    return None


def chat_messages(instructions: str | None, given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages vLLM renders a request to (``construct_input_messages``), for hashing."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for item in input_items(given):
        kind = item.get("type")
        last = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
        if kind in ("function_call", "custom_tool_call"):
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", item.get("input"))},
            }
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")})
        elif kind == "reasoning":
            continue  # not carried into the hashed prompt (the chat template drops it for past turns)
        elif item.get("role") == "assistant":
            text = _first_text(item.get("content"))
            if last is not None and last.get("content") is None:
                last["content"] = text
            else:
                messages.append({"role": "assistant", "content": text})
        elif "role" in item:
            messages.append({"role": item["role"], "content": _text_of(item.get("content"))})
        else:
            raise ApiError(400, f"unsupported input item type: {kind!r}", "invalid_request", param="input")
    return messages


def chat_body(request: dict[str, Any]) -> dict[str, Any]:
    """The chat request equivalent to ``request`` for routing: its messages, model, tools and salt."""
    body: dict[str, Any] = {
        "model": request["model"],
        "messages": chat_messages(request.get("instructions"), request["input"]),
    }
    tools = request.get("tools")
    if isinstance(tools, list) and tools:  # Responses' flat function tools, in the chat form
        body["tools"] = [
            {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
            for t in tools
            if isinstance(t, dict) and t.get("type") == "function"
        ] or None
        if body["tools"] is None:
            del body["tools"]
    salt = request.get("cache_salt")
    if isinstance(salt, str) and salt:
        body["cache_salt"] = salt
    return body


def response_object(body: bytes | None) -> dict[str, Any] | None:
    """A unary reply's response object (None when it is not one)."""
    try:
        doc = _decode(body or b"")
    except (msgspec.DecodeError, RecursionError):
        return None
    return doc if isinstance(doc, dict) and doc.get("object") == "response" else None


class CompletedEvent:
    """Follows a Responses SSE stream as it passes and keeps the ``response.completed`` event's
    response object (the stored form of a streamed response). Only the bytes from that event on
    are buffered, up to ``max_bytes`` (a bigger one is not kept)."""

    __slots__ = ("_found", "_max", "_over", "_tail")

    def __init__(self, max_bytes: int) -> None:
        self._tail = bytearray()
        self._max = max_bytes
        self._found = False
        self._over = False

    def feed(self, chunk: bytes) -> None:
        if self._over:
            return
        if not self._found:
            # keep only what could be the start of the marker split over chunks
            self._tail += chunk
            at = self._tail.find(_COMPLETED)
            if at < 0:
                del self._tail[: max(0, len(self._tail) - len(_COMPLETED))]
                return
            self._found = True
            del self._tail[: at + 1]
        else:
            self._tail += chunk
        if len(self._tail) > self._max + 4096:
            self._over = True
            self._tail.clear()

    def response(self) -> dict[str, Any] | None:
        """The completed response, once its event has fully arrived."""
        if not self._found or self._over:
            return None
        end = self._tail.find(b"\n\n")
        frame = bytes(self._tail if end < 0 else self._tail[:end])
        for line in frame.split(b"\n"):
            if line.startswith(b"data:"):
                try:
                    event = _decode(line[5:].strip())
                except (msgspec.DecodeError, RecursionError):
                    return None
                resp = event.get("response") if isinstance(event, dict) else None
                return resp if isinstance(resp, dict) else None
        return None


_ROUTER_ERROR_PREFIX = b'data: {"error"'


def router_error_event(chunk: bytes, sequence_number: int) -> bytes | None:
    """The router's mid-stream error frame (``data: {"error": ...}``, a worker lost after the first
    byte) as the Responses API's ``error`` event; None: ``chunk`` is the engine's, relayed as it is
    (every engine event starts with ``event:``)."""
    if not chunk.startswith(_ROUTER_ERROR_PREFIX):
        return None
    try:
        err = _decode(chunk[len(b"data: ") :].strip())["error"]
    except (msgspec.DecodeError, RecursionError, KeyError, TypeError):
        return None
    err = err if isinstance(err, dict) else {}
    message = err.get("message") if isinstance(err.get("message"), str) else "the worker failed mid-stream"
    event = {
        "type": "error",
        "code": err.get("code") if isinstance(err.get("code"), str) else None,
        "message": message,
        "param": None,
        "sequence_number": sequence_number,
    }
    return b"event: error\ndata: " + msgspec.json.encode(event) + b"\n\n"


def deleted_body(response_id: str) -> bytes:
    """OpenAI's answer to ``DELETE /v1/responses/{id}``."""
    return msgspec.json.encode({"id": response_id, "object": "response", "deleted": True})


def not_found(response_id: str) -> ApiError:
    """vLLM's (and OpenAI's) 404 for an unknown response id."""
    return ApiError(404, f"Response with id '{response_id}' not found.", "response_not_found", param="response_id")
