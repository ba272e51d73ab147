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

This module owns the entry points (:func:`render`, :func:`render_deployment`,
:func:`resolve_namespace`) and the apply order; the builders live beside it, one concern each:
``render_base.py`` (defaults, labels, options, names, the drain budget), ``render_commands.py``
(containers' command lines), ``render_pods.py`` (Pod templates) and ``render_objects.py`` (the
objects). Their public names are importable from here too.
"""
from __future__ import annotations

from typing import Any

# The builders' public names stay importable from here, where the operator, its CLI and the tests
# find them.
from infera.operator.render_base import (DEFAULT_DRAIN_SECONDS, DEFAULT_ENGINE_IMAGES, DEFAULT_ETCD_IMAGE,
                                         DEFAULT_ETCD_STORAGE, DEFAULT_INFERA_IMAGE, DEFAULT_NATS_IMAGE,
                                         DEFAULT_NATS_STORAGE, EPP, EPP_GRPC_PORT, EPP_HEALTH_PORT,
                                         EPP_HEALTH_SERVICE, ETCD_CLIENT_PORT, FRONTEND, GRACE_MARGIN_SECONDS,
                                         HTTPROUTE_API_VERSION, INFERENCE_POOL_API_VERSION, KIND_ORDER, L_COMPONENT,
                                         L_DEPLOYMENT, L_GAIE_FRONTEND, L_MANAGED_BY, L_PART_OF, L_ROLE, L_SERVICE,
                                         MAIN, MIN_GRACE_SECONDS, NATS_CLIENT_PORT, NATS_MONITOR_PORT,
                                         SGLANG_DIST_INIT_PORT, STARTUP_FAILURE_THRESHOLD, STARTUP_PERIOD_S,
                                         RenderOptions, _Ctx, base_labels, component_labels, component_selector,
                                         drain_seconds, etcd_endpoint, grace_period_seconds, nats_url, object_name,
                                         pool_labels, pool_selector, worker_label_selector)
from infera.operator.render_commands import (SIM_ENGINE_VALUE_FLAGS, SIM_FLAG_ALIASES, SIM_LAUNCHER_BOOL_FLAGS,
                                             SIM_LAUNCHER_VALUE_FLAGS, epp_command, frontend_command, server_command,
                                             worker_command)
from infera.operator.render_objects import (_dashboard, _etcd_objects, _gaie_objects, _kvd_objects, _nats_objects,
                                            _rbac, _server_objects, _worker_objects, grafana_dashboard_json)
from infera.operator.spec import Deployment, SpecError, parse_deployment

__all__ = ["DEFAULT_DRAIN_SECONDS", "DEFAULT_ENGINE_IMAGES", "DEFAULT_ETCD_IMAGE", "DEFAULT_ETCD_STORAGE",
           "DEFAULT_INFERA_IMAGE", "DEFAULT_NATS_IMAGE", "DEFAULT_NATS_STORAGE", "EPP", "EPP_GRPC_PORT",
           "EPP_HEALTH_PORT", "EPP_HEALTH_SERVICE", "ETCD_CLIENT_PORT", "FRONTEND", "GRACE_MARGIN_SECONDS",
           "HTTPROUTE_API_VERSION", "INFERENCE_POOL_API_VERSION", "KIND_ORDER", "L_COMPONENT", "L_DEPLOYMENT",
           "L_GAIE_FRONTEND", "L_MANAGED_BY", "L_PART_OF", "L_ROLE", "L_SERVICE", "MAIN", "MIN_GRACE_SECONDS",
           "NATS_CLIENT_PORT", "NATS_MONITOR_PORT", "RenderOptions", "SGLANG_DIST_INIT_PORT",
           "SIM_ENGINE_VALUE_FLAGS", "SIM_FLAG_ALIASES", "SIM_LAUNCHER_BOOL_FLAGS", "SIM_LAUNCHER_VALUE_FLAGS",
           "STARTUP_FAILURE_THRESHOLD", "STARTUP_PERIOD_S", "base_labels", "component_labels", "component_selector",
           "drain_seconds", "epp_command", "etcd_endpoint", "frontend_command", "grace_period_seconds",
           "grafana_dashboard_json", "nats_url", "object_name", "pool_labels", "pool_selector", "render",
           "render_deployment", "resolve_namespace", "server_command", "worker_command", "worker_label_selector"]


def _sort_key(obj: dict[str, Any]) -> tuple[int, str]:
    return KIND_ORDER.index(obj["kind"]), obj["metadata"]["name"]


def render_deployment(dep: Deployment, namespace: str, options: RenderOptions = RenderOptions()) -> list[dict[str, Any]]:  # noqa: B008 (frozen)
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


def render(cr: dict[str, Any], options: RenderOptions = RenderOptions()) -> list[dict[str, Any]]:  # noqa: B008 (a frozen dataclass)
    """Every object the ``InferaDeployment`` ``cr`` (a dict) owns; :class:`SpecError` on a bad spec."""
    dep = parse_deployment(cr)
    return render_deployment(dep, resolve_namespace(dep.namespace, options), options)
