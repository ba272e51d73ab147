"""One renderer, two users: an ``InferaDeployment`` to the Kubernetes objects that run it.

:func:`render` is pure and deterministic: the same CR and options give the same list, sorted by
kind (in apply order) then name. The operator reconciles with it; ``python -m infera.operator
render`` prints it for GitOps users (like ``helm template``). docs/kubernetes.md is the contract
for names and labels.

Objects, for a CR ``<idep>`` (see ``spec.py`` for the spec's rules):

* ``ServiceAccount``/``Role``/``RoleBinding`` ``<idep>-infera``: Pods get/list/watch (+ patch with
  kubernetes discovery: a worker writes its record on its own Pod, and RBAC cannot name a Pod in
  advance); this ``InferaDeployment`` get/patch (the scaling API), by name.
* a server pool: ``Deployment`` (2 replicas by default, spread over nodes), ``PodDisruptionBudget``
  (maxUnavailable 1) and a ClusterIP ``Service`` whose port is the container port (upstream's
  manual port-forwarded a port the Service did not have ⚠).
* a worker pool: ``Deployment``, or a ``LeaderWorkerSet`` when ``numberOfNodes > 1`` (every node runs
  the launcher; the follower gate, ``LWS_WORKER_INDEX > 0``, keeps followers from registering).
* ``StatefulSet`` + ``Service`` ``<idep>-nats`` (JetStream on a PVC) with kubernetes discovery and
  ``nats.deploy``; ``<idep>-etcd`` with etcd discovery and no ``etcdEndpoint``. Their PVCs go with
  the StatefulSet (``persistentVolumeClaimRetentionPolicy.whenDeleted: Delete``).
* ``DaemonSet`` ``<idep>-kvd`` when ``kvd.enabled``; ``ConfigMap`` ``<idep>-grafana-dashboard``
  (label ``grafana_dashboard: "1"`` for Grafana's sidecar), the dashboard shipped as package data
  (``infera/operator/grafana_dashboard.json``, a copy of ``deploy/grafana/infera.json`` that a test
  keeps equal: an image has no repository ``deploy/`` folder).

* ``gaie.enabled`` (the Gateway API Inference Extension): the endpoint picker, a ``Deployment`` and
  ``Service`` ``<idep>-epp`` (``python3 -m infera.gaie``: ext_proc on 9002 over TLS, plaintext gRPC
  health ``inference-extension`` on 9003 for the kubelet's probes, the server's discovery and plane
  flags, kv-aware with ``gaie.tokenizerPath``, destination port ``gaie.frontendPort``); a sidecar
  ``infera-frontend`` in every worker Pod that serves (not LWS followers), ``infera.server
  --router-mode direct`` on ``frontendPort``, which sends each request to the worker (PD: the pair)
  the picker named; an ``InferencePool`` ``<idep>-pool`` (``inference.networking.k8s.io/v1``) of
  the Pods labelled ``infera.amd.com/gaie-frontend``, target port ``frontendPort``, picker
  ``<idep>-epp:9002`` with ``FailClose`` (without the picker's headers a sidecar cannot route); an
  ``HTTPRoute`` ``<idep>-route`` (``gateway.networking.k8s.io/v1``) from ``gatewayName`` /
  ``gatewayNamespace`` and ``hostnames``, path ``/``, to the pool, gateway timeouts off (streams).

Every object carries the contract's labels and, when the CR has a ``metadata.uid`` (it came from
the API server), an owner reference to it (controller, blockOwnerDeletion), so deleting the CR
deletes everything. A CR rendered offline has no uid: then there are no owner references, and the
objects are the user's to delete (GitOps).

Commands (every flag exists in the launcher's argparse; user ``args`` come last, so a repeated
flag is the user's): ``python3 -m infera.server --host 0.0.0.0 --port P`` or ``python3 -m
infera.engine.<backend> --host 0.0.0.0 --port P`` (ATOM: ``--server-port``), then discovery
(``--discovery-backend kubernetes`` [+ the server's ``--k8s-label-selector``] or ``etcd
--etcd-endpoint E``), the plane (``--request-transport nats --kv-event-transport nats --nats-server
nats://<idep>-nats.<ns>.svc:4222`` with NATS; ``nats`` without a URL when ``nats.deploy`` is false
and ``spec.envs`` names an external broker in ``NATS_SERVER``; else ``http``/``zmq``; ATOM is always
HTTP), the PD
role (SGLang ``--disaggregation-mode``; vLLM, ATOM and the sim ``--kv-transfer-config`` whose
``kv_role`` is the pool's role: a user's config keeps its connector and gets the role, a default one
is NIXL for vLLM and Mooncake for ATOM; never ``--disaggregation-mode`` for vLLM ⚠), and the
multi-node flags (SGLang ``--nnodes --node-rank --dist-init-addr``, vLLM ``--distributed-executor-backend
mp --nnodes --node-rank --master-addr`` and ``--headless`` on followers, from the LWS env) unless the
user gave them.

Drain budget: ``preStop`` sleeps ``drain.preStopSeconds``; ``terminationGracePeriodSeconds =
max(120, preStop + drain + 50)``, drain from the pool's final argv (``--drain-timeout N`` or
``=N``, the last one wins), else ``INFERA_DRAIN_TIMEOUT`` (the pool's env, then ``spec.envs``), else
30 (:func:`grace_period_seconds`).

``RenderOptions(sim=True)`` keeps every object and flag but runs ``python3 -m infera.engine.sim``
with the Infera image in every worker: the PD role as a NIXL ``--kv-transfer-config`` (the sim's),
the model from ``--model``/``--model-path``, and of the user's args only those the sim accepts
(the launcher's flags and the sim's own knobs); GPU limits are dropped.
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from importlib import resources as importlib_resources
from typing import Any

from infera.operator.crd import API_VERSION, KIND
from infera.operator.spec import (KV_ROLES, Deployment, ServiceSpec, SpecError, env_value, flag_values, has_flag,
                                  parse_deployment)

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

# What the sim accepts (tests/unit/test_operator_render.py checks these against its parsers):
# the launcher's flags, which every engine launcher shares ...
SIM_LAUNCHER_VALUE_FLAGS = frozenset({
    "--advertise-host", "--discovery-backend", "--drain-settle", "--drain-timeout", "--engine-entrypoint",
    "--engine-stop-timeout", "--etcd-cacert", "--etcd-cert", "--etcd-endpoint", "--etcd-key",
    "--etcd-password-file", "--etcd-prefix", "--etcd-user", "--fleet-key-file", "--k8s-namespace",
    "--k8s-pod-name", "--kv-event-transport", "--lease-ttl", "--log-level", "--nats-creds", "--nats-nkey-seed",
    "--nats-password-file", "--nats-req-idle-timeout", "--nats-req-max-duration", "--nats-req-max-pending",
    "--nats-server", "--nats-tls-ca", "--nats-tls-cert", "--nats-tls-key", "--nats-token-file", "--nats-user",
    "--ready-timeout", "--request-transport"})
SIM_LAUNCHER_BOOL_FLAGS = frozenset({"--disaggregation-allow-tcp", "--no-disaggregation-allow-tcp",
                                     "--enable-kv-events", "--no-enable-kv-events"})
# ... and the simulated engine's knobs that mean the same on any engine (not its host/port, PD
# config or KV-events config, which the renderer owns, nor --max-model-len, which must fit the
# simulated cache).
SIM_ENGINE_VALUE_FLAGS = frozenset({"--block-size", "--kv-bytes-per-token", "--kv-hold-timeout",
                                    "--kv-offload-blocks", "--kv-offload-load-ms-per-block",
                                    "--kv-transfer-bandwidth", "--kv-transfer-timeout", "--max-num-batched-tokens",
                                    "--max-num-seqs", "--model", "--num-gpu-blocks", "--seed", "--speedup"})
# Real engines' spellings of the sim's flags.
SIM_FLAG_ALIASES = {"--model-path": "--model", "--page-size": "--block-size"}


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


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------
def _plane_flags(ctx: _Ctx, *, atom: bool = False, server: bool = False) -> list[str]:
    """Discovery and transport flags, the same on the server and every worker."""
    dep = ctx.dep
    if dep.discovery == "etcd":
        flags = ["--discovery-backend", "etcd", "--etcd-endpoint", etcd_endpoint(dep, ctx.namespace)]
    else:
        flags = ["--discovery-backend", "kubernetes"]
        if server:  # the server lists the worker Pods; a worker patches its own Pod
            flags += ["--k8s-label-selector", worker_label_selector(dep)]
    if dep.nats_deployed and not atom:
        flags += ["--request-transport", "nats", "--kv-event-transport", "nats",
                  "--nats-server", nats_url(dep, ctx.namespace)]
    elif dep.external_nats and not atom:  # the user's broker: NATS_SERVER in spec.envs names it
        flags += ["--request-transport", "nats", "--kv-event-transport", "nats"]
    else:  # inside a Pod the defaults are NATS: say HTTP and ZMQ when there is no broker
        flags += ["--request-transport", "http", "--kv-event-transport", "zmq"]
    return flags


def server_command(ctx: _Ctx, svc: ServiceSpec) -> tuple[list[str], list[str]]:
    """(command, args) of a server pool's main container."""
    args = ["--host", "0.0.0.0", "--port", str(svc.port), *_plane_flags(ctx, server=True), *svc.args]
    return ["python3", "-m", "infera.server"], args


def _with_kv_role(raw: str, role: str) -> str:
    cfg = json.loads(raw)
    cfg["kv_role"] = KV_ROLES[role]
    return json.dumps(cfg, separators=(",", ":"))


def _role_args(backend: str, svc: ServiceSpec) -> tuple[list[str], list[str]]:
    """(flags to add, the user's args rewritten) for the pool's PD role."""
    user = list(svc.args)
    if svc.role == "mixed":
        return [], user
    if backend == "sglang":
        if has_flag(user, "--disaggregation-mode"):
            return [], user  # spec.py checked it agrees with the role
        return ["--disaggregation-mode", svc.role], user
    # vLLM, ATOM, the sim: the role is the config's kv_role (never --disaggregation-mode).
    if has_flag(user, "--kv-transfer-config"):  # the user's config, its kv_role set to the pool's
        out = []
        i = 0
        while i < len(user):
            tok = user[i]
            if tok == "--kv-transfer-config" and i + 1 < len(user):
                out += [tok, _with_kv_role(user[i + 1], svc.role)]
                i += 2
                continue
            if tok.startswith("--kv-transfer-config="):
                tok = "--kv-transfer-config=" + _with_kv_role(tok.split("=", 1)[1], svc.role)
            out.append(tok)
            i += 1
        return [], out
    connector = "mooncake" if backend == "atom" else "NixlConnector"
    cfg = {"kv_connector": connector, "kv_role": KV_ROLES[svc.role]}
    return ["--kv-transfer-config", json.dumps(cfg, separators=(",", ":"))], user


def _multinode_args(backend: str, svc: ServiceSpec, *, follower: bool) -> list[str]:
    if not svc.multinode:
        return []
    user = svc.args
    wanted: list[tuple[str, str]] = []
    if backend == "sglang":
        wanted = [("--nnodes", str(svc.number_of_nodes)), ("--node-rank", "$(LWS_WORKER_INDEX)"),
                  ("--dist-init-addr", f"$(LWS_LEADER_ADDRESS):{SGLANG_DIST_INIT_PORT}")]
    elif backend == "vllm":
        # vLLM's multiprocessing multi-node mode (no Ray cluster to form): rank 0 serves, the others --headless
        wanted = [("--distributed-executor-backend", "mp"), ("--nnodes", str(svc.number_of_nodes)),
                  ("--node-rank", "$(LWS_WORKER_INDEX)"), ("--master-addr", "$(LWS_LEADER_ADDRESS)")]
    out = [tok for flag, value in wanted if not has_flag(user, flag) for tok in (flag, value)]
    if backend == "vllm" and follower and not has_flag(user, "--headless"):
        out.append("--headless")
    return out


def _kvd_args(ctx: _Ctx, svc: ServiceSpec) -> list[str]:
    if not ctx.dep.kvd.enabled or svc.role == "decode":
        return []
    flag = {"vllm": "--kvd-socket", "sglang": "--infera-kvd-socket"}.get(ctx.dep.backend)
    if flag is None or has_flag(svc.args, flag):
        return []
    return [flag, ctx.dep.kvd.socket_path]


def _sim_user_args(dep: Deployment, svc: ServiceSpec, path: str) -> list[str]:
    """The user's args that mean something to the sim, real engines' spellings translated."""
    user = list(svc.args)
    if dep.backend == "sim":
        return user
    out: list[str] = []
    i = 0
    while i < len(user):
        tok = user[i]
        name, eq, inline = tok.partition("=")
        name = SIM_FLAG_ALIASES.get(name, name)
        if name in SIM_LAUNCHER_BOOL_FLAGS:
            out.append(name)
            i += 1
        elif name in SIM_LAUNCHER_VALUE_FLAGS or name in SIM_ENGINE_VALUE_FLAGS or name == "--served-model-name":
            if eq:
                out.append(f"{name}={inline}")
                i += 1
            elif i + 1 < len(user):
                out += [name, user[i + 1]]
                i += 2
                if name == "--served-model-name":  # vLLM takes several names; skip the aliases
                    while i < len(user) and not user[i].startswith("-"):
                        i += 1
            else:
                i += 1
        else:  # the real engine's own flag: dropped with its values
            i += 1
            if tok.startswith("-") and not eq:
                while i < len(user) and not user[i].startswith("-"):
                    i += 1
    if not has_flag(out, "--model"):
        raise SpecError(f"{path}.args: the sim needs the model: --model or --model-path")
    return out


def worker_command(ctx: _Ctx, svc: ServiceSpec, *, follower: bool = False) -> tuple[list[str], list[str]]:
    """(command, args) of a worker pool's main container (``follower``: an LWS worker Pod)."""
    dep = ctx.dep
    path = f"spec.services.{svc.name}"
    drain = [] if dep.drain.drain_timeout_seconds is None else ["--drain-timeout",
                                                                 str(dep.drain.drain_timeout_seconds)]
    if ctx.options.sim:
        role_flags: list[str] = []
        if svc.role != "mixed":
            cfg = {"kv_connector": "NixlConnector", "kv_role": KV_ROLES[svc.role]}
            role_flags = ["--kv-transfer-config", json.dumps(cfg, separators=(",", ":"))]
        user = _sim_user_args(dep, svc, path)
        if dep.backend == "sim":  # already the sim's args: the role as for vLLM
            role_flags, user = _role_args("sim", svc)
        args = [*_plane_flags(ctx), *drain, "--host", "0.0.0.0", "--port", str(svc.port), *role_flags, *user]
        return ["python3", "-m", "infera.engine.sim"], args
    backend = dep.backend
    role_flags, user = _role_args(backend, svc)
    address = ["--host", "0.0.0.0", "--server-port" if backend == "atom" else "--port", str(svc.port)]
    args = [*_plane_flags(ctx, atom=backend == "atom"), *drain, *_kvd_args(ctx, svc), *address, *role_flags,
            *_multinode_args(backend, svc, follower=follower), *user]
    return ["python3", "-m", f"infera.engine.{backend}"], args


def epp_command(ctx: _Ctx) -> tuple[list[str], list[str]]:
    """(command, args) of the GAIE endpoint picker: it discovers the workers as the server does,
    picks kv-aware from the same KV events, and names ``<pod ip>:<frontendPort>`` (the sidecar) as
    the destination. TLS on the ext_proc port (gateways connect with TLS and skip verification, as
    GAIE's reference EPP expects); the health port stays plaintext for the kubelet's gRPC probe."""
    gaie = ctx.dep.gaie
    assert gaie.tokenizer_path is not None  # spec.py requires it with gaie.enabled
    # The server's plane flags: the same discovery and KV events, and with NATS the replicas share
    # in-flight state (--replica-sync defaults to nats there) as server replicas do.
    args = ["--host", "0.0.0.0", "--grpc-port", str(EPP_GRPC_PORT), "--grpc-health-port", str(EPP_HEALTH_PORT),
            "--destination-port", str(gaie.frontend_port), "--secure-serving",
            *_plane_flags(ctx, server=True),
            "--router-policy", "kv-aware", "--router-tokenizer-path", gaie.tokenizer_path]
    return ["python3", "-m", "infera.gaie"], args


def frontend_command(ctx: _Ctx) -> tuple[list[str], list[str]]:
    """(command, args) of the per-worker GAIE sidecar: an ``infera.server`` that routes each request
    to the worker the EPP named (``x-worker-instance-id``; for PD the pair, with
    ``x-prefill-instance-id``), over NATS requests when NATS is deployed, else HTTP. It picks
    nothing itself: one process, round-robin (no tokenizer), no replica sync or engine scrapes."""
    args = ["--host", "0.0.0.0", "--port", str(ctx.dep.gaie.frontend_port), "--router-mode", "direct",
            *_plane_flags(ctx, server=True),
            "--router-policy", "round-robin", "--workers", "1", "--replica-sync", "off",
            "--engine-scrape-interval", "0"]
    return ["python3", "-m", "infera.server"], args


# ---------------------------------------------------------------------------------------------
# Pods
# ---------------------------------------------------------------------------------------------
def _downward_env() -> list[dict[str, Any]]:
    return [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]


def _merge_env(*lists: Any) -> list[dict[str, Any]]:
    """Concatenate env lists; a later entry replaces an earlier one of the same name, in place."""
    out: list[dict[str, Any]] = []
    index: dict[str, int] = {}
    for env in lists:
        for entry in env:
            entry = copy.deepcopy(dict(entry))
            if entry["name"] in index:
                out[index[entry["name"]]] = entry
            else:
                index[entry["name"]] = len(out)
                out.append(entry)
    return out


def _http_probes(port_name: str) -> dict[str, Any]:
    get = {"path": "/health", "port": port_name}
    return {
        "startupProbe": {"httpGet": dict(get), "periodSeconds": STARTUP_PERIOD_S, "timeoutSeconds": 5,
                         "failureThreshold": STARTUP_FAILURE_THRESHOLD},
        "readinessProbe": {"httpGet": dict(get), "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"httpGet": dict(get), "periodSeconds": 10, "timeoutSeconds": 10, "failureThreshold": 6},
    }


def _resources(svc: ServiceSpec, *, sim: bool) -> dict[str, Any]:
    r = svc.resources
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if r.cpu is not None:
        requests["cpu"] = r.cpu  # no CPU limit: throttling an engine's scheduler loop costs latency
    if r.memory is not None:
        requests["memory"] = limits["memory"] = r.memory
    if r.gpu and not sim:
        limits[r.gpu_type] = r.gpu
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _merge_extra_pod_spec(template: dict[str, Any], extra: dict[str, Any] | None) -> None:
    """Merge a pool's ``extraPodSpec`` (a PodSpec, or a template with metadata/spec) into ``template``.

    Its container named main or infera merges into ours (lists of named items by name, its scalars
    win, ``resources`` ignored: they come from ``resources``); other containers, init containers,
    volumes and tolerations are added; any other PodSpec field is taken as given.
    """
    if not extra:
        return
    extra = copy.deepcopy(extra)
    if "spec" in extra or "metadata" in extra:
        meta = extra.get("metadata") or {}
        for key in ("labels", "annotations"):
            if meta.get(key):
                merged = {**meta[key], **template["metadata"].get(key, {})}  # ours win
                template["metadata"][key] = merged
        extra = extra.get("spec") or {}
    pod = template["spec"]
    for key, value in extra.items():
        if key == "containers":
            for container in value or []:
                if container.get("name") in ("main", "infera"):
                    _merge_main_container(pod["containers"][0], container)
                else:
                    pod["containers"].append(container)
        elif key in ("volumes", "initContainers", "tolerations", "imagePullSecrets", "hostAliases"):
            pod[key] = _merge_named(pod.get(key, []), value or [])
        else:
            pod[key] = value


def _merge_named(ours: list[Any], theirs: list[Any]) -> list[Any]:
    out = list(ours)
    for item in theirs:
        name = item.get("name") if isinstance(item, dict) else None
        for i, existing in enumerate(out):
            if name is not None and isinstance(existing, dict) and existing.get("name") == name:
                out[i] = item
                break
        else:
            out.append(item)
    return out


def _merge_main_container(main: dict[str, Any], theirs: dict[str, Any]) -> None:
    for key, value in theirs.items():
        if key in ("name", "resources"):
            continue
        if key == "env":
            main["env"] = _merge_env(main.get("env", []), value or [])
        elif key in ("volumeMounts", "ports", "envFrom", "volumeDevices"):
            main[key] = _merge_named(main.get(key, []), value or [])
        elif key == "securityContext" and isinstance(value, dict):
            main[key] = {**main.get(key, {}), **value}
        else:
            main[key] = value


def _pod_template(ctx: _Ctx, svc: ServiceSpec, command: list[str], args: list[str], image: str, *,
                  probes: bool, extra_env: list[dict[str, Any]], kvd_mount: bool,
                  frontend: bool = False) -> dict[str, Any]:
    dep = ctx.dep
    labels = {**dict(svc.pod_labels), **pool_labels(dep, svc)}
    env = _merge_env(_downward_env(), extra_env, dep.envs, svc.env)
    pre_stop = dep.drain.pre_stop_seconds
    if svc.is_server:  # the server has no drain flag: size its grace on the fleet's drain
        drain = float(dep.drain.drain_timeout_seconds if dep.drain.drain_timeout_seconds is not None
                      else DEFAULT_DRAIN_SECONDS)
    else:
        try:
            drain = drain_seconds(args, svc.env, dep.envs)
        except SpecError as exc:
            raise SpecError(f"spec.services.{svc.name}: {exc}") from None
    main: dict[str, Any] = {"name": MAIN, "image": image, "command": command, "args": args,
                            "ports": [{"name": "http", "containerPort": svc.port, "protocol": "TCP"}], "env": env}
    if probes and not svc.skip_readiness_probe:
        main.update(_http_probes("http"))
    if pre_stop > 0:
        main["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(pre_stop)]}}}
    resources = _resources(svc, sim=ctx.options.sim and not svc.is_server)
    if resources:
        main["resources"] = resources
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if svc.resources.shared_memory is not None:
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": svc.resources.shared_memory}})
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
    if kvd_mount:
        volumes.append({"name": "kvd-socket", "hostPath": {"path": dep.kvd.socket_dir, "type": "DirectoryOrCreate"}})
        mounts.append({"name": "kvd-socket", "mountPath": dep.kvd.socket_dir})
    if mounts:
        main["volumeMounts"] = mounts
    spec: dict[str, Any] = {"serviceAccountName": ctx.sa_name, "containers": [main],
                            "terminationGracePeriodSeconds": grace_period_seconds(pre_stop, drain)}
    if volumes:
        spec["volumes"] = volumes
    if frontend:
        spec["containers"].append(_frontend_container(ctx, pre_stop + math.ceil(drain)))
        labels[L_GAIE_FRONTEND] = "true"
    template = {"metadata": {"labels": labels}, "spec": spec}
    _merge_extra_pod_spec(template, svc.extra_pod_spec)
    template["metadata"]["labels"] = {**template["metadata"]["labels"], **pool_labels(dep, svc)}
    if frontend:
        template["metadata"]["labels"][L_GAIE_FRONTEND] = "true"
    return template


def _frontend_container(ctx: _Ctx, stay_seconds: int) -> dict[str, Any]:
    """The GAIE sidecar. Its preStop outlasts the worker's preStop and drain, so the streams the
    worker finishes while draining still have their proxy (the grace period covers both)."""
    dep = ctx.dep
    command, args = frontend_command(ctx)
    extra_env = ([{"name": "INFERA_K8S_LABEL_SELECTOR", "value": worker_label_selector(dep)}]
                 if dep.discovery == "kubernetes" else [])
    get = {"path": "/health", "port": "frontend"}
    container: dict[str, Any] = {
        "name": FRONTEND, "image": _frontend_image(ctx), "command": command, "args": args,
        "ports": [{"name": "frontend", "containerPort": dep.gaie.frontend_port, "protocol": "TCP"}],
        "env": _merge_env(_downward_env(), extra_env, dep.envs),
        "readinessProbe": {"httpGet": dict(get), "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"httpGet": dict(get), "periodSeconds": 10, "timeoutSeconds": 10, "failureThreshold": 6},
    }
    if stay_seconds > 0:
        container["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(stay_seconds)]}}}
    return container


def _frontend_image(ctx: _Ctx) -> str:
    """The server pool's image: it has infera.server (a worker's engine image need not)."""
    server = next(s for s in ctx.dep.services if s.is_server)
    return server.image or ctx.dep.image or ctx.options.infera_image


def _pool_image(ctx: _Ctx, svc: ServiceSpec) -> str:
    if svc.is_server:
        return svc.image or ctx.dep.image or ctx.options.infera_image
    if ctx.options.sim:
        return ctx.options.infera_image
    return svc.image or ctx.dep.image or ctx.options.engine_image(ctx.dep.backend)


# ---------------------------------------------------------------------------------------------
# Objects
# ---------------------------------------------------------------------------------------------
def _rbac(ctx: _Ctx) -> list[dict[str, Any]]:
    dep = ctx.dep
    labels = base_labels(dep)
    pod_verbs = ["get", "list", "watch"] + (["patch"] if dep.discovery == "kubernetes" else [])
    name = ctx.sa_name
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": ctx.meta(name, labels)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": ctx.meta(name, labels),
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": pod_verbs},
                   {"apiGroups": [API_VERSION.split("/")[0]], "resources": ["inferadeployments"],
                    "resourceNames": [dep.name], "verbs": ["get", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": ctx.meta(name, labels),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ctx.namespace}]},
    ]


def _server_objects(ctx: _Ctx, svc: ServiceSpec) -> list[dict[str, Any]]:
    dep = ctx.dep
    name = object_name(dep, svc.name)
    labels = pool_labels(dep, svc)
    selector = pool_selector(dep, svc)
    command, args = server_command(ctx, svc)
    extra_env = ([{"name": "INFERA_K8S_LABEL_SELECTOR", "value": worker_label_selector(dep)}]
                 if dep.discovery == "kubernetes" else [])
    template = _pod_template(ctx, svc, command, args, _pool_image(ctx, svc), probes=True, extra_env=extra_env,
                             kvd_mount=False)
    template["spec"].setdefault("topologySpreadConstraints", [{
        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": dict(selector)}}])
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": ctx.meta(name, labels),
         "spec": {"replicas": svc.replicas, "selector": {"matchLabels": selector},
                  "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                  "template": template}},
        {"apiVersion": "v1", "kind": "Service", "metadata": ctx.meta(name, labels),
         "spec": {"type": "ClusterIP", "selector": dict(selector),
                  "ports": [{"name": "http", "port": svc.port, "targetPort": "http", "protocol": "TCP"}]}},
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": ctx.meta(name, labels),
         "spec": {"maxUnavailable": 1, "selector": {"matchLabels": dict(selector)}}},
    ]


def _worker_objects(ctx: _Ctx, svc: ServiceSpec) -> list[dict[str, Any]]:
    dep = ctx.dep
    name = object_name(dep, svc.name)
    labels = pool_labels(dep, svc)
    selector = pool_selector(dep, svc)
    image = _pool_image(ctx, svc)
    kvd_mount = dep.kvd.enabled
    command, args = worker_command(ctx, svc)
    leader = _pod_template(ctx, svc, command, args, image, probes=True, extra_env=[], kvd_mount=kvd_mount,
                           frontend=dep.gaie.enabled)
    if not svc.multinode:
        return [{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": ctx.meta(name, labels),
                 "spec": {"replicas": svc.replicas, "selector": {"matchLabels": selector},
                          # a cold start can take longer than the default 10 minutes
                          "progressDeadlineSeconds": 3600,
                          "strategy": {"type": "RollingUpdate",
                                       "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                          "template": leader}}]
    f_command, f_args = worker_command(ctx, svc, follower=True)
    # Followers serve no API (SGLang schedulers, vLLM --headless): no HTTP probes.
    follower = _pod_template(ctx, svc, f_command, f_args, image, probes=False, extra_env=[], kvd_mount=kvd_mount)
    return [{"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "metadata": ctx.meta(name, labels),
             "spec": {"replicas": svc.replicas, "startupPolicy": "LeaderCreated",
                      "rolloutStrategy": {"type": "RollingUpdate",
                                          "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0}},
                      "leaderWorkerTemplate": {"size": svc.number_of_nodes,
                                               "restartPolicy": "RecreateGroupOnPodRestart",
                                               "leaderTemplate": leader, "workerTemplate": follower}}}]


def _statefulset(ctx: _Ctx, component: str, container: dict[str, Any], data_path: str, storage: Any,
                 storage_class: str | None) -> dict[str, Any]:
    dep = ctx.dep
    name = object_name(dep, component)
    labels = component_labels(dep, component)
    container["volumeMounts"] = [{"name": "data", "mountPath": data_path}]
    pvc_spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": storage}}}
    if storage_class:
        pvc_spec["storageClassName"] = storage_class
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": ctx.meta(name, labels),
            "spec": {"serviceName": name, "replicas": 1,
                     "selector": {"matchLabels": component_selector(dep, component)},
                     "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Retain"},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"automountServiceAccountToken": False, "containers": [container]}},
                     "volumeClaimTemplates": [{"metadata": {"name": "data", "labels": labels}, "spec": pvc_spec}]}}


def _nats_objects(ctx: _Ctx) -> list[dict[str, Any]]:
    dep = ctx.dep
    name = object_name(dep, "nats")
    labels = component_labels(dep, "nats")
    container = {
        "name": MAIN, "image": dep.nats.image or ctx.options.nats_image,
        # args only: the image's entrypoint is nats-server (scratch) or passes flags to it (alpine)
        "args": ["-js", "-sd", "/data/jetstream", "-m", str(NATS_MONITOR_PORT)],
        "ports": [{"name": "client", "containerPort": NATS_CLIENT_PORT, "protocol": "TCP"},
                  {"name": "monitor", "containerPort": NATS_MONITOR_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "monitor"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "monitor"}, "periodSeconds": 10,
                          "failureThreshold": 6},
    }
    sts = _statefulset(ctx, "nats", container, "/data", dep.nats.storage_size or DEFAULT_NATS_STORAGE,
                       dep.nats.storage_class_name)
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": ctx.meta(name, labels),
           "spec": {"type": "ClusterIP", "selector": component_selector(dep, "nats"),
                    "ports": [{"name": "client", "port": NATS_CLIENT_PORT, "targetPort": "client", "protocol": "TCP"},
                              {"name": "monitor", "port": NATS_MONITOR_PORT, "targetPort": "monitor",
                               "protocol": "TCP"}]}}
    return [sts, svc]


def _etcd_objects(ctx: _Ctx) -> list[dict[str, Any]]:
    dep = ctx.dep
    name = object_name(dep, "etcd")
    labels = component_labels(dep, "etcd")
    container = {
        "name": MAIN, "image": dep.etcd.image or ctx.options.etcd_image, "command": ["etcd"],
        "args": ["--listen-client-urls", f"http://0.0.0.0:{ETCD_CLIENT_PORT}",
                 "--advertise-client-urls", etcd_endpoint(dep, ctx.namespace),
                 "--data-dir", "/var/lib/etcd"],
        "ports": [{"name": "client", "containerPort": ETCD_CLIENT_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "client"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "client"}, "periodSeconds": 10,
                          "failureThreshold": 6},
    }
    sts = _statefulset(ctx, "etcd", container, "/var/lib/etcd", dep.etcd.storage_size or DEFAULT_ETCD_STORAGE,
                       dep.etcd.storage_class_name)
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": ctx.meta(name, labels),
           "spec": {"type": "ClusterIP", "selector": component_selector(dep, "etcd"),
                    "ports": [{"name": "client", "port": ETCD_CLIENT_PORT, "targetPort": "client",
                               "protocol": "TCP"}]}}
    return [sts, svc]


def _kvd_objects(ctx: _Ctx) -> list[dict[str, Any]]:
    dep = ctx.dep
    kvd = dep.kvd
    name = object_name(dep, "kvd")
    labels = component_labels(dep, "kvd")
    container = {"name": MAIN, "image": kvd.image or ctx.options.infera_image,
                 "command": ["python3", "-m", "infera.kvd"], "args": ["--socket", kvd.socket_path, *kvd.args],
                 "env": _downward_env(),
                 # root: the kubelet creates the hostPath directory root-owned, and kvd's socket
                 # (umask 0o077) must be reachable by the engines, which run as root in the vendor
                 # images; IPC_LOCK lets the shared arena mlock (without it kvd degrades silently).
                 "securityContext": {"runAsUser": 0, "runAsNonRoot": False,
                                     "capabilities": {"add": ["IPC_LOCK"]}},
                 "volumeMounts": [{"name": "kvd-socket", "mountPath": kvd.socket_dir}]}
    return [{"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": ctx.meta(name, labels),
             "spec": {"selector": {"matchLabels": component_selector(dep, "kvd")},
                      "updateStrategy": {"type": "RollingUpdate"},
                      "template": {"metadata": {"labels": labels},
                                   "spec": {"automountServiceAccountToken": False, "containers": [container],
                                            "volumes": [{"name": "kvd-socket",
                                                         "hostPath": {"path": kvd.socket_dir,
                                                                      "type": "DirectoryOrCreate"}}]}}}}]


def _worker_grace_seconds(ctx: _Ctx, svc: ServiceSpec) -> int:
    command, args = worker_command(ctx, svc)
    return grace_period_seconds(ctx.dep.drain.pre_stop_seconds, drain_seconds(args, svc.env, ctx.dep.envs))


def _gaie_objects(ctx: _Ctx) -> list[dict[str, Any]]:
    """The endpoint picker (Deployment + Service ``<idep>-epp``), the InferencePool ``<idep>-pool``
    of the worker Pods' sidecars, and the HTTPRoute ``<idep>-route`` from the Gateway to it."""
    dep = ctx.dep
    gaie = dep.gaie
    name = object_name(dep, EPP)
    labels = component_labels(dep, EPP)
    selector = component_selector(dep, EPP)
    command, args = epp_command(ctx)
    extra_env = ([{"name": "INFERA_K8S_LABEL_SELECTOR", "value": worker_label_selector(dep)}]
                 if dep.discovery == "kubernetes" else [])
    grpc_probe = {"grpc": {"port": EPP_HEALTH_PORT, "service": EPP_HEALTH_SERVICE}}
    container = {
        "name": MAIN, "image": gaie.epp_image or ctx.options.infera_image, "command": command, "args": args,
        "ports": [{"name": "grpc", "containerPort": EPP_GRPC_PORT, "protocol": "TCP"},
                  {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"}],
        "env": _merge_env(_downward_env(), extra_env, dep.envs),
        "readinessProbe": {**grpc_probe, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**grpc_probe, "periodSeconds": 10, "timeoutSeconds": 10, "failureThreshold": 6},
    }
    # In full-duplex mode a response streams through the picker: a stopping replica first leaves the
    # Service (preStop), then lets its open streams finish, as long as a worker may take to drain.
    pre_stop = dep.drain.pre_stop_seconds
    if pre_stop > 0:
        container["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(pre_stop)]}}}
    grace = max(_worker_grace_seconds(ctx, svc) for svc in dep.services if not svc.is_server)
    epp_deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": ctx.meta(name, labels),
        "spec": {"replicas": gaie.epp_replicas, "selector": {"matchLabels": selector},
                 "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                 "template": {"metadata": {"labels": dict(labels)},
                              "spec": {"serviceAccountName": ctx.sa_name, "containers": [container],
                                       "terminationGracePeriodSeconds": grace}}}}
    epp_service = {
        "apiVersion": "v1", "kind": "Service", "metadata": ctx.meta(name, labels),
        "spec": {"type": "ClusterIP", "selector": dict(selector),
                 "ports": [{"name": "grpc", "port": EPP_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
                            "appProtocol": "http2"},
                           {"name": "grpc-health", "port": EPP_HEALTH_PORT, "targetPort": "grpc-health",
                            "protocol": "TCP", "appProtocol": "http2"}]}}
    pool_name = object_name(dep, "pool")
    gaie_labels = component_labels(dep, "gaie")
    pool = {
        "apiVersion": INFERENCE_POOL_API_VERSION, "kind": "InferencePool", "metadata": ctx.meta(pool_name, gaie_labels),
        "spec": {"selector": {"matchLabels": {L_DEPLOYMENT: dep.name, L_GAIE_FRONTEND: "true"}},
                 "targetPorts": [{"number": gaie.frontend_port}],
                 # FailClose: without the picker's headers the sidecar cannot route (direct mode)
                 "endpointPickerRef": {"kind": "Service", "name": name, "port": {"number": EPP_GRPC_PORT},
                                       "failureMode": "FailClose"}}}
    parent: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gaie.gateway_name}
    if gaie.gateway_namespace:
        parent["namespace"] = gaie.gateway_namespace
    route_spec: dict[str, Any] = {"parentRefs": [parent]}
    if gaie.hostnames:
        route_spec["hostnames"] = list(gaie.hostnames)
    route_spec["rules"] = [{
        "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
        "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool_name}],
        # 0s disables the gateway's timeouts (Gateway API: "SHOULD disable"): a stream lasts as long
        # as the generation; the sidecar's own first-byte and idle timeouts still bound a stalled one.
        "timeouts": {"request": "0s", "backendRequest": "0s"}}]
    route = {"apiVersion": HTTPROUTE_API_VERSION, "kind": "HTTPRoute",
             "metadata": ctx.meta(object_name(dep, "route"), gaie_labels), "spec": route_spec}
    return [epp_deployment, epp_service, pool, route]


def grafana_dashboard_json() -> str:
    """The Grafana dashboard shipped with the package (a copy of deploy/grafana/infera.json)."""
    return importlib_resources.files("infera.operator").joinpath("grafana_dashboard.json").read_text("utf-8")


def _dashboard(ctx: _Ctx) -> dict[str, Any]:
    labels = {**base_labels(ctx.dep), "grafana_dashboard": "1"}
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": ctx.meta(object_name(ctx.dep, "grafana-dashboard"), labels),
            "data": {"infera.json": grafana_dashboard_json()}}


def _sort_key(obj: dict[str, Any]) -> tuple[int, str]:
    return KIND_ORDER.index(obj["kind"]), obj["metadata"]["name"]


def render_deployment(dep: Deployment, namespace: str, options: RenderOptions = RenderOptions()) -> list[dict[str, Any]]:
    """The objects of an already-parsed spec (the operator parses once, then renders)."""
    ctx = _Ctx(dep, namespace, options)
    objects = _rbac(ctx) + [_dashboard(ctx)]
    for svc in dep.services:
        objects += _server_objects(ctx, svc) if svc.is_server else _worker_objects(ctx, svc)
    if dep.nats_deployed:
        objects += _nats_objects(ctx)
    if dep.etcd_deployed:
        objects += _etcd_objects(ctx)
    if dep.kvd.enabled:
        objects += _kvd_objects(ctx)
    if dep.gaie.enabled:
        objects += _gaie_objects(ctx)
    return sorted(objects, key=_sort_key)


def resolve_namespace(cr_namespace: str | None, options: RenderOptions) -> str:
    if cr_namespace and options.namespace and cr_namespace != options.namespace:
        raise SpecError(f"metadata.namespace: {cr_namespace!r} differs from the namespace asked for "
                        f"({options.namespace!r})")
    return cr_namespace or options.namespace or "default"


def render(cr: dict[str, Any], options: RenderOptions = RenderOptions()) -> list[dict[str, Any]]:
    """Every object the ``InferaDeployment`` ``cr`` (a dict) owns; :class:`SpecError` on a bad spec."""
    dep = parse_deployment(cr)
    return render_deployment(dep, resolve_namespace(dep.namespace, options), options)
