"""Per-tenant limits shared by replicas (infera/server/tenant_limits.py): the sliding window, each
limit's 429 with its headers, the acknowledged grants that bound R replicas' overshoot to R − 1
(whatever the delays, joins and crashes), peers that expire or say bye, and the tokens a reply reports."""
from __future__ import annotations

import asyncio
import random

import pytest

from infera.api.errors import ApiError
from infera.server.tenant_limits import (LimitsMsg, TenantLimit, TenantLimiter, UsageMeter, _Window, _decode, _encode,
                                         reply_tokens)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Bus:
    """An in-memory replica-sync side channel between limiters."""

    def __init__(self) -> None:
        self.receivers: list = []
        self.up = True

    def channel(self):
        bus = self

        class Channel:
            replica_id = None

            def add_side_channel(self, name, receive):
                bus.receivers.append(receive)
                return "infera.replicas.~" + name

            async def publish_side(self, subject, data):
                if not bus.up:
                    return False
                for r in bus.receivers:
                    r(data)
                return True
        return Channel()


def sync(*limiters: TenantLimiter) -> None:
    """One report period: every limiter reports, every other hears it."""
    for lim in limiters:
        data = _encode(lim.report())
        for other in limiters:
            other.receive(data)


def test_window_slides_by_the_second():
    w = _Window()
    w.add(100, 3)
    w.add(130, 2)
    assert w.total == 5 and w.oldest_age(130) == 30
    w.advance(160)
    assert w.total == 2 and w.oldest_age(160) == 30  # the second-100 bucket left the 60 s window
    w.advance(500)
    assert w.total == 0 and w.oldest_age(500) is None


async def test_requests_per_minute_one_replica():
    clock = Clock()
    lim = TenantLimiter(clock=clock)
    limit = TenantLimit(requests_per_minute=3)
    for _ in range(3):
        (await lim.admit("a", limit)).finish(None)
    with pytest.raises(ApiError) as err:
        await lim.admit("a", limit)
    e = err.value
    assert e.status == 429 and e.code == "rate_limit_exceeded"
    assert e.headers["x-ratelimit-limit-requests"] == "3" and e.headers["x-ratelimit-remaining-requests"] == "0"
    assert e.headers["Retry-After"] == "60" and e.headers["x-ratelimit-reset-requests"] == "60s"
    (await lim.admit("b", limit)).finish(None)  # another tenant has its own window
    clock.t += 20
    with pytest.raises(ApiError) as err:
        await lim.admit("a", limit)
    assert err.value.headers["Retry-After"] == "40"  # the first requests leave the window in 40 s
    clock.t += 41
    await lim.admit("a", limit)
    assert lim.refused == {("a", "requests"): 2}
    assert lim.grant_waits == 0  # alone: every grant is usable at once


async def test_concurrency_is_released_when_the_reply_ends():
    lim = TenantLimiter(clock=Clock())
    limit = TenantLimit(max_concurrent=2)
    first, second = await lim.admit("a", limit), await lim.admit("a", limit)
    with pytest.raises(ApiError) as err:
        await lim.admit("a", limit)
    assert err.value.headers["Retry-After"] == "1"
    first.finish(None)
    first.finish(None)  # once only
    third = await lim.admit("a", limit)
    with pytest.raises(ApiError):
        await lim.admit("a", limit)
    second.finish(None), third.finish(None)


async def test_tokens_per_minute_counts_what_replies_reported():
    clock = Clock()
    lim = TenantLimiter(clock=clock)
    limit = TenantLimit(tokens_per_minute=100)
    (await lim.admit("a", limit)).finish(60)
    (await lim.admit("a", limit)).finish(60)  # admitted while under: the slack is what was in flight
    with pytest.raises(ApiError) as err:
        await lim.admit("a", limit)
    assert err.value.headers["x-ratelimit-limit-tokens"] == "100" and "tokens per minute" in err.value.message
    clock.t += 61
    await lim.admit("a", limit)


async def take_all(lim: TenantLimiter, tenant: str, limit: TenantLimit, *others: TenantLimiter) -> int:
    """Admit until refused, delivering reports between the replicas whenever a grant waits."""
    n = 0
    while True:
        task = asyncio.ensure_future(lim.admit(tenant, limit))
        for _ in range(3):
            await asyncio.sleep(0)
            if task.done():
                break
            sync(lim, *others)
        try:
            (await task).finish(None)
            n += 1
        except ApiError:
            return n


async def test_a_grant_waits_for_every_live_peer_to_hear_it():
    clock = Clock()
    a, b = TenantLimiter(clock=clock, replica_id="a"), TenantLimiter(clock=clock, replica_id="b")
    sync(a, b)
    limit = TenantLimit(requests_per_minute=10)
    task = asyncio.ensure_future(a.admit("t", limit))
    await asyncio.sleep(0)
    assert not task.done() and a._own["t"].pending == 1  # one waiting: a grant of one, unheard yet
    data = _encode(a.report())
    assert _decode(data).asks == a._own["t"].pending_seq  # the report asks to be answered
    b.receive(data)
    assert b._peers[a.replica_id].tenants["t"].reserved == 1  # b counts it before a may use it
    a.receive(_encode(b.report()))  # b's acknowledgement
    permit = await asyncio.wait_for(task, 1)
    assert permit.tenant == "t" and a.grant_waits == 1


async def test_replicas_share_the_limit_and_overshoot_at_most_r_minus_1():
    clock = Clock()
    replicas = [TenantLimiter(clock=clock, replica_id=f"r{i}") for i in range(3)]
    limit = TenantLimit(requests_per_minute=100)
    sync(*replicas)  # they know each other (empty reports are heartbeats)
    admitted = 0
    for period in range(40):  # every replica takes all it can, 0.1 s apart
        for lim in replicas:
            admitted += await take_all(lim, "a", limit, *[r for r in replicas if r is not lim])
        sync(*replicas)
        clock.t += 0.1
    assert 100 <= admitted <= 100 + len(replicas) - 1


def test_without_sync_each_replica_alone_would_allow_its_own_limit():
    """The failure the sync prevents: replicas that do not hear each other admit R × the limit."""
    clock = Clock()
    a, b = TenantLimiter(clock=clock, replica_id="a"), TenantLimiter(clock=clock, replica_id="b")
    limit = TenantLimit(requests_per_minute=10)
    n = 0
    for lim in (a, b):
        for _ in range(20):
            try:
                asyncio.run(lim.admit("t", limit))
                n += 1
            except ApiError:
                pass
    assert n == 20


async def test_a_silent_or_stopped_peer_keeps_its_minute():
    clock = Clock()
    a, b = TenantLimiter(clock=clock, replica_id="a"), TenantLimiter(clock=clock, replica_id="b")
    limit = TenantLimit(requests_per_minute=4)
    for _ in range(4):
        await b.admit("t", limit)  # alone yet: b's grants need no acknowledgement
    sync(a, b)
    with pytest.raises(ApiError):  # b used the whole minute
        await a.admit("t", limit)
    clock.t += 3.5  # b silent past the peer timeout: no longer waited for, but its minute still counts
    assert a._live_peers(clock()) == []
    with pytest.raises(ApiError) as err:
        await a.admit("t", limit)
    assert err.value.headers["x-ratelimit-remaining-requests"] == "0"
    clock.t += 60 + 5 - 3.5 - 0.5
    with pytest.raises(ApiError):  # b was last heard 64.5 s ago: a grant used 5 s after is still in the window
        await a.admit("t", limit)
    clock.t += 1
    await a.admit("t", limit)  # b's requests left every window
    sync(a, b)
    assert [p for p in a._live_peers(clock())]
    a.receive(_encode(LimitsMsg(2, b.replica_id, bye=True)))
    assert a._live_peers(clock()) == []
    a.receive(b"\x01garbage")
    assert a.decode_errors == 1


async def test_a_restarted_replica_is_a_new_one():
    first, second = TenantLimiter(replica_id="r"), TenantLimiter(replica_id="r")
    assert first.replica_id != second.replica_id and first.replica_id.startswith("r.")


async def test_older_reports_do_not_replace_newer_ones():
    clock = Clock()
    a, b = TenantLimiter(clock=clock, replica_id="a"), TenantLimiter(clock=clock, replica_id="b")
    await b.admit("t", TenantLimit(requests_per_minute=10))
    old = _encode(b.report())
    await b.admit("t", TenantLimit(requests_per_minute=10))
    a.receive(_encode(b.report()))
    a.receive(old)  # late: a keeps the newer view
    assert a._peers[b.replica_id].tenants["t"].requests == 2


async def test_the_sync_task_publishes_over_the_channel_and_says_bye():
    bus = Bus()
    a = TenantLimiter(bus.channel(), replica_id="a", sync_s=0.01)
    b = TenantLimiter(bus.channel(), replica_id="b", sync_s=0.01)
    a.start(), b.start()
    limit = TenantLimit(requests_per_minute=5)
    deadline = asyncio.get_running_loop().time() + 5
    while not (a._live_peers(a.clock()) and b._live_peers(b.clock())):
        assert asyncio.get_running_loop().time() < deadline, "the replicas never heard each other"
        await asyncio.sleep(0.01)
    for _ in range(5):
        await a.admit("t", limit)
    while b._peers[a.replica_id].tenants.get("t") is None or b._peers[a.replica_id].tenants["t"].requests < 5:
        assert asyncio.get_running_loop().time() < deadline, "b never heard a's usage"
        await asyncio.sleep(0.01)
    with pytest.raises(ApiError):
        await b.admit("t", limit)
    await a.stop()
    assert a.replica_id not in b._peers  # a's bye
    await b.stop()


class DelayBus:
    """Every message reaches every other limiter after its own random delay (so out of order too)."""

    def __init__(self, rng: random.Random, max_delay_s: float) -> None:
        self.rng, self.max_delay_s = rng, max_delay_s
        self.receivers: dict[int, object] = {}
        self.dead: set[int] = set()

    def channel(self, index: int):
        bus = self

        class Channel:
            replica_id = f"r{index}"

            def add_side_channel(self, name, receive):
                bus.receivers[index] = receive
                return "infera.replicas.~" + name

            async def publish_side(self, subject, data):
                if index in bus.dead:
                    return False
                loop = asyncio.get_running_loop()
                for other, receive in list(bus.receivers.items()):
                    if other != index:
                        loop.call_later(bus.rng.uniform(0, bus.max_delay_s), receive, data)
                return True
        return Channel()


@pytest.mark.parametrize("seed", range(4))
async def test_random_delays_joins_and_crashes_never_pass_limit_plus_r_minus_1(seed):
    """The bound holds whatever the delays: 3 replicas (one joins late, one crashes without a bye),
    messages delayed up to 3 report periods and reordered, 8 clients hammering each replica."""
    rng = random.Random(seed)
    bus = DelayBus(rng, max_delay_s=0.03)
    limit = TenantLimit(requests_per_minute=40)
    make = lambda i: TenantLimiter(bus.channel(i), sync_s=0.01, peer_timeout_s=0.2, grant_ttl_s=0.3, warmup_s=0.1)  # noqa: E731
    replicas = [make(0), make(1)]
    for lim in replicas:
        lim.start()
    admitted = [0, 0, 0]
    stop = asyncio.Event()

    async def client(i: int) -> None:
        while not stop.is_set():
            lim = replicas[i]
            if i in bus.dead:
                return
            try:
                (await lim.admit("t", limit)).finish(None)
                admitted[i] += 1
            except ApiError:
                pass
            await asyncio.sleep(rng.uniform(0, 0.004))

    tasks = [asyncio.ensure_future(client(i)) for i in (0, 1) for _ in range(8)]
    await asyncio.sleep(0.15)
    replicas.append(make(2))
    replicas[2].start()
    tasks += [asyncio.ensure_future(client(2)) for _ in range(8)]
    await asyncio.sleep(0.15)
    bus.dead.add(1)  # r1 crashes: no more reports, no bye
    await replicas[1].stop()
    await asyncio.sleep(0.5)
    stop.set()
    await asyncio.gather(*tasks)
    for lim in (replicas[0], replicas[2]):
        await lim.stop()
    total = sum(admitted)
    assert total <= 40 + 3 - 1, admitted
    assert total >= 30, admitted  # and the limit is not starved by the waits


@pytest.mark.parametrize("data, tokens", [
    (b'{"usage": {"prompt_tokens": 5, "total_tokens": 12}}', 12),
    (b'data: {"usage": null}\n\ndata: {"usage": {"total_tokens": 7}}\n\ndata: [DONE]\n\n', 7),
    (b'{"usage": {"total_tokens": null}}', None),
    (b"", None), (None, None),
])
def test_reply_tokens(data, tokens):
    assert reply_tokens(data) == tokens


def test_usage_meter_prefers_usage_and_else_counts_chunks():
    m = UsageMeter()
    for chunk in (b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n'):
        m.feed(chunk)
    assert m.tokens() == 2
    m.feed(b'data: {"usage": {"total_tokens": 40}}\n\n')
    assert m.tokens() == 40


async def test_side_channels_ride_the_replica_sync_links():
    """Both transports move (subject, bytes); a side subject reaches its receiver, not the policy's."""
    from infera.transport.replica_sync import SIDE_PREFIX, ReplicaSync

    class Link(ReplicaSync):
        transport = "test"

        def __init__(self) -> None:
            super().__init__(replica_id="me")
            self.sent: list[tuple[str, bytes]] = []
            self.up = True

        @property
        def connected(self) -> bool:
            return self.up

        async def _open(self) -> None:
            pass

        async def _send(self, subject: str, data: bytes) -> None:
            self.sent.append((subject, data))

    link = Link()
    heard: list[bytes] = []
    subject = link.add_side_channel("limits", heard.append)
    assert subject == SIDE_PREFIX + "limits" and subject.startswith("infera.replicas.")
    assert not await link.publish_side(subject, b"x")  # not subscribed yet
    link.subscribed = True
    assert await link.publish_side(subject, b"x") and link.sent == [(subject, b"x")]
    link.receive(subject, b"y")  # no kv-aware share attached: side messages still arrive
    assert heard == [b"y"]
    link.up = False
    assert not await link.publish_side(subject, b"z")
