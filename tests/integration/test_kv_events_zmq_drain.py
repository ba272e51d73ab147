"""The ZMQ subscriber reads batches on its ZMTP connection (infera.transport.zmtp) against real
libzmq publishers: a burst arrives whole and in order without holding the loop, batches read while
the task waits (first contact, a gap's replay) neither spin the loop nor get lost, heartbeats are
answered, a publisher that goes away is reconnected, and one that wants CURVE is refused clearly."""
from __future__ import annotations

import array
import asyncio
import fcntl
import gc
import termios
import time

import pytest

from infera.transport.kv_events_zmq import ZmqKvEventSubscriber
from tests.conftest import wait_for
from tests.integration.test_kv_events_zmq import TOPIC, Sink, TinyPublisher

pytestmark = pytest.mark.integration


def zmtp_bytes(*frames: bytes) -> int:
    """Bytes a multipart message takes on a ZMTP 3 connection (flags + short/long size + body)."""
    return sum((2 if len(f) < 256 else 9) + len(f) for f in frames)


def unread_bytes(conn) -> int:
    """Bytes waiting in the kernel's receive queue of a ZmtpSubscription's connection (FIONREAD)."""
    sock = conn.protocol.transport.get_extra_info("socket")
    count = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, count)
    return count[0]


class Reads:
    """Counts the reads the event loop hands a connection's protocol (calls, bytes): the reader's
    own work, whatever else this process (libzmq's I/O threads, the publisher) spends CPU on."""

    def __init__(self, protocol) -> None:
        self.calls = 0
        self.bytes = 0
        inner = protocol.data_received

        def data_received(data: bytes) -> None:
            self.calls += 1
            self.bytes += len(data)
            inner(data)

        protocol.data_received = data_received  # the transport looks it up on the instance, per read


async def loop_turns(n: int) -> None:
    """Let the loop run ``n`` iterations. Each one polls the selector: a reader left registered on
    a readable FD would be called every time (a spin), however fast or slow the box is."""
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.fixture
async def sub_and_sink():
    sink = Sink()
    # The slow-replay test answers ~0.8 s late on purpose; on a loaded box (a CI run beside other
    # work) its setup took the rest of 2 s once and the subscriber gave up on the replay.
    sub = ZmqKvEventSubscriber(sink.on_batch, sink.on_reset, replay_timeout=10.0)
    sink.sub = sub
    await sub.start()
    yield sub, sink
    await sub.stop()


async def test_a_burst_arrives_in_order_without_holding_the_loop(sub_and_sink, monkeypatch):
    sub, sink = sub_and_sink
    # The burst must reach the SUB whole: at ZMQ's default high-water mark (1000) a PUB on a box
    # busy with other work drops part of it (1 run in ~10 with a core kept busy: seqs 1000-1131
    # lost, a gap, a reset), which is not what this test is about.
    p = TinyPublisher(replay=False, sndhwm=100_000)
    try:
        sub.add("w", p.endpoint)
        await p.subscribed()
        p.batch(0)
        await wait_for(lambda: sink.seqs("w") == [0], 10, message="the first batch")
        gaps: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0)
                gaps.append(time.perf_counter() - t)

        # What is measured is the drain's turn-taking, not the collector: a full collection of a
        # heap grown by the thousands of tests before this one in the same process takes ~300 ms.
        gc.collect()
        gc.freeze()
        task = asyncio.create_task(ticker())
        n = 20_000
        for seq in range(1, n + 1):
            p.batch(seq)
            if seq % 500 == 0:
                await asyncio.sleep(0)  # let the PUB flush: under its high-water mark
        await wait_for(lambda: len(sink.seqs("w")) == n + 1, 30, message="the burst")
        stop.set()
        await task
        assert sink.seqs("w") == list(range(n + 1)) and sink.resets == []
        assert sub.stats("w")["gaps"] == 0
        assert max(gaps) < 0.25, f"the loop was held for {max(gaps) * 1000:.0f} ms"
    finally:
        gc.unfreeze()
        await p.close()


async def test_batches_queued_during_a_slow_replay_wait_without_spinning(sub_and_sink):
    """First contact replays the history through a ROUTER that answers late; meanwhile live
    batches queue on the SUB. The FD callback must leave them (the replay comes first) without
    the loop spinning on a readable FD, and they follow the replay in order."""
    sub, sink = sub_and_sink
    p = TinyPublisher(replay=False)
    import zmq

    router = p.ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    replay = router.getsockopt_string(zmq.LAST_ENDPOINT)
    for seq in range(3):
        p.batch(seq, send=False)  # history only the replay has
    try:
        sub.add("w", p.endpoint, replay)
        ident, _, start = await asyncio.wait_for(router.recv_multipart(), 10)
        await p.subscribed()
        conn = sub._keys["w"].conn
        reads = Reads(conn.protocol)
        for seq in range(3, 10):
            p.batch(seq)  # live, queued behind the replay
        live = sum(zmtp_bytes(TOPIC, seq.to_bytes(8, "big"), p.buffer[seq]) for seq in range(3, 10))
        # The barrier: every byte of them has reached the SUB (read, or waiting in its socket).
        await wait_for(lambda: reads.bytes + unread_bytes(conn) >= live, 10, message="the live batches at the SUB")
        calls = reads.calls
        await loop_turns(1000)  # the replay is late: a thousand chances to spin on the readable socket
        assert reads.calls - calls <= 1, f"{reads.calls - calls} reads in 1000 loop turns: the loop spun"
        assert sink.seqs("w") == []
        for seq in range(int.from_bytes(start, "big"), 3):
            await router.send_multipart([ident, b"", TOPIC, seq.to_bytes(8, "big"), p.buffer[seq]])
        await router.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])
        await wait_for(lambda: len(sink.seqs("w")) == 10, 10, message="history then the live batches")
        assert sink.seqs("w") == list(range(10)) and sink.resets == []
    finally:
        router.close(0)
        await p.close()



async def test_heartbeats_are_answered_and_the_connection_stays():
    """A PUB with ZMQ_HEARTBEAT_IVL PINGs its peers (a 3.0 peer too) and drops one that does not
    answer within ZMQ_HEARTBEAT_TIMEOUT."""
    import zmq

    sink = Sink()
    sub = ZmqKvEventSubscriber(sink.on_batch, sink.on_reset)
    sink.sub = sub
    await sub.start()
    p = TinyPublisher(replay=False)
    p.pub.setsockopt(zmq.HEARTBEAT_IVL, 30)
    p.pub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 100)
    try:
        sub.add("w", p.endpoint)
        await p.subscribed()
        for seq in range(10):
            p.batch(seq)
            await asyncio.sleep(0.1)  # 1 s: ten heartbeat timeouts
        await wait_for(lambda: sink.seqs("w") == list(range(10)), 10, message="every batch")
        conn = sub._keys["w"].conn
        assert conn.connects == 1 and conn.failures == 0 and sink.resets == []
    finally:
        await p.close()
        await sub.stop()


async def test_a_publisher_that_goes_away_is_reconnected():
    import zmq
    import zmq.asyncio

    from tests.conftest import free_port

    sink = Sink()
    sub = ZmqKvEventSubscriber(sink.on_batch, sink.on_reset)
    sink.sub = sub
    await sub.start()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.asyncio.Context()

    async def publisher():
        pub = ctx.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(endpoint)
        assert await asyncio.wait_for(pub.recv(), 10) == b"\x01" + TOPIC  # subscribed
        return pub

    try:
        sub.add("w", endpoint)
        pub = await publisher()
        await pub.send_multipart([TOPIC, (0).to_bytes(8, "big"), b"\x93\xcb" + bytes(8) + b"\x90\x00"])
        await wait_for(lambda: sink.seqs("w") == [0], 10, message="the first batch")
        pub.close(0)  # the engine goes away
        await wait_for(lambda: not sub.stats("w")["connected"], 5, message="the connection noticed")
        pub = await publisher()  # and comes back on the same endpoint
        await pub.send_multipart([TOPIC, (0).to_bytes(8, "big"), b"\x93\xcb" + bytes(8) + b"\x90\x00"])
        # a restarted engine starts its seqs over: a restart (the view reset), then its batch
        await wait_for(lambda: sink.seqs("w") == [0, 0], 10, message="the restarted engine's batch")
        assert sub.stats("w")["connected"] and sub._keys["w"].conn.connects == 2
        assert sink.resets == ["w"]
        pub.close(0)
    finally:
        await sub.stop()
        ctx.destroy(linger=0)


async def test_a_curve_publisher_is_refused_with_a_clear_log(caplog):
    import logging

    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    public, secret = zmq.curve_keypair()
    pub.curve_secretkey, pub.curve_publickey, pub.curve_server = secret, public, True
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sink = Sink()
    sub = ZmqKvEventSubscriber(sink.on_batch, sink.on_reset)
    await sub.start()
    try:
        with caplog.at_level(logging.WARNING, logger="infera.transport.zmtp"):
            sub.add("w", f"tcp://127.0.0.1:{port}")
            await wait_for(lambda: sub._keys["w"].conn.failures >= 2, 10, message="two refusals")
        # (libzmq hangs up without finishing its greeting: the mechanism cannot be read off it)
        refusals = [r.getMessage() for r in caplog.records if "CURVE" in r.getMessage()]
        assert len(refusals) == 1 and "only NULL is supported" in refusals[0]  # logged once, retried quietly
        assert not sub.stats("w")["connected"] and sink.batches == []
    finally:
        await sub.stop()
        pub.close(0)
        ctx.destroy(linger=0)


async def test_a_paused_subscription_still_subscribes_and_holds_delivery():
    """Paused from the start (as during a first-contact replay), the connection still completes
    its handshake and subscribes, so the publisher keeps what it publishes meanwhile; delivery
    waits for resume. (It used to stop reading altogether: no subscription until resume, and the
    slow-replay test above deadlocked on its wait for the subscription ~1 run in 5.)"""
    from infera.transport.zmtp import ZmtpSubscription

    p = TinyPublisher(replay=False)
    got: list[list[bytes]] = []
    conn = ZmtpSubscription(p.endpoint, TOPIC, got.append)
    conn.pause()
    conn.start()
    try:
        await p.subscribed()
        await wait_for(lambda: conn.connected, 5, message="the handshake completed while paused")
        reads = Reads(conn.protocol)
        p.batch(0)
        size = zmtp_bytes(TOPIC, (0).to_bytes(8, "big"), p.buffer[0])
        await wait_for(lambda: reads.bytes + unread_bytes(conn) >= size, 5, message="the batch at the SUB")
        calls = reads.calls
        await loop_turns(1000)  # it is there to be read: a paused connection delivers nothing
        assert got == [] and reads.calls - calls <= 1
        conn.resume()
        await wait_for(lambda: len(got) == 1, 5, message="the held batch after resume")
        assert got[0][1] == (0).to_bytes(8, "big")
    finally:
        await conn.close()
        await p.close()
