"""Request transports behind one interface, picked per worker by the transport its record states.

A server always speaks HTTP (it needs no broker); with ``--request-transport nats`` it also has a
NATS client. Workers say how they are reached (``request_transport`` in their record), so one fleet
may mix both planes: each worker is sent requests the way it serves them, and a worker this server
cannot reach (a NATS worker, no NATS here) is named, not routed to.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Protocol

from infera.discovery.record import WorkerRecord
from infera.transport.http import HttpTransport

if TYPE_CHECKING:
    from infera.transport.nats_request import NatsRequestClient


class UpstreamReply(Protocol):
    """A worker's reply as the router reads it (HTTP ``UpstreamResponse`` or ``NatsResponse``)."""

    status: int
    content_type: str

    async def next_chunk(self) -> bytes: ...

    async def read(self) -> bytes: ...

    def release(self) -> None: ...


class RequestTransport(Protocol):
    async def send(self, worker: WorkerRecord, path: str, body: bytes, headers: Iterable[tuple[str, str]] = (),
                   stream: bool = False) -> UpstreamReply: ...


class RequestTransports:
    def __init__(self, http: HttpTransport, nats: "NatsRequestClient | None" = None) -> None:
        self.http = http
        self.nats = nats

    def unreachable_reason(self, worker: WorkerRecord) -> str | None:
        """Why this server cannot send requests to ``worker`` (None: it can)."""
        if worker.request_transport == "nats" and self.nats is None:
            return ("serves requests over NATS only, and this server has no NATS: start it with "
                    "--request-transport nats (and --nats-server) to route to it")
        return None

    async def send(self, worker: WorkerRecord, path: str, body: bytes, headers: Iterable[tuple[str, str]] = (),
                   stream: bool = False) -> UpstreamReply:
        if worker.request_transport == "nats" and self.nats is not None:
            return await self.nats.send(worker, path, body, headers, stream)
        return await self.http.send(worker, path, body, headers, stream)

    def forget(self, worker: WorkerRecord) -> None:
        self.http.forget(worker.url)
        if self.nats is not None:
            self.nats.forget(worker)

    async def start(self) -> None:
        await self.http.start()
        if self.nats is not None:
            await self.nats.start()

    async def close(self) -> None:
        if self.nats is not None:
            await self.nats.close()
        await self.http.close()
