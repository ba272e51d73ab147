"""The wire format of requests over NATS, shared by the router's client and the worker's server.

Request: a message on ``infera.req.<token>`` (token = base64url(worker_id), no padding) whose
payload is the OpenAI request body, verbatim, and whose reply subject is the router's inbox for
this request. Headers: ``Infera-Path`` (``/v1/chat/completions`` …), ``Infera-Stream`` (1/0),
``Infera-Max-Duration`` (seconds, when capped), and the engine-bound request headers as
``Infera-H-<name>`` (``X-Request-Id``, ``X-Data-Parallel-Rank``).

Reply: messages on that inbox, each with ``Infera-Seq`` (0, 1, 2, … so a lost frame is detected,
never silently skipped) and ``Infera-Frame``:

* ``head``: ``Infera-Status`` and ``Infera-Content-Type`` of the engine's reply; the payload is
  the first body bytes. The engine's status travels before any byte, so an engine error before the
  first byte keeps its HTTP status (upstream answers 200 with an error body);
* ``data``: more body bytes (a body larger than the broker's max payload is split);
* ``busy``: admission refused (the worker already has ``--nats-req-max-pending`` requests);
* ``error``: the worker failed the request (payload: UTF-8 message; ``Infera-Status`` if known).

``Infera-End: 1`` on a ``head`` or ``data`` frame ends the reply: a unary reply is one message.
A cancel is the request's inbox, published to ``infera.cancel.<token>``.
"""
from __future__ import annotations

REQUEST_SUBJECT = "infera.req."
CANCEL_SUBJECT = "infera.cancel."

H_PATH = "Infera-Path"
H_STREAM = "Infera-Stream"
H_MAX_DURATION = "Infera-Max-Duration"
H_FORWARD_PREFIX = "Infera-H-"
H_SEQ = "Infera-Seq"
H_FRAME = "Infera-Frame"
H_STATUS = "Infera-Status"
H_CONTENT_TYPE = "Infera-Content-Type"
H_END = "Infera-End"

FRAME_HEAD = "head"
FRAME_DATA = "data"
FRAME_BUSY = "busy"
FRAME_ERROR = "error"

# Room left in a message for its headers when a body is split to the broker's max payload.
HEADER_ROOM = 1024


def request_subject(token: str) -> str:
    return REQUEST_SUBJECT + token


def cancel_subject(token: str) -> str:
    return CANCEL_SUBJECT + token


def request_headers(path: str, stream: bool, forward: tuple[tuple[str, str], ...] | list[tuple[str, str]],
                    max_duration: float = 0.0) -> dict[str, str]:
    headers = {H_PATH: path, H_STREAM: "1" if stream else "0"}
    if max_duration > 0:
        headers[H_MAX_DURATION] = f"{max_duration:g}"
    for name, value in forward:
        headers[H_FORWARD_PREFIX + name] = value
    return headers


def forwarded_headers(headers: dict[str, str]) -> list[tuple[str, str]]:
    """The engine-bound headers of a request message."""
    n = len(H_FORWARD_PREFIX)
    return [(k[n:], v) for k, v in headers.items() if k.startswith(H_FORWARD_PREFIX) and len(k) > n]


def reply_headers(seq: int, frame: str, *, end: bool = False, status: int | None = None,
                  content_type: str | None = None) -> dict[str, str]:
    headers = {H_SEQ: str(seq), H_FRAME: frame}
    if end:
        headers[H_END] = "1"
    if status is not None:
        headers[H_STATUS] = str(status)
    if content_type is not None:
        headers[H_CONTENT_TYPE] = content_type
    return headers


def split_payload(data: bytes, max_payload: int) -> list[bytes]:
    """``data`` cut to fit the broker's max payload (at least one piece, maybe empty)."""
    size = max(1024, max_payload - HEADER_ROOM)
    if len(data) <= size:
        return [data]
    return [data[i:i + size] for i in range(0, len(data), size)]
