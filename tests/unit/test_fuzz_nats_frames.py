"""Fuzzing the NATS wire formats (issue 26, item 5): request messages and reply frames
(``infera.transport.nats_frames``) with the worker's request server and the router's reply state
machine that read them, and replica-sync messages (``infera.transport.replica_sync``) with the
local transport's framing (``replica_sync_local``).

The contract, for every input: a parser returns well-typed values or raises its documented error
(``FrameError``; a replica-sync message is counted in ``decode_errors`` and dropped), never another
exception; what it accepts is safe for what comes next (a request's headers are valid HTTP for the
engine request, a reply frame's parts are what it announced); the state machines fed those bytes
end in a clear state (a reply done or failed with ``UpstreamError``; the policy's tables finite and
consistent) within bounded waits.
"""
from __future__ import annotations

import asyncio
import math
import socket
import struct

import msgspec
import pytest
from hypothesis import example, given, settings, strategies as st

from infera.transport.http import UpstreamError
from infera.transport.nats_frames import (BUSY, DATA, ERROR, FLAG_END, FRAME_PREFIX, HEAD, FrameError, decode_frame,
                                          decode_request, encode_frame, encode_request)
from infera.transport.nats_request import NatsResponse
from infera.transport.nats_request_server import NatsRequestServer, _Request
from infera.transport.replica_sync import (SUBJECT_PREFIX, VERSION, Finished, ReplicaMsg, Started, _encode,
                                           pack_blocks, subject_for)
from infera.transport.replica_sync_local import MAX_FRAME_BYTES, _Reader, frame
from tests.fuzzing import mutated
from tests.unit.test_kv_aware_policy import BS, PROMPT, FakeIndex, pick, request, worker
from tests.unit.test_replica_sync import Bus, Clock, Replica

CHAT = "/v1/chat/completions"
# What the worker writes into the engine's HTTP request for each header pair (HttpTransport.post).
HEADER_LINE = "{}: {}\r\n"


# -- request messages ------------------------------------------------------------------------------------
token = st.text("abcXYZ-_.019!#$%&'*+^`|~", min_size=1, max_size=12)
field_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xff, blacklist_characters="\x7f"), max_size=20)
any_text = st.text(max_size=12)  # control characters and non-latin-1 ones included
headers_ok = st.lists(st.tuples(token, field_text), max_size=3)
headers_any = st.lists(st.tuples(st.one_of(token, any_text), st.one_of(field_text, any_text)), max_size=3)
paths = st.sampled_from([CHAT, "/v1/completions", "/v1/admin/x", ""]) | st.text(max_size=10)
durations = st.floats() | st.integers(-5, 10**6).map(float)


@st.composite
def request_messages(draw) -> bytes:
    """Requests as the router writes them, with odd meta (any headers, any duration) now and then
    a meta of another shape or a length prefix that lies, and then mutated bytes."""
    r = draw(st.integers(0, 9))
    body = draw(st.binary(max_size=40))
    if r < 6:
        data = encode_request(draw(paths), draw(st.booleans()), draw(headers_ok if r < 3 else headers_any), body,
                              draw(durations))
    else:
        meta = msgspec.msgpack.encode(draw(st.lists(st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats()
                                                    | st.text(max_size=8) | st.lists(st.tuples(any_text, any_text)),
                                                    max_size=5)))
        n = len(meta) if r < 8 else draw(st.integers(0, 2**32 - 1))
        data = struct.pack(">I", n) + meta + body
    return draw(mutated(data)) if draw(st.booleans()) else data


def _check_request(data: bytes):
    try:
        path, stream, max_duration, headers, body = decode_request(data)
    except FrameError:
        return None
    assert type(path) is str and type(stream) is bool and type(max_duration) is float and type(body) is bytes
    for name, value in headers:
        line = HEADER_LINE.format(name, value).encode("latin-1")  # what HttpTransport.post writes
        assert line.count(b"\r") == 1 and line.count(b"\n") == 1 and line.endswith(b"\r\n"), line
        assert name and b":" not in name.encode("latin-1") and not any(c < 0x20 or c == 0x7f for c in line[:-2]
                                                                           if c != 0x09), line
    return path, stream, max_duration, headers, body


@settings(max_examples=300)
@given(data=st.binary(max_size=120))
@example(data=b"\x00\x00\x00\x0b\x94\xa1/\xc2\xcb" + bytes(8) + b"\x90")  # cut inside the meta
def test_requests_from_arbitrary_bytes(data):
    _check_request(data)


@settings(max_examples=300)
@given(data=request_messages())
@example(data=encode_request(CHAT, False, [("X-Request-Id", "a\r\nX-Evil: 1")], b"{}"))  # header injection
@example(data=encode_request(CHAT, False, [("X-Request-Id", "é-😀")], b"{}"))  # not latin-1: refused by encode
@example(data=encode_request(CHAT, False, [("X Request", "1")], b"{}"))
def test_requests_structured(data):
    _check_request(data)


@settings(max_examples=150)
@given(path=st.sampled_from([CHAT, "/v1/completions"]), stream=st.booleans(), headers=headers_ok,
       body=st.binary(max_size=40), duration=st.floats(0, 1e9))
def test_valid_requests_round_trip(path, stream, headers, body, duration):
    assert decode_request(encode_request(path, stream, headers, body, duration)) == (path, stream, duration,
                                                                                     headers, body)


@pytest.mark.parametrize("headers", [[("X-Request-Id", "a\r\nX-Evil: 1")], [("X-Request-Id", "é😀")],
                                     [("X-Req:uest", "1")], [("", "1")], [("X-Request-Id", "a\x00b")]])
def test_headers_that_are_no_http_are_refused(headers):
    with pytest.raises(FrameError, match="not a valid HTTP header"):
        decode_request(encode_request(CHAT, False, headers, b"{}"))


class _Core:
    """What NatsRequestServer uses of the NATS core client: the reply frames it publishes."""

    max_payload = 1 << 20
    congested = False

    def __init__(self) -> None:
        self.published: list[tuple[bytes, bytes]] = []

    def on_disconnect(self, listener) -> None:
        pass

    def publish(self, subject: bytes, data: bytes) -> None:
        self.published.append((subject, data))


class _Nats:
    def __init__(self) -> None:
        self._core = _Core()

    def core(self) -> _Core:
        return self._core


# The engine's port: bound here and never listened on, so a connection is refused at once (every
# request the server takes ends in a 502) and no other process can take the port meanwhile.
_ENGINE = socket.socket()
_ENGINE.bind(("127.0.0.1", 0))
ENGINE_PORT = _ENGINE.getsockname()[1]


@settings(max_examples=100)
@given(data=request_messages())
@example(data=encode_request(CHAT, False, [("X-Request-Id", "é😀")], b"{}"))  # once: UnicodeEncodeError, no reply
def test_the_request_server_answers_every_message(data):
    """The worker's side: whatever arrives on its subject gets one final reply frame (400 for a
    malformed message, 404 for another path, 502 here where the engine is down), no exception."""
    async def serve() -> list[bytes]:
        nats = _Nats()
        server = NatsRequestServer(nats, "w1", f"http://127.0.0.1:{ENGINE_PORT}", idle_timeout=5)
        try:
            await asyncio.wait_for(server._serve(_Request(b"_INBOX.x.1"), data), 10)
        finally:
            await server.http.close()
        return [f for _, f in nats.core().published]

    frames = asyncio.run(serve())
    assert len(frames) == 1, frames
    kind, end, seq, status, _, message = decode_frame(frames[0])
    assert (kind, seq) == (ERROR, 0) and status in (400, 404, 502, 504), (status, message)  # 504: a tiny cap
    assert (status == 400) == (_check_request(data) is None), message


# -- reply frames ------------------------------------------------------------------------------------------
@st.composite
def reply_frames(draw, seq: int) -> bytes:
    kind = draw(st.sampled_from([HEAD, HEAD, DATA, DATA, BUSY, ERROR]) | st.integers(0, 255))
    data = encode_frame(kind, seq if draw(st.integers(0, 9)) else draw(st.integers(0, 2**32 - 1)),
                        draw(st.binary(max_size=16)), end=draw(st.booleans()),
                        status=draw(st.none() | st.integers(100, 599)),
                        content_type=draw(st.none() | st.sampled_from(["text/event-stream", "application/json"])
                                          | st.text(st.characters(max_codepoint=0xff), max_size=300)))
    return draw(mutated(data)) if draw(st.integers(0, 3)) == 0 else data


def _check_frame(data: bytes):
    try:
        kind, end, seq, status, content_type, body = decode_frame(data)
    except FrameError:
        return None
    assert kind in (HEAD, DATA, BUSY, ERROR) and type(end) is bool and 0 <= seq < 2**32
    assert bytes(body) == data[len(data) - len(body):]
    if kind == HEAD:
        assert 0 <= status < 2**16 and len(content_type.encode("latin-1")) == data[FRAME_PREFIX + 2]
    elif kind == ERROR:
        assert 0 <= status < 2**16 and content_type is None
    else:
        assert status is None and content_type is None
    return kind, end, seq, status, content_type, body


@settings(max_examples=300)
@given(data=st.binary(max_size=40))
@example(data=b"\x01\x00\x00\x00\x00\x00\x00\xc8\x10appl")  # a head whose content type is cut short
def test_reply_frames_from_arbitrary_bytes(data):
    _check_frame(data)


@settings(max_examples=200)
@given(kind=st.sampled_from([HEAD, DATA, BUSY, ERROR]), seq=st.integers(0, 2**32 - 1), data=st.binary(max_size=30),
       end=st.booleans(), status=st.integers(0, 2**16 - 1),
       content_type=st.text(st.characters(max_codepoint=0xff), min_size=1, max_size=300))
def test_reply_frames_round_trip(kind, seq, data, end, status, content_type):
    got = decode_frame(encode_frame(kind, seq, data, end=end, status=status, content_type=content_type))
    want_status = status or (200 if kind == HEAD else 502) if kind in (HEAD, ERROR) else None
    want_ctype = content_type.encode("latin-1")[:255].decode("latin-1") if kind == HEAD else None
    assert got == (kind, end, seq, want_status, want_ctype, data)
    assert bool(encode_frame(kind, seq, data, end=end)[1] & FLAG_END) == end


def test_a_head_frame_cut_inside_its_content_type_is_refused():
    frame_bytes = encode_frame(HEAD, 0, b"", status=200, content_type="application/json")
    with pytest.raises(FrameError, match="cut short"):
        decode_frame(frame_bytes[:-3])


class _Client:
    def __init__(self) -> None:
        self.done: list = []
        self.cancelled: list = []

    def _done(self, resp) -> None:
        self.done.append(resp)

    def _cancel(self, resp) -> None:
        self.cancelled.append(resp)


@st.composite
def reply_streams(draw) -> list[bytes]:
    return [draw(reply_frames(i)) if draw(st.integers(0, 5)) else draw(st.binary(max_size=12))
            for i in range(draw(st.integers(0, 5)))]


@settings(max_examples=150)
@given(frames=reply_streams(), no_responders=st.booleans())
def test_the_reply_state_machine_takes_any_frames(frames, no_responders):
    """The router's side: any frames in any order end in a reply that is complete (its body what
    the frames carried) or failed with UpstreamError, or still pending until its idle timeout."""
    async def run():
        client = _Client()
        resp = NatsResponse(client, "w1", b"infera.cancel.dzE", b"_INBOX.x.1", 0.01, None)
        if no_responders:
            resp._on_frame(b"", 503)
        for f in frames:
            resp._on_frame(f)  # never raises
        body = b""
        try:
            await asyncio.wait_for(resp.wait_headers(), 5)
            while chunk := await asyncio.wait_for(resp.next_chunk(), 5):
                body += chunk
        except UpstreamError:
            assert not resp.complete
        else:  # complete: the frames up to the last one all well-formed, their bytes the body
            assert resp.complete and not no_responders
            want = b""
            for f in frames:
                parsed = _check_frame(f)
                assert parsed is not None
                want += parsed[5]
                if parsed[1]:
                    break
            assert body == want
        resp.release()
        assert client.done  # its accounting released, whatever happened

    asyncio.run(run())


# -- replica sync ------------------------------------------------------------------------------------------
odd = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=5)
                   | st.binary(max_size=5), lambda inner: st.lists(inner, max_size=3), max_leaves=6)
rids = st.integers(1, 6) | st.integers(-2**63, 2**64 - 1)
floats_odd = st.floats(0, 10) | st.floats() | st.sampled_from([math.nan, math.inf, -math.inf, -1.0])
blocks = st.one_of(st.lists(st.sampled_from([1, 2, 3, 2**64 - 1]) | st.integers(0, 2**64 - 1), max_size=6)
                   .map(pack_blocks), st.binary(max_size=30))


@st.composite
def replica_messages(draw) -> bytes:
    msg = ReplicaMsg(
        v=draw(st.sampled_from([VERSION] * 8 + [0, 2])),
        replica=draw(st.sampled_from(["B", "C", "C", "me"]) | st.text(max_size=4)),
        seq=draw(st.integers(0, 4) | st.integers(-2**63, 2**64 - 1)),
        started=[Started(draw(rids), draw(st.sampled_from(["a", "b"]) | st.text(max_size=4)), draw(blocks),
                         draw(floats_odd)) for _ in range(draw(st.integers(0, 3)))],
        finished=[Finished(draw(rids), draw(floats_odd)) for _ in range(draw(st.integers(0, 2)))],
        live=draw(st.none() | st.lists(rids, max_size=4)),
        want=draw(st.lists(st.sampled_from(["*", "me", "B"]) | st.text(max_size=3), max_size=2)),
        bye=draw(st.integers(0, 9)) == 0)
    data = _encode(msg)
    r = draw(st.integers(0, 9))
    if r == 0:  # a newer sender's extra trailing items (skipped by the decoder)
        data = bytes((data[0] + 1,)) + data[1:] + msgspec.msgpack.encode(draw(odd))
    elif r == 1:
        data = draw(mutated(data))
    return data


subjects = st.sampled_from([subject_for("m"), subject_for("m"), subject_for(""), subject_for("other"), SUBJECT_PREFIX,
                            SUBJECT_PREFIX + "!!", SUBJECT_PREFIX + "_x", SUBJECT_PREFIX + "gA"])
DEEP_TAIL = b"\x99\x01\xa1X\x01\x90\x90\xc0\x90\xc2" + b"\x91" * 20_000 + b"\xc0"  # once: RecursionError
NAN_CHARGE = _encode(ReplicaMsg(VERSION, "B", 1, started=[Started(1, "a", pack_blocks([1, 2]), math.nan)]))


def _replica():
    clock = Clock()
    return Replica(Bus(), clock, FakeIndex(), "me"), clock


def _consistent(rep) -> None:
    policy = rep.policy
    share = policy.replicas
    assert all(math.isfinite(v) for v in policy.recent.values()), policy.recent
    assert share.remote_blocks == sum(len(e[2]) for p in share.peers.values() for e in p.entries.values())
    assert all(n > 0 for n in policy.inflight.values())
    w = pick(policy, [worker("a"), worker("b")], request(PROMPT))  # the policy still picks
    assert w.worker_id in ("a", "b")


@settings(max_examples=200)
@given(messages=st.lists(st.tuples(subjects, st.binary(max_size=60)), min_size=1, max_size=4))
@example(messages=[(subject_for("m"), DEEP_TAIL)])
def test_replica_messages_from_arbitrary_bytes(messages):
    rep, _ = _replica()
    for subject, data in messages:
        before = rep.sync.decode_errors
        rep.sync.receive(subject, data)
        if rep.sync.decode_errors == before:
            msgspec.msgpack.decode(data, type=ReplicaMsg)  # only a message that decodes counts as one
    _consistent(rep)


@settings(max_examples=200)
@given(messages=st.lists(st.tuples(subjects, replica_messages()), min_size=1, max_size=6), heartbeat=st.booleans())
@example(messages=[(subject_for("m"), NAN_CHARGE)], heartbeat=False)  # once: NaN in the policy's charges
def test_replica_messages_structured(messages, heartbeat):
    rep, clock = _replica()
    for subject, data in messages:
        rep.sync.receive(subject, data)
        clock.advance(0.3)
    _consistent(rep)
    rep.tick(heartbeat=heartbeat)  # answers what was asked (full states), expires the silent
    clock.advance(10)
    rep.policy.replicas.expire(clock())
    _consistent(rep)
    assert rep.policy.replicas.remote_blocks == 0 and not rep.policy.replicas.peers


def test_a_nan_charge_is_a_bad_message():
    rep, _ = _replica()
    rep.sync.receive(subject_for("m"), NAN_CHARGE)
    assert rep.sync.decode_errors == 1 and not rep.policy.recent and not rep.policy.replicas.peers


# -- the local transport's framing: [u32 data length][u16 subject length][subject][data] ---------------------
class _Sync:
    def __init__(self) -> None:
        self.got: list[tuple[str, bytes]] = []
        self.decode_errors = 0

    def receive(self, subject: str, data: bytes) -> None:
        self.got.append((subject, data))


class _Transport:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _reader() -> tuple[_Reader, _Sync, _Transport]:
    sync, transport = _Sync(), _Transport()
    reader = _Reader(sync)
    reader.transport = transport
    return reader, sync, transport


def _chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:])]


@settings(max_examples=150)
@given(messages=st.lists(st.tuples(st.text(max_size=10), st.binary(max_size=30)), max_size=5),
       cuts=st.lists(st.integers(0, 10**6), max_size=8))
def test_local_frames_arrive_whole_however_the_stream_is_cut(messages, cuts):
    reader, sync, transport = _reader()
    for chunk in _chunks(b"".join(frame(s, d) for s, d in messages), cuts):
        reader.data_received(chunk)
    assert sync.got == messages and not reader.buf and not transport.closed and sync.decode_errors == 0


@settings(max_examples=200)
@given(data=st.binary(max_size=80), cuts=st.lists(st.integers(0, 10**6), max_size=4))
@example(data=struct.pack("<IH", MAX_FRAME_BYTES + 1, 0), cuts=[])
@example(data=struct.pack("<IH", 1, 2) + b"\xff\xfex", cuts=[])  # a subject that is no UTF-8
def test_local_frames_from_arbitrary_bytes(data, cuts):
    """Garbage: each whole frame is handed on (its subject decoded) or counted; a length past the
    limit closes the connection; a partial frame waits in the buffer, no more than it."""
    reader, sync, transport = _reader()
    for chunk in _chunks(data, cuts):
        if transport.closed:
            break
        reader.data_received(chunk)
    pos, delivered = 0, []
    while len(data) - pos >= 6:
        n, k = struct.unpack_from("<IH", data, pos)
        if n > MAX_FRAME_BYTES or pos + 6 + k + n > len(data):
            break
        try:
            delivered.append((data[pos + 6:pos + 6 + k].decode(), data[pos + 6 + k:pos + 6 + k + n]))
        except UnicodeDecodeError:
            pass
        pos += 6 + k + n
    assert sync.got == delivered
    if transport.closed:
        assert not reader.buf and sync.decode_errors >= 1
    else:
        assert bytes(reader.buf) == data[pos:]
