"""LocalKubelet: a one-node Kubernetes data plane for tests, run against an API server over HTTP.

It is the controller-manager, scheduler, kube-proxy, cluster DNS and kubelet in one asyncio test
tool (tests only; never the product's runtime). It talks to the API server (the fake in
``tests/fakes/kube_api.py``, or any) only over HTTP: list + watch of each kind, writes through the
main resource, ``/status`` and DELETE. Use it as::

    async with LocalKubelet(api_url, token, workdir, probe_period_cap=0.5) as kubelet:
        ...  # create Deployments / StatefulSets / DaemonSets / LeaderWorkerSets / Services / Pods
        print(kubelet.logs("my-pod", tail=50))

What it does: Deployments, StatefulSets, DaemonSets and LeaderWorkerSets become Pods; each Pod is
bound to the node ``local-node``, gets its own loopback IP (``127.0.<x>.1`` upwards, x from a random
first block in 10..149, below the fake's Service IPs in ``127.0.200.0``-``127.0.254.255``), and
each of its containers runs as a local process (its own process group) with the Pod's env, probes,
restarts and graceful deletion; each Service with a cluster IP is served by a TCP proxy on
``clusterIP:port``; Python processes resolve Service names through
``tests/fakes/pod_sitecustomize/sitecustomize.py``.

Where it differs from a real cluster:

* One node (``local-node``), no resources, taints, affinity or preemption: every Pod fits.
  Pods its controllers create are bound at creation (``spec.nodeName`` set in the POST); other Pods
  are bound with the ``binding`` subresource, else a merge patch of ``spec.nodeName``.
* No isolation: a "container" is a process on the host, sharing its filesystem, network and user.
  Images are not pulled: ``command``/``args`` run as given, argv[0] ``python``/``python3[.X]`` is the
  test's interpreter, ``nats-server`` and ``etcd`` are the binaries of the test environment, anything
  else comes from ``PATH``. An image table (``images=``) gives the entrypoint and default args of an
  image when the Pod gives no ``command``: by default ``nats`` (``nats-server``) and
  ``quay.io/coreos/etcd``/``etcd`` (``etcd``); any other image without a command fails to start
  (waiting reason ``CreateContainerError``).
* Network: all Pods share the host's network namespace on loopback. Each Pod has its own IP
  (``127.0.<x>.<y>``, never reused while in use), so every ``0.0.0.0`` inside an argument or env
  value (``0.0.0.0``, ``--host=0.0.0.0``, ``http://0.0.0.0:2379``, also inside mounted ConfigMap
  files) is rewritten to the Pod's IP, keeping Pods from colliding on ports; ``nats-server`` and
  ``etcd`` without a listen address in their args are given the Pod's IP (:func:`bind_to_pod_ip`).
  Any other process that binds all interfaces by default (no address in its args) can collide with
  another Pod, or with a Service proxy, on the same port. No NetworkPolicy; ``hostNetwork`` and
  ``hostPort`` are ignored.
* Volumes: ``emptyDir`` and ``persistentVolumeClaim`` are directories under ``workdir`` (per Pod,
  per claim), ``hostPath`` is a per-node directory under ``workdir``; ``configMap``/``secret``
  volumes are written as files. Mount paths are not mounted: every mount path found in an argument,
  an env value or a mounted ConfigMap file is rewritten to its directory (``subPath`` honoured).
  volumeClaimTemplates make no PVC objects; a claim's directory outlives its Pod, as a PV does.
* Controllers: a Deployment owns its Pods directly (no ReplicaSets; Pod names keep the
  ``<deploy>-<templatehash10>-<5 random>`` shape and the ``pod-template-hash`` label); rolling
  update defaults to maxSurge 1 / maxUnavailable 0 (a real cluster: 25% / 25%), honours the given
  ``strategy.rollingUpdate`` and ``Recreate``; ``minReadySeconds``, ``progressDeadlineSeconds``
  and revision history are ignored (available = ready). StatefulSets: OrderedReady or Parallel,
  rolling update from the highest ordinal, no partitions, ControllerRevisions or PVC retention.
  No adoption of orphaned Pods that match a selector (ownership is by owner reference only).
  DaemonSets: one Pod on the one node. LeaderWorkerSets: group ``i`` is a leader ``<lws>-<i>``
  and workers ``<lws>-<i>-<j>``, all owned by the LWS itself (a real one uses StatefulSets and
  leader-owned workers), no headless Service object is made (DNS answers
  ``<pod>.<lws>.<ns>`` anyway), a template change recreates groups from the highest index,
  ``restartPolicy`` (RecreateGroupOnPodRestart) and ``startupPolicy`` are ignored.
* Kubelet: probes (startup, readiness, liveness; httpGet, tcpSocket, exec) follow their fields, but
  ``probe_period_cap`` (seconds) caps ``periodSeconds`` and ``initialDelaySeconds`` to speed tests;
  restart backoff is ``restart_backoff`` (base, cap) seconds, 10 s doubling to 300 s by default,
  never reset; ``grace_period_cap`` caps the termination grace period. Init containers run in
  order before the containers. No resource limits, securityContext, image pull, ephemeral
  containers, sidecar (restartable) init containers or Events. Env: the Pod's ``env`` (``value``;
  ``valueFrom`` ``fieldRef`` for metadata.name/namespace/uid, metadata.labels['x'],
  metadata.annotations['x'], status.podIP, status.hostIP, spec.nodeName, spec.serviceAccountName;
  ``configMapKeyRef``, ``secretKeyRef``; ``resourceFieldRef`` answers ``0``), ``envFrom``, ``$(VAR)``
  expansion in env, command and args; plus ``KUBERNETES_SERVICE_HOST``/``PORT`` for the API and
  ``KUBECONFIG`` (no service-account token is mounted), ``PATH``/``HOME`` and a few others from the
  test's environment, ``PYTHONUNBUFFERED=1`` (as the Infera image), and ``PYTHONPATH`` (the DNS
  hook, the repository). No ``*_SERVICE_HOST``
  service links. Logs go to ``workdir/logs/<ns>_<pod>_<container>.log``. A running Pod's spec
  changes (image, env, command) are not applied (a real kubelet restarts the container). Pods left
  when :meth:`LocalKubelet.stop` runs keep their last status in the API (their processes are gone).
* kube-proxy: a userspace TCP proxy per Service port on its cluster IP (a Service the API server
  gave no cluster IP gets one here, ``127.0.255.<n>``, not written back), round-robin over the
  Pods that match the selector, are Ready and are not terminating (read from the API's Pod
  status); no endpoint means the connection is closed at once (a real one rejects). UDP,
  sessionAffinity, NodePort/LoadBalancer, externalTrafficPolicy and Services without a selector
  are not served; a Service port below 1024 needs root (or ``net.ipv4.ip_unprivileged_port_start``).
  core/v1 Endpoints are written for every Service with a selector (no EndpointSlices, no
  ``publishNotReadyAddresses``; the proxy does not read them back).
* DNS: only Python processes with the hook resolve cluster names: ``socket.getaddrinfo``,
  ``gethostbyname[_ex]`` and uvloop's loop are wrapped; C resolvers (gRPC's c-ares, aiodns,
  libcurl) are not, and the hook's ``sitecustomize`` shadows any other one. The tests' own process
  uses :meth:`LocalKubelet.resolve`. Search path and ``ndots:5`` as in a Pod's resolv.conf;
  records: ``<svc>.<ns>.svc.cluster.local`` (the cluster IP, or the ready Pod IPs of a headless
  Service) and ``<hostname>.<subdomain>.<ns>.svc.cluster.local`` for every Pod with both set (a
  real cluster needs a headless Service named ``subdomain``).
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence
from urllib.parse import urlsplit

import aiohttp

log = logging.getLogger("local_kubelet")

NODE_NAME = "local-node"
REPO_ROOT = Path(__file__).resolve().parents[2]
SITECUSTOMIZE_DIR = Path(__file__).resolve().parent / "pod_sitecustomize"
HOSTS_ENV = "INFERA_TEST_CLUSTER_HOSTS"
NAMESPACE_ENV = "INFERA_TEST_CLUSTER_NAMESPACE"
LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_TEMPLATE_HASH = "leaderworkerset.sigs.k8s.io/template-revision-hash"
LWS_SIZE = "leaderworkerset.sigs.k8s.io/size"  # annotation
LWS_LEADER_NAME = "leaderworkerset.sigs.k8s.io/leader-name"  # annotation on workers
# The alphabet Kubernetes uses for generated names and hashes (no vowels, no look-alikes).
SAFE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
ENV_INHERITED = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "HF_HOME", "HF_HUB_OFFLINE",
                 "TRANSFORMERS_OFFLINE", "INFERA_NATIVE", "VIRTUAL_ENV")


# ==============================================================================================
# Pure parts (unit-tested in tests/unit/test_kubelet_*.py)
# ==============================================================================================
def template_hash(template: Mapping[str, Any]) -> str:
    """A stable 10-character hash of a Pod template (the ``pod-template-hash`` label): the same
    template gives the same hash in every process, any change gives another."""
    digest = hashlib.sha256(json.dumps(template, sort_keys=True, separators=(",", ":")).encode()).digest()
    number = int.from_bytes(digest[:12], "big")
    out = []
    for _ in range(10):
        number, rem = divmod(number, len(SAFE_ALPHABET))
        out.append(SAFE_ALPHABET[rem])
    return "".join(out)


def random_suffix(rng: random.Random | None = None, length: int = 5) -> str:
    return "".join((rng or random).choice(SAFE_ALPHABET) for _ in range(length))


def lws_pod_names(lws_name: str, groups: int, size: int) -> list[tuple[str, int, int]]:
    """(Pod name, group index, worker index) of every Pod of a LeaderWorkerSet: per group ``i`` the
    leader ``<lws>-<i>`` (worker index 0) and the workers ``<lws>-<i>-<j>``, j = 1 .. size-1."""
    out = []
    for group in range(groups):
        out.append((f"{lws_name}-{group}", group, 0))
        out.extend((f"{lws_name}-{group}-{worker}", group, worker) for worker in range(1, size))
    return out


def lws_leader_address(lws_name: str, group: int, namespace: str) -> str:
    """``LWS_LEADER_ADDRESS``: the leader Pod's DNS name (hostname.subdomain.namespace)."""
    return f"{lws_name}-{group}.{lws_name}.{namespace}"


_LABEL_PATH = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")


def field_ref_value(pod: Mapping[str, Any], field_path: str, *, pod_ip: str = "", host_ip: str = "") -> str:
    """The Downward API value of ``fieldRef.fieldPath`` for ``pod``; ValueError for an unsupported path."""
    meta = pod.get("metadata", {})
    spec = pod.get("spec", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", "default"),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName") or NODE_NAME,
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if field_path in simple:
        return str(simple[field_path])
    if m := _LABEL_PATH.match(field_path):
        return str((meta.get(m[1]) or {}).get(m[2], ""))
    raise ValueError(f"env valueFrom.fieldRef.fieldPath {field_path!r} is not supported")


_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand_vars(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: a defined variable is replaced, an undefined reference is
    kept as written, ``$$`` is a literal ``$``."""
    def replace(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m[1], m.group(0))
    return _VAR_REF.sub(replace, text)


def rewrite_value(text: str, pod_ip: str, mounts: Sequence[tuple[str, str]]) -> str:
    """An argument, env value or mounted file with every ``0.0.0.0`` made the Pod's own IP and
    every mount path (``(mountPath, local dir)``; longest first) made its local directory."""
    text = text.replace("0.0.0.0", pod_ip)
    for mount_path, local in sorted(mounts, key=lambda m: -len(m[0])):
        mount_path = mount_path.rstrip("/") or "/"
        if mount_path == "/":
            continue  # a mount over / cannot be told from any absolute path
        pattern = r"(?<![\w./-])" + re.escape(mount_path) + r"(?=/|$|[^\w.-])"
        text = re.sub(pattern, lambda _m: local, text)
    return text


_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")


def image_repository(image: str) -> str:
    """``quay.io/coreos/etcd:v3.5@sha256:..`` → ``quay.io/coreos/etcd``; ``docker.io/library/nats``
    → ``nats``."""
    repo = image.split("@", 1)[0]
    last = repo.rsplit("/", 1)
    if ":" in last[-1]:
        repo = repo[: repo.rfind(":")]
    for prefix in ("docker.io/library/", "docker.io/", "index.docker.io/library/"):
        if repo.startswith(prefix):
            repo = repo[len(prefix):]
    return repo


@dataclass(frozen=True)
class ImageSpec:
    """What an image would run: its entrypoint and its default args (Dockerfile CMD)."""
    entrypoint: tuple[str, ...]
    default_args: tuple[str, ...] = ()


def default_images() -> dict[str, ImageSpec]:
    nats = ImageSpec(("nats-server",), ())
    etcd = ImageSpec(("etcd",), ())
    return {"nats": nats, "quay.io/coreos/etcd": etcd, "etcd": etcd, "gcr.io/etcd-development/etcd": etcd}


def _has_flag(argv: Sequence[str], flags: Iterable[str]) -> bool:
    return any(a == f or a.startswith(f + "=") for a in argv for f in flags)


def bind_to_pod_ip(argv: list[str], pod_ip: str) -> list[str]:
    """Programs that would bind every interface (or localhost) by default get their Pod's IP:
    in a container they bind inside their own network namespace; here they share the host's.
    ``nats-server`` without ``-a``/``--addr``/``--net`` gets ``-a <ip>`` (its monitor port follows);
    ``etcd`` without listen URLs gets them on the Pod IP (client 2379, peer 2380)."""
    program = os.path.basename(argv[0]) if argv else ""
    if program == "nats-server" and not _has_flag(argv, ("-a", "--addr", "--net")):
        return argv + ["-a", pod_ip]
    if program == "etcd":
        extra = []
        if not _has_flag(argv, ("--listen-client-urls",)):
            extra += ["--listen-client-urls", f"http://{pod_ip}:2379"]
            if not _has_flag(argv, ("--advertise-client-urls",)):
                extra += ["--advertise-client-urls", f"http://{pod_ip}:2379"]
        if not _has_flag(argv, ("--listen-peer-urls",)):
            extra += ["--listen-peer-urls", f"http://{pod_ip}:2380"]
        return argv + extra
    return argv


def container_argv(container: Mapping[str, Any], images: Mapping[str, ImageSpec]) -> list[str]:
    """command + args, with an image's entrypoint/default args filling what the Pod leaves out
    (as a container runtime does); ValueError naming the field when nothing can be run."""
    command = list(container.get("command") or [])
    args = container.get("args")
    if command:
        return command + list(args or [])
    image = str(container.get("image", ""))
    spec = images.get(image_repository(image))
    if spec is None:
        raise ValueError(f"container {container.get('name')!r}: image {image!r} has no local mapping; "
                         "give spec.containers[].command or map the image (LocalKubelet images=)")
    return list(spec.entrypoint) + (list(args) if args is not None else list(spec.default_args))


def resolve_program(argv0: str, path_env: str | None = None) -> str:
    """The local executable for a container's argv[0]."""
    base = os.path.basename(argv0)
    if _PYTHON.match(base):
        return sys.executable
    beside = os.path.join(os.path.dirname(sys.executable), base)
    if base in ("nats-server", "etcd", "etcdctl") and os.path.exists(beside):
        return beside
    if base == "etcd":
        from infera.discovery.embedded_etcd import find_etcd_binary
        return find_etcd_binary()
    if os.path.isabs(argv0) and os.access(argv0, os.X_OK):
        return argv0
    found = shutil.which(base, path=path_env)
    if not found:
        raise ValueError(f"executable {argv0!r} not found on PATH")
    return found


def int_or_percent(value: Any, total: int, *, round_up: bool, default: int) -> int:
    """A rolling-update ``maxSurge``/``maxUnavailable``: an int or ``"N%"`` of ``total``."""
    if value is None:
        return default
    if isinstance(value, str) and value.endswith("%"):
        pct = int(value[:-1]) * total
        return -(-pct // 100) if round_up else pct // 100
    return int(value)


@dataclass(frozen=True)
class ProbeTiming:
    """A probe's timing fields, defaulted as Kubernetes does, with periods capped for tests."""
    initial_delay: float = 0.0
    period: float = 10.0
    timeout: float = 1.0
    success_threshold: int = 1
    failure_threshold: int = 3

    @classmethod
    def from_probe(cls, probe: Mapping[str, Any], cap: float | None = None) -> "ProbeTiming":
        initial = float(probe.get("initialDelaySeconds", 0))
        period = float(probe.get("periodSeconds", 10))
        if cap is not None:
            initial, period = min(initial, cap), min(period, cap)
        return cls(initial, period, float(probe.get("timeoutSeconds", 1)),
                   int(probe.get("successThreshold", 1)), int(probe.get("failureThreshold", 3)))


class ProbeState:
    """Consecutive successes/failures of one probe; ``result`` flips only on a threshold."""

    def __init__(self, timing: ProbeTiming, initial: bool = False) -> None:
        self.timing = timing
        self.result = initial
        self.successes = 0
        self.failures = 0

    def record(self, ok: bool) -> bool:
        """Record one probe outcome; returns the probe's result after it."""
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= self.timing.success_threshold:
                self.result = True
        else:
            self.failures, self.successes = self.failures + 1, 0
            if self.failures >= self.timing.failure_threshold:
                self.result = False
        return self.result


def restart_delay(restarts: int, base: float = 10.0, cap: float = 300.0) -> float:
    """The CrashLoopBackOff delay before restart number ``restarts + 1``: base, doubling, capped."""
    return min(cap, base * (2 ** max(0, restarts)))


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def selector_matches(selector: Mapping[str, str] | None, labels: Mapping[str, str] | None) -> bool:
    """A Service's (or matchLabels) equality selector; an empty selector matches nothing here."""
    if not selector:
        return False
    labels = labels or {}
    return all(labels.get(k) == v for k, v in selector.items())


def label_selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str] | None) -> bool:
    """A workload's ``spec.selector`` (matchLabels and matchExpressions)."""
    selector = selector or {}
    labels = labels or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        present = key in labels
        if (op == "In" and labels.get(key) not in values) or (op == "NotIn" and present and labels[key] in values) \
                or (op == "Exists" and not present) or (op == "DoesNotExist" and present):
            return False
    return True


def allocate_ip(index: int, first: tuple[int, int] = (10, 1)) -> str:
    """The ``index``-th Pod IP: ``127.0.<a>.<b>`` counting from ``first`` (``127.0.10.1``), skipping
    ``.0``/``.255`` and stopping below ``127.0.200.0`` (the fake's Service IPs start there)."""
    per_block = 254
    a, b = first
    offset = (b - 1) + index
    block, host = divmod(offset, per_block)
    second = a + block
    if second >= 200:
        raise ValueError("out of Pod IPs")
    return f"127.0.{second}.{host + 1}"


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj.get("metadata", {}).get("ownerReferences") or [])


def owner_ref(owner: Mapping[str, Any], api_version: str, kind: str) -> dict[str, Any]:
    return {"apiVersion": api_version, "kind": kind, "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


# ==============================================================================================
# API access: plain HTTP (aiohttp), list + watch informers
# ==============================================================================================
@dataclass(frozen=True)
class Kind:
    """A namespaced resource: its API group path and plural."""
    prefix: str  # "/api/v1" or "/apis/<group>/<version>"
    plural: str

    def collection(self, namespace: str | None = None) -> str:
        if namespace is None:
            return f"{self.prefix}/{self.plural}"
        return f"{self.prefix}/namespaces/{namespace}/{self.plural}"

    def item(self, namespace: str, name: str, sub: str = "") -> str:
        return f"{self.collection(namespace)}/{name}" + (f"/{sub}" if sub else "")


PODS = Kind("/api/v1", "pods")
SERVICES = Kind("/api/v1", "services")
CONFIGMAPS = Kind("/api/v1", "configmaps")
ENDPOINTS = Kind("/api/v1", "endpoints")
SECRETS = Kind("/api/v1", "secrets")
DEPLOYMENTS = Kind("/apis/apps/v1", "deployments")
STATEFULSETS = Kind("/apis/apps/v1", "statefulsets")
DAEMONSETS = Kind("/apis/apps/v1", "daemonsets")
LEADERWORKERSETS = Kind(f"/apis/{LWS_GROUP}/v1", "leaderworkersets")


class ApiError(Exception):
    def __init__(self, status: int, body: Any, what: str) -> None:
        self.status = status
        self.body = body
        message = body.get("message") if isinstance(body, dict) else str(body)[:200]
        super().__init__(f"{what}: HTTP {status}: {message}")


class ApiClient:
    """JSON over HTTP to the API server, with its bearer token."""

    def __init__(self, base_url: str, token: str | None) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self.session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None, connect=5))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def request(self, method: str, path: str, *, body: Any = None, params: dict[str, str] | None = None,
                      content_type: str = "application/json", timeout: float = 15) -> Any:
        assert self.session is not None
        data = json.dumps(body) if body is not None else None
        async with self.session.request(method, self.base_url + path, data=data, params=params,
                                        headers={"Content-Type": content_type},
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            text = await resp.text()
            try:
                payload = json.loads(text) if text else None
            except ValueError:
                payload = text
            if resp.status >= 400:
                raise ApiError(resp.status, payload, f"{method} {path}")
            return payload

    async def get(self, path: str, **kw: Any) -> Any:
        return await self.request("GET", path, **kw)

    async def create(self, path: str, body: Any) -> Any:
        return await self.request("POST", path, body=body)

    async def merge_patch(self, path: str, body: Any) -> Any:
        return await self.request("PATCH", path, body=body, content_type="application/merge-patch+json")

    async def delete(self, path: str, grace_seconds: int | None = None) -> Any:
        params = {"gracePeriodSeconds": str(grace_seconds)} if grace_seconds is not None else None
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": grace_seconds} \
            if grace_seconds is not None else None
        return await self.request("DELETE", path, body=body, params=params)


def _rv(obj: Mapping[str, Any]) -> int | None:
    try:
        return int(obj.get("metadata", {}).get("resourceVersion"))
    except (TypeError, ValueError):
        return None


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata", {})
    return meta.get("namespace", "default"), meta.get("name", "")


class Informer:
    """A list + watch cache of one kind across namespaces; calls ``on_change`` after each change.

    Writes this tool makes are folded in at once with :meth:`observe` (the watch event follows), so
    a controller never acts twice on one change; an older resourceVersion never replaces a newer
    one, and a deleted object's uid is never brought back by a late answer."""

    def __init__(self, api: ApiClient, kind: Kind, on_change: Callable[[], None], namespace: str | None = None) -> None:
        self.api = api
        self.kind = kind
        self.namespace = namespace
        self.on_change = on_change
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.synced = asyncio.Event()
        self.last_error: str | None = None
        self._deleted_uids: set[str] = set()

    def observe(self, obj: Mapping[str, Any] | None) -> None:
        if not isinstance(obj, dict) or not obj.get("metadata"):
            return
        uid = obj["metadata"].get("uid")
        if uid in self._deleted_uids:
            return
        key = _key(obj)
        old = self.objects.get(key)
        if old is not None and old["metadata"].get("uid") == uid:
            old_rv, new_rv = _rv(old), _rv(obj)
            if old_rv is not None and new_rv is not None and new_rv < old_rv:
                return
        self.objects[key] = obj
        self.on_change()

    def forget(self, obj: Mapping[str, Any]) -> None:
        key = _key(obj)
        uid = obj.get("metadata", {}).get("uid")
        if uid:
            self._deleted_uids.add(uid)
        current = self.objects.get(key)
        if current is not None and (uid is None or current["metadata"].get("uid") == uid):
            del self.objects[key]
        self.on_change()

    def values(self) -> list[dict[str, Any]]:
        return list(self.objects.values())

    async def run(self) -> None:
        """List, then watch from the list's resourceVersion; re-list on 410 or after an error,
        backing off (0.1 s doubling to 5 s) while the kind is not served or the server is down."""
        delay = 0.1
        path = self.kind.collection(self.namespace)
        while True:
            try:
                listing = await self.api.get(path)
                fresh = {_key(o): o for o in listing.get("items") or []}
                for key, obj in fresh.items():
                    obj.setdefault("metadata", {}).setdefault("namespace", key[0])
                gone = [o for k, o in self.objects.items() if k not in fresh]
                self.objects = {k: o for k, o in fresh.items()
                                if o.get("metadata", {}).get("uid") not in self._deleted_uids}
                for obj in gone:
                    self._deleted_uids.add(obj["metadata"].get("uid"))
                self.on_change()
                self.synced.set()
                rv = (listing.get("metadata") or {}).get("resourceVersion", "")
                delay = 0.1
                self.last_error = None
                while True:
                    rv = await self._watch(path, rv)
                    if rv is None:
                        break  # 410 Gone / too large: re-list
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # server down, kind not served yet: retry with backoff
                if str(exc) != self.last_error:
                    log.debug("informer %s: %s", self.kind.plural, exc)
                self.last_error = str(exc)
                await asyncio.sleep(delay)
                delay = min(5.0, delay * 2)

    async def _watch(self, path: str, rv: str) -> str | None:
        """One watch request; returns the resourceVersion to resume from, None to re-list."""
        assert self.api.session is not None
        params = {"watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": "60"}
        if rv:
            params["resourceVersion"] = rv
        async with self.api.session.get(self.api.base_url + path, params=params,
                                        timeout=aiohttp.ClientTimeout(total=None, sock_read=90)) as resp:
            if resp.status == 410:
                return None
            if resp.status >= 400:
                raise ApiError(resp.status, await resp.text(), f"watch {path}")
            async for raw in resp.content:
                line = raw.strip()
                if not line:
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    return None
                new_rv = obj.get("metadata", {}).get("resourceVersion")
                if new_rv:
                    rv = new_rv
                if kind in ("ADDED", "MODIFIED"):
                    obj.setdefault("metadata", {}).setdefault("namespace", "default")
                    self.observe(obj)
                elif kind == "DELETED":
                    self.forget(obj)
        return rv


# ==============================================================================================
# Controllers (Deployment, StatefulSet, DaemonSet, LeaderWorkerSet)
# ==============================================================================================
def pod_from_template(template: Mapping[str, Any], *, name: str, namespace: str, owner: dict[str, Any],
                      labels: Mapping[str, str] = {}, env: Sequence[dict[str, Any]] = (),
                      spec_extra: Mapping[str, Any] = {}) -> dict[str, Any]:
    """A Pod for a controller: the template's metadata and spec, the extra labels, env added to
    every container, bound to the node at creation."""
    meta = copy.deepcopy(template.get("metadata") or {})
    spec = copy.deepcopy(template.get("spec") or {})
    spec.update(copy.deepcopy(dict(spec_extra)))
    spec["nodeName"] = NODE_NAME
    if env:
        for container in list(spec.get("containers") or []) + list(spec.get("initContainers") or []):
            container["env"] = list(env) + [e for e in container.get("env") or []
                                            if e.get("name") not in {x["name"] for x in env}]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {**(meta.get("labels") or {}), **labels},
                     "annotations": dict(meta.get("annotations") or {}),
                     "ownerReferences": [owner]},
        "spec": spec,
    }


def plan_rollout(new: Sequence[Any], old: Sequence[Any], replicas: int, surge: int, unavailable: int,
                 ready: Callable[[Any], bool], created: Callable[[Any], float]) -> tuple[int, list[Any]]:
    """One step of a Deployment's RollingUpdate: how many Pods of the current template to create
    and which Pods to delete, given the live (not terminating) Pods of the current template
    (``new``) and of older ones (``old``). Never more than ``replicas + surge`` Pods, never fewer
    than ``replicas - unavailable`` ready; an unready old Pod goes at once (it costs no
    availability); Pods are deleted unready first, then newest first (as the ReplicaSet
    controller ranks them)."""
    def rank(pod: Any) -> tuple[bool, float]:
        return ready(pod), -created(pod)

    delete: list[Any] = []
    if len(new) > replicas:
        delete += sorted(new, key=rank)[: len(new) - replicas]
    kept_new = [p for p in new if p not in delete]
    if not old:
        return max(0, replicas - len(new)), delete
    create = max(0, min(replicas + surge - len(kept_new) - len(old), replicas - len(kept_new)))
    budget = sum(ready(p) for p in kept_new + list(old)) - (replicas - unavailable)
    for pod in sorted(old, key=rank):
        if not ready(pod):
            delete.append(pod)
        elif budget > 0:
            delete.append(pod)
            budget -= 1
    return create, delete


def _terminating(pod: Mapping[str, Any]) -> bool:
    return bool(pod.get("metadata", {}).get("deletionTimestamp"))


def _created(pod: Mapping[str, Any]) -> str:
    return pod.get("metadata", {}).get("creationTimestamp") or ""


def _condition(type_: str, ok: bool, reason: str = "", message: str = "",
               previous: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    status = "True" if ok else "False"
    before = next((c for c in previous if c.get("type") == type_), None)
    since = before.get("lastTransitionTime") if before and before.get("status") == status else now_iso()
    cond = {"type": type_, "status": status, "lastTransitionTime": since}
    if reason:
        cond["reason"] = reason
    if message:
        cond["message"] = message
    return cond


def _same_status(a: Mapping[str, Any] | None, b: Mapping[str, Any]) -> bool:
    """Equal but for condition timestamps (which are kept from the previous status anyway)."""
    def strip(s: Mapping[str, Any] | None) -> str:
        s = copy.deepcopy(dict(s or {}))
        for cond in s.get("conditions") or []:
            cond.pop("lastTransitionTime", None)
            cond.pop("lastUpdateTime", None)
            cond.pop("lastProbeTime", None)
        return json.dumps(s, sort_keys=True)
    return strip(a) == strip(b)


class Controllers:
    """The workload controllers; one reconcile pass over every workload at a time."""

    def __init__(self, kubelet: "LocalKubelet") -> None:
        self.k = kubelet
        self.rng = random.Random()

    # -- shared -------------------------------------------------------------------------------
    def owned_pods(self, owner: Mapping[str, Any]) -> list[dict[str, Any]]:
        uid = owner["metadata"]["uid"]
        ns = owner["metadata"].get("namespace", "default")
        return [p for p in self.k.pods.values() if p["metadata"].get("namespace", "default") == ns and owned_by(p, uid)]

    async def create_pod(self, pod: dict[str, Any]) -> None:
        ns = pod["metadata"]["namespace"]
        try:
            created = await self.k.api.create(PODS.collection(ns), pod)
        except ApiError as exc:
            if exc.status != 409:  # 409: exists already (a watch event is on its way)
                raise
            return
        self.k.pods.observe(created)

    async def delete_pod(self, pod: Mapping[str, Any]) -> None:
        ns, name = _key(pod)
        try:
            answer = await self.k.api.delete(PODS.item(ns, name))
        except ApiError as exc:
            if exc.status != 404:
                raise
            self.k.pods.forget(pod)
            return
        if isinstance(answer, dict) and answer.get("kind") == "Pod":
            self.k.pods.observe(answer)

    async def write_status(self, informer: Informer, kind: Kind, obj: dict[str, Any], status: dict[str, Any]) -> None:
        if _same_status(obj.get("status"), status):
            return
        ns, name = _key(obj)
        updated = await self.k.api.merge_patch(kind.item(ns, name, "status"), {"status": status})
        informer.observe(updated)

    async def reconcile(self) -> None:
        for informer, handler in ((self.k.deployments, self.deployment), (self.k.statefulsets, self.statefulset),
                                  (self.k.daemonsets, self.daemonset), (self.k.leaderworkersets, self.lws)):
            for obj in informer.values():
                if _terminating(obj):
                    continue  # being deleted: the API server's garbage collector takes its Pods
                try:
                    await handler(obj)
                except Exception as exc:
                    self.k.note_error(f"{informer.kind.plural}/{obj['metadata'].get('name')}", exc)

    # -- Deployment ---------------------------------------------------------------------------
    async def deployment(self, deploy: dict[str, Any]) -> None:
        spec = deploy.get("spec") or {}
        ns, name = _key(deploy)
        replicas = int(spec.get("replicas", 1))
        template = spec.get("template") or {}
        current_hash = template_hash(template)
        pods = [p for p in self.owned_pods(deploy) if not _terminating(p)]
        new = [p for p in pods if p["metadata"].get("labels", {}).get("pod-template-hash") == current_hash]
        old = [p for p in pods if p not in new]
        strategy = spec.get("strategy") or {}
        recreate = strategy.get("type") == "Recreate"
        rolling = strategy.get("rollingUpdate") or {}
        surge = int_or_percent(rolling.get("maxSurge"), replicas, round_up=True, default=1)
        unavailable = int_or_percent(rolling.get("maxUnavailable"), replicas, round_up=False, default=0)
        if surge == 0 and unavailable == 0:
            surge = 1
        owner = owner_ref(deploy, "apps/v1", "Deployment")

        def make() -> dict[str, Any]:
            return pod_from_template(template, name=f"{name}-{current_hash}-{random_suffix(self.rng)}",
                                     namespace=ns, owner=owner, labels={"pod-template-hash": current_hash})

        if recreate and old:
            for pod in old:
                await self.delete_pod(pod)
        elif recreate and any(_terminating(p) for p in self.owned_pods(deploy)
                              if p["metadata"].get("labels", {}).get("pod-template-hash") != current_hash):
            pass  # Recreate: the new Pods start once every old one is gone
        else:
            create, delete = plan_rollout(new, old, replicas, surge, unavailable, pod_is_ready, _ts)
            for _ in range(create):
                await self.create_pod(make())
            for pod in delete:
                await self.delete_pod(pod)
        await self.deployment_status(deploy, current_hash, replicas, unavailable)

    async def deployment_status(self, deploy: dict[str, Any], current_hash: str, replicas: int,
                                unavailable: int) -> None:
        pods = [p for p in self.owned_pods(deploy) if not _terminating(p)]
        updated = [p for p in pods if p["metadata"].get("labels", {}).get("pod-template-hash") == current_hash]
        ready = sum(pod_is_ready(p) for p in pods)
        previous = (deploy.get("status") or {}).get("conditions") or []
        complete = len(updated) == replicas and len(pods) == replicas and ready == replicas
        available = ready >= replicas - unavailable
        status = {
            "observedGeneration": deploy["metadata"].get("generation", 1),
            "replicas": len(pods), "updatedReplicas": len(updated), "readyReplicas": ready,
            "availableReplicas": ready, "unavailableReplicas": max(0, replicas - ready),
            "conditions": [
                _condition("Available", available,
                           "MinimumReplicasAvailable" if available else "MinimumReplicasUnavailable",
                           previous=previous),
                _condition("Progressing", True, "NewReplicaSetAvailable" if complete else "ReplicaSetUpdated",
                           previous=previous),
            ],
        }
        await self.write_status(self.k.deployments, DEPLOYMENTS, deploy, status)

    # -- StatefulSet --------------------------------------------------------------------------
    async def statefulset(self, sts: dict[str, Any]) -> None:
        spec = sts.get("spec") or {}
        ns, name = _key(sts)
        replicas = int(spec.get("replicas", 1))
        template = spec.get("template") or {}
        revision = f"{name}-{template_hash(template)}"
        ordered = spec.get("podManagementPolicy", "OrderedReady") != "Parallel"
        owner = owner_ref(sts, "apps/v1", "StatefulSet")
        by_name = {p["metadata"]["name"]: p for p in self.owned_pods(sts)}
        claims = spec.get("volumeClaimTemplates") or []
        for ordinal in range(replicas):
            pod_name = f"{name}-{ordinal}"
            pod = by_name.get(pod_name)
            if pod is None:
                volumes = [{"name": c["metadata"]["name"],
                            "persistentVolumeClaim": {"claimName": f"{c['metadata']['name']}-{pod_name}"}}
                           for c in claims]
                template_volumes = [v for v in (template.get("spec") or {}).get("volumes") or []
                                    if v.get("name") not in {c["metadata"]["name"] for c in claims}]
                await self.create_pod(pod_from_template(
                    template, name=pod_name, namespace=ns, owner=owner,
                    labels={"statefulset.kubernetes.io/pod-name": pod_name,
                            "apps.kubernetes.io/pod-index": str(ordinal), "controller-revision-hash": revision},
                    spec_extra={"hostname": pod_name, "subdomain": spec.get("serviceName", ""),
                                "volumes": template_volumes + volumes}))
                if ordered:
                    break
            elif ordered and (_terminating(pod) or not pod_is_ready(pod)):
                break  # OrderedReady: the next ordinal waits for this one
        # Scale down: highest ordinal first, one at a time when ordered.
        extra = sorted((p for n, p in by_name.items() if _ordinal(n, name) >= replicas),
                       key=lambda p: -_ordinal(p["metadata"]["name"], name))
        if any(_terminating(p) for p in extra) and ordered:
            pass
        else:
            for pod in extra:
                if not _terminating(pod):
                    await self.delete_pod(pod)
                    if ordered:
                        break
        # Rolling update: highest ordinal first, when every Pod is ready.
        members = [by_name.get(f"{name}-{i}") for i in range(replicas)]
        if all(p is not None and pod_is_ready(p) and not _terminating(p) for p in members):
            stale = [p for p in members if p["metadata"].get("labels", {}).get("controller-revision-hash") != revision]
            if stale:
                await self.delete_pod(stale[-1])
        live = [p for p in self.owned_pods(sts) if not _terminating(p)]
        ready = sum(pod_is_ready(p) for p in live)
        updated = sum(p["metadata"].get("labels", {}).get("controller-revision-hash") == revision for p in live)
        status = {"observedGeneration": sts["metadata"].get("generation", 1), "replicas": len(live),
                  "readyReplicas": ready, "availableReplicas": ready, "currentReplicas": updated,
                  "updatedReplicas": updated, "currentRevision": revision, "updateRevision": revision}
        await self.write_status(self.k.statefulsets, STATEFULSETS, sts, status)

    # -- DaemonSet ----------------------------------------------------------------------------
    async def daemonset(self, ds: dict[str, Any]) -> None:
        spec = ds.get("spec") or {}
        ns, name = _key(ds)
        template = spec.get("template") or {}
        current_hash = template_hash(template)
        pods = self.owned_pods(ds)
        live = [p for p in pods if not _terminating(p)]
        current = [p for p in live if p["metadata"].get("labels", {}).get("controller-revision-hash") == current_hash]
        for pod in live:
            if pod not in current[:1]:
                await self.delete_pod(pod)  # an old template, or a second Pod on the one node
        if not current and not any(_terminating(p) for p in pods):
            await self.create_pod(pod_from_template(
                template, name=f"{name}-{random_suffix(self.rng)}", namespace=ns,
                owner=owner_ref(ds, "apps/v1", "DaemonSet"), labels={"controller-revision-hash": current_hash}))
        ready = sum(pod_is_ready(p) for p in current[:1])
        status = {"observedGeneration": ds["metadata"].get("generation", 1), "desiredNumberScheduled": 1,
                  "currentNumberScheduled": len(live[:1]), "numberMisscheduled": 0, "numberReady": ready,
                  "numberAvailable": ready, "numberUnavailable": 1 - ready, "updatedNumberScheduled": len(current[:1])}
        await self.write_status(self.k.daemonsets, DAEMONSETS, ds, status)

    # -- LeaderWorkerSet ----------------------------------------------------------------------
    async def lws(self, lws: dict[str, Any]) -> None:
        spec = lws.get("spec") or {}
        ns, name = _key(lws)
        groups = int(spec.get("replicas", 1))
        lwt = spec.get("leaderWorkerTemplate") or {}
        size = int(lwt.get("size", 1))
        worker_template = lwt.get("workerTemplate") or {}
        leader_template = lwt.get("leaderTemplate") or worker_template
        revision = template_hash({"leader": leader_template, "worker": worker_template, "size": size})
        owner = owner_ref(lws, f"{LWS_GROUP}/v1", "LeaderWorkerSet")
        pods = self.owned_pods(lws)
        by_name = {p["metadata"]["name"]: p for p in pods}
        wanted = lws_pod_names(name, groups, size)
        for pod_name, group, worker in wanted:
            if pod_name in by_name:
                continue
            env = [{"name": "LWS_LEADER_ADDRESS", "value": lws_leader_address(name, group, ns)},
                   {"name": "LWS_GROUP_SIZE", "value": str(size)},
                   {"name": "LWS_WORKER_INDEX", "value": str(worker)}]
            pod = pod_from_template(
                leader_template if worker == 0 else worker_template, name=pod_name, namespace=ns, owner=owner,
                labels={LWS_NAME: name, LWS_GROUP_INDEX: str(group), LWS_WORKER_INDEX: str(worker),
                        LWS_TEMPLATE_HASH: revision},
                env=env, spec_extra={"hostname": pod_name, "subdomain": name})
            pod["metadata"]["annotations"][LWS_SIZE] = str(size)
            if worker:
                pod["metadata"]["annotations"][LWS_LEADER_NAME] = f"{name}-{group}"
            await self.create_pod(pod)
        wanted_names = {n for n, _, _ in wanted}
        for pod in pods:
            if pod["metadata"]["name"] not in wanted_names and not _terminating(pod):
                await self.delete_pod(pod)
        group_pods = {g: [by_name.get(n) for n, gi, _ in wanted if gi == g] for g in range(groups)}

        def group_ready(g: int) -> bool:
            return all(p is not None and pod_is_ready(p) and not _terminating(p) for p in group_pods[g])

        # Template change: recreate one whole group at a time, highest index first, when all are ready.
        if all(group_ready(g) for g in range(groups)):
            for g in reversed(range(groups)):
                if any(p["metadata"].get("labels", {}).get(LWS_TEMPLATE_HASH) != revision for p in group_pods[g]):
                    for pod in group_pods[g]:
                        await self.delete_pod(pod)
                    break
        ready_groups = sum(group_ready(g) for g in range(groups))
        previous = (lws.get("status") or {}).get("conditions") or []
        status = {"observedGeneration": lws["metadata"].get("generation", 1), "replicas": groups,
                  "readyReplicas": ready_groups, "updatedReplicas": groups,
                  "conditions": [_condition("Available", ready_groups == groups,
                                            "AllGroupsReady" if ready_groups == groups else "GroupsNotReady",
                                            previous=previous)]}
        await self.write_status(self.k.leaderworkersets, LEADERWORKERSETS, lws, status)


def _ts(pod: Mapping[str, Any]) -> float:
    """A Pod's creation time as seconds (0 when unknown)."""
    text = _created(pod)
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").timestamp()
    except ValueError:
        return 0.0


def _ordinal(pod_name: str, sts_name: str) -> int:
    tail = pod_name[len(sts_name) + 1:]
    return int(tail) if tail.isdigit() else -1


# ==============================================================================================
# Kubelet: a Pod's containers as local processes
# ==============================================================================================
def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class ContainerRuntime:
    """One container: its process (restarted per the Pod's restartPolicy with backoff) and probes."""

    def __init__(self, pod: "PodRuntime", spec: dict[str, Any], init: bool = False) -> None:
        self.pod = pod
        self.spec = spec
        self.name = spec.get("name", "main")
        self.init = init
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self.started = False
        self.ready = False
        self.state: dict[str, Any] = {"waiting": {"reason": "ContainerCreating"}}
        self.last_state: dict[str, Any] = {}
        self.log_path = pod.k.workdir / "logs" / f"{pod.namespace}_{pod.name}_{self.name}.log"
        self.pids: list[int] = []  # every process group this container has run (for the tests)

    def status(self) -> dict[str, Any]:
        out = {"name": self.name, "image": self.spec.get("image", ""), "imageID": "",
               "ready": self.ready and not self.pod.terminating, "started": self.started,
               "restartCount": self.restarts, "state": self.state}
        if self.proc is not None:
            out["containerID"] = f"local://{self.proc.pid}"
        if self.last_state:
            out["lastState"] = self.last_state
        return out

    def _set(self, **kw: Any) -> None:
        for key, value in kw.items():
            setattr(self, key, value)
        self.pod.changed()

    async def run_once(self) -> int:
        """Start the process and wait for it to exit (probes run meanwhile); its exit code."""
        argv, env, cwd = await self.pod.build(self.spec)
        if self.pod.stopping.is_set():
            return -1
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            logf.write(f"=== {now_iso()} start {self.pod.name}/{self.name} (restart {self.restarts}): "
                       f"{' '.join(argv)[:500]}\n".encode())
            logf.flush()
            self.proc = await asyncio.create_subprocess_exec(
                *argv, env=env, cwd=cwd, stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=logf,
                start_new_session=True)
        self.pids.append(self.proc.pid)
        self.pod.k.started_pids.append(self.proc.pid)
        started_at = now_iso()
        self._set(state={"running": {"startedAt": started_at}}, started=not self.spec.get("startupProbe"),
                  ready=False)
        probes = None if self.init else asyncio.create_task(self.probe_loop(self.proc))
        try:
            returncode = await self.proc.wait()
        finally:
            if probes is not None:
                probes.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await probes
            _signal_group(self.proc.pid, signal.SIGKILL)  # the rest of the container goes with it
        code = _exit_code(returncode)
        self._set(ready=False, started=False,
                  state={"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                        "startedAt": started_at, "finishedAt": now_iso()}})
        return code

    async def supervise(self) -> int:
        """Run, restarting per restartPolicy (Always/OnFailure) with backoff until the Pod stops;
        an init container returns once it succeeds."""
        policy = self.pod.spec.get("restartPolicy", "Always")
        base, cap = self.pod.k.restart_backoff
        while not self.pod.stopping.is_set():
            try:
                code = await self.run_once()
            except (ValueError, OSError) as exc:  # nothing runnable: as a runtime's CreateContainerError
                code = -1
                self._set(state={"waiting": {"reason": "CreateContainerError", "message": str(exc)}})
            if self.pod.terminating and not self.init:
                await self.pod.stopping.wait()  # a terminating Pod's containers are not restarted
            if self.pod.stopping.is_set():
                return code
            if (self.init and code == 0) or policy == "Never" or (policy == "OnFailure" and code == 0):
                return code
            if code != -1:
                self.last_state = self.state
                self._set(state={"waiting": {"reason": "CrashLoopBackOff",
                                             "message": f"back-off restarting failed container {self.name}"}})
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.pod.stopping.wait(), restart_delay(self.restarts, base, cap))
            if code != -1:
                self.restarts += 1  # a container that never started is retried, not restarted
        return -1

    # -- probes ----------------------------------------------------------------------------------
    async def probe_loop(self, proc: asyncio.subprocess.Process) -> None:
        cap = self.pod.k.probe_period_cap
        startup = self.spec.get("startupProbe")
        if startup:
            timing = ProbeTiming.from_probe(startup, cap)
            state = ProbeState(timing)
            await asyncio.sleep(timing.initial_delay)
            while not state.record(await self.probe(startup, timing.timeout)):
                if state.failures >= timing.failure_threshold:
                    await self.kill_for_restart(proc, "startup probe failed")
                    return
                await asyncio.sleep(timing.period)
            self._set(started=True)
        tasks = [asyncio.create_task(self.readiness_loop())]
        if self.spec.get("livenessProbe"):
            tasks.append(asyncio.create_task(self.liveness_loop(proc)))
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    async def readiness_loop(self) -> None:
        probe = self.spec.get("readinessProbe")
        if not probe:
            self._set(ready=True)
            return
        timing = ProbeTiming.from_probe(probe, self.pod.k.probe_period_cap)
        state = ProbeState(timing)
        await asyncio.sleep(timing.initial_delay)
        while True:
            ready = state.record(await self.probe(probe, timing.timeout))
            if ready != self.ready:
                self._set(ready=ready)
            await asyncio.sleep(timing.period)

    async def liveness_loop(self, proc: asyncio.subprocess.Process) -> None:
        probe = self.spec["livenessProbe"]
        timing = ProbeTiming.from_probe(probe, self.pod.k.probe_period_cap)
        state = ProbeState(timing, initial=True)
        await asyncio.sleep(timing.initial_delay)
        while state.record(await self.probe(probe, timing.timeout)):
            await asyncio.sleep(timing.period)
        await self.kill_for_restart(proc, "liveness probe failed")

    async def kill_for_restart(self, proc: asyncio.subprocess.Process, why: str) -> None:
        with contextlib.suppress(OSError):
            with open(self.log_path, "ab") as logf:
                logf.write(f"=== {now_iso()} {why}: killing {self.name}\n".encode())
        await stop_group(proc, grace=min(self.pod.grace_seconds(), 5.0))

    async def probe(self, probe: Mapping[str, Any], timeout: float) -> bool:
        """One probe attempt (httpGet, tcpSocket or exec): True on success."""
        try:
            if "httpGet" in probe:
                return await self.pod.http_action(self.spec, probe["httpGet"], timeout)
            if "tcpSocket" in probe:
                port = self.pod.resolve_port(self.spec, probe["tcpSocket"].get("port"))
                host = probe["tcpSocket"].get("host") or self.pod.ip
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
                return True
            if "exec" in probe:
                return await self.pod.exec_action(self.spec, probe["exec"].get("command") or [], timeout) == 0
            if "grpc" in probe:
                raise ValueError("grpc probes are not supported by LocalKubelet")
        except (OSError, asyncio.TimeoutError, aiohttp.ClientError):
            return False
        except ValueError as exc:  # a probe that cannot work (unknown named port, no command): a failure
            self.pod.k.note_error(f"probe of {self.pod.name}/{self.name}", exc)
            return False
        return False


CANCEL_WAIT_S = 10.0  # how long a stop waits for its cancelled tasks


async def cancel_tasks(tasks: Iterable[asyncio.Task], timeout: float = CANCEL_WAIT_S) -> None:
    """Cancel ``tasks`` and wait for them to end, at most ``timeout`` s. Python 3.11's wait_for can
    swallow a cancellation that lands as its wait ends, leaving a loop running: those are cancelled
    again every 0.2 s (a teardown once hung on one, the Pod it owned restarting for minutes)."""
    pending = {t for t in tasks if t is not None}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while pending:
        for task in pending:
            task.cancel()
        done, pending = await asyncio.wait(pending, timeout=min(0.2, max(0.0, deadline - loop.time())))
        for task in done:
            if not task.cancelled():
                task.exception()  # retrieved
        if loop.time() >= deadline:
            break


async def stop_group(proc: asyncio.subprocess.Process, grace: float) -> None:
    """SIGTERM to the process group, SIGKILL to it after ``grace`` seconds; the process is reaped."""
    if proc.returncode is not None:
        return  # exited and reaped; its group was killed then (ContainerRuntime.run_once)
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), grace)
    except asyncio.TimeoutError:
        pass
    _signal_group(proc.pid, signal.SIGKILL)
    await proc.wait()


class PodRuntime:
    """One Pod on the node: volumes, init containers, containers, status, graceful deletion."""

    def __init__(self, kubelet: "LocalKubelet", pod: dict[str, Any], ip: str) -> None:
        self.k = kubelet
        self.pod = pod
        self.namespace, self.name = _key(pod)
        self.uid = pod["metadata"].get("uid", "")
        self.spec = pod.get("spec") or {}
        self.ip = ip
        self.dir = kubelet.workdir / "pods" / f"{self.namespace}_{self.name}_{self.uid[:8]}"
        self.init_containers = [ContainerRuntime(self, c, init=True) for c in self.spec.get("initContainers") or []]
        self.containers = [ContainerRuntime(self, c) for c in self.spec.get("containers") or []]
        self.initialized = not self.init_containers
        self.terminating = False
        self.stopping = asyncio.Event()
        self.volume_dirs: dict[str, Path] = {}
        self.failure: str | None = None
        self.done = asyncio.Event()
        self._dirty = asyncio.Event()
        self._written: dict[str, Any] | None = None
        self._tasks: list[asyncio.Task] = []
        self._main: asyncio.Task | None = None
        self._termination: asyncio.Task | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._status_writer()))
        self._main = asyncio.create_task(self._run())
        self.changed()

    def changed(self) -> None:
        self._dirty.set()
        self.k.wake()

    async def _run(self) -> None:
        try:
            await self.prepare_volumes()
            for init in self.init_containers:
                code = await init.supervise()
                if code != 0:
                    self.failure = f"init container {init.name} failed ({code})"
                    self.changed()
                    return
            self.initialized = True
            self.changed()
            await asyncio.gather(*(c.supervise() for c in self.containers))
        except Exception as exc:  # a volume that cannot be made: the Pod stays Pending, as on a node
            self.failure = f"{type(exc).__name__}: {exc}"
            self.k.note_error(f"pod {self.namespace}/{self.name}", exc)
            self.changed()
        finally:
            self.changed()

    def grace_seconds(self) -> float:
        meta = self.pod.get("metadata", {})
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = self.spec.get("terminationGracePeriodSeconds", 30)
        grace = float(grace)
        return min(grace, self.k.grace_period_cap) if self.k.grace_period_cap is not None else grace

    def begin_termination(self, pod: dict[str, Any]) -> None:
        """The Pod got a deletionTimestamp: not ready at once, preStop, SIGTERM, grace, SIGKILL,
        then the final DELETE (gracePeriodSeconds=0)."""
        self.pod = pod
        if self._termination is None:
            self._termination = asyncio.create_task(self._terminate())

    async def _terminate(self) -> None:
        self.terminating = True
        self.changed()
        try:
            await self._flush_status()  # not ready at once: out of every Service before preStop runs
        except Exception as exc:  # the status writer retries; the termination goes on regardless
            self.k.note_error(f"status of terminating {self.namespace}/{self.name}", exc)
        grace = self.grace_seconds()
        start = time.monotonic()
        hooks = [self._pre_stop(c, grace) for c in self.containers
                 if c.proc is not None and c.proc.returncode is None and (c.spec.get("lifecycle") or {}).get("preStop")]
        if hooks:
            await asyncio.gather(*hooks)
        # After preStop the process gets what is left of the grace period, at least 2 s (as kubelet).
        remaining = max(2.0, grace - (time.monotonic() - start))
        await self.stop(remaining)
        delay = 0.1
        for _ in range(20):  # the final DELETE, retried while the API server fails (bounded)
            try:
                await self.k.api.delete(PODS.item(self.namespace, self.name), grace_seconds=0)
                return
            except ApiError as exc:
                if exc.status == 404:
                    return
                self.k.note_error(f"final delete of {self.namespace}/{self.name}", exc)
            except (OSError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
                self.k.note_error(f"final delete of {self.namespace}/{self.name}", exc)
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)

    async def _pre_stop(self, container: ContainerRuntime, grace: float) -> None:
        hook = container.spec["lifecycle"]["preStop"]
        with contextlib.suppress(OSError):
            with open(container.log_path, "ab") as logf:
                logf.write(f"=== {now_iso()} preStop {container.name}\n".encode())
        try:
            if "exec" in hook:
                await self.exec_action(container.spec, hook["exec"].get("command") or [], grace)
            elif "httpGet" in hook:
                await self.http_action(container.spec, hook["httpGet"], grace)
            elif "sleep" in hook:
                await asyncio.sleep(min(grace, float(hook["sleep"].get("seconds", 0))))
        except (OSError, ValueError, asyncio.TimeoutError, aiohttp.ClientError) as exc:
            self.k.note_error(f"preStop of {self.name}/{container.name}", exc)

    async def stop(self, grace: float) -> None:
        """Stop every container: no more restarts, SIGTERM, ``grace`` seconds, SIGKILL; reaped."""
        self.stopping.set()
        self.changed()
        containers = self.init_containers + self.containers
        await asyncio.gather(*(stop_group(c.proc, grace) for c in containers if c.proc is not None))
        if self._main is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(self._main), 5)
            self._main.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._main
        # A process started while the first round ran (a restart racing the stop) goes too.
        await asyncio.gather(*(stop_group(c.proc, 0) for c in containers if c.proc is not None))
        self.done.set()

    async def detach(self) -> None:
        """Stop talking to the API: the status writer and the termination task end (the kubelet
        is stopping; the processes are stopped by :meth:`stop`)."""
        await cancel_tasks(self._tasks + ([self._termination] if self._termination else []))

    async def close(self) -> None:
        await self.detach()
        if self._main is not None:
            self._main.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._main

    # -- status ----------------------------------------------------------------------------------
    def ready(self) -> bool:
        return (not self.terminating and self.initialized and bool(self.containers)
                and all(c.ready for c in self.containers))

    def status(self) -> dict[str, Any]:
        previous = (self.pod.get("status") or {}).get("conditions") or []
        all_started = self.initialized and all(c.proc is not None for c in self.containers)
        finished = self.initialized and all("terminated" in c.state for c in self.containers) \
            and self.spec.get("restartPolicy", "Always") != "Always" and bool(self.containers)
        if self.failure and self.spec.get("restartPolicy", "Always") == "Never":
            phase = "Failed"
        elif finished:
            phase = "Succeeded" if all(c.state["terminated"]["exitCode"] == 0 for c in self.containers) else "Failed"
        else:
            phase = "Running" if all_started else "Pending"
        ready = self.ready()
        containers_ready = self.initialized and all(c.ready for c in self.containers)
        status = {
            "phase": phase, "hostIP": "127.0.0.1", "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": self.ip, "podIPs": [{"ip": self.ip}], "qosClass": "BestEffort",
            "conditions": [
                _condition("PodScheduled", True, previous=previous),
                _condition("Initialized", self.initialized, previous=previous),
                _condition("ContainersReady", containers_ready, previous=previous),
                _condition("Ready", ready,
                           "" if ready else ("Terminating" if self.terminating else "ContainersNotReady"),
                           previous=previous),
            ],
            "containerStatuses": [c.status() for c in self.containers],
        }
        if self.init_containers:
            status["initContainerStatuses"] = [c.status() for c in self.init_containers]
        if self.failure:
            status["message"] = self.failure
        status.setdefault("startTime", (self.pod.get("status") or {}).get("startTime") or now_iso())
        return status

    async def _flush_status(self) -> None:
        status = self.status()
        if self._written is not None and _same_status(self._written, status):
            return
        updated = await self.k.api.merge_patch(PODS.item(self.namespace, self.name, "status"), {"status": status})
        self._written = status
        if isinstance(updated, dict):
            self.pod = updated
            self.k.pods.observe(updated)

    async def _status_writer(self) -> None:
        delay = 0.05
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._flush_status()
                delay = 0.05
            except asyncio.CancelledError:
                raise
            except ApiError as exc:
                if exc.status == 404:
                    return  # the Pod is gone; the kubelet's sync stops it
                self.k.note_error(f"status of {self.namespace}/{self.name}", exc)
                self._dirty.set()
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
            except Exception as exc:
                self.k.note_error(f"status of {self.namespace}/{self.name}", exc)
                self._dirty.set()
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    # -- container setup -------------------------------------------------------------------------
    async def prepare_volumes(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for volume in self.spec.get("volumes") or []:
            name = volume["name"]
            if "persistentVolumeClaim" in volume:
                path = self.k.workdir / "pvc" / self.namespace / volume["persistentVolumeClaim"]["claimName"]
            elif "hostPath" in volume:
                path = self.k.workdir / "node" / "hostpath" / volume["hostPath"]["path"].strip("/")
            else:
                path = self.dir / "volumes" / name
            path.mkdir(parents=True, exist_ok=True)
            self.volume_dirs[name] = path
        all_mounts = self.mounts_of_all()
        for volume in self.spec.get("volumes") or []:
            files = await self._volume_files(volume)
            for rel, content in files.items():
                target = self.volume_dirs[volume["name"]] / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    text = content.decode()
                    target.write_text(rewrite_value(text, self.ip, all_mounts))
                except UnicodeDecodeError:
                    target.write_bytes(content)

    async def _volume_files(self, volume: Mapping[str, Any]) -> dict[str, bytes]:
        if "configMap" in volume:
            source, data = volume["configMap"], await self._config_data(CONFIGMAPS, volume["configMap"], "configMap")
        elif "secret" in volume:
            ref = dict(volume["secret"])
            ref["name"] = ref.get("secretName")
            source, data = ref, await self._config_data(SECRETS, ref, "secret")
        else:
            return {}
        items = source.get("items")
        if items:
            return {item.get("path", item["key"]): data[item["key"]] for item in items if item["key"] in data}
        return data

    async def _config_data(self, kind: Kind, ref: Mapping[str, Any], what: str) -> dict[str, bytes]:
        try:
            obj = await self.k.api.get(kind.item(self.namespace, ref["name"]))
        except ApiError as exc:
            if exc.status == 404 and ref.get("optional"):
                return {}
            raise ValueError(f"{what} {ref.get('name')!r}: {exc}") from exc
        out: dict[str, bytes] = {}
        for key, value in (obj.get("binaryData") or {}).items():
            out[key] = base64.b64decode(value)
        for key, value in (obj.get("data") or {}).items():
            out[key] = base64.b64decode(value) if kind is SECRETS else str(value).encode()
        for key, value in (obj.get("stringData") or {}).items():
            out[key] = str(value).encode()
        return out

    def mounts_of(self, container: Mapping[str, Any]) -> list[tuple[str, str]]:
        out = []
        for mount in container.get("volumeMounts") or []:
            base = self.volume_dirs.get(mount.get("name"))
            if base is None:
                continue
            local = base / mount["subPath"] if mount.get("subPath") else base
            if mount.get("subPath"):
                local.mkdir(parents=True, exist_ok=True)
            out.append((mount["mountPath"], str(local)))
        return out

    def mounts_of_all(self) -> list[tuple[str, str]]:
        seen: dict[str, str] = {}
        for c in (self.spec.get("initContainers") or []) + (self.spec.get("containers") or []):
            for path, local in self.mounts_of(c):
                seen.setdefault(path, local)
        return list(seen.items())

    async def container_env(self, container: Mapping[str, Any]) -> dict[str, str]:
        env = {k: os.environ[k] for k in ENV_INHERITED if k in os.environ}
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "/usr/bin:/bin")
        env["PYTHONUNBUFFERED"] = "1"  # as the Infera image sets it; logs are whole when a test reads them
        env.update(self.k.cluster_env(self.namespace))
        env.update(self.k.extra_env)
        mounts = self.mounts_of(container)
        for source in container.get("envFrom") or []:
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                data = await self._config_data(CONFIGMAPS, source["configMapRef"], "envFrom configMapRef")
            elif "secretRef" in source:
                data = await self._config_data(SECRETS, source["secretRef"], "envFrom secretRef")
            else:
                continue
            env.update({prefix + k: v.decode() for k, v in data.items()})
        for item in container.get("env") or []:
            name = item["name"]
            if "valueFrom" in item:
                value = await self._env_from(item["valueFrom"], name)
                if value is None:
                    continue
            else:
                value = expand_vars(str(item.get("value", "")), env)
            env[name] = rewrite_value(value, self.ip, mounts)
        return env

    async def _env_from(self, source: Mapping[str, Any], name: str) -> str | None:
        if "fieldRef" in source:
            return field_ref_value(self.pod, source["fieldRef"].get("fieldPath", ""), pod_ip=self.ip,
                                   host_ip="127.0.0.1")
        if "resourceFieldRef" in source:
            return "0"
        for key, kind in (("configMapKeyRef", CONFIGMAPS), ("secretKeyRef", SECRETS)):
            if key in source:
                ref = source[key]
                data = await self._config_data(kind, ref, f"env {name} {key}")
                if ref["key"] not in data:
                    if ref.get("optional"):
                        return None
                    raise ValueError(f"env {name}: {key} {ref.get('name')!r} has no key {ref['key']!r}")
                return data[ref["key"]].decode()
        raise ValueError(f"env {name}: unsupported valueFrom {sorted(source)}")

    async def build(self, container: Mapping[str, Any]) -> tuple[list[str], dict[str, str], str]:
        """argv, env and working directory of a container's process."""
        env = await self.container_env(container)
        mounts = self.mounts_of(container)
        argv = [rewrite_value(expand_vars(a, env), self.ip, mounts) for a in container_argv(container, self.k.images)]
        argv = bind_to_pod_ip(argv, self.ip)
        argv[0] = resolve_program(argv[0], env.get("PATH"))
        cwd = str(self.dir)
        if container.get("workingDir"):
            local = rewrite_value(container["workingDir"], self.ip, mounts)
            if os.path.isdir(local):
                cwd = local
        return argv, env, cwd

    def resolve_port(self, container: Mapping[str, Any], port: Any) -> int:
        if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
            return int(port)
        for c in [container] + list(self.spec.get("containers") or []):
            for p in c.get("ports") or []:
                if p.get("name") == port:
                    return int(p["containerPort"])
        raise ValueError(f"container {container.get('name')!r}: no port named {port!r}")

    async def http_action(self, container: Mapping[str, Any], action: Mapping[str, Any], timeout: float) -> bool:
        port = self.resolve_port(container, action.get("port"))
        scheme = str(action.get("scheme", "HTTP")).lower()
        url = f"{scheme}://{action.get('host') or self.ip}:{port}{action.get('path', '/')}"
        headers = {h["name"]: h["value"] for h in action.get("httpHeaders") or []}
        async with self.k.probe_session.get(url, headers=headers, ssl=False, allow_redirects=False,
                                            timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            await resp.read()
            return 200 <= resp.status < 400

    async def exec_action(self, container: Mapping[str, Any], command: Sequence[str], timeout: float) -> int:
        """Run an exec probe or hook in the container's environment; its exit code (-1 on timeout)."""
        if not command:
            raise ValueError(f"container {container.get('name')!r}: exec without a command")
        env = await self.container_env(container)
        mounts = self.mounts_of(container)
        argv = [rewrite_value(str(a), self.ip, mounts) for a in command]
        argv[0] = resolve_program(argv[0], env.get("PATH"))
        devnull = asyncio.subprocess.DEVNULL
        proc = await asyncio.create_subprocess_exec(*argv, env=env, cwd=str(self.dir), stdin=devnull, stdout=devnull,
                                                    stderr=devnull, start_new_session=True)
        self.k.started_pids.append(proc.pid)
        try:
            return await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            return -1
        finally:
            await stop_group(proc, 0)


# ==============================================================================================
# kube-proxy: a userspace TCP proxy per Service port
# ==============================================================================================
class ServiceProxy:
    """Listens on ``clusterIP:port`` for every Service port and forwards each connection to the
    next ready endpoint, round-robin; the endpoints are read at each connection."""

    def __init__(self, kubelet: "LocalKubelet") -> None:
        self.k = kubelet
        self.servers: dict[tuple[str, str, str, int], asyncio.base_events.Server] = {}
        self.round_robin: dict[tuple[str, str, int], int] = {}
        self.connections: set[asyncio.Task] = set()
        self.bind_retry: dict[tuple[str, str, str, int], tuple[float, float]] = {}  # key → (retry at, next delay)

    def endpoints(self, service: Mapping[str, Any], port_spec: Mapping[str, Any]) -> list[tuple[str, int]]:
        ns = service["metadata"].get("namespace", "default")
        selector = (service.get("spec") or {}).get("selector")
        target = port_spec.get("targetPort", port_spec.get("port"))
        out = []
        for pod in sorted(self.k.pods.values(), key=lambda p: p["metadata"]["name"]):
            if pod["metadata"].get("namespace", "default") != ns or _terminating(pod) or not pod_is_ready(pod):
                continue
            if not selector_matches(selector, pod["metadata"].get("labels")):
                continue
            ip = (pod.get("status") or {}).get("podIP")
            port = _pod_port(pod, target)
            if ip and port:
                out.append((ip, port))
        return out

    async def sync(self) -> None:
        wanted: dict[tuple[str, str, str, int], tuple[dict[str, Any], dict[str, Any]]] = {}
        for svc in self.k.services.values():
            spec = svc.get("spec") or {}
            ip = self.k.service_ip(svc)
            if not ip or not spec.get("selector"):
                continue
            for port_spec in spec.get("ports") or []:
                if port_spec.get("protocol", "TCP") != "TCP":
                    continue
                key = (svc["metadata"].get("namespace", "default"), svc["metadata"]["name"], ip, int(port_spec["port"]))
                wanted[key] = (svc, port_spec)
        for key in [k for k in self.servers if k not in wanted]:
            self.servers.pop(key).close()
        for key, (svc, port_spec) in wanted.items():
            if key in self.servers:
                continue
            ns, name, ip, port = key

            def handler(reader, writer, key=key):
                task = asyncio.create_task(self._forward(key, reader, writer))
                self.connections.add(task)
                task.add_done_callback(self.connections.discard)

            retry_at, delay = self.bind_retry.get(key, (0.0, 0.5))
            if time.monotonic() < retry_at:
                continue
            try:
                self.servers[key] = await asyncio.start_server(handler, ip, port, reuse_address=True)
                self.bind_retry.pop(key, None)
            except OSError as exc:
                # Taken (another test run's proxy, a process bound to all interfaces): retry later.
                self.bind_retry[key] = (time.monotonic() + delay, min(10.0, delay * 2))
                self.k.note_error(f"proxy for service {ns}/{name} on {ip}:{port}", exc)

    async def _forward(self, key: tuple[str, str, str, int], reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
        ns, name, _ip, port = key
        svc = self.k.services.objects.get((ns, name))
        ports = ((svc or {}).get("spec") or {}).get("ports") or []
        port_spec = next((p for p in ports if int(p["port"]) == port), None)
        endpoints = self.endpoints(svc, port_spec) if svc and port_spec else []
        if not endpoints:
            writer.close()
            return
        rr_key = (ns, name, port)
        index = self.round_robin.get(rr_key, 0)
        self.round_robin[rr_key] = index + 1
        host, target_port = endpoints[index % len(endpoints)]
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(host, target_port), 5)
        except (OSError, asyncio.TimeoutError):
            writer.close()
            return
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()

    async def close(self) -> None:
        for server in self.servers.values():
            server.close()
        for task in list(self.connections):
            task.cancel()
        for server in self.servers.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2)
        self.servers.clear()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        writer.close()


def _pod_port(pod: Mapping[str, Any], target: Any) -> int | None:
    if isinstance(target, int) or (isinstance(target, str) and target.isdigit()):
        return int(target)
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") == target:
                return int(p["containerPort"])
    return None


# ==============================================================================================
# LocalKubelet
# ==============================================================================================
class LocalKubelet:
    """The one-node data plane for tests (see the module docstring for what differs from a real
    cluster). ``async with LocalKubelet(api_url, token, workdir) as kubelet: ...``.

    Options: ``namespace`` (None: every namespace), ``images`` (image repository → ImageSpec; the
    default maps nats and etcd), ``probe_period_cap`` (seconds; caps probe periods and initial
    delays), ``restart_backoff`` ((base, cap) seconds), ``grace_period_cap`` (seconds; caps the
    termination grace period), ``extra_env`` (added to every container), ``first_pod_ip``
    ((third, fourth) octet of the first Pod IP in 127.0.x.y; default a random x in 10..149, y 1),
    ``stop_grace`` (seconds each process
    gets on :meth:`stop` before SIGKILL), ``start_timeout`` (seconds :meth:`start` waits for the
    first list of Pods and Services; then RuntimeError naming the errors)."""

    def __init__(self, api_url: str, token: str | None, workdir: str | os.PathLike, *,
                 namespace: str | None = None, images: Mapping[str, ImageSpec] | None = None,
                 probe_period_cap: float | None = None, restart_backoff: tuple[float, float] = (10.0, 300.0),
                 grace_period_cap: float | None = None, extra_env: Mapping[str, str] | None = None,
                 first_pod_ip: tuple[int, int] | None = None, stop_grace: float = 5.0,
                 start_timeout: float = 15.0) -> None:
        self.api_url = api_url.rstrip("/")
        self.token = token
        self.workdir = Path(workdir).resolve()
        self.namespace = namespace
        self.images = dict(default_images() if images is None else images)
        self.probe_period_cap = probe_period_cap
        self.restart_backoff = restart_backoff
        self.grace_period_cap = grace_period_cap
        self.extra_env = dict(extra_env or {})
        # A random first block by default, so kubelets of test runs side by side rarely share IPs.
        self.first_pod_ip = first_pod_ip or (random.randrange(10, 150), 1)
        self.stop_grace = stop_grace
        self.start_timeout = start_timeout
        self.api = ApiClient(self.api_url, token)
        self.pods = Informer(self.api, PODS, self.wake, namespace)
        self.services = Informer(self.api, SERVICES, self.wake, namespace)
        self.deployments = Informer(self.api, DEPLOYMENTS, self.wake, namespace)
        self.statefulsets = Informer(self.api, STATEFULSETS, self.wake, namespace)
        self.daemonsets = Informer(self.api, DAEMONSETS, self.wake, namespace)
        self.leaderworkersets = Informer(self.api, LEADERWORKERSETS, self.wake, namespace)
        self.informers = [self.pods, self.services, self.deployments, self.statefulsets, self.daemonsets,
                          self.leaderworkersets]
        self.controllers = Controllers(self)
        self.proxy = ServiceProxy(self)
        self.runtimes: dict[str, PodRuntime] = {}  # by Pod uid
        self.finished: dict[str, PodRuntime] = {}  # stopped, kept for pids/logs until the Pod is gone
        self.hosts_path = self.workdir / "cluster-hosts.json"
        self.errors: list[str] = []
        self._error_seen: dict[str, float] = {}
        self._local_service_ips: dict[str, str] = {}
        self.started_pids: list[int] = []
        self.probe_session: aiohttp.ClientSession | None = None
        self._ip_index = 0
        self._ips_in_use: set[str] = set()
        self._bound: set[str] = set()
        self._final_deletes: set[str] = set()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._hosts_written: str | None = None
        self._endpoints_written: dict[tuple[str, str], str] = {}
        self._kubeconfigs: dict[str, Path] = {}
        from tests.fakes.pod_sitecustomize import sitecustomize as dns
        self._dns = dns

    # -- start / stop ----------------------------------------------------------------------------
    async def __aenter__(self) -> "LocalKubelet":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    async def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._write_hosts({})
        await self.api.open()
        self.probe_session = aiohttp.ClientSession()
        self._tasks = [asyncio.create_task(i.run()) for i in self.informers]
        try:
            await asyncio.wait_for(asyncio.gather(self.pods.synced.wait(), self.services.synced.wait()),
                                   self.start_timeout)
        except asyncio.TimeoutError:
            errors = "; ".join(f"{i.kind.plural}: {i.last_error}" for i in self.informers if i.last_error)
            await self.stop()
            raise RuntimeError(f"LocalKubelet could not list Pods and Services from {self.api_url}: {errors}")
        self._tasks.append(asyncio.create_task(self._sync_loop()))

    async def stop(self) -> None:
        """Stop every loop, every Pod's processes (SIGTERM, ``stop_grace`` s, SIGKILL, reaped) and
        every proxy; the Pods stay in the API as they are."""
        await cancel_tasks(self._tasks)
        runtimes = list(self.runtimes.values()) + list(self.finished.values())
        for runtime in runtimes:
            await runtime.detach()
        await asyncio.gather(*(r.stop(self.stop_grace) for r in runtimes))
        for runtime in runtimes:
            await runtime.close()
        await self.proxy.close()
        if self.probe_session is not None:
            await self.probe_session.close()
        await self.api.close()

    # -- queries for tests -----------------------------------------------------------------------
    def logs(self, pod_name: str, tail: int = 50, namespace: str | None = None) -> str:
        """The last ``tail`` lines of each container log of a Pod (kept after the Pod is gone)."""
        pattern = f"{namespace}_{pod_name}_*.log" if namespace else f"*_{pod_name}_*.log"
        out = []
        for path in sorted((self.workdir / "logs").glob(pattern)):
            if not path.name.split("_", 1)[1].startswith(pod_name + "_"):
                continue
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            out.append(f"--- {path.name} ---\n" + "\n".join(lines))
        return "\n".join(out) if out else f"(no logs for pod {pod_name})"

    def all_logs(self, tail: int = 30) -> str:
        paths = sorted((self.workdir / "logs").glob("*.log")) if (self.workdir / "logs").exists() else []
        out = "\n".join(f"--- {p.name} ---\n" + "\n".join(p.read_text(errors="replace").splitlines()[-tail:])
                        for p in paths)
        return out + ("\n--- kubelet errors ---\n" + "\n".join(self.errors[-20:]) if self.errors else "")

    def resolve(self, name: str, namespace: str = "default") -> list[str] | None:
        """What the DNS hook answers for ``name`` inside a Pod of ``namespace`` (None: not a cluster name)."""
        return self._dns.lookup(self._records(), name, namespace)

    def runtime(self, pod_name: str, namespace: str = "default") -> PodRuntime | None:
        for runtime in list(self.runtimes.values()) + list(self.finished.values()):
            if runtime.name == pod_name and runtime.namespace == namespace:
                return runtime
        return None

    def process_ids(self) -> list[int]:
        """The process group ids of every process this kubelet has started (containers, exec
        probes and hooks), in start order, including those of Pods long gone."""
        return list(self.started_pids)

    # -- internals -------------------------------------------------------------------------------
    def wake(self) -> None:
        self._wake.set()

    def note_error(self, what: str, exc: BaseException) -> None:
        """Log a failure once per distinct message a minute (a failing loop retries often)."""
        message = f"{what}: {type(exc).__name__}: {exc}"
        now = time.monotonic()
        if now - self._error_seen.get(message, -1e9) < 60:
            return
        self._error_seen[message] = now
        log.warning("%s", message)
        self.errors.append(f"{now_iso()} {message}")
        del self.errors[:-200]

    def cluster_env(self, namespace: str) -> dict[str, str]:
        """The env every container gets to reach the API server and the DNS hook."""
        url = urlsplit(self.api_url)
        pythonpath = [str(SITECUSTOMIZE_DIR), str(REPO_ROOT)] + \
            [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        return {
            "KUBERNETES_SERVICE_HOST": url.hostname or "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(url.port or (443 if url.scheme == "https" else 80)),
            "KUBECONFIG": str(self._kubeconfig(namespace)),
            "PYTHONPATH": os.pathsep.join(pythonpath),
            HOSTS_ENV: str(self.hosts_path),
            NAMESPACE_ENV: namespace,
        }

    def _kubeconfig(self, namespace: str) -> Path:
        path = self._kubeconfigs.get(namespace)
        if path is None:
            path = self.workdir / f"kubeconfig-{namespace}.json"
            user = {"token": self.token} if self.token else {}
            config = {"apiVersion": "v1", "kind": "Config", "current-context": "local",
                      "clusters": [{"name": "local", "cluster": {"server": self.api_url}}],
                      "users": [{"name": "local", "user": user}],
                      "contexts": [{"name": "local", "context": {"cluster": "local", "user": "local",
                                                                  "namespace": namespace}}]}
            path.write_text(json.dumps(config))
            self._kubeconfigs[namespace] = path
        return path

    def _next_ip(self) -> str:
        # Never reuse an IP still in use; a freed one is reused only after the range wraps.
        for _ in range(190 * 254):
            try:
                ip = allocate_ip(self._ip_index, self.first_pod_ip)
            except ValueError:
                self._ip_index = 0
                continue
            self._ip_index += 1
            if ip not in self._ips_in_use:
                self._ips_in_use.add(ip)
                return ip
        raise RuntimeError("out of Pod IPs")

    async def _sync_loop(self) -> None:
        """Level-triggered: after any change (or every second) reconcile workloads, Pods, proxies
        and DNS; a failing round is logged and retried."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)
            self._wake.clear()
            for step in (self.controllers.reconcile, self._sync_pods, self.proxy.sync, self._sync_hosts,
                         self._sync_endpoints):
                try:
                    await step()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self.note_error(f"sync {step.__name__}", exc)
            await asyncio.sleep(0.02)  # coalesce a burst of events into one round

    async def _sync_pods(self) -> None:
        seen: set[str] = set()
        for pod in self.pods.values():
            seen.add(pod["metadata"].get("uid", ""))
            try:
                await self._sync_pod(pod)
            except (ApiError, OSError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
                self.note_error(f"pod {'/'.join(_key(pod))}", exc)  # one Pod's failure holds no other back
        for uid in [u for u in self.runtimes if u not in seen]:
            runtime = self.runtimes.pop(uid)
            self.finished[uid] = runtime
            if runtime._termination is None:
                # Gone from the API without our final DELETE (a force delete): stop it now.
                runtime._termination = asyncio.create_task(self._stop_gone(runtime))
        for uid in [u for u, r in self.finished.items() if u not in seen and r.done.is_set()]:
            runtime = self.finished.pop(uid)
            await runtime.close()
            self._ips_in_use.discard(runtime.ip)

    async def _sync_pod(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        uid = meta.get("uid", "")
        node = spec.get("nodeName")
        if not node:
            if not _terminating(pod) and uid not in self._bound:
                await self._bind(pod)
            return
        if node != NODE_NAME:
            return
        runtime = self.runtimes.get(uid)
        if runtime is None and uid not in self.finished:
            if _terminating(pod):
                await self._final_delete(pod)  # never ran here: nothing to stop
                return
            runtime = PodRuntime(self, pod, self._next_ip())
            self.runtimes[uid] = runtime
            runtime.start()
        if runtime is not None:
            new_rv, old_rv = _rv(pod), _rv(runtime.pod)
            if new_rv is None or old_rv is None or new_rv >= old_rv:
                runtime.pod = pod
            if _terminating(pod):
                runtime.begin_termination(pod)
                if runtime._termination is not None and runtime._termination.done():
                    self.finished[uid] = self.runtimes.pop(uid)

    async def _stop_gone(self, runtime: PodRuntime) -> None:
        runtime.terminating = True
        await runtime.stop(min(2.0, runtime.grace_seconds()))

    async def _bind(self, pod: Mapping[str, Any]) -> None:
        ns, name = _key(pod)
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name, "namespace": ns},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": NODE_NAME}}
        try:
            await self.api.create(PODS.item(ns, name, "binding"), binding)
        except ApiError as exc:
            if exc.status == 409:
                pass  # bound already (a watch event is on its way)
            elif exc.status in (404, 405):  # no binding subresource: set the field itself
                self.pods.observe(await self.api.merge_patch(PODS.item(ns, name), {"spec": {"nodeName": NODE_NAME}}))
            else:
                raise
        self._bound.add(pod["metadata"].get("uid", ""))

    async def _final_delete(self, pod: Mapping[str, Any]) -> None:
        uid = pod["metadata"].get("uid", "")
        if uid in self._final_deletes:
            return
        self._final_deletes.add(uid)
        ns, name = _key(pod)
        with contextlib.suppress(ApiError):
            await self.api.delete(PODS.item(ns, name), grace_seconds=0)

    def service_ip(self, svc: Mapping[str, Any]) -> str | None:
        """A Service's cluster IP: the API server's, else one of our own (``127.0.255.<n>``, past the
        fake's range, not written back) for an API server that allocates none; None when headless."""
        spec = svc.get("spec") or {}
        ip = spec.get("clusterIP")
        if ip == "None" or spec.get("type") == "ExternalName":
            return None
        if ip:
            return ip
        uid = svc["metadata"].get("uid") or "/".join(_key(svc))
        if uid not in self._local_service_ips:
            n = len(self._local_service_ips)
            if n >= 254:
                raise ValueError("out of local Service IPs (127.0.255.1-254)")
            self._local_service_ips[uid] = f"127.0.255.{n + 1}"
        return self._local_service_ips[uid]

    def _records(self) -> dict[str, list[str]]:
        records: dict[str, list[str]] = {}
        local_ips = {r.uid: r.ip for r in self.runtimes.values()}

        def pod_ip(pod: Mapping[str, Any]) -> str | None:
            return local_ips.get(pod["metadata"].get("uid")) or (pod.get("status") or {}).get("podIP")

        for svc in self.services.values():
            ns, name = _key(svc)
            spec = svc.get("spec") or {}
            fqdn = f"{name}.{ns}.svc.{self._dns.CLUSTER_DOMAIN}"
            if self.service_ip(svc):
                records[fqdn] = [self.service_ip(svc)]
            elif spec.get("selector"):
                ips = [pod_ip(p) for p in sorted(self.pods.values(), key=lambda p: p["metadata"]["name"])
                       if p["metadata"].get("namespace", "default") == ns and pod_is_ready(p) and not _terminating(p)
                       and selector_matches(spec["selector"], p["metadata"].get("labels"))]
                records[fqdn] = [ip for ip in ips if ip]
        for pod in self.pods.values():
            ns, _ = _key(pod)
            spec = pod.get("spec") or {}
            ip = pod_ip(pod)
            if spec.get("hostname") and spec.get("subdomain") and ip:
                records[f"{spec['hostname']}.{spec['subdomain']}.{ns}.svc.{self._dns.CLUSTER_DOMAIN}"] = [ip]
        return records

    async def _sync_endpoints(self) -> None:
        """core/v1 Endpoints of every Service with a selector (ready and not-ready addresses), as
        the endpoints controller writes them; removed with their Service."""
        services = {_key(svc): svc for svc in self.services.values() if (svc.get("spec") or {}).get("selector")}
        for (ns, name), svc in services.items():
            spec = svc["spec"]
            ready, not_ready, ports = [], [], []
            members = [p for p in sorted(self.pods.values(), key=lambda p: p["metadata"]["name"])
                       if p["metadata"].get("namespace", "default") == ns and not _terminating(p)
                       and (p.get("status") or {}).get("podIP")
                       and selector_matches(spec["selector"], p["metadata"].get("labels"))]
            for pod in members:
                address = {"ip": pod["status"]["podIP"], "nodeName": pod["spec"].get("nodeName", NODE_NAME),
                           "targetRef": {"kind": "Pod", "namespace": ns, "name": pod["metadata"]["name"],
                                         "uid": pod["metadata"].get("uid", "")}}
                (ready if pod_is_ready(pod) else not_ready).append(address)
            for port_spec in spec.get("ports") or []:
                target = port_spec.get("targetPort", port_spec.get("port"))
                number = next((n for n in (_pod_port(p, target) for p in members) if n), None)
                if number is None and isinstance(target, int):
                    number = target
                if number is not None:
                    port = {"port": number, "protocol": port_spec.get("protocol", "TCP")}
                    if port_spec.get("name"):
                        port["name"] = port_spec["name"]
                    ports.append(port)
            subset: dict[str, Any] = {"ports": ports}
            if ready:
                subset["addresses"] = ready
            if not_ready:
                subset["notReadyAddresses"] = not_ready
            subsets = [subset] if (ready or not_ready) else []
            text = json.dumps(subsets, sort_keys=True)
            if self._endpoints_written.get((ns, name)) == text:
                continue
            try:
                await self._write_endpoints(svc, subsets)
            except (ApiError, OSError, aiohttp.ClientError, asyncio.TimeoutError) as exc:
                self.note_error(f"endpoints {ns}/{name}", exc)  # retried next round
                continue
            self._endpoints_written[(ns, name)] = text
        for key in [k for k in self._endpoints_written if k not in services]:
            del self._endpoints_written[key]
            with contextlib.suppress(ApiError):
                await self.api.delete(ENDPOINTS.item(*key))

    async def _write_endpoints(self, svc: Mapping[str, Any], subsets: list[dict[str, Any]]) -> None:
        ns, name = _key(svc)
        try:
            await self.api.merge_patch(ENDPOINTS.item(ns, name), {"subsets": subsets})
        except ApiError as exc:
            if exc.status != 404:
                raise
            await self.api.create(ENDPOINTS.collection(ns), {
                "apiVersion": "v1", "kind": "Endpoints", "subsets": subsets,
                "metadata": {"name": name, "namespace": ns, "labels": dict(svc["metadata"].get("labels") or {})}})

    async def _sync_hosts(self) -> None:
        self._write_hosts(self._records())

    def _write_hosts(self, records: dict[str, list[str]]) -> None:
        text = json.dumps({"records": records}, sort_keys=True)
        if text == self._hosts_written:
            return
        tmp = self.hosts_path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.hosts_path)  # atomic: a reader sees the old or the new file, never half
        self._hosts_written = text
