"""Per-tenant limits shared by replicas (infera/server/tenant_limits.py): the sliding window, each
limit's 429 with its headers, the share of the headroom that bounds R replicas' overshoot to R − 1,
peers that expire or say bye, and the tokens a reply reports."""
from __future__ import annotations

import asyncio

import pytest

from infera.api.errors import ApiError
from infera.server.tenant_limits import (LimitsMsg, TenantLimit, TenantLimiter, UsageMeter, _Window, _encode,
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


def test_requests_per_minute_one_replica():
    clock = Clock()
    lim = TenantLimiter(clock=clock)
    limit = TenantLimit(requests_per_minute=3)
    for _ in range(3):
        lim.admit("a", limit).finish(None)
    with pytest.raises(ApiError) as err:
        lim.admit("a", limit)
    e = err.value
    assert e.status == 429 and e.code == "rate_limit_exceeded"
    assert e.headers["x-ratelimit-limit-requests"] == "3" and e.headers["x-ratelimit-remaining-requests"] == "0"
    assert e.headers["Retry-After"] == "60" and e.headers["x-ratelimit-reset-requests"] == "60s"
    lim.admit("b", limit).finish(None)  # another tenant has its own window
    clock.t += 20
    with pytest.raises(ApiError) as err:
        lim.admit("a", limit)
    assert err.value.headers["Retry-After"] == "40"  # the first requests leave the window in 40 s
    clock.t += 41
    lim.admit("a", limit)
    assert lim.refused == {("a", "requests"): 2}


def test_concurrency_is_released_when_the_reply_ends():
    lim = TenantLimiter(clock=Clock())
    limit = TenantLimit(max_concurrent=2)
    first, second = lim.admit("a", limit), lim.admit("a", limit)
    with pytest.raises(ApiError) as err:
        lim.admit("a", limit)
    assert err.value.headers["Retry-After"] == "1"
    first.finish(None)
    first.finish(None)  # once only
    third = lim.admit("a", limit)
    with pytest.raises(ApiError):
        lim.admit("a", limit)
    second.finish(None), third.finish(None)


def test_tokens_per_minute_counts_what_replies_reported():
    clock = Clock()
    lim = TenantLimiter(clock=clock)
    limit = TenantLimit(tokens_per_minute=100)
    lim.admit("a", limit).finish(60)
    lim.admit("a", limit).finish(60)  # admitted while under: the slack is what was in flight
    with pytest.raises(ApiError) as err:
        lim.admit("a", limit)
    assert err.value.headers["x-ratelimit-limit-tokens"] == "100" and "tokens per minute" in err.value.message
    clock.t += 61
    lim.admit("a", limit)


def test_replicas_share_the_headroom_and_overshoot_at_most_r_minus_1():
    clock = Clock()
    replicas = [TenantLimiter(clock=clock, replica_id=f"r{i}") for i in range(3)]
    limit = TenantLimit(requests_per_minute=100)
    sync(*replicas)  # they know each other (empty reports are heartbeats)
    admitted = 0
    for period in range(40):  # every replica takes all it can each period, 0.1 s apart
        for lim in replicas:
            while True:
                try:
                    lim.admit("a", limit).finish(None)
                    admitted += 1
                except ApiError:
                    break
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
                lim.admit("t", limit)
                n += 1
            except ApiError:
                pass
    assert n == 20


def test_peers_expire_and_say_bye():
    clock = Clock()
    a, b = TenantLimiter(clock=clock, replica_id="a"), TenantLimiter(clock=clock, replica_id="b")
    limit = TenantLimit(requests_per_minute=4)
    for _ in range(4):
        b.admit("t", limit)
    sync(a, b)
    with pytest.raises(ApiError):  # b used the whole minute
        a.admit("t", limit)
    clock.t += 3.5  # b silent past the peer timeout: its usage no longer counts
    a.admit("t", limit)
    sync(a, b)
    a.receive(_encode(LimitsMsg(1, "b", bye=True)))
    assert a._live_peers(clock()) == []
    a.receive(b"\x01garbage")
    assert a.decode_errors == 1


async def test_the_sync_task_publishes_over_the_channel_and_says_bye():
    bus = Bus()
    a = TenantLimiter(bus.channel(), replica_id="a", sync_s=0.01)
    b = TenantLimiter(bus.channel(), replica_id="b", sync_s=0.01)
    a.start(), b.start()
    limit = TenantLimit(requests_per_minute=5)
    for _ in range(5):
        a.admit("t", limit)
    deadline = asyncio.get_running_loop().time() + 5
    while "a" not in b._peers or "t" not in b._peers["a"][1]:
        assert asyncio.get_running_loop().time() < deadline, "b never heard a's usage"
        await asyncio.sleep(0.01)
    with pytest.raises(ApiError):
        b.admit("t", limit)
    await a.stop()
    assert "a" not in b._peers  # a's bye
    await b.stop()


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
