"""OpenAI chat SSE → Anthropic SSE events (part of :mod:`infera.api.anthropic`, which re-exports
:class:`StreamTranslator`): bytes split anywhere in, ``message_start`` / ``content_block_*`` /
``message_delta`` / ``message_stop`` out, one block at a time as Anthropic's are, tool-call argument
fragments as ``input_json_delta``, and the router's mid-stream error frame as Anthropic's ``error``
event. Pure translation, no I/O.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from infera.api.anthropic_errors import _decode, _DecodeErrors, _encode, anthropic_error_type
from infera.api.anthropic_response import _matched_stop, stop_reason_of, usage_of

# (the logger's name is the one it had before the split: log configurations name it)
log = logging.getLogger("infera.api.anthropic")

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
