"""Per-tenant limits of ``--api-keys-file`` (requests and tokens per minute, concurrent requests),
shared by every server replica.

**Windows.** Each replica counts its own admissions and tokens in 1-second buckets over a sliding
60-second window, and its requests in flight. Every ``sync_s`` (0.1 s: a *report period*) it
publishes, on a side channel of the replica sync (NATS between replicas, the local mesh between
``--workers`` processes), one small message with each active tenant's own window totals, in-flight
count and the age of its oldest bucket; an empty one when it has none, so that every replica knows
how many are alive. The last message of each replica replaces the one before (idempotent: a lost one
is superseded by the next); a replica not heard for ``PEER_TIMEOUT_S`` is dropped, and one that
stops says ``bye``. A tenant's global usage is its own plus every live peer's last report.

**Admission.** A request is refused with 429 when, for its tenant:

* concurrent: own + peers' in-flight ≥ ``max_concurrent``;
* requests/min: own + peers' window ≥ ``requests_per_minute``, or this replica used its share of
  the headroom in this report period: with R replicas alive, each may admit at most
  ``max(1, ceil(headroom / R))`` per period, headroom being the limit minus the global count when
  the period's first request came. R replicas together then admit at most ``headroom + R - 1`` in a
  period, and the next period starts from their reports, so **a tenant gets at most its limit +
  R − 1 requests in any 60 s**, as long as reports arrive within a period (they take milliseconds
  against 100 ms; tests/unit/test_tenant_limits.py checks the bound with 3 replicas,
  tests/integration/test_tenant_limits.py with 2 over NATS: 20–21 served of 60 for a limit of 20);
* tokens/min: own + peers' window ≥ ``tokens_per_minute``. Tokens are known when a reply ends
  (its ``usage``: every unary reply, and a stream whose client asked for
  ``stream_options.include_usage``; a stream without usage counts one token per content chunk),
  so the slack is the tokens of the requests admitted while the window was still under the limit.

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
from infera.runtime import cancel_and_wait

log = logging.getLogger(__name__)

WINDOW_S = 60
SYNC_S = 0.1
PEER_TIMEOUT_S = 3.0
CHANNEL = "limits"
VERSION = 1
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
    since_report: int = 0  # admitted since the last report went out
    used_at_period: int | None = None  # the global requests/min count at this period's first admission


class TenantReport(msgspec.Struct, array_like=True):
    tenant: str
    requests: int
    tokens: int
    inflight: int
    requests_oldest_age: int = -1
    tokens_oldest_age: int = -1


class LimitsMsg(msgspec.Struct, array_like=True):
    v: int
    replica: str
    tenants: list[TenantReport] = []
    bye: bool = False


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
    """``admit(tenant, limit)`` → ``Permit`` or a 429 ``ApiError``. ``channel``: the replica-sync
    channel (``ReplicaSync``: ``add_side_channel`` / ``publish_side``), or None for one replica."""

    def __init__(self, channel=None, *, replica_id: str | None = None, sync_s: float = SYNC_S,
                 peer_timeout_s: float = PEER_TIMEOUT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.channel = channel
        self.replica_id = replica_id or (getattr(channel, "replica_id", None) or uuid.uuid4().hex[:12])
        self.sync_s, self.peer_timeout_s, self.clock = sync_s, peer_timeout_s, clock
        self._own: dict[str, _Own] = {}
        self._peers: dict[str, tuple[float, dict[str, TenantReport]]] = {}
        self._subject: str | None = None
        self._task: asyncio.Task | None = None
        self.refused: dict[tuple[str, str], int] = {}  # (tenant, limit) → 429s
        self.reports_sent = self.reports_received = self.decode_errors = 0
        if channel is not None:
            self._subject = channel.add_side_channel(CHANNEL, self.receive)

    # -- admission ---------------------------------------------------------------------------------
    def _state(self, tenant: str) -> _Own:
        own = self._own.get(tenant)
        if own is None:
            own = self._own[tenant] = _Own()
        return own

    def _live_peers(self, now: float) -> list[dict[str, TenantReport]]:
        expired = [r for r, (at, _) in self._peers.items() if now - at > self.peer_timeout_s]
        for replica in expired:
            del self._peers[replica]
        return [reports for _, reports in self._peers.values()]

    def admit(self, tenant: str, limit: TenantLimit) -> Permit:
        now = self.clock()
        now_s = int(now)
        own = self._state(tenant)
        live = self._live_peers(now)
        peers = [p[tenant] for p in live if tenant in p]
        if limit.max_concurrent is not None:
            inflight = own.inflight + sum(p.inflight for p in peers)
            if inflight >= limit.max_concurrent:
                raise self._refuse(tenant, "concurrent", f"{limit.max_concurrent} concurrent requests", 1, {})
        if limit.requests_per_minute is not None:
            own.requests.advance(now_s)
            used = own.requests.total + sum(p.requests for p in peers)
            rpm = limit.requests_per_minute
            share = None
            if live:  # other replicas: this one's share of the headroom this period
                if own.used_at_period is None:
                    own.used_at_period = used
                share = max(1, math.ceil(max(0, rpm - own.used_at_period) / (1 + len(live))))
            if used >= rpm or (share is not None and own.since_report >= share):
                ages = [own.requests.oldest_age(now_s)] + [p.requests_oldest_age for p in peers]
                retry = self._retry_after(ages) if used >= rpm else 1
                raise self._refuse(tenant, "requests", f"{rpm} requests per minute", retry,
                                   self._headers("requests", rpm, max(0, rpm - used), retry))
        if limit.tokens_per_minute is not None:
            own.tokens.advance(now_s)
            used_tokens = own.tokens.total + sum(p.tokens for p in peers)
            tpm = limit.tokens_per_minute
            if used_tokens >= tpm:
                ages = [own.tokens.oldest_age(now_s)] + [p.tokens_oldest_age for p in peers]
                retry = self._retry_after(ages)
                raise self._refuse(tenant, "tokens", f"{tpm} tokens per minute", retry,
                                   self._headers("tokens", tpm, 0, retry))
        own.requests.add(now_s, 1)
        own.since_report += 1
        own.inflight += 1
        return Permit(self, tenant)

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

    def _refuse(self, tenant: str, which: str, what: str, retry: int, headers: dict[str, str]) -> ApiError:
        key = (tenant, which)
        self.refused[key] = self.refused.get(key, 0) + 1
        return ApiError(429, f"rate limit reached for tenant {tenant!r}: {what}; retry in {retry} s",
                        "rate_limit_exceeded", headers={"Retry-After": str(retry), **headers})

    # -- sync --------------------------------------------------------------------------------------
    def report(self) -> LimitsMsg:
        """This replica's current totals (and the start of a new report period)."""
        now = self.clock()
        now_s = int(now)
        peers = self._live_peers(now)
        out = []
        for tenant, own in list(self._own.items()):
            req_age = own.requests.oldest_age(now_s)
            tok_age = own.tokens.oldest_age(now_s)
            own.since_report, own.used_at_period = 0, None  # a new period starts with this report
            if not own.requests.total and not own.tokens.total and not own.inflight:
                if not any(tenant in p for p in peers):
                    del self._own[tenant]  # idle everywhere: forget it (bounded by active tenants)
                continue
            out.append(TenantReport(tenant, own.requests.total, own.tokens.total, own.inflight,
                                    -1 if req_age is None else req_age, -1 if tok_age is None else tok_age))
        return LimitsMsg(VERSION, self.replica_id, out)

    def receive(self, data: bytes) -> None:
        try:
            msg = _decode(data)
        except (msgspec.DecodeError, ValueError, RecursionError):
            self.decode_errors += 1
            return
        if msg.replica == self.replica_id or msg.v != VERSION:
            return
        self.reports_received += 1
        if msg.bye:
            self._peers.pop(msg.replica, None)
            return
        self._peers[msg.replica] = (self.clock(), {r.tenant: r for r in msg.tenants})

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.sync_s)
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
