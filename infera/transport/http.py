"""HTTP request transport: one keep-alive aiohttp connection pool shared by every request."""
from __future__ import annotations

import aiohttp


class HttpTransport:
    """Owns the client session the router uses to reach workers.

    No total/read timeout: a generation may legitimately stream for minutes; the connect timeout
    bounds a dead worker, and a client disconnect cancels the request (closing the connection,
    which the engine observes as an abort).
    """

    def __init__(self, connect_timeout: float = 10.0, keepalive_timeout: float = 60.0) -> None:
        self._connect_timeout = connect_timeout
        self._keepalive_timeout = keepalive_timeout
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=0,  # no pool cap: concurrency is bounded by the engines, not by us
            limit_per_host=0,
            keepalive_timeout=self._keepalive_timeout,
            ttl_dns_cache=300,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout, sock_read=None),
            auto_decompress=False,  # relay bytes as the engine sent them
            skip_auto_headers=("User-Agent",),
        )

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("HttpTransport.start() was not awaited")
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
