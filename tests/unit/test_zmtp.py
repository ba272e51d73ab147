"""The ZMTP 3.0 SUB client (infera.transport.zmtp) against a real libzmq PUB's bytes
(tests/fixtures/zmtp/pub_session.bin), cut at every boundary, and against broken peers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from infera.kv.native import native
from infera.transport import zmtp
from infera.transport.zmtp import (GREETING, ZmtpError, ZmtpSubProtocol, command, message_frame, parse_endpoint,
                                   parse_properties, split)

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "zmtp"
SESSION = (FIX / "pub_session.bin").read_bytes()
EXPECTED = json.loads((FIX / "pub_session.json").read_text())
WANT = [[bytes.fromhex(f) for f in m] for m in EXPECTED["messages"]]
TOPIC = EXPECTED["topic"].encode()
PINGS = SESSION.count(b"\x04PING")
SPLITS = {"python": split, **({"native": native.zmtp_split} if native is not None else {})}


@pytest.fixture(autouse=True, params=sorted(SPLITS))
def splitter(request, monkeypatch):
    """Every test with each frame splitter: the C accelerator's and the Python one."""
    monkeypatch.setattr(zmtp, "_split", SPLITS[request.param])
    return SPLITS[request.param]


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.reading = True
        self.closing = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))

    def pause_reading(self) -> None:
        assert self.reading
        self.reading = False

    def resume_reading(self) -> None:
        assert not self.reading
        self.reading = True

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = self.aborted = True


def client(**kw) -> tuple[ZmtpSubProtocol, FakeTransport, list, list]:
    got, ready = [], []
    p = ZmtpSubProtocol(TOPIC, got.append, lambda: ready.append(True), **kw)
    t = FakeTransport()
    p.connection_made(t)
    return p, t, got, ready


def chunks(data: bytes, size: int):
    for i in range(0, len(data), size):
        yield data[i:i + size]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 10, 63, 64, 65, 200, 4096, len(SESSION)])
async def test_a_real_pub_session_cut_anywhere(size):
    p, t, got, ready = client()
    for piece in chunks(SESSION, size):
        p.data_received(piece)
    assert got == WANT and ready == [True] and not t.aborted
    # what the client said, in order: its greeting, READY (after the PUB's greeting), the
    # subscription (after the PUB's READY), a PONG for every PING
    assert t.written[0] == GREETING
    assert t.written[1] == command(b"READY", {b"Socket-Type": b"SUB"})
    assert t.written[2] == message_frame(b"\x01" + TOPIC)
    assert t.written[3:] == [b"\x04\x05\x04PONG"] * PINGS and PINGS > 0


@pytest.mark.parametrize("size", [1, 64, 100, len(SESSION)])
async def test_paused_before_the_handshake_still_subscribes_and_holds_the_messages(size):
    """Paused from the start (the subscriber's first contact waits on a replay): the handshake is
    read and answered, the subscription sent, and only then is reading paused; the messages wait
    for resume. Pausing the reads at once left the publisher without a subscription until resume."""
    p, t, got, ready = client()
    p.pause()
    assert t.reading  # the handshake still has to be read
    for piece in chunks(SESSION, size):
        if not t.reading:
            p._buf += piece  # what the kernel would hold until resume_reading
            continue
        p.data_received(piece)
    assert ready == [True] and t.written[2] == message_frame(b"\x01" + TOPIC)
    assert got == [] and not t.reading and not t.aborted
    p.resume()
    assert got == WANT and t.reading


async def test_pause_holds_delivery_and_resume_delivers_the_rest_in_order():
    got = []

    def on_message(frames):
        got.append(frames)
        if len(got) == 1:
            p.pause()  # the caller is busy after the first message

    p = ZmtpSubProtocol(TOPIC, on_message, lambda: None)
    t = FakeTransport()
    p.connection_made(t)
    p.data_received(SESSION)
    assert got == WANT[:1] and not t.reading
    p.resume()
    assert got == WANT and t.reading


@pytest.mark.parametrize("peer, why", [
    (b"GET / HTTP/1.1\r\n\r\n", "not a ZMTP peer"),
    (b"\xff" + bytes(8) + b"\x7f\x02\x00" + bytes(52), "ZMTP 2.0 peer"),
    (b"\xff" + bytes(8) + b"\x7f\x03\x01" + b"CURVE".ljust(20, b"\x00") + bytes(32), "CURVE security"),
    (SESSION[:64] + command(b"READY", {b"Socket-Type": b"ROUTER"}), "a ROUTER socket"),
    (SESSION[:64] + bytes([0x04, 11]) + b"\x05ERROR\x04nope", "ERROR: nope"),
    (SESSION[:64] + message_frame(b"early"), "before the handshake"),
    (SESSION[:64] + command(b"READY", {b"Socket-Type": b"PUB"}) + b"\x02" + (1 << 40).to_bytes(8, "big"),
     "a frame of 1099511627776 bytes"),
])
async def test_a_broken_or_foreign_peer_is_dropped(peer, why):
    p, t, got, _ = client()
    p.data_received(peer)
    assert t.aborted and got == []
    reason = p.closed.result()
    assert isinstance(reason, ZmtpError) and why in str(reason)


async def test_the_frame_limit_is_the_callers():
    p, t, got, _ = client(max_frame_bytes=100)
    p.data_received(SESSION)
    assert t.aborted and got == WANT[:1]  # the second message has a 768-byte frame
    assert "limit is 100" in str(p.closed.result())


def test_ready_properties():
    body = command(b"READY", {b"Socket-Type": b"PUB", b"Identity": b""})[2:]
    assert parse_properties(body[1 + body[0]:]) == {b"socket-type": b"PUB", b"identity": b""}
    with pytest.raises(ZmtpError):
        parse_properties(b"\x0bSocket-Type\x00\x00\x00\x09PUB")


@pytest.mark.parametrize("endpoint, want", [
    ("tcp://127.0.0.1:5557", ("tcp", "127.0.0.1", 5557)),
    ("tcp://engine-0.ns.svc:5557", ("tcp", "engine-0.ns.svc", 5557)),
    ("tcp://[::1]:5557", ("tcp", "::1", 5557)),
    ("ipc:///tmp/kv.sock", ("ipc", "/tmp/kv.sock", 0)),
])
def test_endpoints(endpoint, want):
    assert parse_endpoint(endpoint) == want


@pytest.mark.parametrize("endpoint", ["tcp://host", "tcp://:5557", "tcp://eth0;host:5557", "udp://h:1", "ipc://",
                                      "inproc://x", "tcp://h:port"])
def test_bad_endpoints(endpoint):
    with pytest.raises(ValueError):
        parse_endpoint(endpoint)


def test_the_splitters_agree_on_every_prefix_of_the_session():
    body = SESSION[64:]  # after the greeting
    for cut in range(len(body) + 1):
        want = split(body[:cut], 0, 1 << 20)
        if native is not None:
            assert native.zmtp_split(body[:cut], 0, 1 << 20) == want, cut
        items, ends, broken = want
        assert broken is None and (not ends or ends[-1] <= cut)


@pytest.mark.parametrize("stream, items, broken", [
    (b"", [], None),
    (b"\x01\x01a", [], None),  # a message's first frame, more to come
    (b"\x01\x01a\x00\x01b", [[b"a", b"b"]], None),
    (b"\x04\x02\x01X\x00\x00", [b"\x01X", [b""]], None),
    (b"\x02" + (3).to_bytes(8, "big") + b"abc", [[b"abc"]], None),
    (b"\x00\x01a\x01\x01b\x04\x01c", [[b"a"]], "a command among a message's frames"),
    (b"\x00\x01a\x02" + (99).to_bytes(8, "big"), [[b"a"]], "a frame of 99 bytes (the limit is 10)"),
])
def test_split_cases(stream, items, broken):
    for impl in SPLITS.values():
        got_items, ends, why = impl(stream, 0, 10)
        assert got_items == items and why == broken
        assert len(ends) == len(items)
