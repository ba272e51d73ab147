"""Server metrics on a private CollectorRegistry (no process-global state).

Hot-path children are cached per label tuple: ``labels()`` takes a lock and builds a key, and
every request would otherwise pay for it.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from infera.discovery.fleet import Fleet

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _FleetCollector:
    """``infera_workers{status,disagg_mode}`` recomputed at scrape time from the fleet."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def collect(self):
        fam = GaugeMetricFamily("infera_workers", "Workers known to this server", labels=["status", "disagg_mode"])
        counts: dict[tuple[str, str], int] = {("active", "mixed"): 0, ("draining", "mixed"): 0}
        for r in self._fleet.all():
            counts[(r.status, r.disagg_mode)] = counts.get((r.status, r.disagg_mode), 0) + 1
        for (status, mode), n in sorted(counts.items()):
            fam.add_metric([status, mode], n)
        yield fam


class ServerMetrics:
    def __init__(self, fleet: Fleet) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("infera_requests", "Requests by route, status and worker",
                                ["route", "status", "worker"], registry=r)
        self.e2e = Histogram("infera_request_duration_seconds", "End-to-end request latency",
                             ["route", "stream"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("infera_time_to_first_token_seconds", "Time to the first streamed byte",
                              ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.inflight = Gauge("infera_worker_inflight_requests", "Requests in flight per worker",
                              ["worker"], registry=r)
        self.retries = Counter("infera_request_retries", "Attempts that failed before the first byte "
                               "and were retried elsewhere", ["route", "reason"], registry=r)
        self.midstream_failures = Counter("infera_midstream_failures", "Streams that broke after "
                                          "the first byte", ["worker"], registry=r)
        self.client_disconnects = Counter("infera_client_disconnects", "Requests abandoned by the "
                                          "client before completion", ["route"], registry=r)
        r.register(_FleetCollector(fleet))
        self._children: dict[tuple, object] = {}

    def _child(self, metric, *labels: str):
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = metric.labels(*labels)
            self._children[key] = child
        return child

    def count_request(self, route: str, status: int, worker: str) -> None:
        self._child(self.requests, route, str(status), worker).inc()

    def observe_e2e(self, route: str, stream: bool, seconds: float) -> None:
        self._child(self.e2e, route, "true" if stream else "false").observe(seconds)

    def observe_ttft(self, route: str, seconds: float) -> None:
        self._child(self.ttft, route).observe(seconds)

    def inflight_gauge(self, worker: str):
        return self._child(self.inflight, worker)

    def count_retry(self, route: str, reason: str) -> None:
        self._child(self.retries, route, reason).inc()

    def count_midstream_failure(self, worker: str) -> None:
        self._child(self.midstream_failures, worker).inc()

    def count_disconnect(self, route: str) -> None:
        self._child(self.client_disconnects, route).inc()

    def forget_worker(self, worker_id: str) -> None:
        """Drop per-worker series when a worker leaves, so /metrics tracks the live fleet."""
        for metric in (self.inflight, self.midstream_failures):
            try:
                metric.remove(worker_id)
            except KeyError:
                pass
        self._children = {k: v for k, v in self._children.items() if worker_id not in k[1]}

    def render(self) -> bytes:
        return generate_latest(self.registry)


MetricsFactory = Callable[[Fleet], ServerMetrics]
