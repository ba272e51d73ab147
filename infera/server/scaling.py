"""The scaling API (spec §9.3): ``GET`` and ``POST /v1/admin/scale`` (``--enable-scaling-api``).

A server that the Infera operator deployed reads and changes the size of its own
``InferaDeployment``'s services. It finds that deployment from its own Pod's label
``infera.amd.com/deployment`` (the Pod named by ``POD_NAME``; the name is cached after the first
successful lookup), in ``--k8s-namespace`` (``POD_NAMESPACE``).

* ``GET`` answers a snapshot: per service its role, wanted replicas (the spec), current and ready
  replicas (the operator's status), nodes per replica, and, when fewer are ready than wanted, why:
  ``blocked``, read from the service's Pods (the first Pending Pod's ``PodScheduled=False`` reason
  and message, or a container waiting in ImagePullBackOff, ErrImagePull, CrashLoopBackOff or
  CreateContainerConfigError), one line of at most 300 characters.
* ``POST {"services": {"prefill": 4, "decode": {"replicas": 8}}}`` sets absolute counts. The body
  is validated exactly (an integer >= 1, or ``{"replicas": n}``; known service names only), then
  the CR gets ONE JSON merge patch ``{"spec": {"services": {name: {"replicas": n}}}}``; the answer
  is the snapshot after it. Scaling to zero is refused: a router that scales away its own fleet
  (or itself: a server service can be scaled too) is one typo from an outage.

Errors leave in the OpenAI error shape. Kubernetes answers map to: RBAC 403 → 403 naming the verb
and resource the server's service account lacks; the CR gone → 404; the API unreachable or slow →
503; the API's own 5xx → 502. Client-facing messages never carry the API server's address or
credentials; the details are logged.

These are admin endpoints (``/v1/admin/``): the admin-token check of ``infera.server.app`` runs
first, and ``--enable-scaling-api`` refuses to start without ``--admin-token``. Off: 404.
"""
from __future__ import annotations

import asyncio
import logging
import unicodedata
from typing import Any, Iterable, Mapping

import msgspec
from aiohttp import web
from lightkube import AsyncClient
from lightkube.core import generic_client as _generic_client
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from infera.api.errors import ApiError
from infera.api.requests import json_structure_problem
from infera.runtime import wait_for

log = logging.getLogger(__name__)

SCALE_ROUTE = "/v1/admin/scale"
GROUP, VERSION, KIND, PLURAL = "infera.amd.com", "v1alpha1", "InferaDeployment", "inferadeployments"
CR_RESOURCE = f"{PLURAL}.{GROUP}"  # how RBAC messages name it
DEPLOYMENT_LABEL = "infera.amd.com/deployment"
SERVICE_LABEL = "infera.amd.com/service"
MAX_REPLICAS = 10000  # a typo (100000) must not ask the cluster for a hundred thousand GPU Pods
MAX_BODY_BYTES = 64 * 1024  # a scale request is a few names and numbers
BLOCKED_CHARS = 300
REQUEST_TIMEOUT_S = 10.0  # each Kubernetes API call
BLOCKING_WAIT_REASONS = frozenset({"ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff",
                                   "CreateContainerConfigError"})

# lightkube's generic resource class for the CR (registered once in lightkube's own registry; the
# same call elsewhere returns this class).
InferaDeploymentResource = create_namespaced_resource(GROUP, VERSION, KIND, PLURAL)

# The HTTP library lightkube is built on: its transport errors are what an unreachable API raises.
_httpx = _generic_client.httpx
_encode = msgspec.json.Encoder().encode


# --------------------------------------------------------------------------------------------
# Request validation (pure)
# --------------------------------------------------------------------------------------------
def _bad(message: str, code: str = "invalid_request", param: str | None = None) -> ApiError:
    return ApiError(400, message, code, param=param)


def parse_scale_body(raw: bytes) -> dict[str, int]:
    """The wanted replicas per service name from a POST body; any problem is a 400 naming the field.
    Service names are checked against the CR later (:func:`check_service_names`)."""
    if not raw.strip():
        raise _bad('the body must be a JSON object: {"services": {"<service>": <replicas>, ...}}')
    problem = json_structure_problem(raw)
    if problem is not None:
        raise _bad(problem, "json_too_complex")
    try:
        body = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _bad(f"malformed JSON body: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise _bad('the body must be a JSON object: {"services": {"<service>": <replicas>, ...}}')
    unknown = sorted(set(body) - {"services"})
    if unknown:
        raise _bad(f"unknown field(s) {', '.join(map(repr, unknown))}: the body holds only \"services\"",
                   param=unknown[0])
    services = body.get("services")
    if not isinstance(services, dict):
        raise _bad('"services" must be a JSON object of service name to replicas, e.g. '
                   '{"services": {"decode": 3}}', param="services")
    if not services:
        raise _bad('"services" is empty: name at least one service to scale', param="services")
    return {name: _replicas_of(name, value) for name, value in services.items()}


def _replicas_of(name: str, value: Any) -> int:
    field = f"services.{name}"
    if isinstance(value, dict):
        extra = sorted(set(value) - {"replicas"})
        if extra:
            raise _bad(f"{field} takes only \"replicas\", not {', '.join(map(repr, extra))}", param=field)
        if "replicas" not in value:
            raise _bad(f"{field} must hold \"replicas\"", param=field)
        field, value = f"{field}.replicas", value["replicas"]
    if isinstance(value, bool) or not isinstance(value, int):  # bool is an int in Python; 3.0 and "3" are not
        raise _bad(f"{field} must be an integer number of replicas, not {_json_kind(value)} {_show(value)}",
                   param=field)
    if value < 1:
        raise _bad(f"{field} is {value}: scaling a service to zero (or below) is refused through this API; "
                   "at least 1 replica", "scale_to_zero_refused", param=field)
    if value > MAX_REPLICAS:
        raise _bad(f"{field} is {value}: at most {MAX_REPLICAS} replicas", param=field)
    return value


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    return {float: "a number with a fraction", str: "a string", list: "an array", dict: "an object",
            type(None): "null"}.get(type(value), "a non-integer")


def _show(value: Any) -> str:
    text = _encode(value).decode(errors="replace") if value is not None else "null"
    return text if len(text) <= 40 else text[:37] + "..."


def check_service_names(wanted: Mapping[str, int], existing: Iterable[str]) -> None:
    """400 when ``wanted`` names a service the deployment does not have, listing the ones it has."""
    existing = sorted(existing)
    unknown = sorted(set(wanted) - set(existing))
    if unknown:
        raise ApiError(400, f"unknown service(s) {', '.join(map(repr, unknown))}: this deployment has "
                       f"{', '.join(existing) if existing else 'no services'}", "unknown_service",
                       param=f"services.{unknown[0]}")


def merge_patch_for(wanted: Mapping[str, int]) -> dict[str, Any]:
    """The one JSON merge patch (RFC 7386) that sets these replicas and touches nothing else."""
    return {"spec": {"services": {name: {"replicas": n} for name, n in wanted.items()}}}


# --------------------------------------------------------------------------------------------
# Snapshot and blocked reasons (pure, on plain dicts as the API serves them)
# --------------------------------------------------------------------------------------------
def one_line(text: str, limit: int = BLOCKED_CHARS) -> str:
    """``text`` as one line of at most ``limit`` characters: line breaks and tabs become spaces,
    control and format characters (bidi overrides, zero-width) are dropped, runs of blanks fold."""
    kept = []
    for ch in text:
        category = unicodedata.category(ch)
        if ch in "\t\n\r\v\f" or category in ("Zl", "Zp"):
            kept.append(" ")
        elif category not in ("Cc", "Cf"):
            kept.append(ch)
    line = " ".join("".join(kept).split())
    return line if len(line) <= limit else line[:limit - 1] + "…"


def _reason_message(reason: Any, message: Any) -> str | None:
    reason = reason if isinstance(reason, str) else ""
    message = message if isinstance(message, str) else ""
    if not reason and not message:
        return None
    return one_line(f"{reason}: {message}" if reason and message else reason or message)


def pod_blocked_reason(pod: Mapping[str, Any]) -> str | None:
    """Why this Pod does not run: its ``PodScheduled=False`` condition (``reason: message``), else the
    first container (init containers first) waiting for one of :data:`BLOCKING_WAIT_REASONS`."""
    status = pod.get("status") if isinstance(pod.get("status"), dict) else {}
    for condition in status.get("conditions") or ():
        if (isinstance(condition, dict) and condition.get("type") == "PodScheduled"
                and condition.get("status") == "False"):
            found = _reason_message(condition.get("reason"), condition.get("message"))
            if found:
                return found
    for key in ("initContainerStatuses", "containerStatuses"):
        for container in status.get(key) or ():
            waiting = ((container.get("state") or {}).get("waiting") or {}) if isinstance(container, dict) else {}
            if isinstance(waiting, dict) and waiting.get("reason") in BLOCKING_WAIT_REASONS:
                return _reason_message(waiting["reason"], waiting.get("message"))
    return None


def first_blocked_reason(pods: Iterable[Mapping[str, Any]]) -> str | None:
    """The blocked reason of a service from its Pods: Pending Pods first (oldest first), then the
    others that are not being deleted (a crash-looping container leaves its Pod Running)."""
    def order(pod: Mapping[str, Any]) -> tuple:
        meta = pod.get("metadata") or {}
        phase = (pod.get("status") or {}).get("phase")
        return (phase != "Pending", str(meta.get("creationTimestamp") or ""), str(meta.get("name") or ""))

    for pod in sorted(pods, key=order):
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        reason = pod_blocked_reason(pod)
        if reason:
            return reason
    return None


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


# The operator's defaults for a service that gives no replicas (infera/operator/spec.py: the
# renderer decides them, the CRD schema has none): a server runs 2 for availability, a worker 1.
DEFAULT_SERVER_REPLICAS = 2
DEFAULT_WORKER_REPLICAS = 1


def _wanted(svc: Mapping[str, Any]) -> int:
    default = DEFAULT_SERVER_REPLICAS if svc.get("componentType") == "server" else DEFAULT_WORKER_REPLICAS
    return _int(svc.get("replicas"), default)


def _services_spec(cr: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    services = (cr.get("spec") or {}).get("services") or {}
    return {name: (svc if isinstance(svc, dict) else {}) for name, svc in services.items()}


def wanting_more(cr: Mapping[str, Any]) -> list[str]:
    """The services with fewer ready replicas than their spec wants (those get a ``blocked``)."""
    status_services = (cr.get("status") or {}).get("services") or {}
    short = []
    for name, svc in _services_spec(cr).items():
        observed = status_services.get(name) if isinstance(status_services.get(name), dict) else {}
        if _int(observed.get("readyReplicas"), 0) < _wanted(svc):
            short.append(name)
    return short


def build_snapshot(cr: Mapping[str, Any], namespace: str,
                   blocked: Mapping[str, str | None] | None = None) -> dict[str, Any]:
    """The ``GET /v1/admin/scale`` answer from a CR (a dict as the API serves it) and the blocked
    reasons found for its services (only services with fewer ready than wanted show one)."""
    status = cr.get("status") if isinstance(cr.get("status"), dict) else {}
    status_services = status.get("services") if isinstance(status.get("services"), dict) else {}
    blocked = blocked or {}
    services: dict[str, Any] = {}
    for name, svc in _services_spec(cr).items():
        observed = status_services.get(name) if isinstance(status_services.get(name), dict) else {}
        wanted = _wanted(svc)
        ready = _int(observed.get("readyReplicas"), 0)
        entry: dict[str, Any] = {
            "role": svc.get("role") or "mixed",
            "replicas": wanted,
            "current_replicas": _int(observed.get("replicas"), 0),
            "ready_replicas": ready,
            "nodes_per_replica": _int(svc.get("numberOfNodes"), 1),
        }
        if ready < wanted and blocked.get(name):
            entry["blocked"] = blocked[name]
        services[name] = entry
    return {"deployment": (cr.get("metadata") or {}).get("name"), "namespace": namespace,
            "state": status.get("state") or "unknown", "services": services}


# --------------------------------------------------------------------------------------------
# Kubernetes access
# --------------------------------------------------------------------------------------------
def _status_code(exc: BaseException) -> int | None:
    if isinstance(exc, _httpx.HTTPStatusError):  # lightkube's ApiError is one
        return exc.response.status_code
    return None


class DeploymentScaler:
    """Reads and scales the ``InferaDeployment`` this server's own Pod belongs to.

    ``config``: a lightkube config (default: :func:`infera.discovery.kubernetes.load_kube_config`,
    loaded now; when there is none the endpoints answer 503 and the reason is logged).
    """

    def __init__(self, namespace: str, pod_name: str | None, *, config: Any = None,
                 request_timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.namespace = namespace
        self.pod_name = pod_name
        self.request_timeout = request_timeout
        self.deployment: str | None = None  # cached after the first successful lookup
        self._config = config
        if config is None:
            from infera.discovery.kubernetes import KubernetesError, load_kube_config

            try:
                self._config = load_kube_config()
            except KubernetesError as exc:
                log.warning("scaling API: no Kubernetes API configuration (%s); /v1/admin/scale answers 503", exc)
        self._client: AsyncClient | None = None
        if self._config is not None:  # now, at server start: building its TLS context reads files
            self._get_client()

    def _get_client(self) -> AsyncClient:
        if self._config is None:
            raise ApiError(503, "the scaling API has no Kubernetes API configuration (not inside a Pod and no "
                           "kubeconfig); see the server's log", "kubernetes_unavailable")
        if self._client is None:
            self._client = AsyncClient(config=self._config, namespace=self.namespace, field_manager="infera-server",
                                       timeout=_httpx.Timeout(self.request_timeout))
        return self._client

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    async def _call(self, what: str, verb: str, resource: str, call: Any) -> Any:
        """Await one API call, bounded; its failures become the client-facing ApiErrors (404 is the
        caller's to interpret: it is re-raised as a 404 ApiError with code ``k8s_not_found``)."""
        try:
            return await wait_for(call, self.request_timeout)
        except asyncio.TimeoutError:
            log.warning("scaling API: %s: no answer from the Kubernetes API within %g s", what, self.request_timeout)
            raise ApiError(503, f"the Kubernetes API did not answer within {self.request_timeout:g} s ({what})",
                           "kubernetes_unavailable", headers={"Retry-After": "5"}) from None
        except (_httpx.TransportError, OSError) as exc:
            log.warning("scaling API: %s: the Kubernetes API is unreachable: %r", what, exc)
            raise ApiError(503, f"the Kubernetes API is unreachable ({what}); see the server's log",
                           "kubernetes_unavailable", headers={"Retry-After": "5"}) from None
        except _httpx.HTTPStatusError as exc:
            raise self._mapped(exc, what, verb, resource) from None
        except ApiError:
            raise
        except Exception:  # an answer lightkube could not decode (not JSON, not the expected object)
            log.exception("scaling API: %s: unexpected failure talking to the Kubernetes API", what)
            raise ApiError(502, f"the Kubernetes API gave an answer this server could not read ({what}); see the "
                           "server's log", "kubernetes_error") from None

    def _mapped(self, exc: BaseException, what: str, verb: str, resource: str) -> ApiError:
        code = _status_code(exc)
        api_message = str(getattr(getattr(exc, "status", None), "message", None) or "")
        log.warning("scaling API: %s: the Kubernetes API answered HTTP %s: %s", what, code, api_message or exc)
        if code == 403:
            return ApiError(403, f"Kubernetes RBAC forbids this server's service account to {verb} {resource} in "
                            f"namespace {self.namespace!r} ({what}): its Role needs verb '{verb}' on "
                            f"'{resource}'", "kubernetes_forbidden")
        if code == 404:
            return ApiError(404, f"{what}: not found", "k8s_not_found")
        if code == 401:
            return ApiError(503, f"the Kubernetes API refused this server's credentials ({what}); see the "
                            "server's log", "kubernetes_unauthorized")
        if code == 422 or code == 400:  # the CRD's schema refused the value: its words name the field
            return ApiError(400, f"the Kubernetes API refused the change: {one_line(api_message, 500)}",
                            "kubernetes_invalid")
        if code == 409:
            return ApiError(409, f"the Kubernetes API reported a conflict ({what}); retry", "kubernetes_conflict")
        if code == 429:
            return ApiError(503, f"the Kubernetes API is throttling this server ({what}); retry shortly",
                            "kubernetes_unavailable", headers={"Retry-After": "5"})
        return ApiError(502, f"the Kubernetes API answered HTTP {code} ({what}); see the server's log",
                        "kubernetes_error")

    async def deployment_name(self) -> str:
        """The ``infera.amd.com/deployment`` label of this server's own Pod (cached once found)."""
        if self.deployment is not None:
            return self.deployment
        if not self.pod_name:
            raise ApiError(503, "the scaling API needs this server's Pod name: set POD_NAME (the Downward API's "
                           "metadata.name) or --k8s-pod-name", "pod_name_unknown")
        client = self._get_client()
        what = f"reading this server's Pod {self.pod_name!r}"
        try:
            pod = await self._call(what, "get", "pods", client.get(Pod, self.pod_name, namespace=self.namespace))
        except ApiError as exc:
            if exc.code == "k8s_not_found":
                raise ApiError(503, f"this server's Pod {self.pod_name!r} is not in namespace {self.namespace!r} "
                               "(POD_NAME / POD_NAMESPACE wrong?)", "pod_not_found") from None
            raise
        labels = (pod.metadata.labels if pod.metadata is not None else None) or {}
        name = labels.get(DEPLOYMENT_LABEL)
        if not name:
            raise ApiError(409, f"this server's Pod {self.pod_name!r} has no label {DEPLOYMENT_LABEL}: the scaling "
                           "API works in deployments made by the Infera operator only", "not_an_infera_deployment")
        self.deployment = name
        return name

    async def _read_cr(self, name: str) -> dict[str, Any]:
        what = f"reading InferaDeployment {name!r}"
        try:
            cr = await self._call(what, "get", CR_RESOURCE,
                                  self._get_client().get(InferaDeploymentResource, name, namespace=self.namespace))
        except ApiError as exc:
            raise self._cr_missing(name) if exc.code == "k8s_not_found" else exc from None
        return cr.to_dict()

    def _cr_missing(self, name: str) -> ApiError:
        return ApiError(404, f"InferaDeployment {name!r} does not exist in namespace {self.namespace!r}",
                        "deployment_not_found")

    async def _blocked(self, deployment: str, service: str) -> str | None:
        """The service's blocked reason from its Pods; None when none is found or the Pods cannot be
        read (the snapshot is still worth answering, above all right after a scale: logged)."""
        selector = {DEPLOYMENT_LABEL: deployment, SERVICE_LABEL: service}

        async def pods() -> list[dict[str, Any]]:
            return [p.to_dict() async for p in self._get_client().list(Pod, namespace=self.namespace,
                                                                        labels=selector)]

        try:
            return first_blocked_reason(await self._call(f"listing the Pods of service {service!r}", "list", "pods",
                                                         pods()))
        except ApiError as exc:
            log.warning("scaling API: no blocked reason for service %r: %s", service, exc.message)
            return None

    async def _snapshot_of(self, cr: dict[str, Any]) -> dict[str, Any]:
        deployment = (cr.get("metadata") or {}).get("name") or self.deployment or ""
        short = wanting_more(cr)
        reasons = await asyncio.gather(*(self._blocked(deployment, name) for name in short))
        return build_snapshot(cr, self.namespace, dict(zip(short, reasons)))

    async def snapshot(self) -> dict[str, Any]:
        return await self._snapshot_of(await self._read_cr(await self.deployment_name()))

    async def scale(self, wanted: Mapping[str, int]) -> dict[str, Any]:
        """Check the names against the CR, apply one merge patch, answer the snapshot after it."""
        name = await self.deployment_name()
        cr = await self._read_cr(name)
        check_service_names(wanted, _services_spec(cr))
        what = f"patching InferaDeployment {name!r}"
        try:
            patched = await self._call(what, "patch", CR_RESOURCE, self._get_client().patch(
                InferaDeploymentResource, name, merge_patch_for(wanted), namespace=self.namespace,
                patch_type=PatchType.MERGE))
        except ApiError as exc:
            raise self._cr_missing(name) if exc.code == "k8s_not_found" else exc from None
        log.info("scaling API: InferaDeployment %s/%s scaled: %s", self.namespace, name,
                 ", ".join(f"{svc}={n}" for svc, n in wanted.items()))
        return await self._snapshot_of(patched.to_dict())


# --------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------
async def _read_bounded(request: web.Request) -> bytes:
    """The body, refused (413) past MAX_BODY_BYTES as it streams in (a chunked body has no length)."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.read(16 * 1024):
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"a scale request is at most {MAX_BODY_BYTES} bytes", "request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def handle(request: web.Request, scaler: DeploymentScaler | None) -> web.Response:
    """``GET`` / ``POST /v1/admin/scale``; ``scaler`` None: the API is off (404)."""
    if scaler is None:
        raise ApiError(404, "the scaling API is disabled: start the server with --enable-scaling-api (or "
                       "INFERA_ENABLE_SCALING_API=1)", "scaling_disabled")
    if request.method == "POST":
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            raise ApiError(413, f"a scale request is at most {MAX_BODY_BYTES} bytes", "request_too_large")
        body = await scaler.scale(parse_scale_body(await _read_bounded(request)))
    else:
        body = await scaler.snapshot()
    return web.Response(body=_encode(body), content_type="application/json", headers={"Cache-Control": "no-store"})


__all__ = ["DeploymentScaler", "InferaDeploymentResource", "MAX_REPLICAS", "SCALE_ROUTE", "build_snapshot",
           "check_service_names", "first_blocked_reason", "handle", "merge_patch_for", "one_line",
           "parse_scale_body", "pod_blocked_reason", "wanting_more"]
