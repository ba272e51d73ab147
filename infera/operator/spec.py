"""An ``InferaDeployment``'s spec: parsed, defaulted and checked into frozen dataclasses.

:func:`parse_deployment` takes the CR as a dict (what ``kubectl`` or the API server has) and returns
a :class:`Deployment`, or raises :class:`SpecError` whose message starts with the field's path, e.g.
``spec.services.decode.replicas: must be >= 0``. The CRD schema (``crd.py``) refuses the same typos
at apply time; this module is what ``render`` and the operator rely on, so it checks everything
itself (a manifest rendered offline never met an API server) plus the rules a schema cannot say:

* at least one server and one worker pool; a server has no PD role and runs on one node;
* PD (a prefill or a decode pool) needs both roles;
* vLLM (and the sim, and ATOM) take the PD role from ``--kv-transfer-config`` only:
  ``--disaggregation-mode`` in such a pool's args is refused (vLLM's parser rejects it; upstream's
  operator appended it ⚠); a ``kv_role`` in the user's config is the pool's role or ``kv_both``
  (which the renderer replaces with the role);
* SGLang's ``--disaggregation-mode`` in args must agree with the role;
* ATOM runs on etcd (its launcher registers nowhere else) and on one node per engine;
* ``etcdEndpoint`` only with ``discoveryBackend: etcd`` (which works here: upstream refused it ⚠);
* GAIE (``gaie.enabled``) needs ``tokenizerPath`` and ``gatewayName``; its ``frontendPort`` (the
  per-worker sidecar) must differ from every worker pool's port, and no pool may be named ``epp``
  (``<name>-epp`` is the endpoint picker's Deployment and Service).

Defaults that depend on another field: server replicas 2, worker replicas 1; server port 8000,
worker port 30000; discovery kubernetes (etcd for atom).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping

from infera.operator.crd import (API_VERSION, BACKENDS, COMPONENT_TYPES, DISCOVERY_BACKENDS, DRAIN_SCHEMA, ETCD_SCHEMA,
                                 GAIE_SCHEMA, KIND, KVD_SCHEMA, NATS_SCHEMA, RESOURCES_SCHEMA, ROLES, SERVICE_SCHEMA,
                                 SPEC_SCHEMA)

DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # DNS-1035: Service names start with a letter
NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# <name>-<pool> names StatefulSets/LeaderWorkerSets too, whose Pods carry a
# controller-revision-hash label of name + "-" + 10 characters (<= 63).
MAX_OBJECT_NAME = 52
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
RESERVED_LABEL_PREFIXES = ("infera.amd.com/", "app.kubernetes.io/")
QUANTITY = re.compile(r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")

# <name>-nats, -etcd, -kvd, -infera, -grafana-dashboard are the operator's own objects.
RESERVED_POOL_NAMES = ("nats", "etcd", "kvd", "infera", "grafana-dashboard")

DEFAULT_SERVER_REPLICAS = 2
DEFAULT_WORKER_REPLICAS = 1
DEFAULT_SERVER_PORT = 8000
DEFAULT_WORKER_PORT = 30000
DEFAULT_PRESTOP_SECONDS = 15
DEFAULT_KVD_SOCKET_DIR = "/var/run/infera-kvd"
DEFAULT_GPU_TYPE = "amd.com/gpu"
DEFAULT_FRONTEND_PORT = 8000
DEFAULT_EPP_REPLICAS = 1
# Gateway API's Hostname (a wildcard only as the first label), as its CRD's pattern.
GATEWAY_HOSTNAME = re.compile(r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
MAX_HOSTNAMES = 16  # HTTPRoute spec.hostnames maxItems

# vLLM's kv_role per pool role (vLLM, the sim and ATOM read the PD role from --kv-transfer-config).
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "mixed": "kv_both"}


# The fields each object may have: the CRD schema's, so the two cannot disagree.
SPEC_FIELDS = frozenset(SPEC_SCHEMA["properties"])
SERVICE_FIELDS = frozenset(SERVICE_SCHEMA["properties"])
RESOURCES_FIELDS = frozenset(RESOURCES_SCHEMA["properties"])
NATS_FIELDS = frozenset(NATS_SCHEMA["properties"])
GAIE_FIELDS = frozenset(GAIE_SCHEMA["properties"])
DRAIN_FIELDS = frozenset(DRAIN_SCHEMA["properties"])
KVD_FIELDS = frozenset(KVD_SCHEMA["properties"])
ETCD_FIELDS = frozenset(ETCD_SCHEMA["properties"])


class SpecError(ValueError):
    """A spec the operator cannot deploy; the message starts with the field's path."""


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Resources:
    gpu: int | None = None
    gpu_type: str = DEFAULT_GPU_TYPE
    cpu: str | int | None = None
    memory: str | int | None = None
    shared_memory: str | int | None = None


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    component_type: str  # server | worker
    role: str  # mixed | prefill | decode (mixed for a server)
    replicas: int
    number_of_nodes: int
    skip_readiness_probe: bool
    image: str | None
    port: int
    resources: Resources
    args: tuple[str, ...]
    env: tuple[dict[str, Any], ...]
    extra_pod_spec: dict[str, Any] | None
    pod_labels: tuple[tuple[str, str], ...]

    @property
    def is_server(self) -> bool:
        return self.component_type == "server"

    @property
    def multinode(self) -> bool:
        return self.number_of_nodes > 1


@dataclass(frozen=True)
class NatsSpec:
    deploy: bool = True
    image: str | None = None
    storage_size: str | int | None = None
    storage_class_name: str | None = None


@dataclass(frozen=True)
class GaieSpec:
    enabled: bool = False
    epp_image: str | None = None
    tokenizer_path: str | None = None  # required when enabled
    gateway_name: str | None = None  # required when enabled
    gateway_namespace: str | None = None  # None: the HTTPRoute's own namespace
    hostnames: tuple[str, ...] = ()
    frontend_port: int = DEFAULT_FRONTEND_PORT
    model_name: str | None = None
    epp_replicas: int = DEFAULT_EPP_REPLICAS


@dataclass(frozen=True)
class DrainSpec:
    pre_stop_seconds: int = DEFAULT_PRESTOP_SECONDS
    drain_timeout_seconds: int | None = None


@dataclass(frozen=True)
class KvdSpec:
    enabled: bool = False
    image: str | None = None
    args: tuple[str, ...] = ()
    socket_dir: str = DEFAULT_KVD_SOCKET_DIR

    @property
    def socket_path(self) -> str:
        return self.socket_dir.rstrip("/") + "/kvd.sock"


@dataclass(frozen=True)
class EtcdSpec:
    image: str | None = None
    storage_size: str | int | None = None
    storage_class_name: str | None = None


@dataclass(frozen=True)
class Deployment:
    name: str
    namespace: str | None
    uid: str | None
    backend: str
    image: str | None
    discovery: str  # kubernetes | etcd
    etcd_endpoint: str | None  # external etcd; None with etcd discovery: the operator deploys one
    nats: NatsSpec
    gaie: GaieSpec
    envs: tuple[dict[str, Any], ...]
    services: tuple[ServiceSpec, ...]  # sorted by name
    drain: DrainSpec
    kvd: KvdSpec
    etcd: EtcdSpec

    @property
    def nats_deployed(self) -> bool:
        return self.discovery == "kubernetes" and self.nats.deploy

    @property
    def external_nats(self) -> bool:
        """NATS without deploying it: nats.deploy false and NATS_SERVER in spec.envs."""
        return (self.discovery == "kubernetes" and not self.nats.deploy
                and any(e["name"] == "NATS_SERVER" for e in self.envs))

    @property
    def etcd_deployed(self) -> bool:
        return self.discovery == "etcd" and not self.etcd_endpoint

    def service(self, name: str) -> ServiceSpec:
        for s in self.services:
            if s.name == name:
                return s
        raise KeyError(name)


# ---------------------------------------------------------------------------------------------
# Field readers: each names the path it reads
# ---------------------------------------------------------------------------------------------
_MISSING = object()


def _fields(obj: Mapping[str, Any], path: str, known: frozenset[str] | set[str]) -> None:
    unknown = sorted(set(obj) - known)
    if unknown:
        raise SpecError(f"{path}.{unknown[0]}: unknown field (known: {', '.join(sorted(known))})")


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SpecError(f"{path}: must be an object, got {type(value).__name__}")
    return value


def _get_mapping(obj: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any]:
    value = obj.get(key)
    return {} if value is None else _mapping(value, f"{path}.{key}")


def _str(obj: Mapping[str, Any], key: str, path: str, default: Any = None, *, enum: list[str] | None = None,
         non_empty: bool = True) -> Any:
    value = obj.get(key, _MISSING)
    if value is _MISSING or value is None:
        return default
    if not isinstance(value, str):
        raise SpecError(f"{path}.{key}: must be a string, got {type(value).__name__}")
    if non_empty and not value:
        raise SpecError(f"{path}.{key}: must not be empty")
    if enum is not None and value not in enum:
        raise SpecError(f"{path}.{key}: must be one of {', '.join(enum)}, got {value!r}")
    return value


def _int(obj: Mapping[str, Any], key: str, path: str, default: Any = None, *, minimum: int | None = None,
         maximum: int | None = None) -> Any:
    value = obj.get(key, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{path}.{key}: must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise SpecError(f"{path}.{key}: must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise SpecError(f"{path}.{key}: must be <= {maximum}")
    return value


def _bool(obj: Mapping[str, Any], key: str, path: str, default: bool) -> bool:
    value = obj.get(key, _MISSING)
    if value is _MISSING or value is None:
        return default
    if not isinstance(value, bool):
        raise SpecError(f"{path}.{key}: must be true or false, got {value!r}")
    return value


def _quantity(obj: Mapping[str, Any], key: str, path: str) -> str | int | None:
    value = obj.get(key, _MISSING)
    if value is _MISSING or value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not QUANTITY.match(str(value)):
        raise SpecError(f"{path}.{key}: must be a Kubernetes quantity (e.g. 16Gi, 500m, 4), got {value!r}")
    return value


def _str_list(obj: Mapping[str, Any], key: str, path: str) -> tuple[str, ...]:
    value = obj.get(key)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise SpecError(f"{path}.{key}: must be a list of strings")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise SpecError(f"{path}.{key}[{i}]: must be a string, got {item!r} (quote numbers in YAML)")
    return tuple(value)


def _env(obj: Mapping[str, Any], key: str, path: str) -> tuple[dict[str, Any], ...]:
    value = obj.get(key)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise SpecError(f"{path}.{key}: must be a list of {{name, value | valueFrom}}")
    out = []
    for i, item in enumerate(value):
        where = f"{path}.{key}[{i}]"
        item = _mapping(item, where)
        _fields(item, where, {"name", "value", "valueFrom"})
        name = _str(item, "name", where)
        if name is None:
            raise SpecError(f"{where}.name: required")
        entry: dict[str, Any] = {"name": name}
        if "value" in item and item["value"] is not None:
            if not isinstance(item["value"], str):
                raise SpecError(f"{where}.value: must be a string, got {item['value']!r} (quote it in YAML)")
            entry["value"] = item["value"]
        if item.get("valueFrom") is not None:
            if "value" in entry:
                raise SpecError(f"{where}: value and valueFrom are exclusive")
            entry["valueFrom"] = dict(_mapping(item["valueFrom"], f"{where}.valueFrom"))
        out.append(entry)
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# argv helpers shared with the renderer
# ---------------------------------------------------------------------------------------------
def flag_values(args: tuple[str, ...] | list[str], name: str) -> list[str]:
    """Every value of ``name`` in ``args`` (``--x v`` and ``--x=v``), in order."""
    out = []
    for i, tok in enumerate(args):
        if tok == name and i + 1 < len(args):
            out.append(args[i + 1])
        elif tok.startswith(name + "="):
            out.append(tok[len(name) + 1:])
    return out


def has_flag(args: tuple[str, ...] | list[str], name: str) -> bool:
    return any(tok == name or tok.startswith(name + "=") for tok in args)


def env_value(env: tuple[dict[str, Any], ...], name: str) -> str | None:
    """The literal value of ``name`` (the last entry wins), None if absent or not literal."""
    value = None
    for entry in env:
        if entry["name"] == name:
            value = entry.get("value")
    return value


# ---------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------
def _resources(svc: Mapping[str, Any], path: str) -> Resources:
    obj = _get_mapping(svc, "resources", path)
    where = f"{path}.resources"
    _fields(obj, where, RESOURCES_FIELDS)
    return Resources(gpu=_int(obj, "gpu", where, minimum=0),
                     gpu_type=_str(obj, "gpuType", where, DEFAULT_GPU_TYPE),
                     cpu=_quantity(obj, "cpu", where), memory=_quantity(obj, "memory", where),
                     shared_memory=_quantity(obj, "sharedMemory", where))


def _pod_labels(svc: Mapping[str, Any], path: str) -> tuple[tuple[str, str], ...]:
    obj = _get_mapping(svc, "podLabels", path)
    out = []
    for key, value in sorted(obj.items()):
        where = f"{path}.podLabels.{key}"
        if any(key.startswith(p) for p in RESERVED_LABEL_PREFIXES):
            raise SpecError(f"{where}: the operator owns the {key.split('/')[0]}/ labels")
        if not isinstance(value, str) or len(value) > 63 or not LABEL_VALUE.match(value):
            raise SpecError(f"{where}: must be a label value (<= 63 alphanumerics, '-', '_', '.'), got {value!r}")
        out.append((key, value))
    return tuple(out)


def _check_pd_args(backend: str, role: str, args: tuple[str, ...], path: str) -> None:
    where = f"{path}.args"
    modes = flag_values(args, "--disaggregation-mode")
    if backend in ("vllm", "sim", "atom"):
        if has_flag(args, "--disaggregation-mode"):
            raise SpecError(f"{where}: {backend} has no --disaggregation-mode (vLLM's parser rejects it); "
                            "the PD role comes from the pool's role, rendered as --kv-transfer-config")
        for raw in flag_values(args, "--kv-transfer-config"):
            try:
                cfg = json.loads(raw)
            except ValueError as exc:
                raise SpecError(f"{where}: --kv-transfer-config is not JSON ({exc})") from None
            if not isinstance(cfg, dict):
                raise SpecError(f"{where}: --kv-transfer-config must be a JSON object")
            kv_role = cfg.get("kv_role")
            # kv_both (vLLM's NIXL examples use it on both sides) or none: the pool's role is rendered in
            if kv_role not in (None, "kv_both", KV_ROLES[role]):
                raise SpecError(f"{where}: --kv-transfer-config kv_role {kv_role!r} disagrees with role "
                                f"{role!r} (expected {KV_ROLES[role]!r})")
    elif backend == "sglang":
        for mode in modes:
            expected = "null" if role == "mixed" else role
            if mode != expected:
                raise SpecError(f"{where}: --disaggregation-mode {mode} disagrees with role {role!r}")


def _service(name: str, raw: Any, backend: str, path: str) -> ServiceSpec:
    svc = _mapping(raw, path)
    _fields(svc, path, SERVICE_FIELDS)
    component = _str(svc, "componentType", path, enum=COMPONENT_TYPES)
    if component is None:
        raise SpecError(f"{path}.componentType: required (server or worker)")
    role = _str(svc, "role", path, "mixed", enum=ROLES)
    is_server = component == "server"
    if is_server and role != "mixed":
        raise SpecError(f"{path}.role: a server has no PD role (got {role!r})")
    nodes = _int(svc, "numberOfNodes", path, 1, minimum=1)
    if is_server and nodes != 1:
        raise SpecError(f"{path}.numberOfNodes: a server runs on one node")
    if nodes > 1 and backend == "atom":
        raise SpecError(f"{path}.numberOfNodes: ATOM has no multi-node follower gate; use 1")
    replicas = _int(svc, "replicas", path, DEFAULT_SERVER_REPLICAS if is_server else DEFAULT_WORKER_REPLICAS,
                    minimum=0)
    port = _int(svc, "port", path, DEFAULT_SERVER_PORT if is_server else DEFAULT_WORKER_PORT,
                minimum=1, maximum=65535)
    args = _str_list(svc, "args", path)
    if not is_server:
        _check_pd_args(backend, role, args, path)
    extra = svc.get("extraPodSpec")
    extra_pod_spec = None if extra is None else dict(_mapping(extra, f"{path}.extraPodSpec"))
    return ServiceSpec(name=name, component_type=component, role=role, replicas=replicas, number_of_nodes=nodes,
                       skip_readiness_probe=_bool(svc, "skipReadinessProbe", path, False),
                       image=_str(svc, "image", path), port=port, resources=_resources(svc, path), args=args,
                       env=_env(svc, "env", path), extra_pod_spec=extra_pod_spec,
                       pod_labels=_pod_labels(svc, path))


def _gaie(raw: Mapping[str, Any]) -> GaieSpec:
    path = "spec.gaie"
    _fields(raw, path, GAIE_FIELDS)
    hostnames = _str_list(raw, "hostnames", path)
    if len(hostnames) > MAX_HOSTNAMES:
        raise SpecError(f"{path}.hostnames: at most {MAX_HOSTNAMES} (the HTTPRoute's limit)")
    for i, host in enumerate(hostnames):
        if len(host) > 253 or not GATEWAY_HOSTNAME.match(host):
            raise SpecError(f"{path}.hostnames[{i}]: must be a lowercase DNS name, optionally '*.'-prefixed, "
                            f"without a port, got {host!r}")
    gateway_namespace = _str(raw, "gatewayNamespace", path)
    if gateway_namespace is not None and not NAMESPACE.match(gateway_namespace):
        raise SpecError(f"{path}.gatewayNamespace: must be a namespace name (DNS label), got {gateway_namespace!r}")
    gaie = GaieSpec(enabled=_bool(raw, "enabled", path, False), epp_image=_str(raw, "eppImage", path),
                    tokenizer_path=_str(raw, "tokenizerPath", path), gateway_name=_str(raw, "gatewayName", path),
                    gateway_namespace=gateway_namespace, hostnames=hostnames,
                    frontend_port=_int(raw, "frontendPort", path, DEFAULT_FRONTEND_PORT, minimum=1, maximum=65535),
                    model_name=_str(raw, "modelName", path),
                    epp_replicas=_int(raw, "eppReplicas", path, DEFAULT_EPP_REPLICAS, minimum=0))
    if gaie.gateway_name is not None and (len(gaie.gateway_name) > 253 or not NAMESPACE.match(gaie.gateway_name)):
        raise SpecError(f"{path}.gatewayName: must be an object name (lowercase letters, digits, '-'), "
                        f"got {gaie.gateway_name!r}")
    if gaie.enabled:
        if gaie.tokenizer_path is None:
            raise SpecError(f"{path}.tokenizerPath: required with gaie.enabled (the endpoint picker's kv-aware "
                            "picks tokenize the prompt: a folder with tokenizer.json, or the file)")
        if gaie.gateway_name is None:
            raise SpecError(f"{path}.gatewayName: required with gaie.enabled (the Gateway the HTTPRoute attaches to)")
    return gaie


def parse_spec(name: str, spec_raw: Any, *, namespace: str | None = None, uid: str | None = None) -> Deployment:
    spec = _mapping(spec_raw, "spec")
    _fields(spec, "spec", SPEC_FIELDS)
    backend = _str(spec, "backendFramework", "spec", "sglang", enum=BACKENDS)
    discovery = _str(spec, "discoveryBackend", "spec", "etcd" if backend == "atom" else "kubernetes",
                     enum=DISCOVERY_BACKENDS)
    if backend == "atom" and discovery != "etcd":
        raise SpecError("spec.discoveryBackend: atom registers in etcd only (its launcher has no Pod-annotation "
                        "registration); use etcd (the operator deploys one) or leave it unset")
    etcd_endpoint = _str(spec, "etcdEndpoint", "spec")
    if etcd_endpoint is not None and discovery != "etcd":
        raise SpecError("spec.etcdEndpoint: only used with discoveryBackend: etcd")

    nats_raw = _get_mapping(spec, "nats", "spec")
    _fields(nats_raw, "spec.nats", NATS_FIELDS)
    nats = NatsSpec(deploy=_bool(nats_raw, "deploy", "spec.nats", True), image=_str(nats_raw, "image", "spec.nats"),
                    storage_size=_quantity(nats_raw, "storageSize", "spec.nats"),
                    storage_class_name=_str(nats_raw, "storageClassName", "spec.nats"))

    gaie = _gaie(_get_mapping(spec, "gaie", "spec"))

    drain_raw = _get_mapping(spec, "drain", "spec")
    _fields(drain_raw, "spec.drain", DRAIN_FIELDS)
    drain = DrainSpec(pre_stop_seconds=_int(drain_raw, "preStopSeconds", "spec.drain", DEFAULT_PRESTOP_SECONDS,
                                            minimum=0),
                      drain_timeout_seconds=_int(drain_raw, "drainTimeoutSeconds", "spec.drain", minimum=0))

    kvd_raw = _get_mapping(spec, "kvd", "spec")
    _fields(kvd_raw, "spec.kvd", KVD_FIELDS)
    kvd = KvdSpec(enabled=_bool(kvd_raw, "enabled", "spec.kvd", False), image=_str(kvd_raw, "image", "spec.kvd"),
                  args=_str_list(kvd_raw, "args", "spec.kvd"),
                  socket_dir=_str(kvd_raw, "socketDir", "spec.kvd", DEFAULT_KVD_SOCKET_DIR))
    if not kvd.socket_dir.startswith("/"):
        raise SpecError("spec.kvd.socketDir: must be an absolute path")

    etcd_raw = _get_mapping(spec, "etcd", "spec")
    _fields(etcd_raw, "spec.etcd", ETCD_FIELDS)
    etcd = EtcdSpec(image=_str(etcd_raw, "image", "spec.etcd"),
                    storage_size=_quantity(etcd_raw, "storageSize", "spec.etcd"),
                    storage_class_name=_str(etcd_raw, "storageClassName", "spec.etcd"))

    services_raw = spec.get("services")
    if services_raw is None:
        raise SpecError("spec.services: required (a server and at least one worker pool)")
    services_raw = _mapping(services_raw, "spec.services")
    services = []
    for svc_name in sorted(services_raw):
        path = f"spec.services.{svc_name}"
        if not isinstance(svc_name, str) or not DNS_LABEL.match(svc_name):
            raise SpecError(f"{path}: a pool name is lowercase letters, digits and '-', starting with a letter")
        if svc_name in RESERVED_POOL_NAMES:
            raise SpecError(f"{path}: {svc_name!r} names one of the operator's own objects "
                            f"({', '.join(RESERVED_POOL_NAMES)} are reserved)")
        if len(f"{name}-{svc_name}") > MAX_OBJECT_NAME:
            raise SpecError(f"{path}: {name}-{svc_name} is longer than {MAX_OBJECT_NAME} characters")
        services.append(_service(svc_name, services_raw[svc_name], backend, path))
    if not any(s.is_server for s in services):
        raise SpecError("spec.services: needs a pool with componentType: server (the router front door)")
    workers = [s for s in services if not s.is_server]
    if not workers:
        raise SpecError("spec.services: needs at least one pool with componentType: worker")
    roles = {s.role for s in workers}
    if ("prefill" in roles) != ("decode" in roles):
        missing = "decode" if "prefill" in roles else "prefill"
        raise SpecError(f"spec.services: PD needs a {missing} pool too (a prefill pool and a decode pool)")
    if kvd.enabled and backend in ("atom",):
        raise SpecError("spec.kvd.enabled: ATOM has no kvd connector")
    if gaie.enabled:
        if any(s.name == "epp" for s in services):
            raise SpecError("spec.services.epp: with gaie.enabled, <name>-epp is the endpoint picker's Deployment "
                            "and Service; rename the pool")
        for w in workers:
            if w.port == gaie.frontend_port:
                raise SpecError(f"spec.gaie.frontendPort: {gaie.frontend_port} is also spec.services.{w.name}.port; "
                                "the sidecar and the engine share the Pod's network, so they need different ports")

    return Deployment(name=name, namespace=namespace, uid=uid, backend=backend, image=_str(spec, "image", "spec"),
                      discovery=discovery, etcd_endpoint=etcd_endpoint, nats=nats, gaie=gaie,
                      envs=_env(spec, "envs", "spec"), services=tuple(services), drain=drain, kvd=kvd, etcd=etcd)


def parse_deployment(cr: Any) -> Deployment:
    """The CR (a dict) as a :class:`Deployment`; :class:`SpecError` names the first bad field."""
    cr = _mapping(cr, "InferaDeployment")
    api_version = cr.get("apiVersion", API_VERSION)
    if api_version != API_VERSION:
        raise SpecError(f"apiVersion: must be {API_VERSION}, got {api_version!r}")
    kind = cr.get("kind", KIND)
    if kind != KIND:
        raise SpecError(f"kind: must be {KIND}, got {kind!r}")
    meta = _get_mapping(cr, "metadata", "")
    name = meta.get("name")
    if not isinstance(name, str) or not DNS_LABEL.match(name):
        raise SpecError(f"metadata.name: must be a DNS label (lowercase letters, digits, '-', starting with a "
                        f"letter), got {name!r}")
    if len(name) > MAX_OBJECT_NAME - 5:  # room for -nats / -etcd
        raise SpecError(f"metadata.name: at most {MAX_OBJECT_NAME - 5} characters")
    namespace = meta.get("namespace")
    if namespace is not None and (not isinstance(namespace, str) or not NAMESPACE.match(namespace)):
        raise SpecError(f"metadata.namespace: must be a DNS label, got {namespace!r}")
    uid = meta.get("uid") or None
    if "spec" not in cr:
        raise SpecError("spec: required")
    return parse_spec(name, cr["spec"], namespace=namespace, uid=uid)
