"""The wire format of requests over NATS, shared by the router's client and the worker's server.

Everything travels in the payload: no NATS headers on the hot path (nats-py parses a header
block in Python on both ends, ~9 µs per message here, and a stream is many messages).

Request: a message on ``infera.req.<token>`` (token = base64url(worker_id), no padding), reply
subject = the router's inbox for this request. Payload::

    u32 BE meta length | meta (msgpack [path, stream, max_duration_s, [[name, value], ...]]) | body

``body`` is the OpenAI request, verbatim; the pairs are the engine-bound request headers
(``X-Request-Id``, ``X-Data-Parallel-Rank``); ``max_duration_s`` 0 means uncapped.

Reply: messages on that inbox. Payload::

    u8 kind | u8 flags (bit 0: the last frame) | u32 BE seq | [head only: u16 BE status | u8 n | n bytes
    content type] | bytes

``seq`` counts 0, 1, 2, … so a lost frame is detected, never silently skipped. Kinds:

* ``HEAD``: the engine's status and content type, then the first body bytes. The status travels
  before any byte, so an engine error before the first byte keeps its HTTP status (upstream
  answers 200 with an error body);
* ``DATA``: more body bytes (a body larger than the broker's max payload is split);
* ``BUSY``: admission refused (the worker already has ``--nats-req-max-pending`` requests);
* ``ERROR``: the worker failed the request; the bytes are a UTF-8 message, and a head-style status
  (u16) precedes them (504: timed out).

A unary reply is one ``HEAD`` frame with the last-frame flag. A cancel is the request's inbox,
published to ``infera.cancel.<token>``.

Liveness: each worker's request server publishes an empty message on ``infera.alive.<token>``
every second. A TCP connection tells an HTTP router at once that its worker died; over NATS
nothing would until the idle timeout (900 s), so routers fail a worker's requests after a few
missed heartbeats instead (then they fail over, migrate, or end with an error event).
"""
from __future__ import annotations

import re
import struct

import msgspec

REQUEST_SUBJECT = "infera.req."
CANCEL_SUBJECT = "infera.cancel."
ALIVE_SUBJECT = "infera.alive."
HEARTBEAT_S = 1.0  # a worker's heartbeat period
DEAD_AFTER_S = 3.5  # silence after which routers give up on a worker's requests

HEAD, DATA, BUSY, ERROR = 1, 2, 3, 4
KIND_NAMES = {HEAD: "head", DATA: "data", BUSY: "busy", ERROR: "error"}
FLAG_END = 1

_U32 = struct.Struct(">I")
_FRAME = struct.Struct(">BBI")  # kind, flags, seq
_STATUS = struct.Struct(">H")
FRAME_PREFIX = _FRAME.size
# Room left in a message for the frame prefix when a body is split to the broker's max payload.
PREFIX_ROOM = 512

_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(tuple[str, bool, float, list[tuple[str, str]]])
# What an engine-bound header pair may hold: the worker writes it into the engine's HTTP request as
# ``name: value\r\n`` in latin-1. A name that is no HTTP token, or a CR, LF or other control character
# or a non-latin-1 character in either, would split the request (header injection) or fail its
# encoding after the request was accepted (no reply until the router's idle timeout).
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")


class FrameError(ValueError):
    """A request or reply that does not follow this format."""


def request_subject(token: str) -> str:
    return REQUEST_SUBJECT + token


def cancel_subject(token: str) -> str:
    return CANCEL_SUBJECT + token


def alive_subject(token: str) -> str:
    return ALIVE_SUBJECT + token


# -- requests --------------------------------------------------------------------------------------
def encode_request(path: str, stream: bool, headers: tuple[tuple[str, str], ...] | list[tuple[str, str]],
                   body: bytes, max_duration: float = 0.0) -> bytes:
    meta = _meta_encoder.encode((path, stream, float(max_duration), list(headers)))
    return b"".join((_U32.pack(len(meta)), meta, body))


def decode_request(payload: bytes) -> tuple[str, bool, float, list[tuple[str, str]], bytes]:
    """(path, stream, max_duration_s, engine-bound headers, body)."""
    try:
        (n,) = _U32.unpack_from(payload)
        path, stream, max_duration, headers = _meta_decoder.decode(payload[4:4 + n])
    except (struct.error, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(f"malformed request message: {exc}") from None
    for name, value in headers:
        if not _HEADER_NAME.fullmatch(name) or not _HEADER_VALUE.fullmatch(value):
            raise FrameError(f"malformed request message: header {name[:64]!r}: {value[:64]!r} is not a valid "
                             "HTTP header")
    return path, stream, max_duration, headers, payload[4 + n:]


# -- replies ------------------------------------------------------------------------------------------
def encode_frame(kind: int, seq: int, data: bytes = b"", *, end: bool = False, status: int | None = None,
                 content_type: str | None = None) -> bytes:
    prefix = _FRAME.pack(kind, FLAG_END if end else 0, seq)
    if kind == HEAD:
        ctype = (content_type or "application/json").encode("latin-1")[:255]
        return b"".join((prefix, _STATUS.pack(status or 200), bytes((len(ctype),)), ctype, data))
    if kind == ERROR:
        return b"".join((prefix, _STATUS.pack(status or 502), data))
    return prefix + data if data else prefix


def split_payload(data: bytes, max_payload: int) -> list[bytes]:
    """``data`` cut to fit the broker's max payload with a frame prefix (at least one piece)."""
    size = max(1024, max_payload - PREFIX_ROOM)
    if len(data) <= size:
        return [data]
    return [data[i:i + size] for i in range(0, len(data), size)]


def decode_frame(payload: bytes) -> tuple[int, bool, int, int | None, str | None, bytes]:
    """(kind, last, seq, status, content type, bytes) of a reply frame."""
    if len(payload) < FRAME_PREFIX:
        raise FrameError(f"reply frame of {len(payload)} bytes is shorter than its prefix")
    kind, flags, seq = _FRAME.unpack_from(payload)
    end = bool(flags & FLAG_END)
    if kind == HEAD:
        if len(payload) < FRAME_PREFIX + 3:
            raise FrameError("head frame without a status")
        (status,) = _STATUS.unpack_from(payload, FRAME_PREFIX)
        n = payload[FRAME_PREFIX + 2]
        start = FRAME_PREFIX + 3
        if len(payload) < start + n:  # else a cut frame would pass as a shorter content type
            raise FrameError(f"head frame's content type ({n} bytes) is cut short")
        return kind, end, seq, status, payload[start:start + n].decode("latin-1"), payload[start + n:]
    if kind == ERROR:
        if len(payload) < FRAME_PREFIX + 2:
            raise FrameError("error frame without a status")
        (status,) = _STATUS.unpack_from(payload, FRAME_PREFIX)
        return kind, end, seq, status, None, payload[FRAME_PREFIX + 2:]
    if kind in (DATA, BUSY):
        return kind, end, seq, None, None, payload[FRAME_PREFIX:]
    raise FrameError(f"unknown reply frame kind {kind}")
