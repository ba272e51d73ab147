"""Discovery protocols: the server watches the fleet; a worker registers itself."""
from __future__ import annotations

from typing import Protocol

from infera.discovery.fleet import Fleet
from infera.discovery.record import WorkerRecord


class Discovery(Protocol):
    """Server side: keep ``fleet`` equal to the registry's content (list, watch, resync)."""

    async def start(self, fleet: Fleet) -> None: ...

    async def stop(self) -> None: ...


class Registration(Protocol):
    """Worker side: publish ``record`` while alive; re-assert it if the registry lost it."""

    async def register(self, record: WorkerRecord) -> None: ...

    async def deregister(self) -> None: ...

    async def close(self) -> None: ...
