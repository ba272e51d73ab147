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
        want = split(body[:cut], 0, 1 << 20, 1 << 20, 16)
        if native is not None:
            assert native.zmtp_split(body[:cut], 0, 1 << 20, 1 << 20, 16) == want, cut
        items, ends, broken, partial = want
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
        got_items, ends, why, _ = impl(stream, 0, 10, 100, 8)
        assert got_items == items and why == broken
        assert len(ends) == len(items)


# -- bounded messages (issue 26, item 7) --------------------------------------------------------------

LIMITS = (10, 30, 4)  # max_frame, max_message (payload bytes), max_frames


@pytest.mark.parametrize("stream, items, broken", [
    (b"\x01\x0a" + b"a" * 10 + b"\x01\x0a" + b"b" * 10 + b"\x00\x0a" + b"c" * 10, [[b"a" * 10, b"b" * 10, b"c" * 10]],
     None),  # exactly the byte limit
    (b"\x01\x0a" + b"a" * 10 + b"\x01\x0a" + b"b" * 10 + b"\x00\x0b", [], "a frame of 11 bytes (the limit is 10)"),
    (b"\x00\x00" + b"\x01\x0a" + b"a" * 10 + b"\x01\x0a" + b"b" * 10 + b"\x01\x0a" + b"c" * 10 + b"\x01\x01", [[b""]],
     "a message of more than 30 bytes"),  # decided at the header: the body never arrived
    (b"\x01\x00" * 3 + b"\x00\x00", [[b""] * 4], None),  # exactly the frame limit
    (b"\x01\x00" * 4 + b"\x00", [], None),  # the 5th header is not whole yet: no verdict...
    (b"\x01\x00" * 4 + b"\x00\x00", [], "a message of more than 4 frames"),  # ...now it is
    (b"\x04\x0a" + b"X" * 10 + b"\x04\x0a" + b"Y" * 10 + b"\x04\x0a" + b"Z" * 10 + b"\x04\x00",
     [b"X" * 10, b"Y" * 10, b"Z" * 10, b""], None),  # commands are bounded by the frame limit alone
    (b"\x01\x01a\x06" + (1).to_bytes(8, "big") + b"b", [], "a command among a message's frames"),  # LONG|COMMAND
])
def test_split_message_limits(stream, items, broken):
    for impl in SPLITS.values():
        got, ends, why, _ = impl(stream, 0, *LIMITS)
        assert (got, why) == (items, broken) and len(ends) == len(items)


def test_split_resumes_an_incomplete_message_where_its_scan_stopped():
    """The partial state names the incomplete message at the end; passed back (offsets shifted by
    what the caller dropped), the next scan resumes after its whole frames: the same items and
    verdict as one scan of everything, each header read once (plus once when the message is
    collected)."""
    msg = [bytes([i]) * (i + 1) for i in range(6)]
    stream = b"\x04\x02\x01X" + b"".join(message_frame(f, more=i < 5) for i, f in enumerate(msg)) + b"\x00\x01z"
    for impl in SPLITS.values():
        first = impl(stream[:20], 0, 100, 1000, 10)
        # the command, then the message's frames 0..2 whole (2+1, 2+2, 2+3 bytes), frame 3 cut
        assert first == ([b"\x01X"], [4], None, (4, 16, 3, 6))
        buf, partial = bytearray(stream[4:]), (0, 12, 3, 6)  # the caller dropped the 4 bytes taken
        before = headers_read(impl)
        items, ends, why, out = impl(buf, 0, 100, 1000, 10, partial)
        after = headers_read(impl)
        assert (items, why, out) == ([msg, [b"z"]], None, None) and ends == [len(buf) - 3, len(buf)]
        # frames 3, 4, 5 scanned, the 6 collected, then b"z" scanned and collected: 11, not 6 + 11
        assert after - before == 3 + 6 + 2
        assert impl(buf, 0, 100, 1000, 10)[:3] == (items, ends, why)  # what one scan of it all finds
        with pytest.raises(ValueError):
            impl(buf, 0, 100, 1000, 10, (0, len(buf) + 1, 3, 6))  # a state that does not fit the buffer
        with pytest.raises(ValueError):
            impl(buf, 0, 100, 1000, 10, (0, 12, 0, 6))


def headers_read(impl) -> int:
    return zmtp._headers_read if impl is split else native.zmtp_headers_read()


def _handshaken(**kw):
    p, t, got, ready = client(**kw)
    p.data_received(SESSION[:64] + command(b"READY", {b"Socket-Type": b"PUB"}))
    assert ready == [True] and not t.aborted
    return p, t, got


@pytest.mark.parametrize("frame, cap, dropped_at, why", [
    (100, dict(max_message_bytes=10_000), 101, "a message of more than 10000 bytes"),
    (0, dict(max_message_frames=500), 501, "a message of more than 500 frames"),
])
async def test_a_message_that_never_ends_is_dropped_at_the_cap(frame, cap, dropped_at, why):
    """A publisher sets MORE on every frame, one frame a read: the connection is dropped at the
    header of the frame that passes the cap (not when memory runs out), with one reason naming
    only the limit, and the scan reads each header once, not the whole message again every read
    (quadratic: ~dropped_at**2 / 2 headers)."""
    p, t, got = _handshaken(**cap)
    before = zmtp.headers_read()
    for i in range(1, dropped_at + 1):
        assert not t.aborted, i
        p.data_received(message_frame(b"x" * frame, more=True))
    assert t.aborted and got == [] and str(p.closed.result()) == why
    assert zmtp.headers_read() - before == dropped_at  # each header once
    assert len(p._buf) <= dropped_at * (frame + 2)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64, 1000])
async def test_a_long_message_in_many_reads_is_scanned_once(chunk):
    """Linear work whatever the reads: a 3000-frame message cut into ``chunk``-byte reads reads
    each frame header at most once per read it spans plus once more to collect the frames."""
    frames = [bytes([i % 251]) * 5 for i in range(3000)]
    wire = b"".join(message_frame(f, more=i < len(frames) - 1) for i, f in enumerate(frames))
    p, t, got = _handshaken(max_message_frames=4096)
    before, reads = zmtp.headers_read(), 0
    for piece in chunks(wire, chunk):
        p.data_received(piece)
        reads += 1
    assert got == [frames] and not t.aborted and p._buf == b"" and p._partial is None
    work = zmtp.headers_read() - before
    assert work <= 2 * len(frames) + reads  # a rescan per read: ~len(frames) * reads / 2
    assert work >= 2 * len(frames)


async def test_the_default_caps():
    """64 MiB of payload per message, 4096 frames: at the header of the frame that passes either."""
    assert zmtp.DEFAULT_MAX_MESSAGE_BYTES == zmtp.DEFAULT_MAX_FRAME_BYTES == 64 << 20
    p, t, _ = _handshaken()
    mib = message_frame(b"\x00" * (1 << 20), more=True)
    for _ in range(64):
        p.data_received(mib)
    assert not t.aborted  # exactly 64 MiB so far: allowed
    p.data_received(mib[:9])  # the next frame's header alone
    assert t.aborted and str(p.closed.result()) == f"a message of more than {64 << 20} bytes"
    p, t, _ = _handshaken()
    p.data_received(message_frame(b"", more=True) * 4096)
    assert not t.aborted
    p.data_received(message_frame(b"", more=True))
    assert t.aborted and str(p.closed.result()) == "a message of more than 4096 frames"


async def test_the_drop_is_one_log_line_without_content(caplog):
    """Over a real loopback connection: a peer that never ends its message is dropped once the cap
    is passed, with one WARNING line (a repeat on the reconnection is DEBUG), the limit its only
    detail; the frames' bytes appear nowhere in the log."""
    import asyncio
    import logging

    from infera.transport.zmtp import ZmtpSubscription

    secret = b"SECRET-PROMPT-TEXT"
    conns, dropped = [], asyncio.Event()

    async def never_ending_pub(reader, writer):
        conns.append(writer)
        writer.write(SESSION[:64] + command(b"READY", {b"Socket-Type": b"PUB"}))
        await reader.readexactly(64)  # its greeting
        try:
            while True:
                writer.write(message_frame(secret * 10, more=True))
                await writer.drain()
                await asyncio.sleep(0)
        except (ConnectionError, OSError):
            pass
        finally:
            if len(conns) >= 2:
                dropped.set()

    server = await asyncio.start_server(never_ending_pub, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    caplog.set_level(logging.DEBUG, logger="infera.transport.zmtp")
    sub = ZmtpSubscription(f"tcp://127.0.0.1:{port}", b"", lambda frames: pytest.fail("delivered"),
                           reconnect_s=0.01, max_message_bytes=100_000)
    sub.start()
    try:
        await asyncio.wait_for(dropped.wait(), 10)  # dropped twice (the first, then its reconnection)
        await asyncio.wait_for(_until(lambda: sub.failures >= 2), 10)
    finally:
        await sub.close()
        server.close()
        await server.wait_closed()
    records = [r for r in caplog.records if r.name == "infera.transport.zmtp"]
    warnings = [r for r in records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "a message of more than 100000 bytes" in warnings[0].getMessage()
    assert len(records) == sub.failures  # one line a drop, none a frame
    assert all(secret.decode() not in r.getMessage() for r in records)


async def _until(cond, interval=0.01):
    import asyncio
    while not cond():
        await asyncio.sleep(interval)


async def test_a_connected_subscription_parks_no_task_and_reconnects_after_a_drop():
    """Connected, the subscription is followed by a callback, not a task (one per engine of a fleet);
    a dropped connection is made again after the backoff; close() stops it, retries included."""
    import asyncio

    from infera.transport.zmtp import ZmtpSubscription

    accepted: list[asyncio.StreamWriter] = []

    async def pub(reader, writer):
        accepted.append(writer)
        writer.write(SESSION[:64] + command(b"READY", {b"Socket-Type": b"PUB"}))
        await writer.drain()
        try:
            await reader.read()  # until the subscriber goes
        except (ConnectionError, OSError):
            pass

    server = await asyncio.start_server(pub, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sub = ZmtpSubscription(f"tcp://127.0.0.1:{port}", b"", lambda frames: None, reconnect_s=0.01)
    sub.start()
    try:
        await asyncio.wait_for(_until(lambda: sub.connected), 10)
        assert sub._task is None and sub._timer is None
        assert not any(t.get_name().startswith("zmtp-sub:") for t in asyncio.all_tasks())
        accepted[0].close()  # the publisher drops it: the subscription connects again
        await asyncio.wait_for(_until(lambda: sub.connects >= 2 and sub.connected), 10)
        assert sub.failures == 1 and len(accepted) == 2
        server.close()  # nothing to connect to any more: it keeps retrying, backing off
        accepted[1].close()
        await asyncio.wait_for(_until(lambda: sub.failures >= 3), 10)
    finally:
        await sub.close()
        server.close()
        await server.wait_closed()
    assert sub._timer is None and sub._task is None and sub.protocol is None
    failures = sub.failures
    await asyncio.sleep(0.1)
    assert sub.failures == failures  # closed: no retry ran after
