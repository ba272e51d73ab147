"""kvd Prometheus metrics (own CollectorRegistry: no process-global state)."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

L2 = "l2"
L3 = "l3"
TIERS = (L2, L3)


class KvdMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.hits = Counter("infera_kvd_hits", "GETs answered, by the tier that had the value", ["tier"], registry=r)
        self.misses = Counter("infera_kvd_misses", "GET lookups that missed, by tier", ["tier"], registry=r)
        self.evictions = Counter("infera_kvd_evictions", "entries evicted for space, by tier", ["tier"], registry=r)
        self.sets = Counter("infera_kvd_sets", "SETs by outcome (reason; empty = stored)", ["reason"], registry=r)
        self.load_seconds = Histogram(
            "infera_kvd_load_seconds", "time to load a value, by the tier it came from", ["tier"], registry=r,
            buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0))
        self.prefetch = Counter("infera_kvd_prefetch_keys", "prefetch hint keys by outcome", ["outcome"], registry=r)
        self.connections = Gauge("infera_kvd_connections", "open client connections", registry=r)
        self._bytes = Gauge("infera_kvd_bytes", "bytes held, by tier", ["tier"], registry=r)
        self._entries = Gauge("infera_kvd_entries", "entries held, by tier", ["tier"], registry=r)
        for tier in TIERS:  # export zeros before the first event
            self.hits.labels(tier)
            self.misses.labels(tier)
            self.evictions.labels(tier)

    def watch_tier(self, tier: str, nbytes: Callable[[], float], entries: Callable[[], float]) -> None:
        self._bytes.labels(tier).set_function(nbytes)
        self._entries.labels(tier).set_function(entries)

    def render(self) -> bytes:
        return generate_latest(self.registry)
