"""Fuzzing the kvd socket protocol (issue 26, item 5): ``decode_request`` / ``decode_response``
(``infera.kvd.protocol``) on arbitrary bytes, on structure-aware request maps (every op, fields of
the right type or not, unknown keys) and on mutated valid frames; and the daemon's connection loop
(``KvdServer._serve``, over a socketpair, with a real service behind it: RAM store and L3 region)
fed the same bodies.

The contract: a body decodes to a request or raises ``ProtocolError`` with ``bad_frame``,
``bad_op`` or ``bad_request`` (never another exception); the connection answers every frame with
exactly one response (a fire-and-forget ``prefetch_hint`` with none), never ``internal_error``,
and stays usable afterwards (only a frame over the size limit closes it, after its error).
"""
from __future__ import annotations

import asyncio
import math
import random
import socket
import struct
import tempfile

import msgspec
import pytest
from hypothesis import example, given, settings, strategies as st

from infera.kvd import protocol as p
from infera.kvd.server import KvdServer
from infera.kvd.service import KvdService
from infera.kvd.store import HostStore
from infera.kvd.tablespace import Tablespace

CODES = {p.BAD_FRAME, p.BAD_OP, p.BAD_REQUEST}
# Bodies that once escaped decode_request: nesting past the recursion limit (msgspec raised
# RecursionError) in an Any field and in an unknown key; a typed error before a truncation (the
# fallback decode raised msgspec.DecodeError).
DEEP_METADATA = b"\x83\xa2op\xa3set\xa3key\xc4\x01k\xa8metadata" + b"\x81\xa1a" * 5000 + b"\xc0"
DEEP_UNKNOWN = b"\x82\xa2op\xa5stats\xa1x" + b"\x91" * 20_000 + b"\xc0"
CUT_AFTER_A_TYPE_ERROR = b"\x93\x01"


def _decode(body: bytes):
    try:
        req = p.decode_request(body)
    except p.ProtocolError as e:
        assert e.code in CODES, e
        return None
    assert isinstance(req, p.Request.__args__)
    for key in p._keys_of(req):
        assert 1 <= len(key) <= p.MAX_KEY_BYTES
    return req


# -- strategies ----------------------------------------------------------------------------------------
odd = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=6)
                   | st.binary(max_size=6), lambda inner: st.lists(inner, max_size=3)
                   | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)
keys = st.binary(min_size=1, max_size=16)  # the wrong lengths: BAD_KEYS, now and then
BAD_KEYS = [b"", b"x" * (p.MAX_KEY_BYTES + 1)]
ttl = st.none() | st.floats() | st.integers(-5, 100)
FIELDS = {
    "hello": {"client_id": st.text(max_size=8), "protocol_version": st.integers(-1, 3),
              "prefers_shared_arena": st.booleans()},
    "get": {"key": keys, "model": st.text(max_size=4), "compat_key": st.text(max_size=4)},
    "batch_get": {"keys": st.lists(keys, max_size=3), "model": st.text(max_size=4)},
    "set": {"key": keys, "value": st.binary(max_size=64), "retention": st.sampled_from(["short", "long", "x", ""]),
            "model": st.text(max_size=4), "metadata": st.dictionaries(st.text(max_size=4), odd, max_size=2),
            "ttl_seconds": ttl},
    "batch_set": {"keys": st.lists(keys, max_size=3), "values": st.lists(st.binary(max_size=32), max_size=3),
                  "retentions": st.lists(st.sampled_from(["short", "long", "x"]), max_size=3),
                  "metadatas": st.lists(st.dictionaries(st.text(max_size=3), odd, max_size=2), max_size=3),
                  "ttls_seconds": st.none() | st.lists(ttl, max_size=3)},
    "set_reserve": {"size": st.integers(-2**63, 2**64 - 1)},
    "set_commit": {"lease_token": st.integers(-2**63, 2**64 - 1), "key": keys, "length": st.integers(-1, 2**40),
                   "retention": st.sampled_from(["default", "long", ""]), "ttl_seconds": st.floats()},
    "set_cancel": {"lease_token": st.integers(-2**63, 2**64 - 1)},
    "prefetch_hint": {"keys": st.lists(keys, max_size=3), "deadline_ms": st.integers(-2**63, 2**63 - 1)},
    "exists": {"keys": st.lists(keys, max_size=3)},
    "clear": {"model": st.text(max_size=4), "compat_key": st.text(max_size=4)},
    "stats": {},
}
assert set(FIELDS) == p.REQUEST_OPS


@st.composite
def request_bodies(draw) -> bytes:
    """A request map: a known op mostly, its fields typed right mostly, some left out, an unknown
    key now and then; encoded, and sometimes mutated on the wire. (The weights come from a seeded
    Random: hypothesis's own choices favour the last branch, which made a bad op the common case.)"""
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    r = rnd.random()
    op = draw(st.sampled_from(sorted(FIELDS))) if r < 0.85 else draw(st.text(max_size=6) if r < 0.92 else odd)
    fields = FIELDS.get(op, {}) if isinstance(op, str) else {}
    body = {"op": op} if rnd.random() < 0.95 else {}
    for name, strategy in fields.items():
        r = rnd.random()
        if r < 0.1:
            continue  # left out: a default, or a required field missing (bad_request)
        body[name] = draw(odd) if r < 0.13 else draw(strategy)
    if rnd.random() < 0.05 and ("key" in body or body.get("keys")):
        if "key" in body:
            body["key"] = rnd.choice(BAD_KEYS)
        else:
            body["keys"] = [*body["keys"], rnd.choice(BAD_KEYS)]
    if rnd.random() < 0.1:
        body[draw(st.text(max_size=5))] = draw(odd)  # unknown keys are ignored
    items = list(body.items())
    rnd.shuffle(items)  # "op" anywhere in the map
    data = msgspec.msgpack.encode(dict(items))
    if rnd.random() < 0.2:
        b = bytearray(data)
        i = rnd.randrange(len(b))
        how = rnd.choice(["flip", "cut", "insert"])
        if how == "flip":
            b[i] = draw(st.integers(0, 255))
        elif how == "cut":
            del b[i:]
        else:
            b[i:i] = draw(st.binary(min_size=1, max_size=3))
        data = bytes(b)
    return data


# -- the decoders --------------------------------------------------------------------------------------
@settings(max_examples=300)
@given(body=st.binary(max_size=80))
@example(body=DEEP_METADATA)
@example(body=DEEP_UNKNOWN)
@example(body=CUT_AFTER_A_TYPE_ERROR)
def test_requests_from_arbitrary_bytes(body):
    _decode(body)


@settings(max_examples=300)
@given(body=request_bodies())
def test_requests_structured(body):
    _decode(body)


@settings(max_examples=200)
@given(body=st.binary(max_size=80) | request_bodies())
@example(body=b"\x82\xa2op\xa9hello_ack\xa1x" + b"\x91" * 20_000 + b"\xc0")
def test_responses_from_arbitrary_bytes(body):
    try:
        resp = p.decode_response(body)
    except p.ProtocolError as e:
        assert e.code == p.BAD_FRAME
    else:
        assert isinstance(resp, p.Response.__args__)


@pytest.mark.parametrize("body, code", [
    (DEEP_METADATA, p.BAD_FRAME), (DEEP_UNKNOWN, p.BAD_FRAME), (CUT_AFTER_A_TYPE_ERROR, p.BAD_FRAME),
    (msgspec.msgpack.encode({"op": "get", "key": "text"})[:-2], p.BAD_FRAME),
    # a NaN TTL was stored as "never expires"
    (p.encode_body(p.Set(key=b"k", value=b"v", ttl_seconds=math.nan)), p.BAD_REQUEST),
    (p.encode_body(p.SetCommit(lease_token=1, key=b"k", length=1, ttl_seconds=math.nan)), p.BAD_REQUEST),
    (p.encode_body(p.BatchSet(keys=[b"k", b"l"], values=[b"v", b"w"], ttls_seconds=[1.0, math.nan])), p.BAD_REQUEST),
])
def test_bodies_that_escaped_get_codes(body, code):
    with pytest.raises(p.ProtocolError) as e:
        p.decode_request(body)
    assert e.value.code == code


# -- the daemon's connection loop ------------------------------------------------------------------------
def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


async def _talk(bodies: list[bytes], tail: bytes | None) -> None:
    """Serve one connection of a fresh daemon (RAM store, L3 region in a temp dir); send each body
    as a frame and read its answer; then ``tail`` (raw bytes: a bad length) if any; then a stats
    request, which must still be answered unless the connection was closed by design."""
    loop = asyncio.get_running_loop()
    with tempfile.TemporaryDirectory() as root:
        region = Tablespace(root, 1 << 20, container_bytes=1 << 20, slot_bytes=4096).open()
        service = KvdService(HostStore(64 * 1024), long_region=region, io_workers=2)
        service.start()
        server = KvdServer(service, root + "/unused.sock")
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        theirs.setblocking(False)
        task = loop.create_task(server._serve(theirs))
        try:
            for body in bodies:
                req = _decode(body)
                await loop.sock_sendall(ours, _frame(body))
                if isinstance(req, p.PrefetchHint):
                    continue  # fire-and-forget
                resp = p.decode_response(await asyncio.wait_for(p.read_frame(loop, ours), 10))
                if req is None:
                    assert isinstance(resp, p.Error) and resp.code in CODES, resp
                else:
                    assert not (isinstance(resp, p.Error) and resp.code == p.INTERNAL_ERROR), (req, resp)
            closed = False
            if tail is not None:
                await loop.sock_sendall(ours, tail)
                resp = p.decode_response(await asyncio.wait_for(p.read_frame(loop, ours), 10))
                assert isinstance(resp, p.Error)
                closed = resp.code == p.FRAME_TOO_LARGE
                assert resp.code == (p.FRAME_TOO_LARGE if closed else p.BAD_FRAME)
            if closed:
                await asyncio.wait_for(task, 10)  # the daemon hung up
                assert await loop.sock_recv(ours, 1) == b""
            else:
                await loop.sock_sendall(ours, p.encode_frame(p.Stats()))
                resp = p.decode_response(await asyncio.wait_for(p.read_frame(loop, ours), 10))
                assert isinstance(resp, p.StatsResponse)
                assert not task.done()
        finally:
            ours.close()
            await asyncio.wait_for(task, 10)  # ends with its peer (no exception: it swallows PeerClosed)
            await service.close()


TAILS = st.none() | st.sampled_from([_frame(b""), struct.pack(">I", p.MAX_FRAME_BYTES + 1)])


@settings(max_examples=60)
@given(bodies=st.lists(request_bodies() | st.binary(min_size=1, max_size=40), min_size=1, max_size=6), tail=TAILS)
@example(bodies=[DEEP_METADATA, CUT_AFTER_A_TYPE_ERROR, DEEP_UNKNOWN], tail=None)  # once: the connection died
def test_the_daemon_answers_every_frame(bodies, tail):
    asyncio.run(_talk(bodies, tail))


@settings(max_examples=40)
@given(ttls=st.lists(st.floats() | st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -1.0, 1e308]), min_size=1,
                     max_size=4),
       retention=st.sampled_from(["short", "long"]))
def test_odd_ttls_are_answered(ttls, retention):
    """Odd TTLs on both SET forms and both tiers (L3 write-through for ``long``): an answer each
    (a NaN one: bad_request)."""
    bodies = [p.encode_body(p.Set(key=b"k%d" % i, value=b"v", retention=retention, ttl_seconds=t))
              for i, t in enumerate(ttls)]
    bodies.append(p.encode_body(p.BatchSet(keys=[b"b%d" % i for i in range(len(ttls))], values=[b"v"] * len(ttls),
                                           retentions=[retention] * len(ttls), ttls_seconds=ttls)))
    bodies += [p.encode_body(p.Get(key=b"k0")), p.encode_body(p.Exists(keys=[b"k0", b"b0"]))]
    asyncio.run(_talk(bodies, None))
