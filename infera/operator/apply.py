"""The operator's side of the Kubernetes REST API: server-side apply, owned-object lists, prune.

Raw requests on the HTTP client lightkube builds from a kubeconfig (``client_adapter.AsyncClient``:
base URL, TLS, bearer token re-read from the service-account token file, exec plugins), so any kind
the renderer writes is reachable by its path without a typed model per kind.

* :func:`resource_path` maps ``apiVersion``/``kind`` to its REST path (the kinds the renderer
  writes and the CR itself; another kind is a clear error, not a guessed plural).
* :meth:`KubeRest.apply` is one server-side apply (``application/apply-patch+yaml``, field manager
  ``infera-operator``, ``force=true``): the API server merges our fields and changes nothing when
  they are already so (no resourceVersion bump, so an untouched pool does not roll).
* :func:`select_prunable` (pure) picks the owned objects that the current render no longer has.
"""
from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from lightkube import KubeConfig
from lightkube.config import client_adapter

from infera.operator.status import DEPLOYMENT_LABEL, MANAGED_BY, MANAGED_BY_LABEL

FIELD_MANAGER = "infera-operator"

CRD_GROUP = "infera.amd.com"
CRD_VERSION = "v1alpha1"
CRD_PLURAL = "inferadeployments"
CRD_KIND = "InferaDeployment"

# (apiVersion, kind) -> plural, for every namespaced kind the renderer may write.
RESOURCES: dict[tuple[str, str], str] = {
    ("v1", "Service"): "services",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("v1", "PersistentVolumeClaim"): "persistentvolumeclaims",
    ("apps/v1", "Deployment"): "deployments",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("apps/v1", "DaemonSet"): "daemonsets",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkersets",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools",  # GAIE v1 (GA)
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproutes",
    (f"{CRD_GROUP}/{CRD_VERSION}", CRD_KIND): CRD_PLURAL,
}

# Kinds listed for pruning on every reconcile, whether or not the current render has one: a kind
# the spec no longer asks for at all (kvd turned off: no DaemonSet) must still be pruned. The kinds
# the renderer writes; never PersistentVolumeClaims (NATS' data outlives a pruned StatefulSet, as
# with any StatefulSet) nor Secrets (the operator writes none). Any other kind a render has is
# listed too.
PRUNE_KINDS: tuple[tuple[str, str], ...] = (
    ("v1", "Service"), ("v1", "ServiceAccount"), ("v1", "ConfigMap"),
    ("apps/v1", "Deployment"), ("apps/v1", "StatefulSet"), ("apps/v1", "DaemonSet"),
    ("policy/v1", "PodDisruptionBudget"),
    ("rbac.authorization.k8s.io/v1", "Role"), ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
    # gaie.enabled; a cluster without these CRDs answers the list with 404: skipped, not an error
    ("inference.networking.k8s.io/v1", "InferencePool"), ("gateway.networking.k8s.io/v1", "HTTPRoute"),
)

# What to install when the API server does not serve a kind the render has (an apply answered 404).
CRD_HINTS: dict[str, str] = {
    "LeaderWorkerSet": " (install the LeaderWorkerSet CRD: https://github.com/kubernetes-sigs/lws)",
    "InferencePool": " (install the Gateway API Inference Extension CRDs, or set gaie.enabled false: "
                     "https://github.com/kubernetes-sigs/gateway-api-inference-extension)",
    "HTTPRoute": " (install the Gateway API CRDs, or set gaie.enabled false: https://gateway-api.sigs.k8s.io)",
}

# The workloads whose status feeds the CR's status.
WORKLOAD_RESOURCES: tuple[tuple[str, str], ...] = (
    ("apps/v1", "Deployment"), ("apps/v1", "StatefulSet"), ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"))


class KubeApiError(Exception):
    """An error answer of the API server (``code`` is its HTTP status)."""

    def __init__(self, code: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path}: HTTP {code}: {message}")
        self.code = code
        self.message = message

    @property
    def transient(self) -> bool:
        """Worth retrying as is (conflict, throttling, server trouble); a 4xx is the object's fault."""
        return self.code in (409, 429) or self.code >= 500


def collection_path(api_version: str, kind: str, namespace: str | None) -> str:
    plural = RESOURCES.get((api_version, kind))
    if plural is None:
        raise ValueError(f"unknown kind {kind!r} of apiVersion {api_version!r}: "
                         f"the operator knows {sorted(k for _, k in RESOURCES)}")
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    return f"{base}/namespaces/{namespace}/{plural}" if namespace else f"{base}/{plural}"


def resource_path(obj: Mapping[str, Any], namespace: str | None = None) -> str:
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    if not name:
        raise ValueError(f"{obj.get('kind')!r} object without metadata.name")
    ns = meta.get("namespace") or namespace
    return f"{collection_path(obj.get('apiVersion', ''), obj.get('kind', ''), ns)}/{name}"


def object_key(obj: Mapping[str, Any]) -> tuple[str, str, str]:
    """(apiVersion group, kind, name): an object's identity within one namespace. The group, not
    the version, so a version change of the same kind is the same object."""
    group = obj.get("apiVersion", "").rpartition("/")[0]
    return group, obj.get("kind", ""), (obj.get("metadata") or {}).get("name", "")


def state_event(cr: Mapping[str, Any], state: str, reason: str, message: str, now: str) -> dict[str, Any]:
    """A core/v1 Event on the CR for a state change (``kubectl describe idep`` shows it)."""
    meta = cr.get("metadata") or {}
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta.get('name')}.", "namespace": meta.get("namespace")},
        "involvedObject": {"apiVersion": cr.get("apiVersion", f"{CRD_GROUP}/{CRD_VERSION}"), "kind": CRD_KIND,
                           "name": meta.get("name"), "namespace": meta.get("namespace"), "uid": meta.get("uid")},
        "type": "Warning" if state in ("failed", "degraded") else "Normal",
        "reason": reason or state.capitalize(),
        "message": (f"state {state}: {message}" if message else f"state {state}")[:1024],
        "source": {"component": FIELD_MANAGER}, "reportingComponent": FIELD_MANAGER,
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }


def deployment_selector(cr_name: str) -> str:
    return f"{MANAGED_BY_LABEL}={MANAGED_BY},{DEPLOYMENT_LABEL}={cr_name}"


def owned_by(obj: Mapping[str, Any], owner_uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(isinstance(r, Mapping) and r.get("uid") == owner_uid for r in refs)


def select_prunable(live: Iterable[Mapping[str, Any]], rendered: Iterable[Mapping[str, Any]],
                    cr_name: str, owner_uid: str) -> list[Mapping[str, Any]]:
    """The live objects to delete: labelled as this CR's (managed by the operator, its deployment
    label) and owned by this CR (by uid: a CR recreated under the same name does not adopt), but not
    in the rendered set. Objects being deleted already are left alone."""
    wanted = {object_key(o) for o in rendered}
    prunable = []
    for obj in live:
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") or {}
        if labels.get(MANAGED_BY_LABEL) != MANAGED_BY or labels.get(DEPLOYMENT_LABEL) != cr_name:
            continue
        if not owned_by(obj, owner_uid) or meta.get("deletionTimestamp"):
            continue
        if object_key(obj) not in wanted:
            prunable.append(obj)
    return sorted(prunable, key=object_key)


@dataclass(frozen=True)
class ListResult:
    items: list[dict[str, Any]]
    served: bool  # False: the API server does not serve this kind (e.g. the LWS CRD is not installed)


class KubeRest:
    """A small async REST client on the kubeconfig's connection."""

    def __init__(self, config: Any, timeout_s: float = 30.0) -> None:
        single = config.get() if isinstance(config, KubeConfig) else config
        params = client_adapter.ConnectionParams(timeout=client_adapter.httpx.Timeout(timeout_s))
        self._http = client_adapter.AsyncClient(single, params)

    async def close(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, *, query: Mapping[str, str] | None = None,
                       body: Any = None, content_type: str = "application/json") -> dict[str, Any] | None:
        url = path + ("?" + urllib.parse.urlencode(query) if query else "")
        headers = {"Accept": "application/json"}
        content = None
        if body is not None:
            headers["Content-Type"] = content_type
            content = json.dumps(body, separators=(",", ":")).encode()
        response = await self._http.request(method, url, content=content, headers=headers)
        if response.status_code == 404 and method == "GET":
            return None
        if response.status_code >= 400:
            try:
                answer = response.json()
                message = answer.get("message") if isinstance(answer, dict) else None
            except ValueError:
                message = None
            raise KubeApiError(response.status_code, method, path, message or response.text[:500])
        return response.json() if response.content else {}

    async def get(self, path: str) -> dict[str, Any] | None:
        return await self._request("GET", path)

    async def list(self, path: str, label_selector: str | None = None) -> ListResult:
        answer = await self._request("GET", path, query={"labelSelector": label_selector} if label_selector else None)
        if answer is None:
            return ListResult(items=[], served=False)
        return ListResult(items=list(answer.get("items") or []), served=True)

    async def apply(self, obj: Mapping[str, Any], namespace: str) -> dict[str, Any]:
        """Server-side apply of one object (JSON is YAML, so the body is the object as JSON)."""
        body = dict(obj)
        body["metadata"] = {**(obj.get("metadata") or {}), "namespace": (obj.get("metadata") or {}).get("namespace") or namespace}
        path = resource_path(body)
        try:
            answer = await self._request("PATCH", path, body=body,
                                         query={"fieldManager": FIELD_MANAGER, "force": "true"},
                                         content_type="application/apply-patch+yaml")
        except KubeApiError as exc:
            if exc.code == 404:  # an apply creates: a 404 means the kind itself is not served
                hint = CRD_HINTS.get(body.get("kind", ""), "")
                raise KubeApiError(404, "PATCH", path, f"the API server does not serve {body.get('kind')} "
                                   f"{body.get('apiVersion')}{hint}") from exc
            raise
        return answer or {}

    async def delete(self, obj: Mapping[str, Any], namespace: str) -> None:
        path = resource_path(obj, namespace)
        try:
            await self._request("DELETE", path, body={"kind": "DeleteOptions", "apiVersion": "v1",
                                                       "propagationPolicy": "Background"})
        except KubeApiError as exc:
            if exc.code != 404:  # gone already: what we wanted
                raise

    async def post_event(self, event: Mapping[str, Any]) -> None:
        namespace = event["metadata"]["namespace"]
        await self._request("POST", f"/api/v1/namespaces/{namespace}/events", body=event)

    async def patch_status(self, cr: Mapping[str, Any], status_patch: Mapping[str, Any]) -> dict[str, Any]:
        path = resource_path(cr) + "/status"
        answer = await self._request("PATCH", path, body={"status": status_patch},
                                     content_type="application/merge-patch+json")
        return answer or {}
