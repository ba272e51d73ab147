"""Router side of requests over NATS: publish to the worker's subject, stream the reply frames back.

One wildcard subscription (``<inbox prefix>.*``) carries every reply of this server, demultiplexed
by the last token, so a request costs one publish and no subscribe/unsubscribe round trips. The
reply looks like an HTTP ``UpstreamResponse`` (status, content type, ``next_chunk``, ``read``,
``release``), so mixed dispatch and both PD legs use NATS workers unchanged.

Every wait is bounded: the next frame within ``idle_timeout`` (and what is left of
``max_duration``); expiry cancels the request on the worker and raises ``UpstreamTimeout`` (504).
Leaving early (client gone, timeout, failure) publishes a cancel, so the worker aborts the engine
request. Frames carry sequence numbers: a lost frame fails the request instead of corrupting it.
A lost NATS connection fails every request in flight at once (their replies are gone with it);
new requests wait a bounded time for the reconnect, so traffic resumes by itself.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from typing import Iterable

from infera.discovery.record import WorkerRecord
from infera.transport.http import ChunkedReply, UpstreamError, UpstreamTimeout
from infera.transport.nats_conn import NatsConnection, subject_token
from infera.transport.nats_core import NatsError
from infera.transport.nats_frames import (ALIVE_SUBJECT, BUSY, DEAD_AFTER_S, ERROR, HEAD, FrameError,
                                          cancel_subject, decode_frame, encode_request, request_subject)

log = logging.getLogger(__name__)

# How long a new request waits for a lost NATS connection to come back before failing.
RECONNECT_GRACE_S = 10.0
# A liveness check this late ran after the router's own loop was held up (CPU starvation, a long
# callback): heartbeats that arrived meanwhile still wait unread behind it, so it judges again once
# they are read (LIVENESS_RECHECK_S later) instead of failing live workers' requests.
LIVENESS_LATE_S = 0.5
LIVENESS_RECHECK_S = 0.1


class AdmissionRefused(UpstreamError):
    """The worker's request backlog is full (``--nats-req-max-pending``): try another, or 429."""

    status = 429


class NatsResponse(ChunkedReply):
    """One request's reply, fed frame by frame by the client's inbox subscription."""

    __slots__ = ("_client", "worker_id", "cancel_subject", "token", "sent_at", "alive_at", "inbox", "status", "content_type", "complete", "_chunks", "_error",
                 "_waiter", "_headers", "_expected_seq", "_deadline", "_released", "_idle")

    def __init__(self, client: "NatsRequestClient", worker_id: str, cancel_subject: bytes, inbox: bytes,
                 idle_timeout: float, deadline: float | None) -> None:
        self._client = client
        self.worker_id = worker_id
        self.cancel_subject = cancel_subject
        self.token = b""  # the worker's subject token: its heartbeats are keyed by it
        self.sent_at = 0.0
        self.alive_at: float | None = None  # the worker's last heartbeat seen while this was pending
        self.inbox = inbox
        self.status = 0
        self.content_type = "application/json"
        self.complete = False
        self._chunks: collections.deque[bytes] = collections.deque()
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future | None = None
        self._headers: asyncio.Future = asyncio.get_running_loop().create_future()
        self._expected_seq = 0
        self._idle = idle_timeout
        self._deadline = deadline
        self._released = False

    # -- fed by the subscription ---------------------------------------------------------------
    def _on_frame(self, data: bytes, status: int = 0) -> None:
        """One reply message; ``status`` is its NATS header status (503: no responders)."""
        if self.complete or self._error is not None:
            return
        before = not self._headers.done()
        if not data and status == 503:
            # The broker itself: nobody subscribes the worker's subject (gone, or draining).
            self._fail(UpstreamError(f"worker {self.worker_id} is not serving its NATS subject (no responders)",
                                     before_response=True))
            return
        try:
            kind, end, seq, status, content_type, body = decode_frame(data)
        except FrameError as exc:
            self._fail(UpstreamError(f"malformed reply from {self.worker_id}: {exc}", before_response=before))
            return
        if seq != self._expected_seq:
            self._fail(UpstreamError(f"reply frames from {self.worker_id} were lost (expected #{self._expected_seq}, "
                                     f"got #{seq})", before_response=before))
            return
        self._expected_seq += 1
        if kind == HEAD:
            self.status = status  # type: ignore[assignment]
            self.content_type = content_type  # type: ignore[assignment]
            if before:
                self._headers.set_result(None)
        elif kind == BUSY:
            self._fail(AdmissionRefused(f"worker {self.worker_id} request backlog over limit", before_response=True))
            return
        elif kind == ERROR:
            message = body.decode("utf-8", "replace") or "request failed"
            error = UpstreamTimeout if status == 504 else UpstreamError
            self._fail(error(f"worker {self.worker_id}: {message}", before_response=before))
            return
        elif before:  # DATA before HEAD
            self._fail(UpstreamError(f"malformed reply from {self.worker_id}: a data frame before the head",
                                     before_response=True))
            return
        if body:
            self._chunks.append(body)
        if end:
            self.complete = True
            self._client._done(self)
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if self.complete or self._error is not None:
            return
        self._error = error
        if not self._headers.done():
            self._headers.set_exception(error)
            self._headers.exception()  # retrieved: no "never retrieved" warning if nobody waits
        self._client._done(self)
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- consumer side -------------------------------------------------------------------------
    def _arm(self) -> asyncio.TimerHandle | None:
        """A timer for the next wait: the idle timeout, capped by what is left in total. One
        ``call_later`` per wait (not an ``asyncio.wait_for``: that costs a future, a handle and
        callbacks more, on every request); on expiry the reply fails, which wakes the waiter."""
        t = self._idle if self._idle > 0 else None
        cap = False
        if self._deadline is not None:
            left = max(0.0, self._deadline - time.monotonic())
            if t is None or left <= t:
                t, cap = left, True
        return None if t is None else asyncio.get_running_loop().call_later(t, self._timed_out, cap)

    def _timed_out(self, cap: bool) -> None:
        if self.complete or self._error is not None:
            return
        if cap:
            err = UpstreamTimeout(f"nats request to {self.worker_id} exceeded its total time cap",
                                  before_response=not self._headers.done())
        else:
            err = UpstreamTimeout(f"nats request to {self.worker_id} stalled: no reply within {self._idle:g}s "
                                  "(idle timeout)", before_response=not self._headers.done())
        self._fail(err)
        self.release()  # cancels on the worker

    async def wait_headers(self) -> None:
        headers = self._headers
        if not headers.done():
            timer = self._arm()
            try:
                await headers  # ours alone: a cancel of the caller may cancel it, nothing else waits on it
            finally:
                if timer is not None:
                    timer.cancel()
        headers.result()  # raises the reply's error

    async def next_chunk(self) -> bytes:
        """The body bytes received since the last call, waiting (bounded) if there are none;
        b"" at the end; raises UpstreamError if the reply broke off or timed out."""
        while True:
            if self._chunks:
                data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
                self._chunks.clear()
                return data
            if self.complete:
                return b""
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            timer = self._arm()
            try:
                await self._waiter  # woken by a frame, a failure or the timer (which fails the reply)
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()

    def release(self) -> None:
        """Done with the reply; if it had not finished, the worker is told to cancel (the engine
        request is aborted)."""
        if self._released:
            return
        self._released = True
        self._client._done(self)
        if not self.complete and not isinstance(self._error, AdmissionRefused):
            self._client._cancel(self)

    close = release


class NatsRequestClient:
    """Requests to NATS workers. ``max_pending`` > 0 also caps this router's own in-flight
    requests per worker (refused locally, without a round trip)."""

    def __init__(self, nats: NatsConnection, *, idle_timeout: float = 900.0, max_duration: float = 0.0,
                 max_pending: int = 0, reconnect_grace: float = RECONNECT_GRACE_S,
                 dead_after: float = DEAD_AFTER_S) -> None:
        self.nats = nats
        self.idle_timeout = idle_timeout
        self.max_duration = max_duration
        self.max_pending = max_pending
        self.reconnect_grace = reconnect_grace
        self.dead_after = dead_after
        self._alive: dict[bytes, float] = {}  # worker token → loop time of its last heartbeat
        self._liveness: asyncio.TimerHandle | None = None
        self._liveness_due = 0.0  # loop time the pending liveness check is scheduled for
        self._liveness_deferred = False  # the last check was put off (a stalled loop): the next one judges
        self.dead_workers_failed = 0
        self.liveness_checks_deferred = 0
        self._prefix = b""
        self._sid: bytes | None = None
        self._ids = itertools.count(1)
        self._pending: dict[bytes, NatsResponse] = {}
        self._inflight: dict[str, int] = {}  # worker id → this router's unfinished requests
        self._subjects: dict[str, tuple[bytes, bytes, bytes]] = {}  # worker id → (request, cancel subject, token)
        self.sent = 0
        self.cancels_sent = 0
        self._core = None

    @property
    def core(self):
        """The lean request connection (``nats_core``), made and subscribed on first use."""
        core = self._core
        if core is None:
            core = self._core = self.nats.core()
            core.on_disconnect(self._on_disconnect)
            self._prefix = core.new_inbox()
            # One wildcard subscription for every reply, restored by the client on reconnect. It
            # is queued before any request's PUB, so it is in place when the first reply comes.
            self._sid = core.subscribe(self._prefix + b".*", self._on_reply)
            core.subscribe(ALIVE_SUBJECT + "*", self._on_alive)
        return core

    async def start(self) -> None:
        self.core.begin()  # connects in the background: the broker may not be up yet

    async def close(self) -> None:
        for resp in list(self._pending.values()):
            resp._fail(UpstreamError("server shutting down"))
        if self._sid is not None and self._core is not None:
            self._core.unsubscribe(self._sid)
            self._sid = None
        if self._liveness is not None:
            self._liveness.cancel()
            self._liveness = None

    def forget(self, worker: WorkerRecord) -> None:
        subjects = self._subjects.pop(worker.worker_id, None)
        if subjects is not None:
            self._alive.pop(subjects[2], None)

    def inflight(self, worker_id: str) -> int:
        return self._inflight.get(worker_id, 0)

    # -- requests ---------------------------------------------------------------------------------
    async def send(self, worker: WorkerRecord, path: str, body: bytes, headers: Iterable[tuple[str, str]] = (),
                   stream: bool = False) -> NatsResponse:
        """Publish the request; returns once the reply's head frame has arrived (like an HTTP
        status line). Raises ``AdmissionRefused``, ``UpstreamTimeout`` or ``UpstreamError``."""
        wid = worker.worker_id
        if self.max_pending and self._inflight.get(wid, 0) >= self.max_pending:
            raise AdmissionRefused(f"worker {wid} request backlog over limit ({self.max_pending} in flight here)",
                                   before_response=True)
        core = self.core
        if not core.connected:
            if not await core.wait_connected(self.reconnect_grace):
                raise UpstreamError(f"NATS is not connected ({','.join(self.nats.servers)}): cannot reach worker {wid}",
                                    before_response=True)
        if len(body) > core.max_payload - 4096:  # room for the request's meta
            # A client error the router can name, not a broken worker: 413 before anything is sent.
            raise BodyTooLarge(len(body), core.max_payload)
        subjects = self._subjects.get(wid)
        if subjects is None:
            token = subject_token(wid)
            subjects = self._subjects[wid] = (request_subject(token).encode(), cancel_subject(token).encode(),
                                              token.encode())
        inbox = b"%s.%d" % (self._prefix, next(self._ids))
        deadline = time.monotonic() + self.max_duration if self.max_duration > 0 else None
        resp = NatsResponse(self, wid, subjects[1], inbox, self.idle_timeout, deadline)
        resp.token = subjects[2]
        resp.sent_at = asyncio.get_running_loop().time()
        resp.alive_at = self._alive.get(subjects[2])
        self._pending[inbox] = resp
        if self._liveness is None and self.dead_after > 0:
            self._schedule_liveness(1.0)
        self._inflight[wid] = self._inflight.get(wid, 0) + 1
        self.sent += 1
        try:
            try:
                core.publish(subjects[0], encode_request(path, stream, tuple(headers), body, self.max_duration), inbox)
            except NatsError as exc:  # lost between the check and now
                raise UpstreamError(f"cannot reach worker {wid}: {exc}", before_response=True) from None
            await resp.wait_headers()
            return resp
        except BaseException:
            resp.release()
            raise

    def _on_alive(self, subject: bytes, _reply: bytes, _data: bytes, _status: int) -> None:
        self._alive[subject[len(ALIVE_SUBJECT):]] = asyncio.get_running_loop().time()

    def _schedule_liveness(self, delay: float) -> None:
        loop = asyncio.get_running_loop()
        self._liveness_due = loop.time() + delay
        self._liveness = loop.call_later(delay, self._check_liveness)

    def _check_liveness(self) -> None:
        """Once a second while requests are pending: fail those whose worker's heartbeat stopped
        (the process is gone; nothing else would tell us before the idle timeout). Workers never
        heard from (older launchers without heartbeats) are left to the idle timeout. A check that
        runs late (this loop was stalled) first lets the heartbeats queued meanwhile be read."""
        self._liveness = None
        if not self._pending:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now - self._liveness_due > LIVENESS_LATE_S and not self._liveness_deferred:
            self._liveness_deferred = True
            self.liveness_checks_deferred += 1
            self._schedule_liveness(LIVENESS_RECHECK_S)
            return
        self._liveness_deferred = False
        if self._core is not None and self._core.connected:  # (a lost broker is handled on its own)
            alive, limit = self._alive, self.dead_after
            for resp in list(self._pending.values()):
                last = alive.get(resp.token)
                if last is None:  # never heard from, or it left the fleet: its last beat we saw
                    last = resp.alive_at
                else:
                    resp.alive_at = last
                if last is not None and now - max(last, resp.sent_at) > limit:
                    self.dead_workers_failed += 1
                    resp._fail(UpstreamError(f"worker {resp.worker_id} stopped answering over NATS (no heartbeat "
                                             f"for {now - last:.1f}s)", before_response=not resp._headers.done()))
        self._schedule_liveness(1.0)

    def _on_reply(self, subject: bytes, _reply: bytes, data: bytes, status: int) -> None:
        resp = self._pending.get(subject)
        if resp is not None:
            resp._on_frame(data, status)

    # -- bookkeeping ------------------------------------------------------------------------------
    def _done(self, resp: NatsResponse) -> None:
        if self._pending.pop(resp.inbox, None) is not None:
            n = self._inflight.get(resp.worker_id, 0) - 1
            if n > 0:
                self._inflight[resp.worker_id] = n
            else:
                self._inflight.pop(resp.worker_id, None)

    def _cancel(self, resp: NatsResponse) -> None:
        try:
            self.core.publish(resp.cancel_subject, resp.inbox)
            self.cancels_sent += 1
        except NatsError:  # the worker cancels its requests itself when it loses the broker
            log.debug("cancel of %r not sent: NATS is not connected", resp.inbox)

    def _on_disconnect(self) -> None:
        # Replies published while we are away are lost: fail what is in flight now (before its
        # first byte it is retried elsewhere; after it the client gets an SSE error event).
        for resp in list(self._pending.values()):
            resp._fail(UpstreamError("NATS connection lost", before_response=not resp._headers.done()))


class BodyTooLarge(UpstreamError):
    """The request body exceeds the broker's max payload."""

    status = 413

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"request body of {size} bytes exceeds the NATS server's max_payload ({limit} bytes); "
                         "raise max_payload in nats-server's config", before_response=True)
