"""What the router records, as an interface: the dispatchers, the relays and the migrating stream
call these and nothing else. The Prometheus implementation is ``infera.server.metrics.ServerMetrics``
(the server owns the exposition); the router depends only on this protocol so that it never
imports the server above it.
"""

from __future__ import annotations

from typing import Protocol


class InflightGauge(Protocol):
    """One worker's count of requests in flight."""

    def inc(self) -> None: ...

    def dec(self) -> None: ...


class RouterMetrics(Protocol):
    def observe_pick(self, role: str, seconds: float) -> None:
        """The policy's pick time; ``role`` is ``mixed``, ``prefill`` or ``decode``."""
        ...

    def inflight_gauge(self, worker: str) -> InflightGauge:
        """The in-flight gauge of ``worker`` (the same object every call while the worker lives)."""
        ...

    def count_retry(self, route: str, reason: str) -> None:
        """A request sent again to another worker before its first byte."""
        ...

    def count_midstream_failure(self, worker: str) -> None:
        """A stream that broke on ``worker`` after its first byte."""
        ...

    def count_migration(self, reason: str, seconds: float) -> None:
        """A broken stream continued on another worker, and how long the switch took."""
        ...

    def count_migration_failed(self, reason: str) -> None:
        """A broken stream that could not be continued."""
        ...

    def request_inflight_gauge(self, router: str) -> InflightGauge:
        """Requests in flight through ``router`` (``mixed``, ``disagg`` or ``direct``): from the
        dispatch until the reply, or its stream, has ended."""
        ...

    def observe_request(self, router: str, outcome: str, route: str, stream: bool, seconds: float) -> None:
        """A request's dispatch ended: ``outcome`` is ``ok``, a status class (``4xx``, ``5xx``, or
        ``429``/``502``/``503`` themselves), ``error`` (a stream broke) or ``client_gone``."""
        ...

    def observe_pd_dispatch(self, leg: str, worker: str, seconds: float) -> None:
        """A PD leg answered in full (the prefill leg, or an unstreamed decode leg) on ``worker``."""
        ...

    def count_pd_bootstrap_failure(self, reason: str) -> None:
        """A PD attempt failed before the client's first byte (``prefill_5xx``, ``decode_unreachable``, …)."""
        ...

    def count_cache_control(self, retention: str) -> None:
        """A pick made with the request's cache hints in hand; ``retention``: none, short or long."""
        ...

    def count_cache_locality_skipped(self, reason: str) -> None:
        """A pick that ignored prompt-cache overlap (``multimodal``: images decide instead)."""
        ...
