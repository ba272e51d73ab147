"""kvd wire protocol: golden frames decode to the right messages; bad frames get the right codes."""
from __future__ import annotations

import os
import struct

import msgspec
import pytest

from infera.kvd import protocol as p

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "kvd")
K1 = bytes.fromhex("0102030405060708")
K2 = bytes.fromhex("a1a2a3a4a5a6a7a8")


def load(name: str) -> bytes:
    with open(os.path.join(FIXTURES, f"{name}.bin"), "rb") as f:
        frame = f.read()
    (n,) = struct.unpack(">I", frame[:4])
    assert n == len(frame) - 4, "length prefix is big-endian and covers the body exactly"
    return frame[4:]


@pytest.mark.parametrize("name, expected", [
    ("hello", p.Hello(client_id="vllm-rank0", protocol_version=1, prefers_shared_arena=True)),
    ("get", p.Get(key=K1, model="m", compat_key="tp0of1_pp0of1")),
    ("batch_get", p.BatchGet(keys=[K1, K2], model="m")),
    ("set", p.Set(key=K1, value=b"\x00\x01payload", retention="long", model="m", compat_key="tp0of1_pp0of1",
                  metadata={"n": 1})),
    ("set_minimal", p.Set(key=K1, value=b"v", retention="short", model="", compat_key="", metadata={},
                          ttl_seconds=None)),
    ("batch_set", p.BatchSet(keys=[K1, K2], values=[b"a", b"bb"], retentions=["short", "long"], metadatas=[{}, {}],
                             model="m", ttls_seconds=[None, 30.0])),
    ("set_reserve", p.SetReserve(size=4096)),
    ("set_commit", p.SetCommit(lease_token=7, key=K1, length=4096, model="m", retention="default", ttl_seconds=0)),
    ("set_cancel", p.SetCancel(lease_token=7)),
    ("prefetch_hint", p.PrefetchHint(keys=[K1], model="m", deadline_ms=250)),
    ("exists", p.Exists(keys=[K1, K2], model="m")),
    ("clear", p.Clear()),
    ("stats", p.Stats()),
])
def test_golden_requests_decode(name, expected):
    assert p.decode_request(load(name)) == expected


@pytest.mark.parametrize("name, expected", [
    ("hello_ack", p.HelloAck(server_id="kvd-1", protocol_version=1, shared_arena=(1 << 20, 4160, 1234))),
    ("get_response_miss", p.GetResponse(value=None, retention="")),
    ("get_shared_response", p.GetSharedResponse(slot_offset=4160, length=4096, version=2, retention="short",
                                                 slot_size=4160)),
    ("batch_get_shared_response", p.BatchGetSharedResponse(offsets=[0, -1], lengths=[10, 0], versions=[2, 0],
                                                           retentions=["long", ""], slot_size=4160)),
    ("set_ack_rejected", p.SetAck(accepted=False, reason="retention_downgrade_not_allowed")),
    ("set_reserve_response", p.SetReserveResponse(lease_token=0, slot_id=-1, reason="arena_full_no_evictable")),
    ("stats_response", p.StatsResponse(entries=3, host_bytes=300, long_bytes=100, gets_total=5, sets_total=3,
                                       hits_total=4, misses_total=1)),
    ("error", p.Error(code="batch_set_arity_mismatch", message="lengths differ")),
])
def test_golden_responses_decode(name, expected):
    assert p.decode_response(load(name)) == expected


@pytest.mark.parametrize("name", ["get", "set", "batch_set", "set_reserve", "prefetch_hint", "hello_ack", "error"])
def test_encoder_reproduces_golden_bytes(name):
    """Our encoder writes what the fixtures hold (same field order), length prefix included."""
    body = load(name)
    decoded = (p.decode_request if name not in ("hello_ack", "error") else p.decode_response)(body)
    assert bytes(p.encode_frame(decoded)) == struct.pack(">I", len(body)) + body


def test_op_is_the_map_tag_on_the_wire():
    raw = msgspec.msgpack.decode(bytes(p.encode_frame(p.Exists(keys=[K1])))[4:])
    assert raw == {"op": "exists", "keys": [K1], "model": "", "compat_key": ""}


@pytest.mark.parametrize("body, code", [
    (b"", p.BAD_FRAME),
    (b"\xc1", p.BAD_FRAME),  # never-used msgpack byte
    (msgspec.msgpack.encode([1, 2]), p.BAD_FRAME),  # not a map
    (msgspec.msgpack.encode({"op": "frobnicate"}), p.BAD_OP),
    (msgspec.msgpack.encode({"key": K1}), p.BAD_OP),  # no op at all
    (msgspec.msgpack.encode({"op": 3}), p.BAD_OP),
    (msgspec.msgpack.encode({"op": "get"}), p.BAD_REQUEST),  # missing key
    (msgspec.msgpack.encode({"op": "get", "key": "text"}), p.BAD_REQUEST),  # key must be bytes
    (msgspec.msgpack.encode({"op": "get", "key": b""}), p.BAD_REQUEST),
    (msgspec.msgpack.encode({"op": "get", "key": b"x" * 65}), p.BAD_REQUEST),
    (msgspec.msgpack.encode({"op": "set_reserve", "size": "big"}), p.BAD_REQUEST),
])
def test_bad_frames_get_codes(body, code):
    with pytest.raises(p.ProtocolError) as e:
        p.decode_request(body)
    assert e.value.code == code


def test_unknown_fields_are_ignored():
    assert p.decode_request(msgspec.msgpack.encode({"op": "stats", "future": 1})) == p.Stats()


def test_sync_framing_roundtrip_and_limits():
    import socket
    a, b = socket.socketpair()
    try:
        p.write_msg_sync(a, p.Get(key=K1))
        assert p.decode_request(p.read_frame_sync(b)) == p.Get(key=K1)
        a.sendall(struct.pack(">I", p.MAX_FRAME_BYTES + 1))
        with pytest.raises(p.ProtocolError) as e:
            p.read_frame_sync(b)
        assert e.value.code == p.FRAME_TOO_LARGE
        a.sendall(struct.pack(">I", 10) + b"abc")
        a.close()
        with pytest.raises(p.PeerClosed):
            p.read_frame_sync(b)
    finally:
        a.close()
        b.close()
