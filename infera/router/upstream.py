"""One request to one worker, up to its first byte, and the relay of the rest: shared by mixed
dispatch and by each leg of a PD pair.

Before the first byte a failure (5xx, connection refused or reset, no first byte within the
transport's first-byte timeout, a stream that ends empty) is a ``LegFailure`` the caller may retry
elsewhere; after it, a broken or stalled stream ends with an SSE error event, because bytes already
reached the client. A unary reply over the transport's byte cap is a non-retryable 502.
"""

from __future__ import annotations

import logging
import re
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import AsyncGeneratorType
from typing import cast

import msgspec

from infera.api.errors import ApiError, error_bytes, sse_error_event
from infera.discovery.record import WorkerRecord
from infera.router.metrics import RouterMetrics
from infera.transport.http import ReplyTooLarge, UpstreamError
from infera.transport.request import RequestTransport, UpstreamReply

log = logging.getLogger(__name__)

# A stream's usage chunk comes last: this much of its tail is kept for whoever wants it.
TAIL_BYTES = 2048
DP_RANK_HEADER = "X-Data-Parallel-Rank"


def request_headers(
    request_id: str, dp_rank: int | None, trace: tuple[tuple[str, str], ...] = ()
) -> tuple[tuple[str, str], ...]:
    """The request id every engine sees, the DP rank a rank-multiplexed worker must run on, and
    the request's trace context (``traceparent``: the engine's spans join the trace)."""
    if dp_rank is None:
        return (("X-Request-Id", request_id), *trace)
    return (("X-Request-Id", request_id), (DP_RANK_HEADER, str(dp_rank)), *trace)


# Direct mode (a gateway's sidecar): a pinned worker that could not be reached before the first byte
# is named in this reply header, so the gateway retries on another pick that leaves it out
# (infera.gaie's Envoy bootstrap retries on it; its picker excludes the named worker).
UNREACHABLE_WORKER_HEADER = "x-infera-upstream-connect-failure"


def unreachable_mark(exc: LegFailure) -> dict[str, str]:
    """The error reply's headers plus, for a worker that could not be reached, its mark."""
    if exc.reason == "unreachable":
        return {**exc.headers, UNREACHABLE_WORKER_HEADER: exc.worker_id}
    return exc.headers


class LegFailure(Exception):
    """A worker failed before the first byte. ``retryable`` False: the client's fault (a 4xx)."""

    def __init__(
        self,
        worker_id: str,
        status: int,
        message: str,
        reason: str,
        body: bytes | None = None,
        *,
        role: str = "mixed",
        content_type: str = "application/json",
        retryable: bool = True,
        detail: str | None = None,
    ) -> None:
        super().__init__(detail or message)
        self.worker_id = worker_id
        self.status = status
        self.message = message  # what the client is told: names no worker, address or socket
        self.detail = detail or message  # for the logs: which worker, and the transport's own words
        self.reason = reason
        self.body = body
        self.role = role
        self.content_type = content_type
        self.retryable = retryable

    @property
    def blames_worker(self) -> bool:
        """Whether the circuit breaker counts it: a full backlog is load, not a fault; a 4xx or a
        body too large for the broker is the client's."""
        return self.retryable and self.reason != "admission"

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"} if self.status in (429, 503) else {}


def is_engine_error(exc: LegFailure) -> bool:
    """The worker's engine answered 5xx (it ran the request and failed on it), as opposed to a
    transport failure or a missing first byte, which always count against the worker."""
    return exc.status >= 500 and exc.reason.startswith("http_")


def engine_error_message(body: bytes | None, limit: int = 1000) -> str:
    """What an engine's error body says (OpenAI/vLLM ``{"error": {"message"}}``, SGLang/older
    vLLM ``{"message"}``, FastAPI ``{"detail"}``, or plain text), at most ``limit`` characters."""
    if not body:
        return ""
    text: object = None
    try:
        data = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        data = None
    if isinstance(data, dict):
        err = data.get("error")
        text = err.get("message") if isinstance(err, dict) else err if isinstance(err, str) else None
        text = text if isinstance(text, str) else data.get("message") or data.get("detail")
    if not isinstance(text, str):
        text = body.decode("utf-8", "replace")
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "…"


def repeated_engine_error(request_id: str, suspect: str, exc: LegFailure) -> ApiError:
    """The engines of two workers answered 5xx to this request: the request is what fails (a
    client can send one that crashes every engine), so it goes back to the client with the engine's
    words, no other worker is tried, and neither breaker counts it. Otherwise two such requests per
    worker would open every breaker of the fleet."""
    log.warning(
        "request %s: engines of %s and %s both answered 5xx (%s); returned to the client, not held against either",
        request_id,
        suspect,
        exc.worker_id,
        exc.status,
    )
    detail = engine_error_message(exc.body)
    message = "the engines of two workers failed on this request" + (f": {detail}" if detail else "")
    return ApiError(exc.status, message, "engine_error", headers=exc.headers)


@dataclass(slots=True)
class Opened:
    """A worker's answer up to the first byte: a whole body (unary, or any non-200), or an open
    200 stream with its first chunk."""

    status: int
    content_type: str
    body: bytes | None = None
    resp: UpstreamReply | None = None
    first: bytes = b""


# What a client is told of a transport failure: the transport's own words, less what names the
# worker's address (its id is host:port today, URLs, socket addresses), which stays in the logs
# (LegFailure.detail). Issue 27: error replies handed out every worker's address.
_ADDRESS = re.compile(
    r"[A-Za-z][A-Za-z0-9+.-]*://[^\s,;)\]]+"  # URLs (http://h:p/..., nats://...)
    r"|\(\s*'[^']*'\s*,\s*\d+[^)]*\)"  # Python socket addresses ('10.0.0.1', 8000)
    r"|\[[0-9A-Fa-f:.]+\](?::\d+)?"  # [IPv6]:port
    r"|(?<![\w.:/-])[A-Za-z0-9_.-]+:\d{1,5}(?!\w|[.:]\d)"
)  # host:port


def public_text(text: str, worker_id: str = "") -> str:
    """``text`` with the worker's id and any address in it replaced, for a client."""
    if worker_id:  # (a whole word only: a short NATS worker name may be part of other words)
        text = re.sub(rf"(?:\bworker )?(?<![\w.:-]){re.escape(worker_id)}(?![\w-]|[.:]\w)", "the worker", text)
    return _ADDRESS.sub("<address>", text)


async def open_upstream(
    transport: RequestTransport,
    worker: WorkerRecord,
    route: str,
    body: bytes,
    headers: Sequence[tuple[str, str]],
    stream: bool,
    role: str = "mixed",
) -> Opened:
    """POST ``body`` to ``worker`` and wait for its first byte; ``LegFailure`` if it failed first.
    Cancelled (client gone): the connection is closed, so the engine aborts the request."""
    wid = worker.worker_id
    resp: UpstreamReply | None = None
    try:
        resp = await transport.send(worker, route, body, headers, stream)
        status = resp.status
        if status >= 500 or not stream or status != 200:
            data = await resp.read()
            resp.release()
            if status >= 500:
                raise LegFailure(
                    wid,
                    status,
                    f"the worker returned {status}",
                    f"http_{status}",
                    data,
                    role=role,
                    detail=f"worker {wid} returned {status}",
                )
            return Opened(status, resp.content_type, body=data)
        first = await resp.next_chunk()
        if not first:
            resp.release()
            raise LegFailure(
                wid,
                502,
                "the worker closed the stream before the first byte",
                "empty_stream",
                role=role,
                detail=f"worker {wid} closed the stream before the first byte",
            )
        return Opened(200, resp.content_type, resp=resp, first=first)
    except LegFailure:
        raise
    except UpstreamError as exc:
        if resp is not None:
            resp.release()  # unfinished: the connection is closed, so the engine aborts
        if isinstance(exc, ReplyTooLarge):  # as large on any worker: neither retried nor blamed
            message = f"the worker replied with more than {exc.limit} bytes (--max-upstream-reply-bytes)"
            raise LegFailure(
                wid,
                502,
                message,
                "upstream_reply_too_large",
                error_bytes(message, 502, "upstream_reply_too_large"),
                role=role,
                retryable=False,
                detail=f"worker {wid}: {message}",
            ) from None
        failed_status: int | None = getattr(exc, "status", None)
        # No first byte in time (504, HTTP or NATS), NATS backlog full (429), body over the broker's limit (413)
        if failed_status is not None:
            reason = {429: "admission", 504: "timeout", 413: "body_too_large"}.get(failed_status, "unreachable")
            message = public_text(str(exc), wid)
            raise LegFailure(
                wid,
                failed_status,
                message,
                reason,
                error_bytes(message, failed_status, reason),
                role=role,
                retryable=failed_status != 413,
                detail=str(exc),
            ) from None
        raise LegFailure(
            wid,
            502,
            f"the worker is unreachable: {public_text(str(exc), wid)}",
            "unreachable",
            role=role,
            detail=f"worker {wid} unreachable: {exc}",
        ) from None
    except BaseException:
        if resp is not None:
            resp.release()
        raise


def midstream_error_event(worker_id: str, exc: BaseException | None) -> bytes:
    """The SSE event that ends a stream its worker broke (``exc``; None: it ended without
    ``[DONE]``) or stalled past the idle timeout."""
    if getattr(exc, "status", None) == 504:  # idle timeout: the connection is already closed
        return sse_error_event(
            f"the worker stalled mid-stream: {public_text(str(exc), worker_id)}", 504, "worker_timeout_midstream"
        )
    return sse_error_event("the worker failed mid-stream", 502, "worker_failed_midstream")


class StreamTail:
    """The last ``TAIL_BYTES`` of a stream, kept as its last chunks (``bytes()`` joins them at the
    end): no copy per chunk, where re-slicing a 2 KB tail for every chunk of every stream cost the
    kv-aware router's relay twice round-robin's (bench/kv_routing.py, under cProfile)."""

    __slots__ = ("chunks", "size")

    def __init__(self, first: bytes = b"") -> None:
        self.chunks: deque[bytes] = deque()
        self.size = 0
        if first:
            self.add(first)

    def add(self, chunk: bytes) -> None:
        chunks = self.chunks
        chunks.append(chunk)
        self.size += len(chunk)
        while self.size - len(chunks[0]) >= TAIL_BYTES:
            self.size -= len(chunks.popleft())

    def bytes(self) -> bytes:
        return b"".join(self.chunks)[-TAIL_BYTES:]


class Relay:
    """A worker's stream, relayed unchanged: iterate it, then ``aclose()`` it.

    ``done`` runs exactly once however the relay ends — finished, broken, client gone, or closed
    before it was ever iterated (an unstarted async generator skips its ``finally`` on
    ``aclose()``, which would leak the connection and the in-flight accounting). ``on_tail`` gets
    the last ``TAIL_BYTES`` of a stream that finished. ``on_end`` callbacks hear, at ``aclose()``,
    how the stream went for the client: ``ok``, ``error`` (it ended with an error event) or
    ``client_gone`` (closed before its end).
    """

    __slots__ = (
        "_broken",
        "_done",
        "_ended",
        "_finished",
        "_gen",
        "_judge",
        "_metrics",
        "_on_tail",
        "_opened",
        "_worker",
    )

    def __init__(
        self,
        opened: Opened,
        worker: WorkerRecord,
        metrics: RouterMetrics,
        done: Callable[[], None],
        on_tail: Callable[[bytes], None] | None = None,
    ) -> None:
        assert opened.resp is not None
        self._opened, self._worker, self._metrics, self._done, self._on_tail = opened, worker, metrics, done, on_tail
        # (an async generator: every subclass's _chunks is one)
        self._gen = cast("AsyncGeneratorType[bytes, None]", self._chunks())
        self._finished = False
        self._ended: list[Callable[[str], None]] = []
        self._broken = False  # ended with an error event
        self._judge: Callable[[], bool] | None = None

    def on_end(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(outcome)`` once, when the relay is closed."""
        self._ended.append(callback)

    def judge_by(self, ended_well: Callable[[], bool]) -> None:
        """For a stream read to its end: whether it ended well (instead of "no error event")."""
        self._judge = ended_well

    def outcome(self) -> str:
        """``client_gone`` until the stream has been read to its end; then ``ok`` or ``error``."""
        if self._gen.ag_frame is not None:  # suspended or never started: the reader stopped early
            return "client_gone"
        well = self._judge() if self._judge is not None else not self._broken
        return "ok" if well else "error"

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._gen

    async def aclose(self) -> None:
        outcome = self.outcome()  # (before the close, which ends a suspended generator too)
        try:
            await self._gen.aclose()
        finally:
            self._finish()
            ended, self._ended = self._ended, []
            for callback in ended:
                callback(outcome)

    def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            # Fully read: the connection goes back to the pool. Otherwise (client gone, error) it
            # is closed, so the engine sees the abort and frees the slot.
            self._opened.resp.release()  # type: ignore[union-attr]
            self._done()

    async def _chunks(self) -> AsyncIterator[bytes]:
        resp = self._opened.resp
        assert resp is not None
        first, on_tail, wid = self._opened.first, self._on_tail, self._worker.worker_id
        tail = StreamTail(first) if on_tail is not None else None
        try:
            yield first
            while True:
                chunk = await resp.next_chunk()
                if not chunk:
                    break
                if tail is not None:
                    tail.add(chunk)
                yield chunk
            if on_tail is not None:
                on_tail(tail.bytes())  # type: ignore[union-attr]
        except UpstreamError as exc:
            log.warning("worker %s failed mid-stream: %s", wid, exc)
            self._metrics.count_midstream_failure(wid)
            self._broken = True
            yield midstream_error_event(wid, exc)
        finally:
            self._finish()
