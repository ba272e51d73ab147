"""Per-tenant limits of ``--api-keys-file`` (requests and tokens per minute, concurrent requests),
shared by every server replica.

**Windows and reports.** Each replica counts its own admissions and tokens in 1-second buckets over a
sliding 60-second window, and its requests in flight. Every ``sync_s`` (0.1 s), and at once when a
grant below needs it, it publishes on a side channel of the replica sync (NATS between replicas, the
local mesh between ``--workers`` processes) one small message: a sequence number, the last sequence
number it heard from each other replica (its *acks*), and each active tenant's window totals,
in-flight count, reserved requests and the age of its oldest bucket. An empty one goes out when it
has no tenant, so that every replica knows which are alive. Each message replaces the sender's one
before. Every limiter instance has its own id, so a restarted replica is a new one.

**Requests per minute never exceed the limit + R − 1** (R: replicas alive), whatever the delays
between replicas. A replica admits a request only against a *grant*: requests it reserved for itself
and that every other live replica has acknowledged. It makes a grant of at most
``ceil(headroom / R)``, headroom being the limit minus what it knows is committed: each replica's
counted requests plus its reserved ones (its own exactly, the others' from their last reports).
It also keeps at most one grant unacknowledged at a time, and a grant counts as reserved from the
moment it is made, so every replica hears it before any request uses it. Of any two replicas'
latest grants, the later one was made knowing the other's commitment before its latest grant, and
where the earlier one missed the later replica's previous grant, the later one knew the earlier
grant itself: so the grants made without seeing each other split one headroom R ways, and the
rounding adds at most R − 1. ``tests/unit/test_tenant_limits.py`` checks this with random delays, joins and crashes.

Grants are sized by demand (requests waiting, twice the last two seconds' rate) so that an idle
replica holds little. One is renewed when half used, and lapses unused after ``GRANT_TTL_S``. With a
grant in hand a request costs no message. Without one it waits for acknowledgement (one round trip:
the others answer a message that asks at once) for at most ``peer_timeout_s`` + 2 ``sync_s``.
When the others' reservations leave no headroom, the answer is 429.

**Replicas that stop or fall silent.** A replica not heard for ``PEER_TIMEOUT_S`` is no longer
waited for, and one that stops says ``bye``. Their last-reported requests and reservations keep
counting for ``WINDOW_S + GRANT_TTL_S`` (the longest any of them can stay in a window), so a crash
or a restart does not free its minute early. A network partition longer than ``PEER_TIMEOUT_S``
between replicas that both keep serving is the exception: each side then takes the other for gone
after its last report, and each side's admissions are bounded by the limit on their own.

**Tokens and concurrency** are counted from the reports, not granted. Tokens per minute: a request
is refused when own + peers' tokens in the window reach the limit. Tokens are known when a reply
ends (its ``usage``: every unary reply, and a stream whose client asked for
``stream_options.include_usage``; a stream without usage counts one token per content chunk), so the
slack is the tokens of the requests admitted while the window was still under the limit.
Concurrent: own + peers' in-flight ≥ ``max_concurrent`` is refused (peers' as of their last report).

A 429 carries ``Retry-After`` (seconds until the oldest counted request or token leaves the window,
at least 1) and the ``x-ratelimit-limit-*``, ``x-ratelimit-remaining-*`` and ``x-ratelimit-reset-*``
headers OpenAI clients read. Without a peer channel (one replica, ``--replica-sync off``) the limits
are exact for that replica alone.
"""
from __future__ import annotations

import asyncio
import logging
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterator

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from infera.api.errors import ApiError
from infera.runtime import cancel_and_wait, wait_for

log = logging.getLogger(__name__)

WINDOW_S = 60
SYNC_S = 0.1
PEER_TIMEOUT_S = 3.0
GRANT_TTL_S = 5.0  # an acknowledged grant's life; longer than a wait for acknowledgement
WARMUP_S = 1.0  # a replica that just started grants nothing until it has heard the others (10 reports)
CHANNEL = "limits"
VERSION = 2
_TOTAL_TOKENS = re.compile(rb'"total_tokens"\s*:\s*(\d+)')


@dataclass(frozen=True, slots=True)
class TenantLimit:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.requests_per_minute, self.tokens_per_minute, self.max_concurrent))


class _Window:
    """Counts in 1-second buckets over the last ``WINDOW_S`` seconds."""

    __slots__ = ("buckets", "second", "total")

    def __init__(self) -> None:
        self.buckets = [0] * WINDOW_S
        self.second = 0  # the newest bucket's second
        self.total = 0

    def advance(self, now_s: int) -> None:
        gap = now_s - self.second
        if gap <= 0:
            return
        if gap >= WINDOW_S:
            self.buckets = [0] * WINDOW_S
            self.total = 0
        else:
            for s in range(self.second + 1, now_s + 1):
                i = s % WINDOW_S
                self.total -= self.buckets[i]
                self.buckets[i] = 0
        self.second = now_s

    def add(self, now_s: int, n: int) -> None:
        self.advance(now_s)
        self.buckets[now_s % WINDOW_S] += n
        self.total += n

    def recent(self, now_s: int, seconds: int) -> int:
        """The count of the last ``seconds`` buckets (this one included)."""
        self.advance(now_s)
        return sum(self.buckets[(now_s - age) % WINDOW_S] for age in range(min(seconds, WINDOW_S)))

    def oldest_age(self, now_s: int) -> int | None:
        """Seconds since the oldest bucket still counted (None: empty)."""
        self.advance(now_s)
        if not self.total:
            return None
        for age in range(WINDOW_S - 1, -1, -1):
            if self.buckets[(now_s - age) % WINDOW_S]:
                return age
        return None


@dataclass(slots=True)
class _Own:
    requests: _Window = field(default_factory=_Window)
    tokens: _Window = field(default_factory=_Window)
    inflight: int = 0
    granted: int = 0  # acknowledged, unused requests of this replica's grants
    granted_until: float = 0.0
    last_grant: int = 0
    pending: int = 0  # the grant awaiting acknowledgement (at most one)
    pending_seq: int = 0  # the report that carries it
    pending_until: float = 0.0
    waiting: int = 0  # requests waiting for a grant
    changed: asyncio.Event | None = None  # set when a grant is acknowledged or lapses

    def reserved(self) -> int:
        return self.granted + self.pending


class TenantReport(msgspec.Struct, array_like=True):
    tenant: str
    requests: int
    tokens: int
    inflight: int
    requests_oldest_age: int = -1
    tokens_oldest_age: int = -1
    reserved: int = 0  # granted + pending: counts as used for the others

    def committed(self) -> int:
        return self.requests + self.reserved


class LimitsMsg(msgspec.Struct, array_like=True):
    v: int
    replica: str
    tenants: list[TenantReport] = []
    bye: bool = False
    seq: int = 0
    acks: dict[str, int] = {}  # replica → the last seq heard from it
    asks: int = 0  # the seq of its oldest grant awaiting acknowledgement: answer it at once (0: none)


@dataclass(slots=True)
class _Peer:
    heard_at: float
    seq: int
    acks: dict[str, int]
    tenants: dict[str, TenantReport]


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(LimitsMsg).decode


class Permit:
    """One admitted request: ``finish(tokens)`` once, when its reply ended (or broke)."""

    __slots__ = ("_limiter", "tenant", "_done")

    def __init__(self, limiter: "TenantLimiter", tenant: str) -> None:
        self._limiter, self.tenant, self._done = limiter, tenant, False

    def finish(self, tokens: int | None) -> None:
        if not self._done:
            self._done = True
            self._limiter._finish(self.tenant, tokens or 0)


class UsageMeter:
    """The tokens of a streamed reply: its last ``usage.total_tokens`` (the client asked for
    ``stream_options.include_usage``), else one per content chunk."""

    __slots__ = ("tail", "chunks")

    def __init__(self) -> None:
        self.tail = b""
        self.chunks = 0

    def feed(self, chunk: bytes) -> None:
        self.chunks += chunk.count(b"data: ") - chunk.count(b"data: [DONE]")
        self.tail = (self.tail + chunk)[-4096:]

    def tokens(self) -> int:
        found = reply_tokens(self.tail)
        return found if found is not None else self.chunks


def reply_tokens(data: bytes | None) -> int | None:
    """``usage.total_tokens`` of a reply body or a stream's tail (the last one), if any."""
    if not data:
        return None
    at = data.rfind(b'"total_tokens"')
    while at >= 0:
        m = _TOTAL_TOKENS.match(data, at)
        if m is not None:
            return int(m.group(1))
        at = data.rfind(b'"total_tokens"', 0, at)
    return None


class TenantLimiter:
    """``await admit(tenant, limit)`` → ``Permit`` or a 429 ``ApiError``. ``channel``: the replica-sync
    channel (``ReplicaSync``: ``add_side_channel`` / ``publish_side``), or None for one replica."""

    def __init__(self, channel=None, *, replica_id: str | None = None, sync_s: float = SYNC_S,
                 peer_timeout_s: float = PEER_TIMEOUT_S, grant_ttl_s: float = GRANT_TTL_S,
                 warmup_s: float = WARMUP_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.channel = channel
        base = replica_id or getattr(channel, "replica_id", None) or uuid.uuid4().hex[:12]
        # this instance's own id: a restarted replica is another one, whose window starts empty
        self.replica_id = f"{base}.{uuid.uuid4().hex[:6]}"
        self.sync_s, self.peer_timeout_s, self.grant_ttl_s, self.clock = sync_s, peer_timeout_s, grant_ttl_s, clock
        self.warmup_s = warmup_s
        self._warm_at = 0.0  # before it (from start()), no grant: the others may not have been heard yet
        self._own: dict[str, _Own] = {}
        self._peers: dict[str, _Peer] = {}
        self._gone: dict[str, tuple[float, dict[str, TenantReport]]] = {}  # id → (until, last report)
        self._seq = 0
        self._acks_sent: dict[str, int] = {}  # replica → the last of its seqs our reports acknowledged
        self._pending_tenants: set[str] = set()
        self._wake: asyncio.Event | None = None
        self._subject: str | None = None
        self._task: asyncio.Task | None = None
        self.refused: dict[tuple[str, str], int] = {}  # (tenant, limit) → 429s
        self.reports_sent = self.reports_received = self.decode_errors = 0
        self.grants = self.grant_waits = 0
        if channel is not None:
            self._subject = channel.add_side_channel(CHANNEL, self.receive)

    # -- the others ----------------------------------------------------------------------------------
    def _live_peers(self, now: float) -> list[_Peer]:
        expired = [r for r, p in self._peers.items() if now - p.heard_at > self.peer_timeout_s]
        for replica in expired:
            self._forget(replica, now)
        if expired:
            self._check_pending(now)
        return list(self._peers.values())

    def _forget(self, replica: str, now: float) -> None:
        """A peer gone (bye) or silent: its last-reported usage and reservations still count until
        its last admissions leave every window."""
        peer = self._peers.pop(replica, None)
        if peer is not None and peer.tenants:
            # its last grant can be used up to TTL after it was heard, then stays a window long
            self._gone[replica] = (peer.heard_at + WINDOW_S + self.grant_ttl_s, peer.tenants)

    def _others(self, now: float, tenant: str) -> tuple[list[TenantReport], int]:
        """(every other replica's last report of ``tenant``, gone ones included; live peers)."""
        live = self._live_peers(now)
        if self._gone:
            for replica in [r for r, (until, _) in self._gone.items() if now >= until]:
                del self._gone[replica]
        reports = [p.tenants[tenant] for p in live if tenant in p.tenants]
        reports += [t[tenant] for _, t in self._gone.values() if tenant in t]
        return reports, len(live)

    # -- admission ---------------------------------------------------------------------------------
    def _state(self, tenant: str) -> _Own:
        own = self._own.get(tenant)
        if own is None:
            own = self._own[tenant] = _Own()
        return own

    async def admit(self, tenant: str, limit: TenantLimit) -> Permit:
        own = self._state(tenant)
        self._check(tenant, own, limit)
        if limit.requests_per_minute is not None and await self._take_request(tenant, own, limit.requests_per_minute):
            try:
                self._check(tenant, own, limit)  # the wait may have changed the others
            except ApiError:
                own.granted += 1  # not used: still this replica's to admit with
                raise
        own.requests.add(int(self.clock()), 1)
        own.inflight += 1
        return Permit(self, tenant)

    def _check(self, tenant: str, own: _Own, limit: TenantLimit) -> None:
        """Concurrency and tokens/min (from the reports), and the requests/min window."""
        now = self.clock()
        now_s = int(now)
        peers, _ = self._others(now, tenant)
        if limit.max_concurrent is not None:
            if own.inflight + sum(p.inflight for p in peers) >= limit.max_concurrent:
                raise self._refuse(tenant, "concurrent", f"{limit.max_concurrent} concurrent requests", 1, {})
        if limit.requests_per_minute is not None:
            rpm = limit.requests_per_minute
            own.requests.advance(now_s)
            used = own.requests.total + sum(p.requests for p in peers)
            if used >= rpm:
                ages = [own.requests.oldest_age(now_s)] + [p.requests_oldest_age for p in peers]
                raise self._refuse_requests(tenant, rpm, used, self._retry_after(ages))
        if limit.tokens_per_minute is not None:
            own.tokens.advance(now_s)
            tpm = limit.tokens_per_minute
            if own.tokens.total + sum(p.tokens for p in peers) >= tpm:
                ages = [own.tokens.oldest_age(now_s)] + [p.tokens_oldest_age for p in peers]
                retry = self._retry_after(ages)
                raise self._refuse(tenant, "tokens", f"{tpm} tokens per minute", retry,
                                   self._headers("tokens", tpm, 0, retry))

    async def _take_request(self, tenant: str, own: _Own, rpm: int) -> bool:
        """One request out of an acknowledged grant: made here, and waited for when needed.
        True when it waited (the others' usage may have moved meanwhile)."""
        deadline = self.clock() + self.peer_timeout_s + 2 * self.sync_s
        waited = False
        own.waiting += 1
        try:
            while True:
                now = self.clock()
                self._lapse(own, now)
                if own.granted > 0:
                    own.granted -= 1
                    if own.pending == 0 and own.granted * 2 < own.last_grant:
                        self._grant(tenant, own, rpm, now)  # renew before it runs out
                    return waited
                if own.pending == 0 and now < self._warm_at:
                    pass  # just started: wait to hear who else is alive
                elif own.pending == 0 and not self._grant(tenant, own, rpm, now):
                    peers, _ = self._others(now, tenant)
                    used = own.requests.total + sum(p.requests for p in peers)
                    raise self._refuse_requests(tenant, rpm, used, 1)  # the rest is reserved elsewhere
                if own.granted > 0:
                    continue  # alone: granted at once
                left = deadline - now
                if left <= 0:
                    raise self._refuse_requests(tenant, rpm, rpm, 1)  # the others did not answer
                self.grant_waits += 1
                waited = True
                if own.changed is None:
                    own.changed = asyncio.Event()
                own.changed.clear()
                try:
                    await wait_for(own.changed.wait(), min(left, self.sync_s))
                except asyncio.TimeoutError:
                    self._live_peers(self.clock())  # a silent peer stops being waited for
        finally:
            own.waiting -= 1

    def _lapse(self, own: _Own, now: float) -> None:
        if own.granted and now >= own.granted_until:
            own.granted = 0
        if own.pending and now >= own.pending_until:
            own.pending = 0

    def _grant(self, tenant: str, own: _Own, rpm: int, now: float) -> bool:
        """Reserve ``ceil(headroom / R)`` at most (less when demand is less); False when the headroom
        is gone. It is usable once every live peer has heard it (at once when there is none)."""
        peers, live = self._others(now, tenant)
        now_s = int(now)
        own.requests.advance(now_s)
        committed = own.requests.total + own.reserved() + sum(p.committed() for p in peers)
        headroom = rpm - committed
        if headroom <= 0:
            return False
        want = max(1, own.waiting, 2 * own.requests.recent(now_s, 2))
        size = min(math.ceil(headroom / (1 + live)), want)
        self.grants += 1
        own.last_grant = size
        own.pending, own.pending_seq, own.pending_until = size, self._seq + 1, now + self.grant_ttl_s
        self._pending_tenants.add(tenant)
        if not live:
            self._acknowledged(own)
        elif self._wake is not None:
            self._wake.set()  # the others hear it now, not at the next tick
        return True

    def _acknowledged(self, own: _Own) -> None:
        own.granted += own.pending
        own.granted_until = own.pending_until
        own.pending = 0
        if own.changed is not None:
            own.changed.set()

    def _check_pending(self, now: float) -> None:
        """Grants every live peer has now heard become usable."""
        if not self._pending_tenants:
            return
        peers = list(self._peers.values())
        for tenant in list(self._pending_tenants):
            own = self._own.get(tenant)
            if own is None or not own.pending:
                self._pending_tenants.discard(tenant)
                continue
            if all(p.acks.get(self.replica_id, 0) >= own.pending_seq for p in peers):
                self._pending_tenants.discard(tenant)
                self._acknowledged(own)

    def _finish(self, tenant: str, tokens: int) -> None:
        own = self._state(tenant)
        own.inflight = max(0, own.inflight - 1)
        if tokens > 0:
            own.tokens.add(int(self.clock()), tokens)

    @staticmethod
    def _retry_after(ages: list) -> int:
        """Seconds until the oldest counted bucket anywhere leaves the window (≥ 1)."""
        known = [a for a in ages if a is not None and a >= 0]
        return max(1, WINDOW_S - max(known)) if known else 1

    @staticmethod
    def _headers(kind: str, limit: int, remaining: int, retry: int) -> dict[str, str]:
        return {f"x-ratelimit-limit-{kind}": str(limit), f"x-ratelimit-remaining-{kind}": str(remaining),
                f"x-ratelimit-reset-{kind}": f"{retry}s"}

    def _refuse_requests(self, tenant: str, rpm: int, used: int, retry: int) -> ApiError:
        return self._refuse(tenant, "requests", f"{rpm} requests per minute", retry,
                            self._headers("requests", rpm, max(0, rpm - used), retry))

    def _refuse(self, tenant: str, which: str, what: str, retry: int, headers: dict[str, str]) -> ApiError:
        key = (tenant, which)
        self.refused[key] = self.refused.get(key, 0) + 1
        return ApiError(429, f"rate limit reached for tenant {tenant!r}: {what}; retry in {retry} s",
                        "rate_limit_exceeded", headers={"Retry-After": str(retry), **headers})

    # -- sync --------------------------------------------------------------------------------------
    def report(self) -> LimitsMsg:
        """This replica's current totals, under the next sequence number."""
        now = self.clock()
        now_s = int(now)
        peers = self._live_peers(now)
        self._seq += 1
        out = []
        asks = 0
        for tenant, own in list(self._own.items()):
            self._lapse(own, now)
            req_age = own.requests.oldest_age(now_s)
            tok_age = own.tokens.oldest_age(now_s)
            if not (own.requests.total or own.tokens.total or own.inflight or own.reserved() or own.waiting):
                if not any(tenant in p.tenants for p in peers):
                    del self._own[tenant]  # idle everywhere: forget it (bounded by active tenants)
                continue
            if own.pending and (not asks or own.pending_seq < asks):
                asks = own.pending_seq
            out.append(TenantReport(tenant, own.requests.total, own.tokens.total, own.inflight,
                                    -1 if req_age is None else req_age, -1 if tok_age is None else tok_age,
                                    own.reserved()))
        acks = {replica: p.seq for replica, p in self._peers.items()}
        self._acks_sent = acks
        return LimitsMsg(VERSION, self.replica_id, out, seq=self._seq, acks=acks, asks=asks)

    def receive(self, data: bytes) -> None:
        try:
            msg = _decode(data)
        except (msgspec.DecodeError, ValueError, RecursionError):
            self.decode_errors += 1
            return
        if msg.replica == self.replica_id or msg.v != VERSION:
            return
        self.reports_received += 1
        now = self.clock()
        if msg.bye:
            self._forget(msg.replica, now)
            self._check_pending(now)
            return
        known = self._peers.get(msg.replica)
        if known is not None and msg.seq <= known.seq:
            return  # out of order: an older view than the one held
        self._peers[msg.replica] = _Peer(now, msg.seq, msg.acks, {r.tenant: r for r in msg.tenants})
        self._gone.pop(msg.replica, None)
        self._check_pending(now)
        if msg.asks and self._acks_sent.get(msg.replica, 0) < msg.asks and self._wake is not None:
            self._wake.set()  # it waits for our acknowledgement, which has not gone out yet

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            try:
                await wait_for(self._wake.wait(), self.sync_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                msg = self.report()  # sent even when empty: the others count the replicas alive
                if self.channel is not None and self._subject is not None:
                    if await self.channel.publish_side(self._subject, _encode(msg)):
                        self.reports_sent += 1
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a bug must not end the sync: log, carry on
                log.exception("tenant limits: report failed")

    def start(self) -> None:
        if self._task is None:
            self._warm_at = self.clock() + self.warmup_s if self.channel is not None else 0.0
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="tenant-limits-sync")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if self.channel is not None and self._subject is not None:
            await self.channel.publish_side(self._subject, _encode(LimitsMsg(VERSION, self.replica_id, bye=True)))


class TenantLimitsMetrics:
    def __init__(self, limiter: TenantLimiter, tenant_label: Callable[[str], str]) -> None:
        self.limiter, self.tenant_label = limiter, tenant_label

    def collect(self) -> Iterator[Metric]:
        lim = self.limiter
        c = CounterMetricFamily("infera_tenant_rate_limited", "Requests refused (429) by a tenant limit",
                                labels=["tenant", "limit"])
        for (tenant, which), n in sorted(lim.refused.items()):
            c.add_metric([self.tenant_label(tenant), which], n)
        yield c
        g = GaugeMetricFamily("infera_tenant_limit_peers", "Other replicas whose tenant usage this one counts")
        g.add_metric([], len(lim._live_peers(lim.clock())))
        yield g
