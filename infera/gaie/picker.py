"""The endpoint picker's pick: the same request parsing, topology rule and policy as
``infera.server``, through ``AutoRouter.pick`` (the server's routers, built by
``infera.server.routing_stack.RoutingStack``), then the GAIE headers for the chosen target."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import urlsplit

from infera.api.errors import ApiError
from infera.api.requests import parse_request
from infera.discovery.record import WorkerRecord
from infera.router.auto import AutoRouter, Picked
from infera.router.dispatch import UsageObserver
from infera.router.policy import RoutedRequest
from infera.router.upstream import DP_RANK_HEADER
from infera.server.request_salt import CACHE_SALT_STATE

DESTINATION_HEADER = "x-gateway-destination-endpoint"
WORKER_HEADER = "x-worker-instance-id"
PREFILL_HEADER = "x-prefill-instance-id"
INFERENCE_ROUTES = ("/v1/chat/completions", "/v1/completions")


@dataclass(slots=True)
class EndpointPick:
    """A pick and the request headers that carry it (set, and removed: a client's own pinning
    headers never reach the sidecar)."""

    picked: Picked
    request: RoutedRequest
    destination: str
    set_headers: dict[str, str]
    remove_headers: tuple[str, ...]

    def finish(self, status: int | None, blame: str | None = None) -> None:
        self.picked.finish(status, blame)


def destination(worker: WorkerRecord, port: int) -> str:
    """``ip:port`` (``[ip]:port`` for IPv6) Envoy's ORIGINAL_DST cluster connects to: the worker's
    host at ``port`` (its sidecar), or at the worker's own port when ``port`` is 0."""
    parts = urlsplit(worker.url)
    host = parts.hostname or ""
    if not host:
        raise ApiError(503, f"worker {worker.worker_id!r} has no host in its url {worker.url!r}", "worker_not_found",
                       headers={"Retry-After": "1"})
    target_port = port or parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{target_port}" if ":" in host else f"{host}:{target_port}"


class EndpointPicker:
    """``pick(path, body, headers)``: parse, pick (tokenizing on the router's tokenizer threads),
    charge in flight until ``EndpointPick.finish``."""

    def __init__(self, router: AutoRouter, *, destination_port: int, allow_kv_transfer_params: bool = False,
                 usage_observer: UsageObserver | None = None) -> None:
        self.router = router
        # kv-aware: a served reply's engine-reported cached tokens, checked against the pick (as the server does)
        self.usage_observer = usage_observer
        self.destination_port = destination_port
        self.allow_kv_transfer_params = allow_kv_transfer_params

    async def pick(self, path: str, body: bytes, headers: Mapping[str, str],
                   exclude: frozenset[str] = frozenset()) -> EndpointPick:
        """``exclude``: workers not to pick (they refused this request's connection before)."""
        route = path.split("?", 1)[0]
        if route not in INFERENCE_ROUTES:
            raise ApiError(404, f"the endpoint picker routes POST {' and '.join(INFERENCE_ROUTES)}, not {route!r}",
                           "not_found")
        parsed = parse_request(route, body, allow_kv_transfer_params=self.allow_kv_transfer_params)
        request_id = headers.get("x-request-id") or uuid.uuid4().hex
        req = RoutedRequest(route=route, body=body, parsed=parsed, model=parsed.model, stream=bool(parsed.stream),
                            request_id=request_id)
        salt = getattr(parsed, "cache_salt", None)
        if isinstance(salt, str) and salt:  # the engine folds the client's salt into its hashes: so must the pick
            req.state[CACHE_SALT_STATE] = salt
        picked = await self.router.pick(req, exclude)
        set_headers = {DESTINATION_HEADER: destination(picked.worker, self.destination_port),
                       WORKER_HEADER: picked.worker.worker_id}
        remove: list[str] = []
        if picked.prefill is not None:
            set_headers[PREFILL_HEADER] = picked.prefill.worker_id
        else:
            remove.append(PREFILL_HEADER)
        if picked.dp_rank is not None:
            set_headers[DP_RANK_HEADER.lower()] = str(picked.dp_rank)
        else:
            remove.append(DP_RANK_HEADER.lower())
        return EndpointPick(picked, req, set_headers[DESTINATION_HEADER], set_headers, tuple(remove))
