"""The renderer's vocabulary, shared by every builder of ``render.py``: the default images, ports,
storage sizes and probe budget, the apply order of kinds, the contract's labels
(docs/kubernetes.md), :class:`RenderOptions`, the object names and label sets derived from a CR,
the drain budget (``drain_seconds``, ``grace_period_seconds``) and ``_Ctx``, what every builder is
handed (the spec, the namespace, the options, and the metadata with the owner reference).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from infera.operator.crd import API_VERSION, KIND
from infera.operator.spec import Deployment, ServiceSpec, SpecError, env_value, flag_values

DEFAULT_INFERA_IMAGE = "ghcr.io/infera/infera:0.1.0"
DEFAULT_ENGINE_IMAGES = {"vllm": "ghcr.io/infera/infera-vllm:0.1.0",
                         "sglang": "ghcr.io/infera/infera-sglang:0.1.0",
                         "atom": "ghcr.io/infera/infera-atom:0.1.0"}
DEFAULT_NATS_IMAGE = "nats:2.10-alpine"
DEFAULT_ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
DEFAULT_NATS_STORAGE = "4Gi"
DEFAULT_ETCD_STORAGE = "1Gi"
DEFAULT_DRAIN_SECONDS = 30  # the launchers' --drain-timeout default
MIN_GRACE_SECONDS = 120
GRACE_MARGIN_SECONDS = 50  # deregister (10) + engine stop (30) + slack
NATS_CLIENT_PORT = 4222
NATS_MONITOR_PORT = 8222
ETCD_CLIENT_PORT = 2379
SGLANG_DIST_INIT_PORT = 20000
MAIN = "main"

# Cold starts (weights download, compile) take tens of minutes: 360 x 5 s = 30 min before liveness.
STARTUP_PERIOD_S = 5
STARTUP_FAILURE_THRESHOLD = 360

# Apply order: identities and config first, then what serves, then what selects it.
KIND_ORDER = ["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "StatefulSet", "DaemonSet",
              "Deployment", "LeaderWorkerSet", "PodDisruptionBudget", "InferencePool", "HTTPRoute"]

# GAIE (spec.gaie.enabled): the endpoint picker's ports and health service (GAIE's conventions,
# which gateways and the kubelet's gRPC probe expect), the per-worker sidecar's container name.
INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
HTTPROUTE_API_VERSION = "gateway.networking.k8s.io/v1"
EPP_GRPC_PORT = 9002
EPP_HEALTH_PORT = 9003
EPP_HEALTH_SERVICE = "inference-extension"
FRONTEND = "infera-frontend"
EPP = "epp"

L_MANAGED_BY = "app.kubernetes.io/managed-by"
L_PART_OF = "app.kubernetes.io/part-of"
L_DEPLOYMENT = "infera.amd.com/deployment"
L_SERVICE = "infera.amd.com/service"
L_COMPONENT = "infera.amd.com/component"
L_ROLE = "infera.amd.com/role"
# On the worker Pods that run the GAIE frontend sidecar (not LWS followers): the InferencePool's selector.
L_GAIE_FRONTEND = "infera.amd.com/gaie-frontend"


@dataclass(frozen=True)
class RenderOptions:
    """How to render. ``namespace``: used when the CR names none ("default" when neither does); a
    CR whose namespace differs from it is refused."""
    sim: bool = False
    namespace: str | None = None
    infera_image: str = DEFAULT_INFERA_IMAGE
    vllm_image: str = DEFAULT_ENGINE_IMAGES["vllm"]
    sglang_image: str = DEFAULT_ENGINE_IMAGES["sglang"]
    atom_image: str = DEFAULT_ENGINE_IMAGES["atom"]
    nats_image: str = DEFAULT_NATS_IMAGE
    etcd_image: str = DEFAULT_ETCD_IMAGE

    def engine_image(self, backend: str) -> str:
        return {"vllm": self.vllm_image, "sglang": self.sglang_image, "atom": self.atom_image}.get(
            backend, self.infera_image)


# ---------------------------------------------------------------------------------------------
# Small pure helpers (public: the operator and the tests use them)
# ---------------------------------------------------------------------------------------------
def drain_seconds(argv: list[str] | tuple[str, ...], *envs: tuple[dict[str, Any], ...]) -> float:
    """The drain a launcher started with ``argv`` and env lists ``envs`` (first wins) will use."""
    values = flag_values(argv, "--drain-timeout")
    raw: str | None = values[-1] if values else None
    if raw is None:
        for env in envs:
            raw = env_value(env, "INFERA_DRAIN_TIMEOUT")
            if raw is not None:
                break
    if raw is None:
        return float(DEFAULT_DRAIN_SECONDS)
    try:
        value = float(raw)
    except ValueError:
        raise SpecError(f"--drain-timeout / INFERA_DRAIN_TIMEOUT: not a number: {raw!r}") from None
    if value < 0 or math.isnan(value) or math.isinf(value):
        raise SpecError(f"--drain-timeout / INFERA_DRAIN_TIMEOUT: must be >= 0, got {raw!r}")
    return value


def grace_period_seconds(pre_stop_seconds: int, drain: float) -> int:
    """max(120, preStop + drain + 50): the budget of docs/kubernetes.md, only ever raised."""
    return max(MIN_GRACE_SECONDS, pre_stop_seconds + math.ceil(drain) + GRACE_MARGIN_SECONDS)


def object_name(dep: Deployment, suffix: str) -> str:
    return f"{dep.name}-{suffix}"


def nats_url(dep: Deployment, namespace: str) -> str:
    return f"nats://{dep.name}-nats.{namespace}.svc:{NATS_CLIENT_PORT}"


def etcd_endpoint(dep: Deployment, namespace: str) -> str:
    return dep.etcd_endpoint or f"http://{dep.name}-etcd.{namespace}.svc:{ETCD_CLIENT_PORT}"


def worker_label_selector(dep: Deployment) -> str:
    return f"{L_DEPLOYMENT}={dep.name},{L_COMPONENT}=worker"


def base_labels(dep: Deployment) -> dict[str, str]:
    return {L_MANAGED_BY: "infera-operator", L_PART_OF: "infera", L_DEPLOYMENT: dep.name}


def pool_labels(dep: Deployment, svc: ServiceSpec) -> dict[str, str]:
    labels = {**base_labels(dep), L_SERVICE: svc.name, L_COMPONENT: "server" if svc.is_server else "worker"}
    if not svc.is_server:
        labels[L_ROLE] = svc.role
    return labels


def pool_selector(dep: Deployment, svc: ServiceSpec) -> dict[str, str]:
    return {L_DEPLOYMENT: dep.name, L_SERVICE: svc.name}


def component_labels(dep: Deployment, component: str) -> dict[str, str]:
    return {**base_labels(dep), L_COMPONENT: component}


def component_selector(dep: Deployment, component: str) -> dict[str, str]:
    return {L_DEPLOYMENT: dep.name, L_COMPONENT: component}


class _Ctx:
    """What every builder needs: the spec, the namespace, the options."""

    def __init__(self, dep: Deployment, namespace: str, options: RenderOptions) -> None:
        self.dep = dep
        self.namespace = namespace
        self.options = options

    def meta(self, name: str, labels: dict[str, str], **extra: Any) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "namespace": self.namespace, "labels": dict(labels)}
        if self.dep.uid:
            meta["ownerReferences"] = [{"apiVersion": API_VERSION, "kind": KIND, "name": self.dep.name,
                                        "uid": self.dep.uid, "controller": True, "blockOwnerDeletion": True}]
        meta.update(extra)
        return meta

    @property
    def sa_name(self) -> str:
        return object_name(self.dep, "infera")
