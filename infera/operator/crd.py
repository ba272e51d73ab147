"""The ``InferaDeployment`` CustomResourceDefinition, built as a dict.

``deploy/kubernetes/crd.yaml`` is :func:`crd_yaml`'s output (a unit test keeps them equal;
``python -m infera.operator crd`` prints it). The schema is complete and structural: every field of
spec §10 is typed, with enums, minimums and the defaults that do not depend on another field, so the
API server prunes nothing a user meant and ``kubectl apply`` (field validation ``Strict``, kubectl's
default) refuses a misspelt field. Only ``extraPodSpec`` and an env entry's ``valueFrom`` keep unknown
fields (they are Kubernetes' own types); quantities are int-or-string as in Kubernetes.

Defaults that depend on another field are not in the schema, so an unset field stays unset and the
renderer (``spec.py``) decides: ``replicas`` (2 for a server, 1 for a worker), ``port`` (server 8000,
worker 30000), ``discoveryBackend`` (kubernetes; etcd for ``atom``).

Infera's extensions to upstream's schema (upstream manifests stay valid): ``atom`` and ``sim``
backends, ``drain``, ``kvd``, ``etcd``, ``gaie.eppReplicas``, and ``discoveryBackend: etcd``
(upstream's controller refused it).
"""
from __future__ import annotations

from typing import Any

import yaml

GROUP = "infera.amd.com"
VERSION = "v1alpha1"
KIND = "InferaDeployment"
PLURAL = "inferadeployments"
SINGULAR = "inferadeployment"
SHORT_NAMES = ["idep"]
CRD_NAME = f"{PLURAL}.{GROUP}"
API_VERSION = f"{GROUP}/{VERSION}"

BACKENDS = ["sglang", "vllm", "atom", "sim"]
DISCOVERY_BACKENDS = ["kubernetes", "etcd"]
COMPONENT_TYPES = ["server", "worker"]
ROLES = ["mixed", "prefill", "decode"]
STATES = ["initializing", "pending", "ready", "degraded", "failed"]
CONDITION_TYPES = ["Ready", "Progressing", "Degraded"]


def _str(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


def _int(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "integer", "format": "int32", "description": description, **extra}


def _bool(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "boolean", "description": description, **extra}


def _quantity(description: str) -> dict[str, Any]:
    # Kubernetes' own resource.Quantity schema: int-or-string with its pattern.
    return {"x-kubernetes-int-or-string": True, "description": description,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"}


def _obj(description: str, properties: dict[str, Any], required: list[str] | None = None,
         **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "description": description, "properties": properties}
    if required:
        out["required"] = required
    out.update(extra)
    return out


def _env_list(description: str) -> dict[str, Any]:
    return {"type": "array", "description": description,
            "items": _obj("a Kubernetes EnvVar", {
                "name": _str("variable name", minLength=1),
                "value": _str("literal value"),
                "valueFrom": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                              "description": "a Kubernetes EnvVarSource (fieldRef, secretKeyRef, ...)"},
            }, required=["name"])}


def _string_list(description: str) -> dict[str, Any]:
    return {"type": "array", "description": description, "items": {"type": "string"}}


def _string_map(description: str) -> dict[str, Any]:
    return {"type": "object", "description": description, "additionalProperties": {"type": "string"}}


RESOURCES_SCHEMA = _obj("the main container's resources", {
    "gpu": _int("accelerators per Pod (per node of a multi-node group), as a limit of gpuType", minimum=0),
    "gpuType": _str("the extended resource the accelerators are", default="amd.com/gpu", minLength=1),
    "cpu": _quantity("CPU request"),
    "memory": _quantity("memory request and limit"),
    "sharedMemory": _quantity("size of /dev/shm (an emptyDir in memory); engines need more than "
                              "the container runtime's 64Mi default"),
})

SERVICE_SCHEMA = _obj("one pool: the server (router front door) or a worker pool", {
    "componentType": _str("server: the Infera router; worker: an engine pool", enum=COMPONENT_TYPES),
    "role": _str("worker role; PD needs a prefill and a decode pool (default mixed)", enum=ROLES),
    "replicas": _int("Pods (groups when numberOfNodes > 1); default 2 for a server, 1 for a worker",
                     minimum=0),
    "numberOfNodes": _int("nodes per engine; > 1 renders a LeaderWorkerSet whose leader registers",
                          minimum=1, default=1),
    "skipReadinessProbe": _bool("no HTTP probes on the main container"),
    "image": _str("image of this pool (default: spec.image, else the backend's image)"),
    "port": _int("container port, also the Service port of a server (default: server 8000, worker 30000)",
                 minimum=1, maximum=65535),
    "resources": RESOURCES_SCHEMA,
    "args": _string_list("appended last to the rendered command (a repeated flag: the last one wins)"),
    "env": _env_list("env of the main container (wins over spec.envs)"),
    "extraPodSpec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                     "description": "merged into the rendered Pod: a PodSpec, or a template {metadata, spec}; "
                                    "its container named main or infera merges into the main container "
                                    "(resources ignored), other containers are added"},
    "podLabels": _string_map("extra labels of the Pods (the infera.amd.com/* and app.kubernetes.io/* "
                             "labels are the operator's)"),
}, required=["componentType"])

NATS_SCHEMA = _obj("the NATS JetStream broker (requests and KV events) deployed with kubernetes discovery", {
    "deploy": _bool("deploy <name>-nats (StatefulSet + Service); false: HTTP requests and ZMQ events, "
                    "unless spec.envs sets NATS_SERVER (an external broker)", default=True),
    "image": _str("NATS image (default nats:2.10-alpine)"),
    "storageSize": _quantity("JetStream volume size"),
    "storageClassName": _str("StorageClass of the JetStream volume"),
})

GAIE_SCHEMA = _obj("Gateway API Inference Extension: the endpoint picker (python -m infera.gaie) as a Deployment "
                   "and Service <name>-epp, an InferencePool <name>-pool of the worker Pods, an HTTPRoute "
                   "<name>-route on the Gateway, and a frontend sidecar (infera.server --router-mode direct) in "
                   "every worker Pod. Needs the GAIE and Gateway API CRDs on the cluster", {
    "enabled": _bool("render the EPP, InferencePool and HTTPRoute", default=False),
    "eppImage": _str("EPP image (default: the Infera image)"),
    "tokenizerPath": _str("tokenizer for the EPP's kv-aware picks (required when enabled)"),
    "gatewayName": _str("Gateway of the HTTPRoute (required when enabled)"),
    "gatewayNamespace": _str("namespace of the Gateway (default: the HTTPRoute's)"),
    "hostnames": _string_list("HTTPRoute hostnames"),
    "frontendPort": _int("port of the per-worker frontend sidecar, the InferencePool's target port",
                         minimum=1, maximum=65535, default=8000),
    "modelName": _str("model the route serves; accepted for upstream compatibility, not rendered (GAIE v1 "
                      "has no per-model object: the picker routes each request by its own model)"),
    "eppReplicas": _int("Infera: EPP replicas (they share in-flight state over NATS when it is deployed)",
                        minimum=0, default=1),
})

DRAIN_SCHEMA = _obj("Infera: the scale-down budget (docs/kubernetes.md). terminationGracePeriodSeconds = "
                    "max(120, preStopSeconds + drain + 50), drain from a pool's --drain-timeout or "
                    "INFERA_DRAIN_TIMEOUT, else drainTimeoutSeconds, else 30", {
    "preStopSeconds": _int("preStop sleep, so routers see the Pod terminating before SIGTERM",
                           minimum=0, default=15),
    "drainTimeoutSeconds": _int("workers' --drain-timeout (a pool's own args or env win)", minimum=0),
})

KVD_SCHEMA = _obj("Infera: the kvd KV-cache daemon as a DaemonSet; its socket directory is a hostPath "
                  "shared into the engine Pods (vLLM --kvd-socket, SGLang --infera-kvd-socket; mixed and "
                  "prefill pools)", {
    "enabled": _bool("deploy <name>-kvd", default=False),
    "image": _str("kvd image (default: the Infera image)"),
    "args": _string_list("extra python -m infera.kvd flags (e.g. --max-bytes 64G)"),
    "socketDir": _str("host directory of the socket", default="/var/run/infera-kvd", pattern="^/"),
})

ETCD_SCHEMA = _obj("Infera: the etcd the operator deploys for discoveryBackend etcd without etcdEndpoint", {
    "image": _str("etcd image (default quay.io/coreos/etcd:v3.5.17)"),
    "storageSize": _quantity("data volume size (default 1Gi)"),
    "storageClassName": _str("StorageClass of the data volume"),
})

SPEC_SCHEMA = _obj("the fleet", {
    "backendFramework": _str("engine of the workers (sim: Infera's simulated engine)", enum=BACKENDS,
                             default="sglang"),
    "image": _str("image of every pool that names none"),
    "discoveryBackend": _str("where worker records live: Pod annotations (kubernetes) or etcd; "
                             "default kubernetes, etcd for atom. Infera: etcd works (upstream refused it)",
                             enum=DISCOVERY_BACKENDS),
    "etcdEndpoint": _str("an external etcd (http(s)://host:port); unset with etcd discovery: the operator "
                         "deploys <name>-etcd"),
    "nats": NATS_SCHEMA,
    "gaie": GAIE_SCHEMA,
    "envs": _env_list("env of every Infera container"),
    "services": {"type": "object", "description": "pools by name (lowercase letters, digits, '-')",
                 "minProperties": 1, "additionalProperties": SERVICE_SCHEMA},
    "drain": DRAIN_SCHEMA,
    "kvd": KVD_SCHEMA,
    "etcd": ETCD_SCHEMA,
}, required=["services"])

CONDITION_SCHEMA = _obj("a standard condition", {
    "type": _str("Ready, Progressing or Degraded", enum=CONDITION_TYPES),
    "status": _str("True, False or Unknown", enum=["True", "False", "Unknown"]),
    "reason": _str("CamelCase reason"),
    "message": _str("human-readable detail"),
    "lastTransitionTime": _str("when status last changed", format="date-time"),
    "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0,
                           "description": "generation the condition was computed for"},
}, required=["type", "status"])

STATUS_SCHEMA = _obj("written by the operator", {
    "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0,
                           "description": "metadata.generation last reconciled"},
    "state": _str("overall state", enum=STATES),
    "message": _str("why the state is what it is (a refused spec names the field)"),
    "conditions": {"type": "array", "description": "Ready, Progressing, Degraded",
                   "items": CONDITION_SCHEMA,
                   "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    "services": {"type": "object", "description": "per pool",
                 "additionalProperties": _obj("a pool's workload", {
                     "kind": _str("Deployment or LeaderWorkerSet"),
                     "replicas": _int("replicas (groups) the workload has", minimum=0),
                     "readyReplicas": _int("ready replicas (groups)", minimum=0),
                 })},
    "gaie": _obj("GAIE objects", {
        "eppReplicas": _int("EPP replicas", minimum=0),
        "eppReadyReplicas": _int("ready EPP replicas", minimum=0),
        "inferencePoolName": _str("InferencePool"),
        "inferencePoolReady": _bool("InferencePool accepted"),
        "httpRouteName": _str("HTTPRoute"),
        "httpRouteAccepted": _bool("HTTPRoute accepted"),
        "ready": _bool("all GAIE objects ready"),
    }),
})


def openapi_schema() -> dict[str, Any]:
    """The version's ``openAPIV3Schema``."""
    return _obj("InferaDeployment: an Infera fleet (server, worker pools, broker) on Kubernetes", {
        "apiVersion": _str("infera.amd.com/v1alpha1"),
        "kind": _str("InferaDeployment"),
        "metadata": {"type": "object"},
        "spec": SPEC_SCHEMA,
        "status": STATUS_SCHEMA,
    }, required=["spec"])


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/part-of": "infera"}},
        "spec": {
            "group": GROUP,
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": SINGULAR,
                      "shortNames": list(SHORT_NAMES), "categories": ["infera"]},
            "scope": "Namespaced",
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Backend", "type": "string", "jsonPath": ".spec.backendFramework"},
                    {"name": "State", "type": "string", "jsonPath": ".status.state"},
                    {"name": "GAIE", "type": "boolean", "jsonPath": ".status.gaie.ready"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
                "schema": {"openAPIV3Schema": openapi_schema()},
            }],
        },
    }


def crd_yaml() -> str:
    """What ``deploy/kubernetes/crd.yaml`` holds."""
    header = ("# Generated by `python -m infera.operator crd` (infera/operator/crd.py); do not edit.\n"
              "# tests/unit/test_operator_crd.py keeps this file equal to the function's output.\n")
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)
