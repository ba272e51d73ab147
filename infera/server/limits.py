"""The front door's own limits against a hostile (or merely broken) network.

aiohttp alone keeps a connection that never completes its request head for its keep-alive timeout
(3,630 s by default), waits for a body as long as the client trickles it, accepts connections until
``accept`` fails with EMFILE (then ``/health`` cannot be reached either) and reads any number of
request bodies at once. Here, per server process:

* **header timeout** -- a connection whose request head (request line and headers) is not complete
  ``header_timeout`` s after it opened, or after the first byte of a later request on a kept-alive
  connection, is closed. One ``loop.call_later`` handle per connection, armed only while a head is
  awaited.
* **body timeout** -- a request whose body has not fully arrived ``body_timeout`` s after its head
  is closed (timer armed only when the body was not already read with the head).
* **keep-alive** -- aiohttp's own ``keepalive_timeout`` for idle connections between requests.
* **connection cap** -- at most ``max_connections`` open connections. A new one past it evicts the
  oldest connection that has no request in progress (idle, or still trickling its head); with none,
  the new one is aborted at once. Either way the process keeps file descriptors free (the default
  cap is derived from ``RLIMIT_NOFILE`` with headroom for the upstream connections), so ``accept``
  never runs out of them and ``/health`` keeps answering.
* **request bytes in flight** -- the bodies of all requests being handled (their declared
  ``Content-Length``; ``max_request_bytes`` for a chunked one) stay under ``max_inflight_bytes``;
  past it a request gets 503 with ``Retry-After`` before its body is read.
"""
from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterator

from aiohttp import web, web_server
from aiohttp.web_protocol import RequestHandler
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from infera.api.errors import ApiError

log = logging.getLogger("infera.server.limits")

DEFAULT_HEADER_TIMEOUT = 15.0
DEFAULT_BODY_TIMEOUT = 60.0
DEFAULT_KEEPALIVE_TIMEOUT = 75.0
DEFAULT_MAX_INFLIGHT_BYTES = 512 * 1024 * 1024
FD_HEADROOM = 64  # listening sockets, logs, ZMQ/NATS/discovery connections, tokenizer files
MIN_CONNECTIONS = 16


def default_max_connections(nofile: int | None = None) -> int:
    """Half of what the fd limit leaves after a fixed headroom: a proxied request holds its
    client's connection and an upstream one."""
    if nofile is None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if nofile == resource.RLIM_INFINITY:
            nofile = 1 << 20
    return max(MIN_CONNECTIONS, (nofile - FD_HEADROOM) // 2)


@dataclass
class ServerLimits:
    header_timeout: float = DEFAULT_HEADER_TIMEOUT  # 0: off
    body_timeout: float = DEFAULT_BODY_TIMEOUT  # 0: off
    keepalive_timeout: float = DEFAULT_KEEPALIVE_TIMEOUT
    max_connections: int = field(default_factory=default_max_connections)
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES
    max_request_bytes: int = 32 * 1024 * 1024
    # state (one process)
    connections: dict = field(default_factory=dict)  # LimitedRequestHandler -> None, oldest first
    inflight_bytes: int = 0
    header_timeouts: int = 0
    body_timeouts: int = 0
    refused: int = 0
    evicted: int = 0
    busy_rejections: int = 0
    fast_requests: int = 0  # requests the fast path (fast_http.py) answered
    handoffs: int = 0  # connections it handed to aiohttp

    @classmethod
    def from_args(cls, args: Any) -> "ServerLimits":
        max_connections = getattr(args, "max_connections", None)
        return cls(header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                   keepalive_timeout=args.keepalive_timeout,
                   max_connections=max_connections or default_max_connections(),
                   max_inflight_bytes=args.max_inflight_bytes, max_request_bytes=args.max_request_bytes)

    def admit(self, handler: "LimitedRequestHandler") -> bool:
        conns = self.connections
        if len(conns) >= self.max_connections:
            victim = None
            for conn in conns:  # oldest first
                if not conn._request_in_progress and not conn._messages:
                    victim = conn
                    break
            if victim is None:
                self.refused += 1
                return False
            del conns[victim]
            self.evicted += 1
            victim.evict()
        conns[handler] = None
        return True

    def reserve(self, n: int) -> bool:
        if self.inflight_bytes + n > self.max_inflight_bytes and self.inflight_bytes > 0:
            return False  # one request alone may always go (it is under --max-request-bytes)
        self.inflight_bytes += n
        return True


class LimitsMetrics:
    """The limits' state and what they closed or refused, for /metrics."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits

    def collect(self) -> Iterator[Metric]:
        lim = self.limits
        yield GaugeMetricFamily("infera_http_connections", "open client connections (this process)",
                                value=len(lim.connections))
        yield GaugeMetricFamily("infera_http_inflight_request_bytes",
                                "request body bytes held by the requests in progress (--max-inflight-bytes)",
                                value=lim.inflight_bytes)
        closed = CounterMetricFamily("infera_http_connections_closed_total",
                                     "client connections the limits closed or refused, by reason", labels=["reason"])
        for reason, value in (("header_timeout", lim.header_timeouts), ("body_timeout", lim.body_timeouts),
                              ("evicted", lim.evicted), ("refused", lim.refused)):
            closed.add_metric([reason], value)
        yield closed
        yield CounterMetricFamily("infera_http_busy_rejections_total",
                                  "requests answered 503 server_busy: past --max-inflight-bytes",
                                  value=lim.busy_rejections)
        yield CounterMetricFamily("infera_http_fast_path_requests_total",
                                  "inference requests answered by the front door's fast path (--http-fast-path)",
                                  value=lim.fast_requests)
        yield CounterMetricFamily("infera_http_fast_path_handoffs_total",
                                  "client connections the fast path handed to aiohttp (a request it does not take: "
                                  "another route, a chunked body, Expect, HTTP/1.0, ...)", value=lim.handoffs)


class LimitedRequestHandler(RequestHandler):
    """aiohttp's protocol with the connection cap and the header timeout."""

    def __init__(self, manager: web_server.Server, *, limits: ServerLimits, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._limits = limits
        self._refused = False
        self._head_handle: asyncio.TimerHandle | None = None
        self._head_count = 0  # requests parsed when the head timer was armed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._limits.admit(self):
            self._refused = True
            log.debug("connection refused: %d connections open (--max-connections)", self._limits.max_connections)
            transport.abort()  # RST: the fd is free at once
            return
        super().connection_made(transport)
        self._arm_head()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            return
        self._limits.connections.pop(self, None)
        if self._head_handle is not None:
            self._head_handle.cancel()
            self._head_handle = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        if self._head_handle is not None:
            if self._request_count != self._head_count:  # a head completed
                self._head_handle.cancel()
                self._head_handle = None
        elif not self._request_in_progress and not self._messages and not self._force_close:
            self._arm_head()  # the first bytes of a later request's head on a kept-alive connection

    def _arm_head(self) -> None:
        timeout = self._limits.header_timeout
        if timeout > 0:
            self._head_count = self._request_count
            self._head_handle = self._loop.call_later(timeout, self._head_expired)

    def _head_expired(self) -> None:
        self._head_handle = None
        if self._request_count != self._head_count or self._request_in_progress or self._messages:
            return  # a head completed meanwhile (or bytes of a body in progress armed it)
        self._limits.header_timeouts += 1
        log.debug("closing a connection whose request head took over %.0f s", self._limits.header_timeout)
        self._close_transport()

    def evict(self) -> None:
        log.debug("closing an idle connection for a new one (--max-connections %d)", self._limits.max_connections)
        self._close_transport()

    def _close_transport(self) -> None:
        transport = self.transport
        if transport is not None:
            transport.abort()  # connection_lost follows: the handler's task, if any, is cancelled


class _LimitedServer(web_server.Server):
    _limits: ServerLimits
    _front: Callable[[Any], asyncio.Protocol] | None = None

    def aiohttp_protocol(self) -> RequestHandler:
        return LimitedRequestHandler(self, loop=self._loop, limits=self._limits, **self._kwargs)

    def __call__(self) -> asyncio.Protocol:  # type: ignore[override]
        if self._front is not None:  # the fast path (fast_http.py), which hands other requests to aiohttp
            return self._front(self)
        return self.aiohttp_protocol()


class LimitedAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections are :class:`LimitedRequestHandler`."""

    def __init__(self, app: web.Application, limits: ServerLimits,
                 front: Callable[[Any], asyncio.Protocol] | None = None, **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=limits.keepalive_timeout, **kwargs)
        self.limits = limits
        self.front = front

    async def _make_server(self) -> web_server.Server:
        server = await super()._make_server()
        server.__class__ = _LimitedServer  # the app's own Server, with our protocol factory
        server._limits = self.limits
        server._front = self.front
        return server


def _body_expired(request: web.BaseRequest, limits: ServerLimits) -> None:
    if not request.content.is_eof():
        limits.body_timeouts += 1
        log.debug("closing a connection whose request body took over %.0f s", limits.body_timeout)
        transport = request.transport
        if transport is not None:
            transport.abort()


def limits_middleware(limits: ServerLimits):
    """The body timeout and the request-bytes-in-flight cap, around every request with a body."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if not request.body_exists:
            return await handler(request)
        size = request.content_length
        if size is None:
            size = limits.max_request_bytes  # chunked: at most this much will be read
        elif size > limits.max_request_bytes:  # as the handlers do, before reading anything
            raise web.HTTPRequestEntityTooLarge(max_size=limits.max_request_bytes, actual_size=size)
        if not limits.reserve(size):
            limits.busy_rejections += 1
            raise ApiError(503, f"the server holds {limits.inflight_bytes} bytes of request bodies (limit "
                                f"{limits.max_inflight_bytes}, --max-inflight-bytes): retry shortly",
                           "server_busy", headers={"Retry-After": "1"})
        timer = None
        if limits.body_timeout > 0 and not request.content.is_eof():
            timer = asyncio.get_running_loop().call_later(limits.body_timeout, _body_expired, request, limits)
        try:
            return await handler(request)
        finally:
            limits.inflight_bytes -= size
            if timer is not None:
                timer.cancel()

    return middleware
