"""Worker side of requests over NATS: serve ``infera.req.<token>`` by proxying to the engine's HTTP API.

Runs in the worker's launcher. Each request is a task keyed by its reply inbox; its engine reply
is streamed back as frames (``nats_frames``). Admission: with ``max_pending`` > 0, a request
arriving while that many are in flight is answered ``busy`` at once (the router fails over or
answers 429). A cancel on ``infera.cancel.<token>`` (client gone, router timeout) cancels the task,
which closes the engine connection: the engine aborts the generation and frees its slot. Losing
the broker cancels everything in flight: those replies cannot be delivered, and the routers fail
the requests on their side.
"""
from __future__ import annotations

import asyncio
import logging
import time

from infera.api.pooling import POOLING_ROUTES
from infera.transport.http import HttpTransport, UpstreamError, UpstreamResponse, split_http_url
from infera.transport.nats_conn import NatsConnection, subject_token
from infera.transport.nats_core import NatsError
from infera.transport.nats_frames import (BUSY, DATA, ERROR, HEAD, HEARTBEAT_S, FrameError, alive_subject,
                                          cancel_subject, decode_request, encode_frame, request_subject,
                                          split_payload)

log = logging.getLogger(__name__)

# messages (and its count_tokens): engines that speak it; responses: the Responses API (conversations kept by
# the router); the pooling and utility routes (embeddings, rerank, score, classify, tokenize)
_ALLOWED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
                            "/v1/responses", *POOLING_ROUTES})


class _Request:
    __slots__ = ("inbox", "seq", "task", "started")

    def __init__(self, inbox: bytes) -> None:
        self.inbox = inbox
        self.seq = 0
        self.task: asyncio.Task | None = None
        self.started = time.monotonic()


class _Watchdog:
    """The time limits of one request as one timer, instead of an ``asyncio.wait_for`` per await
    (each wraps the awaited coroutine in a new Task: a fifth of this server's CPU per request under
    load). When the engine has been silent for ``idle`` seconds, or the deadline has passed, it
    cancels the request's task and says so (``fired``; ``capped``: the deadline did it). The caller
    ``touch``es it after each step; the timer is re-armed only when it comes due."""

    __slots__ = ("loop", "task", "idle", "deadline", "last", "handle", "fired", "capped")

    def __init__(self, idle: float, deadline: float | None) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.idle = idle
        now = self.loop.time()
        # deadline is on time.monotonic(); the loop has its own clock
        self.deadline = None if deadline is None else now + (deadline - time.monotonic())
        self.last = now
        self.fired = self.capped = False
        self.handle: asyncio.TimerHandle | None = None
        due = self._due()
        if due is not None:
            self.handle = self.loop.call_at(due, self._check)

    def _due(self) -> float | None:
        due = self.last + self.idle if self.idle > 0 else None
        if self.deadline is not None:
            due = self.deadline if due is None else min(due, self.deadline)
        return due

    def _check(self) -> None:
        due = self._due()
        if due is not None and due - self.loop.time() > 0.001:  # there was progress since: wait on
            self.handle = self.loop.call_at(due, self._check)
            return
        self.handle = None
        self.fired = True
        self.capped = self.deadline is not None and due == self.deadline
        self.task.cancel()

    def touch(self) -> None:
        self.last = self.loop.time()

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


class NatsRequestServer:
    def __init__(self, nats: NatsConnection, worker_id: str, engine_url: str, *, idle_timeout: float = 900.0,
                 max_duration: float = 0.0, max_pending: int = 0, http: HttpTransport | None = None) -> None:
        self.nats = nats
        self.worker_id = worker_id
        self.token = subject_token(worker_id)
        self.engine = split_http_url(engine_url)
        self.idle_timeout = idle_timeout
        self.max_duration = max_duration
        self.max_pending = max_pending
        self.http = http or HttpTransport()
        self.core = nats.core()
        self._requests: dict[bytes, _Request] = {}
        self._req_sub: bytes | None = None
        self._cancel_sub: bytes | None = None
        self.served = 0
        self.refused = 0
        self.cancelled = 0
        self.heartbeat_s = HEARTBEAT_S
        self._alive_subject = alive_subject(self.token).encode()
        self._heartbeat: asyncio.TimerHandle | None = None
        self.core.on_disconnect(self._on_disconnect)

    @property
    def inflight(self) -> int:
        return len(self._requests)

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        core = self.core
        self._cancel_sub = core.subscribe(cancel_subject(self.token), self._on_cancel)
        self._req_sub = core.subscribe(request_subject(self.token), self._on_request)
        # Subscribed on the broker before the record is registered (when the broker is up; if not,
        # the subscriptions go out with the connect, and routers see "no responders" till then).
        if await core.wait_connected(5):
            try:
                await core.flush(timeout=5)
            except (NatsError, asyncio.TimeoutError) as exc:
                log.warning("NATS flush after subscribing: %s", exc)
        self._beat()
        log.info("serving NATS subject %s for %s", request_subject(self.token), self.worker_id)

    def _beat(self) -> None:
        """Routers give up on this worker's requests when these stop (the process died)."""
        if self.core.connected:
            try:
                self.core.publish(self._alive_subject, b"")
            except NatsError:
                pass
        self._heartbeat = asyncio.get_running_loop().call_later(self.heartbeat_s, self._beat)

    async def drain(self, timeout: float) -> None:
        """Stop taking requests (routers get "no responders" and go elsewhere), then give those in
        flight up to ``timeout`` seconds; the rest are cancelled by ``stop``."""
        if self._req_sub is not None:
            self.core.unsubscribe(self._req_sub)
            self._req_sub = None
            try:  # the broker has it before routers are told we are gone
                await self.core.flush(timeout=2)
            except (NatsError, asyncio.TimeoutError) as exc:
                log.debug("flush after unsubscribe: %s", exc)
        tasks = [r.task for r in self._requests.values() if r.task is not None]
        if tasks and timeout > 0:
            log.info("draining %d NATS request(s) (up to %.0fs)", len(tasks), timeout)
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            if pending:
                log.warning("%d NATS request(s) still running after the drain timeout", len(pending))

    async def stop(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        for sid in (self._req_sub, self._cancel_sub):
            if sid is not None:
                self.core.unsubscribe(sid)
        self._req_sub = self._cancel_sub = None
        tasks = [r.task for r in self._requests.values() if r.task is not None]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.http.close()

    # -- subscriptions -------------------------------------------------------------------------------
    def _on_request(self, _subject: bytes, inbox: bytes, data: bytes, _status: int) -> None:
        if not inbox or inbox in self._requests:
            return
        req = _Request(inbox)
        if self.max_pending and len(self._requests) >= self.max_pending:
            self.refused += 1
            self._publish(req, BUSY, b"", status=429)
            return
        self._requests[inbox] = req
        req.task = asyncio.ensure_future(self._serve(req, data))
        req.task.add_done_callback(lambda _t, inbox=inbox: self._requests.pop(inbox, None))

    def _on_cancel(self, _subject: bytes, _reply: bytes, data: bytes, _status: int) -> None:
        req = self._requests.get(data)
        if req is not None and req.task is not None and not req.task.done():
            self.cancelled += 1
            req.task.cancel()

    def _on_disconnect(self) -> None:
        for req in list(self._requests.values()):
            if req.task is not None:
                req.task.cancel()

    # -- one request ------------------------------------------------------------------------------------
    async def _serve(self, req: _Request, data: bytes) -> None:
        try:
            path, _stream, asked, headers, body = decode_request(data)
        except FrameError as exc:
            self._publish(req, ERROR, str(exc).encode(), status=400)
            return
        if path not in _ALLOWED_PATHS:
            self._publish(req, ERROR, f"unsupported path {path!r}".encode(), status=404)
            return
        cap = self.max_duration
        if asked > 0:
            cap = asked if cap <= 0 else min(cap, asked)
        deadline = req.started + cap if cap > 0 else None
        resp: UpstreamResponse | None = None
        watchdog = _Watchdog(self.idle_timeout, deadline)
        try:
            try:
                host, port = self.engine
                resp = await self.http.post(host, port, path, body, headers)
                watchdog.touch()
                streaming = resp.content_type.startswith("text/event-stream")
                if streaming:
                    first = await resp.next_chunk()
                    watchdog.touch()
                    await self._send_body(req, first, resp, head=True, end=not first)
                    while first:
                        chunk = await resp.next_chunk()
                        if chunk:
                            # One loop turn before publishing: events the engine wrote meanwhile
                            # (a burst of tokens, or a backlog under load) join this frame. Each
                            # NATS message costs the broker, this process and the router about as
                            # much as its bytes; per-event frames kept streams at 0.58x HTTP's
                            # throughput, coalesced 0.8x (bench/router_overhead.py). Spaced
                            # tokens (a real engine's ITL) still go out one by one at once.
                            await asyncio.sleep(0)
                            if resp.ready:
                                chunk += await resp.next_chunk()
                        watchdog.touch()
                        await self._send_body(req, chunk, resp, head=False, end=not chunk)
                        if not chunk:
                            break
                else:  # a unary reply travels as one message (split only past the max payload)
                    parts = []
                    while True:
                        chunk = await resp.next_chunk()
                        watchdog.touch()
                        if not chunk:
                            break
                        parts.append(chunk)
                    watchdog.cancel()
                    await self._send_body(req, b"".join(parts), resp, head=True, end=True)
                self.served += 1
            finally:
                watchdog.cancel()
        except asyncio.CancelledError:
            if not watchdog.fired:
                self._publish(req, ERROR, b"request cancelled", status=499)
                raise
            uncancel = getattr(watchdog.task, "uncancel", None)  # 3.11+: this cancel is handled
            if uncancel is not None:
                uncancel()
            what = "exceeded its max duration" if watchdog.capped else (
                f"got nothing from the engine for {self.idle_timeout:g}s")
            self._publish(req, ERROR, f"request {what}".encode(), status=504)
        except UpstreamError as exc:
            self._publish(req, ERROR, f"engine request failed: {exc}".encode(), status=502)
        finally:
            if resp is not None:
                resp.release()  # unfinished: the connection is closed and the engine aborts

    async def _send_body(self, req: _Request, data: bytes, resp: UpstreamResponse, *, head: bool, end: bool) -> None:
        core = self.core
        pieces = split_payload(data, core.max_payload)
        for i, piece in enumerate(pieces):
            last = end and i == len(pieces) - 1
            if head and i == 0:
                self._publish(req, HEAD, piece, status=resp.status, content_type=resp.content_type, end=last)
            else:
                self._publish(req, DATA, piece, end=last)
        if core.congested:  # a slow broker: hold the engine's stream back rather than buffer it all
            await core.drain()

    def _publish(self, req: _Request, kind: int, payload: bytes, *, status: int | None = None,
                 content_type: str | None = None, end: bool = False) -> None:
        frame = encode_frame(kind, req.seq, payload, end=end, status=status, content_type=content_type)
        req.seq += 1
        try:
            self.core.publish(req.inbox, frame)
        except NatsError as exc:  # broker gone: the router fails this request on its side
            log.debug("reply frame to %r not sent: %s", req.inbox, exc)
