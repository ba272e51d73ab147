"""The Policy protocol: pick one worker among candidates for a request. The policies implement it
(one file each); ``policies.py`` holds the registry by name."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from infera.discovery.record import WorkerRecord


@dataclass(slots=True)
class RoutedRequest:
    """Everything routing needs about one request, parsed once at the door."""

    route: str  # "/v1/chat/completions" | "/v1/completions"
    body: bytes  # forwarded verbatim
    parsed: Any  # infera.api.requests.* struct
    model: str
    stream: bool
    request_id: str
    direct_worker: str | None = None  # router-mode direct: x-worker-instance-id
    direct_prefill: str | None = None  # router-mode direct, PD: x-prefill-instance-id
    state: dict[str, Any] = field(default_factory=dict)  # per-policy scratch (e.g. block hashes)
    # sent to every engine leg with the request id: the W3C trace context (traceparent, tracestate)
    trace_headers: tuple[tuple[str, str], ...] = ()
    # A mixed worker's own (route, body) in place of route/body, or None: keep them. Anthropic's
    # /v1/messages sends an engine that serves it itself the client's body (route/body stay the
    # chat form: what routing hashes, what PD legs and every other worker get).
    body_for: Callable[[WorkerRecord], tuple[str, bytes] | None] | None = None


class Policy(Protocol):
    name: str

    def pick(self, candidates: Sequence[WorkerRecord], request: RoutedRequest, role: str = "mixed") -> WorkerRecord:
        """``candidates`` is non-empty, sorted by worker_id, and already excludes tried workers.
        ``role``: "mixed", or "prefill"/"decode" for the legs of a PD request."""
        ...

    def on_started(self, worker: WorkerRecord, request: RoutedRequest) -> None: ...

    # Optional, before the first pick of a request: ``async prepare(request)`` (per-request work
    # such as tokenizing), and ``prepare_cached(request) -> bool``, the same done synchronously when
    # it can be (True: ``prepare`` need not run).

    def on_finished(self, worker: WorkerRecord, request: RoutedRequest) -> None: ...

    def forget(self, worker_id: str) -> None:
        """The worker left the fleet: drop any state kept for it."""
        ...


PolicyFactory = Callable[..., Policy]

