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
