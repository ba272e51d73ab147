"""Fuzzing the ZMTP SUB reader (issue 26, item 5): its frame splitter, C and Python, and its handshake.

For the splitter, arbitrary bytes and structure-aware streams (frames with every flag, short and long
sizes, then bits flipped, bytes overwritten, inserted or deleted, the stream cut short) under small
and large limits: the C and the Python splitter give the same items, ends, verdict and partial
state; fed in arbitrary chunks the way the reader feeds them (the partial state passed back, the
taken bytes dropped), they give what one scan of the whole stream gives, with work linear in the
stream (frame headers read, counted by the splitters, not timed).

For the reader (ZmtpSubProtocol on a fake transport), the greeting (signature, version, mechanism),
READY (property lists, socket types), PING, ERROR, other commands and messages, mutated and chunked:
data_received never raises; the peer is either still being waited on or dropped with a ZmtpError
reason; READY is acted on once; no message is delivered before it; and the outcome is the same
whatever the chunking and whichever splitter runs.

The suite's one hypothesis profile (tests/conftest.py) applies; each test sets only its examples.
"""
from __future__ import annotations

import asyncio
from unittest import mock

import pytest
from hypothesis import example, given, settings, strategies as st

from infera.kv.native import native
from infera.transport import zmtp
from infera.transport.zmtp import GREETING, ZmtpError, ZmtpSubProtocol, command, message_frame, split
from tests.fuzzing import mutated

SPLITS = {"python": split, **({"native": native.zmtp_split} if native is not None else {})}
# a libzmq PUB's greeting (tests/fixtures/zmtp/pub_session.bin): version 3.1, NULL, as-server 0
PUB_GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x01" + b"NULL".ljust(20, b"\x00") + bytes(32)


def headers_read(impl) -> int:
    return zmtp._headers_read if impl is split else native.zmtp_headers_read()


# -- strategies -----------------------------------------------------------------------------------------

limits = st.tuples(
    st.one_of(st.integers(0, 300), st.just(64 << 20), st.just(2**64 - 1)),  # max_frame
    st.one_of(st.integers(0, 1200), st.just(64 << 20), st.just(2**64 - 1)),  # max_message
    st.one_of(st.integers(0, 12), st.just(4096)),  # max_frames
)


@st.composite
def frames(draw) -> bytes:
    """One frame: mostly the flags a PUB sends (a last or a MORE frame, a command), short or long
    form (long also for small sizes, which ZMTP allows), sometimes any flags byte at all."""
    flags = draw(st.one_of(st.sampled_from([0x00, 0x01, 0x04, 0x05]), st.integers(0, 255)))
    body = draw(st.binary(max_size=300))
    if len(body) > 255 or draw(st.booleans()):
        return bytes([flags | 0x02]) + len(body).to_bytes(8, "big") + body
    return bytes([flags & ~0x02]) + bytes([len(body)]) + body


@st.composite
def streams(draw) -> bytes:
    structured = b"".join(draw(st.lists(frames(), max_size=10)))
    return draw(st.one_of(st.binary(max_size=400), st.just(structured), mutated(structured)))


chunkings = st.lists(st.integers(1, 80), min_size=1, max_size=8)  # read sizes, used in turn


def chunked(data: bytes, sizes: list[int]):
    i, k = 0, 0
    while i < len(data):
        yield data[i:i + sizes[k % len(sizes)]]
        i += sizes[k % len(sizes)]
        k += 1


# -- the splitter ---------------------------------------------------------------------------------------

def fed(impl, stream: bytes, sizes: list[int], lim: tuple) -> tuple[list, str | None, int, int, bytes]:
    """``stream`` through ``impl`` read by read, as the reader does: (items, verdict, calls, frame
    headers read, what is left unparsed)."""
    buf, partial, items, calls, before = bytearray(), None, [], 0, headers_read(impl)
    for piece in chunked(stream, sizes):
        buf += piece
        got, ends, why, partial = impl(buf, 0, *lim, partial)
        calls += 1
        items += got
        if why is not None:
            return items, why, calls, headers_read(impl) - before, bytes(buf)
        taken = ends[-1] if ends else 0
        del buf[:taken]
        if partial is not None:
            start, scan, nframes, size = partial
            partial = (start - taken, scan - taken, nframes, size)
            assert 0 <= start - taken <= scan - taken <= len(buf) and nframes >= 1 and 0 <= size <= scan - start
    return items, None, calls, headers_read(impl) - before, bytes(buf)


@settings(max_examples=400)
@given(stream=streams(), lim=limits, start=st.integers(0, 20))
@example(stream=b"\x06" + (1).to_bytes(8, "big") + b"x", lim=(10, 10, 4), start=0)  # LONG|COMMAND
@example(stream=b"\x02" + (2**64 - 1).to_bytes(8, "big"), lim=(2**64 - 1, 2**64 - 1, 4), start=0)  # no wrap
@example(stream=b"\x01\x05hello\x01\x05world\x01\x01", lim=(300, 10, 12), start=0)  # over the message cap
@example(stream=b"\x01\x00\x01\x00\x00\x00", lim=(300, 1200, 2), start=0)  # over the frame cap
@example(stream=b"\x01\x01a\x05\x00", lim=(300, 1200, 12), start=0)  # a command (with MORE) among frames
def test_the_splitters_agree_on_any_stream(stream, lim, start):
    start = min(start, len(stream))
    results = {name: impl(stream, start, *lim) for name, impl in SPLITS.items()}
    want = results["python"]
    assert all(r == want for r in results.values()), results
    items, ends, why, partial = want
    assert len(ends) == len(items) and ends == sorted(ends) and all(start < e <= len(stream) for e in ends)
    assert why is None or partial is None
    assert why is None or isinstance(why, str) and why.startswith(("a frame of", "a command", "a message of"))
    for bad in (len(stream) + 1, -1):
        for impl in SPLITS.values():
            with pytest.raises(ValueError):
                impl(stream, bad, *lim)


@settings(max_examples=300)
@given(stream=streams(), lim=limits, sizes=chunkings)
@example(stream=message_frame(b"x", more=True) * 40 + message_frame(b"end"), lim=(300, 1200, 64), sizes=[1])
@example(stream=b"\x01\x00" * 30, lim=(300, 1200, 12), sizes=[2, 3])  # the frame cap, read by read
def test_any_chunking_gives_what_one_scan_gives_in_linear_work(stream, lim, sizes):
    outcomes = {}
    for name, impl in SPLITS.items():
        whole_items, ends, whole_why, _ = impl(stream, 0, *lim)
        items, why, calls, work, left = fed(impl, stream, sizes, lim)
        assert (items, why) == (whole_items, whole_why)
        if why is None:
            assert left == stream[ends[-1] if ends else 0:]
        # each header is read once as it is scanned (a frame is at least 2 bytes), once more when
        # its message is collected, and the header of a frame still incomplete once a call
        assert work <= len(stream) + calls, (work, len(stream), calls)
        outcomes[name] = (items, why, calls, work)
    assert all(o == outcomes["python"] for o in outcomes.values())


# -- the handshake and the reader ---------------------------------------------------------------------

class Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.aborted

    def pause_reading(self) -> None:  # the reader pauses for a long burst only; not with _TURN_S patched
        raise AssertionError("paused")

    resume_reading = close = pause_reading

    def abort(self) -> None:
        self.aborted = True


@st.composite
def greetings(draw) -> bytes:
    """A libzmq PUB's greeting most of the time (so that the rest is reached), else a variant."""
    if draw(st.integers(0, 3)):
        return PUB_GREETING
    g = bytearray(PUB_GREETING)
    g[10:12] = bytes(draw(st.sampled_from([(3, 1), (3, 0), (2, 0), (4, 0), (1, 0)])))
    mechanism = draw(st.sampled_from([b"NULL", b"PLAIN", b"CURVE", b"", b"NULLX", b"null"]))
    g[12:32] = mechanism.ljust(20, b"\x00")
    g[32] = draw(st.sampled_from([0, 1]))  # as-server
    return draw(st.one_of(st.just(bytes(g)), mutated(bytes(g))))


socket_types = st.sampled_from([b"PUB", b"XPUB", b"SUB", b"ROUTER", b"pub", b""])
prop_names = st.one_of(st.sampled_from([b"Socket-Type", b"socket-type", b"Identity", b"X-Other"]),
                       st.binary(max_size=12))


@st.composite
def commands(draw) -> bytes:
    kind = draw(st.sampled_from(["ready", "ready", "ready-raw", "ping", "error", "other", "message", "frame"]))
    if kind == "ready":
        props = draw(st.dictionaries(prop_names, st.binary(max_size=12), max_size=3))
        props[draw(st.sampled_from([b"Socket-Type", b"SOCKET-TYPE"]))] = draw(socket_types)
        return command(b"READY", props)
    if kind == "ready-raw":  # a property list that may be truncated anywhere
        body = b"\x05READY" + draw(st.binary(max_size=40))
        return bytes([0x04, len(body)]) + body
    if kind == "ping":  # TTL and context (ZMTP 3.1), possibly short
        body = b"\x04PING" + draw(st.binary(max_size=10))
        return bytes([0x04, len(body)]) + body
    if kind == "error":
        body = b"\x05ERROR" + draw(st.binary(max_size=20))
        return bytes([0x04, len(body)]) + body
    if kind == "other":
        name = draw(st.binary(max_size=8))
        body = bytes([draw(st.integers(0, 255))]) + name + draw(st.binary(max_size=10))
        return bytes([0x04, len(body)]) + body
    if kind == "message":
        parts = draw(st.lists(st.binary(max_size=40), min_size=1, max_size=3))
        return b"".join(message_frame(p, more=i < len(parts) - 1) for i, p in enumerate(parts))
    return draw(frames())


@st.composite
def sessions(draw) -> bytes:
    """A greeting, mostly a PUB's READY first, then commands and messages; as they are, mutated
    after the greeting, mutated anywhere, or arbitrary bytes."""
    greeting = draw(greetings())
    first = draw(st.sampled_from([b"PUB", b"PUB", b"XPUB", None]))
    tail = (command(b"READY", {b"Socket-Type": first}) if first else b"") + b"".join(
        draw(st.lists(commands(), max_size=6)))
    mode = draw(st.sampled_from(["clean", "clean", "tail", "tail", "anywhere", "bytes"]))
    if mode == "clean":
        return greeting + tail
    if mode == "tail":
        return greeting + draw(mutated(tail))
    if mode == "anywhere":
        return draw(mutated(greeting + tail))
    return draw(st.binary(max_size=200))


def run_reader(impl, stream: bytes, sizes: list[int] | None) -> tuple:
    """The reader on ``stream`` (in reads of ``sizes``, or whole): what it delivered, said and decided."""

    async def main() -> tuple:
        got, ready = [], []

        def on_message(frames):
            assert p._ready, "a message before READY"
            got.append(frames)

        p = ZmtpSubProtocol(b"", on_message, lambda: ready.append(1), max_frame_bytes=200, max_message_bytes=300,
                            max_message_frames=4)
        t = Transport()
        p.connection_made(t)
        for piece in (chunked(stream, sizes) if sizes else [stream]):
            if t.aborted:
                break  # a transport reads no more after abort
            p.data_received(piece)
        assert len(ready) <= 1
        if t.aborted:
            reason = p.closed.result()
            assert isinstance(reason, ZmtpError) and str(reason)
            # one log line, bounded: what the peer said is escaped and cut
            assert str(reason).isprintable() and len(str(reason)) < 200
            return got, ready, t.written, str(reason)
        assert not p.closed.done()
        return got, ready, t.written, None

    with mock.patch.object(zmtp, "_split", impl), mock.patch.object(zmtp, "_TURN_S", 1e9):
        return asyncio.run(main())


@settings(max_examples=250)
@given(stream=sessions(), sizes=chunkings)
@example(stream=PUB_GREETING + b"\x04\x0a\x05READY\x0bS", sizes=[1])  # a property cut in its name
@example(stream=PUB_GREETING + b"\x04\x12\x05READY\x0bSocket-Type\x00", sizes=[64, 1])  # ...in its size
@example(stream=PUB_GREETING + command(b"READY", {b"Socket-Type": b"PUB"}) * 2 + message_frame(b"m"), sizes=[7])
@example(stream=PUB_GREETING + command(b"READY", {b"Socket-Type": b"PUB"}) + b"\x04\x05\x04PING", sizes=[3])
@example(stream=PUB_GREETING + b"\x04\x00", sizes=[80])  # an empty command
@example(stream=PUB_GREETING + command(b"READY", {b"Socket-Type": b"PUB"}) + bytes([0x04, 45]) + b"\x04PING\x00\x01"
         + b"c" * 38, sizes=[80])  # a context over 16 bytes
@example(stream=b"\xff" + bytes(8) + b"\x7e" + PUB_GREETING[10:], sizes=[5])  # the signature's last bit
@example(stream=PUB_GREETING + command(b"READY", {b"Socket-Type": b"P\nUB" * 100}), sizes=[80])  # a long, odd type
@example(stream=PUB_GREETING + bytes([0x04, 13]) + b"\x05ERROR\x06\nfake\r", sizes=[80])  # a newline in a reason
@example(stream=PUB_GREETING + b"\x06" + (262).to_bytes(8, "big") + b"\x05ERROR\xff" + b"\xfe" * 255, sizes=[80])  # escaped 6x
@example(stream=PUB_GREETING + b"\x04\x05\x04PING" + command(b"READY", {b"Socket-Type": b"PUB"}), sizes=[1])  # PING first
def test_the_handshake_on_any_bytes(stream, sizes):
    whole = {name: run_reader(impl, stream, None) for name, impl in SPLITS.items()}
    assert all(w == whole["python"] for w in whole.values())
    for impl in SPLITS.values():
        assert run_reader(impl, stream, sizes) == whole["python"]
    got, ready, written, reason = whole["python"]
    assert written[0] == GREETING
    if ready:  # READY answered, the subscription sent, each PING ponged (its context, 16 bytes at most)
        assert written[1] == command(b"READY", {b"Socket-Type": b"SUB"}) and written[2] == message_frame(b"\x01")
        assert all(w[0] == 0x04 and w[2:7] == b"\x04PONG" and w[1] == len(w) - 2 <= 5 + 16 for w in written[3:])
    assert ready or not got
