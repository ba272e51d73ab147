"""Server metrics: plain counters on the hot path, exported through a scrape-time collector.

The server is one event loop, so updates need no locks: a request bumps dict entries and a
histogram slot (bisect), and the Prometheus families are built only when /metrics is scraped.
(prometheus_client's own metric objects take a lock and build label keys on every update — a
measurable share of the router's CPU under load.)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord
from infera.router.breaker import STATE_CODES, CircuitBreaker
from infera.router.metrics import RouterMetrics
from infera.server.keyed_family import Escapes, KeyedFamily, cumulative

# The policy's pick alone (no tokenizing or hashing: those run before it), sub-millisecond.
PICK_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# A PD leg answered in full (the reference's 0.01…60).
PD_LEG_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
DISAGG_MODES = ("mixed", "prefill", "decode")


class Histogram:
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last slot: +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # bucket le=b holds values <= b
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        return cumulative(tuple(map(_fmt, self.bounds)), self.counts)


def _fmt(x: float) -> str:
    return repr(float(x))


LATENCY_LABELS = tuple(map(_fmt, LATENCY_BUCKETS))  # their le labels


def holds_worker(label: str, worker_id: str) -> bool:
    """Is ``label`` (a worker id, or a route key ``<worker_id>#dp<rank>``) one of ``worker_id``'s?"""
    return label == worker_id or (label.startswith(worker_id) and label.startswith("#dp", len(worker_id)))


def drop_worker_keys(table: dict[Any, Any], worker_id: str, position: int | None = None) -> int:
    """Delete ``table``'s entries of ``worker_id`` (keys are worker ids or route keys, or tuples
    holding one at ``position``); returns how many went."""
    gone = [k for k in table if holds_worker(k if position is None else k[position], worker_id)]
    for k in gone:
        del table[k]
    return len(gone)


# Workers that left, remembered so that the requests they still had in flight, finishing after the
# leave, do not bring their series back. Bounded: enough for any burst of departures.
_DEPARTED_CAP = 4096


class Gauge:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self) -> None:
        self.value += 1

    def dec(self) -> None:
        self.value -= 1


class ServerMetrics(RouterMetrics):
    """The router's metrics (``RouterMetrics``) and the server's own, exported to Prometheus."""

    def __init__(self, fleet: Fleet, breaker: CircuitBreaker | None = None) -> None:
        self._fleet = fleet
        self._breaker = breaker
        self.requests: dict[tuple[str, str, str], int] = {}
        self.e2e: dict[tuple[str, str], Histogram] = {}  # the HTTP handler's view: (route, stream)
        # The router's view, (route, stream, router, outcome): labelled as ours was (route, stream) and
        # as the reference's is (router, outcome), so dashboards built for either work.
        self.request_seconds: dict[tuple[str, str, str, str], Histogram] = {}
        self.request_inflight: dict[str, Gauge] = {}  # router → requests in its dispatch
        self.pd_leg_seconds: dict[tuple[str, str], Histogram] = {}  # (leg, worker)
        self.pd_bootstrap_failures: dict[str, int] = {}  # reason → PD attempts failed before the first byte
        self.cache_control_seen: dict[str, int] = {}  # retention → picks with the request's hints
        self.cache_locality_skipped: dict[str, int] = {}  # reason → picks that ignored prompt overlap
        self.ttft: dict[str, Histogram] = {}
        self.pick: dict[str, Histogram] = {}  # role → the policy's pick time
        self.inflight: dict[str, Gauge] = {}
        self.retries: dict[tuple[str, str], int] = {}
        self.midstream_failures: dict[str, int] = {}
        self.client_disconnects: dict[str, int] = {}
        self.migrations: dict[str, int] = {}  # reason → streams moved to another worker
        self.migrations_failed: dict[str, int] = {}  # reason → breaks that could not move
        self.migration_seconds = Histogram()  # break → the continuation's first byte
        self._departed: OrderedDict[str, None] = OrderedDict()
        self.registry = MetricsRegistry()
        self.registry.register(self)
        fleet.subscribe(self._on_fleet_change)

    # -- hot path ----------------------------------------------------------------------------------
    def count_request(self, route: str, status: int, worker: str) -> None:
        if worker in self._departed:
            return
        key = (route, str(status), worker)
        self.requests[key] = self.requests.get(key, 0) + 1

    def observe_e2e(self, route: str, stream: bool, seconds: float) -> None:
        key = (route, "true" if stream else "false")
        h = self.e2e.get(key)
        if h is None:
            h = self.e2e[key] = Histogram()
        h.observe(seconds)

    def observe_request(self, router: str, outcome: str, route: str, stream: bool, seconds: float) -> None:
        key = (route, "true" if stream else "false", router, outcome)
        h = self.request_seconds.get(key)
        if h is None:
            h = self.request_seconds[key] = Histogram()
        h.observe(seconds)

    def request_inflight_gauge(self, router: str) -> Gauge:
        g = self.request_inflight.get(router)
        if g is None:
            g = self.request_inflight[router] = Gauge()
        return g

    def observe_pd_dispatch(self, leg: str, worker: str, seconds: float) -> None:
        if worker in self._departed:
            return
        key = (leg, worker)
        h = self.pd_leg_seconds.get(key)
        if h is None:
            h = self.pd_leg_seconds[key] = Histogram(PD_LEG_BUCKETS)
        h.observe(seconds)

    def count_pd_bootstrap_failure(self, reason: str) -> None:
        self.pd_bootstrap_failures[reason] = self.pd_bootstrap_failures.get(reason, 0) + 1

    def count_cache_control(self, retention: str) -> None:
        self.cache_control_seen[retention] = self.cache_control_seen.get(retention, 0) + 1

    def count_cache_locality_skipped(self, reason: str) -> None:
        self.cache_locality_skipped[reason] = self.cache_locality_skipped.get(reason, 0) + 1

    def observe_pick(self, role: str, seconds: float) -> None:
        h = self.pick.get(role)
        if h is None:
            h = self.pick[role] = Histogram(PICK_BUCKETS)
        h.observe(seconds)

    def observe_ttft(self, route: str, seconds: float) -> None:
        h = self.ttft.get(route)
        if h is None:
            h = self.ttft[route] = Histogram()
        h.observe(seconds)

    def inflight_gauge(self, worker: str) -> Gauge:
        g = self.inflight.get(worker)
        if g is None:
            g = Gauge()
            if worker not in self._departed:  # (a PD leg looks its gauge up again to release it)
                self.inflight[worker] = g
        return g

    def count_retry(self, route: str, reason: str) -> None:
        self.retries[(route, reason)] = self.retries.get((route, reason), 0) + 1

    def count_midstream_failure(self, worker: str) -> None:
        if worker in self._departed:
            return
        self.midstream_failures[worker] = self.midstream_failures.get(worker, 0) + 1

    def count_migration(self, reason: str, seconds: float) -> None:
        self.migrations[reason] = self.migrations.get(reason, 0) + 1
        self.migration_seconds.observe(seconds)

    def count_migration_failed(self, reason: str) -> None:
        self.migrations_failed[reason] = self.migrations_failed.get(reason, 0) + 1

    def count_disconnect(self, route: str) -> None:
        self.client_disconnects[route] = self.client_disconnects.get(route, 0) + 1

    def forget_worker(self, worker_id: str) -> None:
        """Drop per-worker gauges when a worker leaves, so /metrics tracks the live fleet.

        (An in-flight request still holding the gauge object keeps working; it is just no
        longer exported.)
        """
        self.inflight.pop(worker_id, None)

    def _on_fleet_change(self, worker_id: str, record: WorkerRecord | None) -> None:
        """A worker that left the fleet takes every series labelled with it along (the breaker's
        are read from the fleet at scrape time; the kv-aware ones go with their targets)."""
        if record is not None:
            self._departed.pop(worker_id, None)  # back (same id): counted again
            return
        self._departed[worker_id] = None
        while len(self._departed) > _DEPARTED_CAP:
            self._departed.popitem(last=False)
        self.inflight.pop(worker_id, None)
        self.midstream_failures.pop(worker_id, None)
        drop_worker_keys(self.requests, worker_id, 2)
        drop_worker_keys(self.pd_leg_seconds, worker_id, 1)

    # -- scrape ------------------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        labels: tuple[str, ...]
        fam = CounterMetricFamily(
            "infera_requests", "Requests by route, status and worker", labels=["route", "status", "worker_id"]
        )
        for labels, n in sorted(self.requests.items()):
            fam.add_metric(list(labels), n)
        yield fam
        hist = HistogramMetricFamily(
            "infera_request_duration_seconds",
            "Requests from the router's dispatch to the "
            "end of the reply or its stream, by route, stream, router (mixed, disagg, "
            "direct) and outcome (ok, 4xx, 5xx, 429, 502, 503, error, client_gone)",
            labels=["route", "stream", "router", "outcome"],
        )
        for labels, h in sorted(self.request_seconds.items()):
            hist.add_metric(list(labels), h.cumulative(), h.total)
        yield hist
        hist = HistogramMetricFamily(
            "infera_http_request_duration_seconds",
            "Answered requests from the HTTP handler's start (body read, admission queue) to the reply's last byte",
            labels=["route", "stream"],
        )
        for labels, h in sorted(self.e2e.items()):
            hist.add_metric(list(labels), h.cumulative(), h.total)
        yield hist
        g = GaugeMetricFamily(
            "infera_request_inflight",
            "Requests in a router's dispatch, reply or stream (per worker: infera_worker_inflight_requests)",
            labels=["router"],
        )
        for router, gauge in sorted(self.request_inflight.items()):
            g.add_metric([router], gauge.value)
        yield g
        hist = HistogramMetricFamily(
            "infera_pd_dispatch_duration_seconds",
            "PD legs answered in full (the prefill leg, an unstreamed decode leg), by leg and worker",
            labels=["leg", "worker_id"],
        )
        for labels, h in sorted(self.pd_leg_seconds.items()):
            hist.add_metric(list(labels), h.cumulative(), h.total)
        yield hist
        for name, table, label, doc in (
            (
                "infera_pd_bootstrap_failures",
                self.pd_bootstrap_failures,
                "reason",
                "PD attempts that failed before the client's first byte (no_pd_workers, protocol_unresolved, "
                "protocol_annotate_failed, handoff_extract_failed, prefill_/decode_ 4xx, 5xx, unreachable, timeout)",
            ),
            (
                "infera_cache_control_seen",
                self.cache_control_seen,
                "retention",
                "Policy picks made with the request's cache hints, by retention (none, short, long)",
            ),
            (
                "infera_cache_locality_skipped",
                self.cache_locality_skipped,
                "reason",
                "Policy picks that ignored prompt-cache overlap (multimodal: image affinity decides)",
            ),
        ):
            fam = CounterMetricFamily(name, doc, labels=[label])
            for value, n in sorted(table.items()):
                fam.add_metric([value], n)
            yield fam
        hist = HistogramMetricFamily(
            "infera_time_to_first_token_seconds", "Time to the first streamed byte", labels=["route"]
        )
        for route, h in sorted(self.ttft.items()):
            hist.add_metric([route], h.cumulative(), h.total)
        yield hist
        hist = HistogramMetricFamily(
            "infera_router_pick_seconds",
            "The routing policy's pick per request leg (candidates scored; tokenizing and hashing come before it)",
            labels=["role"],
        )
        for role, h in sorted(self.pick.items()):
            hist.add_metric([role], h.cumulative(), h.total)
        yield hist
        g = GaugeMetricFamily("infera_worker_inflight_requests", "Requests in flight per worker", labels=["worker_id"])
        for worker, gauge in sorted(self.inflight.items()):
            g.add_metric([worker], gauge.value)
        yield g
        fam = CounterMetricFamily(
            "infera_request_retries",
            "Attempts that failed before the first byte and were retried elsewhere",
            labels=["route", "reason"],
        )
        for labels, n in sorted(self.retries.items()):
            fam.add_metric(list(labels), n)
        yield fam
        fam = CounterMetricFamily(
            "infera_midstream_failures", "Streams that broke after the first byte", labels=["worker_id"]
        )
        for worker, n in sorted(self.midstream_failures.items()):
            fam.add_metric([worker], n)
        yield fam
        fam = CounterMetricFamily(
            "infera_client_disconnects", "Requests abandoned by the client before completion", labels=["route"]
        )
        for route, n in sorted(self.client_disconnects.items()):
            fam.add_metric([route], n)
        yield fam
        fam = CounterMetricFamily(
            "infera_migrations", "Broken streams moved to another worker (--migration-limit)", labels=["reason"]
        )
        for reason, n in sorted(self.migrations.items()):
            fam.add_metric([reason], n)
        yield fam
        fam = CounterMetricFamily(
            "infera_migrations_failed",
            "Broken streams that could not move: poisoned "
            "(n>1, tool calls, …), limit, no_candidate, no_first_byte, finished",
            labels=["reason"],
        )
        for reason, n in sorted(self.migrations_failed.items()):
            fam.add_metric([reason], n)
        yield fam
        hist = HistogramMetricFamily(
            "infera_migration_duration_seconds",
            "From a stream's break to the first byte of its continuation on another worker",
        )
        hist.add_metric([], self.migration_seconds.cumulative(), self.migration_seconds.total)
        yield hist
        workers = GaugeMetricFamily("infera_workers", "Workers known to this server", labels=["status", "disagg_mode"])
        counts: dict[tuple[str, str], int] = {("active", "mixed"): 0, ("draining", "mixed"): 0}
        for r in self._fleet.all():
            counts[(r.status, r.disagg_mode)] = counts.get((r.status, r.disagg_mode), 0) + 1
        for (status, mode), n in sorted(counts.items()):
            workers.add_metric([status, mode], n)
        yield workers
        active = GaugeMetricFamily(
            "infera_active_workers",
            "Active workers by disagg mode (draining ones too: infera_workers)",
            labels=["disagg_mode"],
        )
        for mode in DISAGG_MODES:
            active.add_metric([mode], counts.get(("active", mode), 0))
        yield active
        if self._breaker is not None:
            yield from self._collect_breaker(self._breaker)

    def _collect_breaker(self, breaker: CircuitBreaker) -> Iterator[Metric]:
        # Read from the breaker at scrape time, for the workers in the fleet (the breaker forgets
        # departed ones), so routing pays nothing for these series.
        state = GaugeMetricFamily(
            "infera_router_worker_breaker_state",
            "Circuit breaker state per worker: 0 closed, "
            "1 half-open (one probe at a time), 2 open (no requests until the cooldown ends)",
            labels=["worker_id"],
        )
        trips = CounterMetricFamily(
            "infera_router_worker_breaker_trips", "Times the circuit breaker opened for a worker", labels=["worker_id"]
        )
        for r in self._fleet.all():
            state.add_metric([r.worker_id], STATE_CODES[breaker.state(r.worker_id)])
            trips.add_metric([r.worker_id], breaker.trips(r.worker_id))
        yield state
        yield trips

    def render(self) -> bytes:
        """The whole page, built here (tests; a server renders it with :meth:`render_off_loop`)."""
        return generate_latest(self.registry)

    async def render_off_loop(self) -> bytes:
        return await render_page(self.registry)


# Replica sync figures exported as gauges (levels) or counters (totals), by their stats() key.
_SYNC_GAUGES = {"peers": "Other server replicas heard from", "remote_in_flight": "Their requests in flight"}
_SYNC_COUNTERS = {
    "messages_sent": "Messages published",
    "messages_received": "Messages received",
    "bytes_sent": "Bytes published",
    "deltas_dropped": "Deltas not shared (NATS down or outbox full)",
    "gaps": "Sequence gaps in other replicas' messages (full state asked for)",
    "remote_started": "Other replicas' requests heard of (started)",
    "remote_finished": "Other replicas' requests heard finishing",
    "remote_expired": "Other replicas' requests dropped without a finish (heartbeat or timeout)",
}


class NatsMetrics:
    """The NATS plane seen from this server: the broker connection, requests over NATS, and (when
    given) the replica sync."""

    def __init__(self, connection: Any, requests: Any = None, replica_sync: Any = None) -> None:
        self.connection = connection  # infera.transport.nats_conn.NatsConnection
        self.requests = requests  # infera.transport.nats_request.NatsRequestClient, if any
        self.replica_sync = ReplicaSyncMetrics(replica_sync) if replica_sync is not None else None

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "infera_nats_connected",
            "1 while this server is connected to NATS",
            value=1 if self.connection.connected else 0,
        )
        yield CounterMetricFamily("infera_nats_disconnects", "NATS connections lost", value=self.connection.disconnects)
        if self.requests is not None:
            yield CounterMetricFamily(
                "infera_nats_requests", "Requests sent to workers over NATS", value=self.requests.sent
            )
            yield CounterMetricFamily(
                "infera_nats_cancels",
                "Cancels published for requests left unfinished (client gone, timeout, failure)",
                value=self.requests.cancels_sent,
            )
        if self.replica_sync is not None:
            yield from self.replica_sync.collect()


class ReplicaSyncMetrics:
    """The replica sync, whatever its transport (infera.transport.replica_sync.ReplicaSync)."""

    def __init__(self, replica_sync: Any) -> None:
        self.replica_sync = replica_sync

    def collect(self) -> Iterator[Metric]:
        stats = self.replica_sync.stats()
        for key, doc in _SYNC_GAUGES.items():
            yield GaugeMetricFamily(f"infera_replica_sync_{key}", doc, value=stats.get(key, 0))
        for key, doc in _SYNC_COUNTERS.items():
            yield CounterMetricFamily(f"infera_replica_sync_{key}", doc, value=stats.get(key, 0))


# -- one /metrics for the processes of one server (--workers N) -------------------------------------

GATHER_TIMEOUT_S = 1.0  # longest wait for a sibling's series; a scrape is never held longer
PROCESS_LABEL = "process"


class _Families:
    """A collector over ready-made families (generate_latest takes anything with collect())."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


# -- a scrape that leaves the event loop its turns -----------------------------------------------------
# At 1,000 workers a page is ~25,000 series: reading the collectors and formatting the text on the loop
# held every request for 0.3-0.4 s a scrape. A collector whose families grow with the fleet offers
# snapshot() (on the loop: a copy of the live state it shows, a few ms) and families(snapshot) (pure:
# any thread); the rest are small and collected whole on the loop. The families are then built and
# formatted in a thread, which hands the GIL back every few ms.


class MetricsRegistry(CollectorRegistry):
    """prometheus_client's registry, keeping its collectors in order for :func:`render_page`."""

    def __init__(self) -> None:
        super().__init__(auto_describe=False)
        self.collectors: list[Any] = []

    def register(self, collector: Any) -> None:
        super().register(collector)
        self.collectors.append(collector)

    def unregister(self, collector: Any) -> None:
        super().unregister(collector)
        self.collectors.remove(collector)


PageParts = list[tuple[Callable[[Any], Iterable[Metric]] | None, Any]]


def read_page(registry: MetricsRegistry) -> PageParts:
    """On the loop: each collector's snapshot (with the function that builds its families), or its
    families when it offers no snapshot."""
    parts: PageParts = []
    for collector in registry.collectors:
        snapshot = getattr(collector, "snapshot", None)
        if snapshot is not None:
            parts.append((collector.families, snapshot()))
        else:
            parts.append((None, list(collector.collect())))
    return parts


def format_page(parts: PageParts, process: str | None = None) -> bytes:
    """Any thread: the text exposition of :func:`read_page`'s parts (a :class:`KeyedFamily` written
    as text, the library's families by ``generate_latest``), in order; with ``process`` (a --workers
    N child's index), every sample labelled ``process="<index>"`` as it is written."""
    out: list[str] = []
    pending: list[Metric] = []
    escapes = Escapes()
    label = _process_label(process) if process is not None else ""

    def flush() -> None:
        text = generate_latest(_Families(pending)).decode()
        out.append(label_process(text, process) if process is not None else text)
        pending.clear()

    for build, part in parts:
        for family in build(part) if build is not None else part:
            if isinstance(family, KeyedFamily):
                if pending:
                    flush()
                family.write(out, escapes, label)
            else:
                pending.append(family)
    if pending:
        flush()
    return "".join(out).encode()


async def render_page(registry: MetricsRegistry, process: str | None = None) -> bytes:
    return await asyncio.to_thread(format_page, read_page(registry), process)


# A sample line of the text exposition (never a "# HELP"/"# TYPE" line): its name, then its labels or
# its value. The process label goes first; label order carries no meaning.
_LABELLED_SAMPLE = re.compile(r"^([^#\s{][^\s{]*)\{", re.M)
_BARE_SAMPLE = re.compile(r"^([^#\s{][^\s{]*) ", re.M)


def _process_label(process: str) -> str:
    if not process.isdigit():
        raise ValueError(f"process label {process!r} is not an index")
    return f'{PROCESS_LABEL}="{process}"'


def label_process(text: str, process: str) -> str:
    """``text`` (exposition) with ``process="<process>"`` on every sample. ``process`` is an index.
    (A regex substitution per sample line, ~2 µs each: the pages' large families are labelled as
    they are written instead, ``format_page(..., process)``.)"""
    label = _process_label(process)
    text = _LABELLED_SAMPLE.sub(r"\1{" + label + ",", text)
    return _BARE_SAMPLE.sub(r"\1{" + label + "} ", text)


def merge_labelled_texts(texts: Iterable[str]) -> bytes:
    """One exposition of every process's text exposition (``generate_latest``'s form: each family a
    "# HELP" line, a "# TYPE" line, then its samples), each sample already labelled
    ``process="<index>"``: the samples of a family from every process under one HELP/TYPE.

    Text in, text out: parsing a 1,000-worker page into sample objects cost ~1 s of CPU a scrape and
    left megabytes of fragmented object arenas in the process that answered; this is a few string
    passes in C."""
    merged: dict[str, list[str]] = {}
    for text in texts:
        for block in ("\n" + text).split("\n# HELP ")[1:]:
            help_end = block.find("\n")
            type_end = block.find("\n", help_end + 1) if help_end >= 0 else -1
            if type_end < 0:  # a family with no samples, last on the page
                head, samples = block + "\n", ""
            else:
                head, samples = block[: type_end + 1], block[type_end + 1 :]
                if samples and not samples.endswith("\n"):
                    samples += "\n"  # (the split took the newline before the next family)
            name = block[: help_end if help_end >= 0 else len(block)].split(" ", 1)[0]
            entry = merged.get(name)
            if entry is None:
                merged[name] = ["# HELP " + head, samples]
            else:
                entry.append(samples)
    return "".join("".join(entry) for entry in merged.values()).encode()


_FIRST_SAMPLE = re.compile(r"^[^#\s].*$", re.M)


def is_labelled(text: str, process: str) -> bool:
    """Whether ``text``'s first sample carries ``process="<process>"`` (as a sibling writes its page
    for the gather); a page without samples needs no label."""
    first = _FIRST_SAMPLE.search(text)
    if first is None:
        return True
    label = _process_label(process)
    line = first.group(0)
    return "{" + label + "," in line or "{" + label + "}" in line


def is_exposition(text: str) -> bool:
    """Whether ``text`` looks like ``generate_latest``'s output (what a sibling serves)."""
    return text == "" or text.startswith("# HELP ")


class ProcessMetrics:
    """``/metrics`` of one child of a ``--workers N`` server: its own series and its siblings',
    each labelled ``process="<i>"``.

    Per process, not summed: most of the series are per-process views that do not add up (the
    fleet each process sees, breaker states, KV views, NATS connections, replica peers), and a sum
    would hide a process that lags or is stuck; counters add up in PromQL
    (``sum without (process) (...)``). Each child serves its raw series on a Unix socket in the
    server's private runtime folder; a scrape asks every sibling at once, waits at most
    ``timeout_s``, and skips (and counts, ``infera_server_metrics_siblings_skipped_total``) one
    that does not answer: restarting, stopped, or too busy."""

    def __init__(
        self,
        registry: MetricsRegistry,
        *,
        index: int,
        count: int,
        socket_path: Callable[[int], str],
        restarts: int = 0,
        timeout_s: float = GATHER_TIMEOUT_S,
    ) -> None:
        self.registry = registry
        self.index = index
        self.count = count
        self.socket_path = socket_path
        self.restarts = restarts
        self.timeout_s = timeout_s
        self.skipped: dict[int, int] = {}
        self.gathers = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._own)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        path = self.socket_path(self.index)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left by the process this one replaces
        await web.UnixSite(self._runner, path).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            with contextlib.suppress(OSError):
                os.unlink(self.socket_path(self.index))

    async def _own(self, request: web.Request) -> web.Response:
        # labelled here, as it is written: the gatherer only groups the families
        return web.Response(body=await render_page(self.registry, str(self.index)), content_type="text/plain")

    async def _sibling(self, index: int) -> str | None:
        # A fresh connection each time: a sibling may have been restarted since the last scrape.
        try:
            async with (
                aiohttp.ClientSession(
                    connector=aiohttp.UnixConnector(path=self.socket_path(index)),
                    timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                ) as session,
                session.get("http://localhost/metrics") as resp,
            ):
                if resp.status == 200:
                    return await resp.text()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            pass
        return None

    async def render(self) -> bytes:
        siblings = [i for i in range(self.count) if i != self.index]
        texts = await asyncio.gather(*(self._sibling(i) for i in siblings))
        self.gathers += 1
        answered = []
        for i, text in zip(siblings, texts):
            if text is None:
                self.skipped[i] = self.skipped.get(i, 0) + 1
            else:
                answered.append((str(i), text))
        own = read_page(self.registry)  # on the loop (the collectors read live state); after the skips
        # Building, formatting and merging megabytes of text with a large fleet: in a thread.
        return await asyncio.to_thread(self._merge, own, answered)

    def _merge(self, own: PageParts, answered: list[tuple[str, str]]) -> bytes:
        texts = [format_page(own, str(self.index)).decode()]
        for process, text in answered:
            if not is_exposition(text):  # counted as not answered (next scrape)
                i = int(process)
                self.skipped[i] = self.skipped.get(i, 0) + 1
            elif is_labelled(text, process):
                texts.append(text)
            else:  # a sibling that does not label its page (started from an older install)
                texts.append(label_process(text, process))
        return merge_labelled_texts(texts)

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("infera_server_processes", "Processes of this server (--workers)", value=self.count)
        yield CounterMetricFamily(
            "infera_server_process_restarts",
            "Times this process's slot was restarted after its process died",
            value=self.restarts,
        )
        fam = CounterMetricFamily(
            "infera_server_metrics_siblings_skipped",
            "Scrapes of this process that left a sibling's series out (it did not answer in time)",
            labels=["sibling"],
        )
        for i, n in sorted(self.skipped.items()):
            fam.add_metric([str(i)], n)
        yield fam
