"""The lean NATS client against a real nats-server: messaging, no-responders, auth, reconnects
that restore subscriptions, and a dead peer noticed by PINGs."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from infera.transport.nats_core import NatsCoreClient, NatsError
from tests.conftest import NatsProcess, wait_for


def _collector():
    got: list[tuple[bytes, bytes, bytes, int]] = []
    return got, lambda subject, reply, data, status: got.append((subject, reply, data, status))


async def test_publish_subscribe_and_no_responders(nats_server):
    a = NatsCoreClient(nats_server.url, name="a")
    b = NatsCoreClient(nats_server.url, name="b")
    try:
        await a.start()
        await b.start()
        assert await a.wait_connected(5) and await b.wait_connected(5)
        got, cb = _collector()
        b.subscribe("core.test.>", cb)
        await b.flush()
        big = os.urandom(300_000)  # spans many socket reads
        for i in range(200):
            a.publish(b"core.test.%d" % i, b"m%d" % i, b"_INBOX.r.%d" % i)
        a.publish(b"core.test.big", big)
        await wait_for(lambda: len(got) == 201, 5, message="all messages delivered")
        assert got[:200] == [(b"core.test.%d" % i, b"_INBOX.r.%d" % i, b"m%d" % i, 0) for i in range(200)]
        assert got[200] == (b"core.test.big", b"", big, 0)
        # A request to a subject nobody serves: the broker answers on the reply subject, status 503.
        inbox = a.new_inbox()
        replies, rcb = _collector()
        a.subscribe(inbox + b".*", rcb)
        a.publish(b"core.nobody.here", b"x", inbox + b".1")
        await wait_for(lambda: replies, 5, message="a no-responders reply")
        assert replies == [(inbox + b".1", b"", b"", 503)]
        assert a.max_payload == nats_server.max_payload
    finally:
        await a.close()
        await b.close()


async def test_restart_restores_subscriptions_and_tells_listeners(own_nats_server):
    sub = NatsCoreClient(own_nats_server.url, reconnect_wait=0.1)
    pub = NatsCoreClient(own_nats_server.url, reconnect_wait=0.1)
    events: list[str] = []
    sub.on_disconnect(lambda: events.append("down"))
    sub.on_reconnect(lambda: events.append("up"))
    got, cb = _collector()
    try:
        sub.subscribe("restart.x", cb)  # before the first connect: goes out with CONNECT
        await sub.start()
        await pub.start()
        assert await sub.wait_connected(5) and await pub.wait_connected(5)
        await sub.flush()
        pub.publish(b"restart.x", b"1")
        await wait_for(lambda: len(got) == 1, 5)
        await asyncio.to_thread(own_nats_server.restart)
        await wait_for(lambda: events == ["down", "up"], 15, message="lost, then restored")
        assert sub.disconnects == 1
        await wait_for(lambda: pub.connected, 10)
        with pytest.raises(NatsError):
            NatsCoreClient(own_nats_server.url).publish(b"restart.x", b"never connected")
        await sub.flush()
        pub.publish(b"restart.x", b"2")
        await wait_for(lambda: len(got) == 2, 5, message="the subscription survived the restart")
        assert got[1][2] == b"2"
    finally:
        await sub.close()
        await pub.close()


async def test_credentials_in_the_url():
    broker = NatsProcess(extra_conf='authorization { user: "infera", password: "s3cret" }')
    broker.start()
    good = NatsCoreClient(f"nats://infera:s3cret@127.0.0.1:{broker.port}")
    bad = NatsCoreClient(f"nats://infera:wrong@127.0.0.1:{broker.port}", reconnect_wait=0.1)
    try:
        await good.start()
        await bad.start()
        assert await good.wait_connected(5)
        await good.flush()
        assert not await bad.wait_connected(1.0)  # refused: never reported as connected
    finally:
        await good.close()
        await bad.close()
        broker.cleanup()


async def test_a_frozen_broker_is_noticed_by_pings(own_nats_server):
    client = NatsCoreClient(own_nats_server.url, ping_interval=0.2, max_outstanding_pings=2, reconnect_wait=0.1)
    lost = asyncio.Event()
    client.on_disconnect(lost.set)
    try:
        await client.start()
        assert await client.wait_connected(5)
        os.kill(own_nats_server.proc.pid, signal.SIGSTOP)
        try:
            await asyncio.wait_for(lost.wait(), 5)  # 3 ping intervals, not a TCP timeout
            assert not client.connected
        finally:
            os.kill(own_nats_server.proc.pid, signal.SIGCONT)
        assert await client.wait_connected(10)
    finally:
        await client.close()
