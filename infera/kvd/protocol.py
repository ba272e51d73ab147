"""kvd wire protocol: a frame is a 4-byte big-endian u32 length, then one msgpack map whose
``op`` field names the message. Requests and responses are msgspec structs tagged by ``op``.

Framing is done with exact-size reads on purpose: the daemon passes the arena memfd as an
SCM_RIGHTS message right after ``hello_ack``, and a reader that buffered ahead would swallow the
byte that carries the descriptor.
"""
from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any, Union

import msgspec

PROTOCOL_VERSION = 1
HEADER = struct.Struct(">I")
# A 128 MiB chunk plus its msgpack envelope fits easily; anything near 4 GiB is a broken peer.
MAX_FRAME_BYTES = 1 << 30
MAX_KEY_BYTES = 64

Key = bytes


class Message(msgspec.Struct, tag_field="op", kw_only=True):
    """Base of every frame body: a msgpack map tagged by ``op``."""


# --- requests -----------------------------------------------------------------------------------

class Hello(Message, tag="hello"):
    client_id: str = ""
    protocol_version: int = PROTOCOL_VERSION
    prefers_shared_arena: bool = False


class Get(Message, tag="get"):
    key: Key
    model: str = ""
    compat_key: str = ""


class BatchGet(Message, tag="batch_get"):
    keys: list[Key]
    model: str = ""
    compat_key: str = ""


class Set(Message, tag="set"):
    key: Key
    value: bytes
    retention: str = "short"
    model: str = ""
    compat_key: str = ""
    metadata: dict[str, Any] = {}
    ttl_seconds: Union[float, None] = None


class BatchSet(Message, tag="batch_set"):
    keys: list[Key]
    values: list[bytes]
    retentions: list[str] = []  # empty: every item "short"
    metadatas: list[dict[str, Any]] = []
    model: str = ""
    compat_key: str = ""
    ttls_seconds: Union[list[Union[float, None]], None] = None


class SetReserve(Message, tag="set_reserve"):
    size: int


class SetCommit(Message, tag="set_commit"):
    lease_token: int
    key: Key
    length: int
    model: str = ""
    compat_key: str = ""
    retention: str = "default"  # "default" means short
    ttl_seconds: float = 0  # <= 0: no TTL (unlike set, where <= 0 means "already expired")


class SetCancel(Message, tag="set_cancel"):
    lease_token: int


class PrefetchHint(Message, tag="prefetch_hint"):
    keys: list[Key]
    model: str = ""
    compat_key: str = ""
    deadline_ms: int = 1000


class Exists(Message, tag="exists"):
    keys: list[Key]
    model: str = ""
    compat_key: str = ""


class Clear(Message, tag="clear"):
    model: str = ""
    compat_key: str = ""


class Stats(Message, tag="stats"):
    pass


Request = Union[Hello, Get, BatchGet, Set, BatchSet, SetReserve, SetCommit, SetCancel, PrefetchHint, Exists,
                Clear, Stats]
REQUEST_OPS = frozenset(t.__struct_config__.tag for t in Request.__args__)

# --- responses ----------------------------------------------------------------------------------


class HelloAck(Message, tag="hello_ack"):
    server_id: str
    protocol_version: int = PROTOCOL_VERSION
    shared_arena: Union[tuple[int, int, int], None] = None  # (arena_size, slot_size, server_pid)


class GetResponse(Message, tag="get_response"):
    value: Union[bytes, None]
    retention: str = ""


class GetSharedResponse(Message, tag="get_shared_response"):
    slot_offset: int
    length: int
    version: int
    retention: str
    slot_size: int


class BatchGetResponse(Message, tag="batch_get_response"):
    values: list[Union[bytes, None]]
    retentions: list[str]


class BatchGetSharedResponse(Message, tag="batch_get_shared_response"):
    offsets: list[int]  # -1: miss
    lengths: list[int]  # 0: miss
    versions: list[int]
    retentions: list[str]
    slot_size: int


class SetAck(Message, tag="set_ack"):
    accepted: bool
    reason: str = ""


class BatchSetAck(Message, tag="batch_set_ack"):
    accepted: list[bool]
    reasons: list[str]


class SetReserveResponse(Message, tag="set_reserve_response"):
    lease_token: int  # 0: rejected, see reason
    slot_id: int = -1
    payload_offset: int = 0
    payload_max_size: int = 0
    reason: str = ""  # "", no_arena, oversize, arena_full_no_evictable


class SetCommitResponse(Message, tag="set_commit_response"):
    accepted: bool
    reason: str = ""


class SetCancelResponse(Message, tag="set_cancel_response"):
    pass


class ExistsResponse(Message, tag="exists_response"):
    present: list[bool]


class ClearAck(Message, tag="clear_ack"):
    cleared_entries: int


class StatsResponse(Message, tag="stats_response"):
    entries: int = 0
    host_bytes: int = 0
    spillover_bytes: int = 0  # the spillover tier no longer exists; kept for wire compatibility
    long_bytes: int = 0
    gets_total: int = 0
    sets_total: int = 0
    hits_total: int = 0
    misses_total: int = 0
    evictions_total: int = 0
    # beyond the reference's fields (decoders ignore unknown keys)
    l2_hits_total: int = 0
    l3_hits_total: int = 0
    long_entries: int = 0
    arena_slots: int = 0
    arena_slot_size: int = 0
    arena_entries: int = 0
    prefetch_dropped_total: int = 0
    prefetch_loaded_total: int = 0


class Error(Message, tag="error"):
    code: str
    message: str = ""


Response = Union[HelloAck, GetResponse, GetSharedResponse, BatchGetResponse, BatchGetSharedResponse, SetAck,
                 BatchSetAck, SetReserveResponse, SetCommitResponse, SetCancelResponse, ExistsResponse, ClearAck,
                 StatsResponse, Error]

# Error codes
BAD_OP = "bad_op"  # unknown or missing op
BAD_FRAME = "bad_frame"  # not msgpack, not a map, or an empty frame
BAD_REQUEST = "bad_request"  # known op, fields of the wrong type or missing
FRAME_TOO_LARGE = "frame_too_large"  # the connection is closed after this one
INTERNAL_ERROR = "internal_error"
BATCH_SET_ARITY_MISMATCH = "batch_set_arity_mismatch"

FD_MESSAGE_BYTE = b"F"  # payload of the SCM_RIGHTS message carrying the arena memfd


class ProtocolError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class PeerClosed(ConnectionError):
    """The peer closed the stream (between frames, or mid-frame)."""


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_response_decoder = msgspec.msgpack.Decoder(Response)
_any_decoder = msgspec.msgpack.Decoder()


def encode_frame(msg: Message) -> bytearray:
    """Length header and msgpack body in one buffer (no second copy of a large value)."""
    buf = bytearray(HEADER.size)
    _encoder.encode_into(msg, buf, HEADER.size)
    HEADER.pack_into(buf, 0, len(buf) - HEADER.size)
    return buf


def encode_body(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode_request(body: bytes | bytearray | memoryview) -> Request:
    """Decode one frame body; raises ProtocolError with the code to answer."""
    if not body:
        raise ProtocolError(BAD_FRAME, "empty frame")
    try:
        req = _request_decoder.decode(body)
    except msgspec.ValidationError as e:  # a subclass of DecodeError: test it first
        try:
            raw = _any_decoder.decode(body)
        except (msgspec.DecodeError, RecursionError) as exc:  # the typed decoder stopped before the flaw
            raise ProtocolError(BAD_FRAME, f"not msgpack: {exc}") from None
        if not isinstance(raw, dict):
            raise ProtocolError(BAD_FRAME, "frame is not a msgpack map") from None
        op = raw.get("op")
        if not isinstance(op, str) or op not in REQUEST_OPS:
            raise ProtocolError(BAD_OP, f"unknown op {op!r}") from None
        raise ProtocolError(BAD_REQUEST, f"{op}: {e}") from None
    except (msgspec.DecodeError, RecursionError) as e:  # RecursionError: msgspec's, for nesting past the limit
        raise ProtocolError(BAD_FRAME, f"not msgpack: {e}") from None
    for key in _keys_of(req):
        if not key or len(key) > MAX_KEY_BYTES:
            raise ProtocolError(BAD_REQUEST, f"keys must be 1..{MAX_KEY_BYTES} bytes")
    # A NaN TTL is no duration (the store took it as "never expires": no comparison with it is
    # true); infinities stay (``inf``: never expires, ``-inf``: expired on arrival, as said).
    for ttl in _ttls_of(req):
        if ttl is not None and ttl != ttl:
            raise ProtocolError(BAD_REQUEST, f"{req.__struct_config__.tag}: a TTL must be a number, not NaN")
    return req


def _ttls_of(req: Request) -> list[float | None]:
    if isinstance(req, (Set, SetCommit)):
        return [req.ttl_seconds]
    if isinstance(req, BatchSet):
        return req.ttls_seconds or []
    return []


def _keys_of(req: Request) -> list[bytes]:
    if isinstance(req, (Get, Set, SetCommit)):
        return [req.key]
    if isinstance(req, (BatchGet, BatchSet, PrefetchHint, Exists)):
        return req.keys
    return []


def decode_response(body: bytes | bytearray | memoryview) -> Response:
    try:
        return _response_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        raise ProtocolError(BAD_FRAME, f"undecodable response: {e}") from None


def _check_length(n: int, limit: int) -> None:
    if n == 0:
        raise ProtocolError(BAD_FRAME, "empty frame")
    if n > limit:
        raise ProtocolError(FRAME_TOO_LARGE, f"frame of {n} bytes exceeds {limit}")


# --- async framing over a non-blocking socket (loop.sock_* API) --------------------------------

async def recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    pos = 0
    while pos < n:
        got = await loop.sock_recv_into(sock, view[pos:])
        if got == 0:
            raise PeerClosed("peer closed" if pos == 0 else "peer closed mid-frame")
        pos += got
    return buf


async def read_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                     limit: int = MAX_FRAME_BYTES) -> bytearray:
    (n,) = HEADER.unpack(await recv_exactly(loop, sock, HEADER.size))
    _check_length(n, limit)
    return await recv_exactly(loop, sock, n)


async def write_msg(loop: asyncio.AbstractEventLoop, sock: socket.socket, msg: Message) -> None:
    await loop.sock_sendall(sock, encode_frame(msg))


# --- blocking framing (sync client) ------------------------------------------------------------

def recv_exactly_sync(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    pos = 0
    while pos < n:
        got = sock.recv_into(view[pos:])
        if got == 0:
            raise PeerClosed("peer closed" if pos == 0 else "peer closed mid-frame")
        pos += got
    return buf


def read_frame_sync(sock: socket.socket, limit: int = MAX_FRAME_BYTES) -> bytearray:
    (n,) = HEADER.unpack(recv_exactly_sync(sock, HEADER.size))
    _check_length(n, limit)
    return recv_exactly_sync(sock, n)


def write_msg_sync(sock: socket.socket, msg: Message) -> None:
    sock.sendall(encode_frame(msg))
