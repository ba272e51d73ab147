"""The process's NATS connections: nats-py for KV events and replica sync (JetStream), and a lean
core client (``nats_core``) for requests, made on first use. Both share the servers and the
background-connect behaviour.

It comes up in the background: a server or worker starts while the broker is still down and
keeps retrying, instead of failing its start (a Pod's NATS may start after it). After the first
connect nats-py reconnects on its own, forever; subscriptions are restored by the client.
Listeners hear ``disconnected`` / ``reconnected`` so in-flight work that lost its replies is
failed at once rather than left waiting for an idle timeout.
"""
from __future__ import annotations

import asyncio
import base64
import logging

from nats.aio.client import Client
from nats.js import JetStreamContext

from infera.runtime import cancel_and_wait, wait_for
from infera.transport.nats_auth import NatsAuth, redact, redact_url
from infera.transport.nats_core import ConnectionEvents, NatsCoreClient

log = logging.getLogger(__name__)

DEFAULT_NATS_SERVER = "nats://127.0.0.1:4222"


def subject_token(worker_id: str) -> str:
    """A worker id as one NATS subject token: base64url without padding (ids hold ':' and '.')."""
    return base64.urlsafe_b64encode(worker_id.encode()).decode().rstrip("=")


def _url_secrets(url: str) -> tuple[str, ...]:
    """The password or token a server URL carries (redacted wherever they might show)."""
    from urllib.parse import unquote, urlsplit

    try:
        u = urlsplit(url if "://" in url else "nats://" + url)
        return tuple(unquote(x) for x in ((u.password,) if u.password is not None else (u.username,)) if x)
    except ValueError:
        return ()


def token_to_worker_id(token: str) -> str:
    return base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()


class NatsConnection(ConnectionEvents):
    def __init__(self, servers: str = DEFAULT_NATS_SERVER, *, name: str = "infera",
                 reconnect_wait: float = 0.5, connect_timeout: float = 2.0, auth: NatsAuth | None = None) -> None:
        self._servers = [s.strip() for s in servers.split(",") if s.strip()]
        self.auth = auth or NatsAuth()
        self.name = name
        self.reconnect_wait = reconnect_wait
        self.connect_timeout = connect_timeout
        self.nc: Client = Client()
        self._js: JetStreamContext | None = None
        self._init_events()
        self._task: asyncio.Task | None = None
        self._closing = False
        self._disconnects = 0
        self._core: NatsCoreClient | None = None

    @classmethod
    def from_args(cls, args, *, name: str) -> "NatsConnection":
        """From the plane flags (``--nats-server`` and the credentials/TLS ones)."""
        return cls(args.nats_server, name=name, auth=NatsAuth.from_args(args))

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Returns at once; the first connect is retried in the background until it succeeds."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._connect_loop())

    @property
    def servers(self) -> list[str]:
        """The server URLs as they may be shown: credentials in them redacted."""
        return [redact_url(u) for u in self._servers]

    def _scrub(self, text: object) -> str:
        """A message (an exception's) fit for a log line: no URL credentials, no password or token."""
        secrets = self.auth.secrets + tuple(filter(None, (p for u in self._servers for p in _url_secrets(u))))
        return redact(str(text), secrets)

    @property
    def connected(self) -> bool:
        return self._connected.is_set() and self.nc.is_connected and (self._core is None or self._core.connected)

    @property
    def disconnects(self) -> int:
        return self._disconnects + (self._core.disconnects if self._core is not None else 0)

    def core(self) -> NatsCoreClient:
        """The request path's connection (its own TCP connection), started on first call."""
        if self._core is None:
            self._core = NatsCoreClient(self._servers, name=f"{self.name} (requests)", auth=self.auth,
                                        reconnect_wait=self.reconnect_wait, connect_timeout=self.connect_timeout)
            if not self._closing:
                self._core.begin()
        return self._core

    @property
    def js(self) -> JetStreamContext:
        if self._js is None:
            self._js = self.nc.jetstream()
        return self._js

    @property
    def max_payload(self) -> int:
        return self.nc.max_payload if self.nc.is_connected else 1024 * 1024

    async def close(self) -> None:
        self._closing = True
        if self._core is not None:
            await self._core.close()
        await cancel_and_wait(self._task)
        self._task = None
        if not self.nc.is_closed:
            try:
                await wait_for(self.nc.close(), 5.0)
            except (asyncio.TimeoutError, Exception) as exc:  # closing a broken connection
                log.debug("nats close: %s", self._scrub(exc))
        self._connected.clear()

    # -- internals ----------------------------------------------------------------------------
    async def _connect_loop(self) -> None:
        warned = False
        while not self._closing:
            try:
                await self.nc.connect(servers=self._servers, name=self.name, allow_reconnect=True,
                                      max_reconnect_attempts=-1, reconnect_time_wait=self.reconnect_wait,
                                      connect_timeout=self.connect_timeout, ping_interval=5,
                                      max_outstanding_pings=2, error_cb=self._error,
                                      disconnected_cb=self._disconnected, reconnected_cb=self._reconnected,
                                      **self.auth.nats_py_options())
                self._connected.set()
                url = self.nc.connected_url
                # host:port only: the URL's netloc would carry user:password
                log.info("connected to NATS at %s", f"{url.hostname}:{url.port}" if url else ",".join(self.servers))
                return
            except Exception as exc:  # broker not up yet: keep trying, say so once
                if not warned:
                    log.warning("cannot reach NATS at %s (%s); retrying every %.1fs", ",".join(self.servers),
                                self._scrub(exc) or type(exc).__name__, self.reconnect_wait)
                    warned = True
                self.nc = Client()
                self._js = None  # a context made earlier wraps the dead client
                await asyncio.sleep(self.reconnect_wait)

    async def _error(self, exc: Exception) -> None:
        log.debug("nats: %s", self._scrub(exc))

    async def _disconnected(self) -> None:
        if self._closing:
            return
        self._disconnects += 1
        log.warning("NATS connection lost; reconnecting")
        await self._fire(self._on_disconnect)

    async def _reconnected(self) -> None:
        log.info("NATS connection restored")
        await self._fire(self._on_reconnect)
