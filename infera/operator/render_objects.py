"""The Kubernetes objects the renderer emits for an ``InferaDeployment``: the RBAC, each server
pool (Deployment, Service, PodDisruptionBudget) and worker pool (Deployment or LeaderWorkerSet),
the NATS and etcd StatefulSets with their Services, kvd's DaemonSet, the GAIE endpoint picker,
InferencePool and HTTPRoute, and the Grafana dashboard's ConfigMap. ``render.py`` lists what each
carries and puts them in apply order.
"""
from __future__ import annotations

from importlib import resources as importlib_resources
from typing import Any

from infera.operator.crd import API_VERSION
from infera.operator.render_base import (DEFAULT_ETCD_STORAGE, DEFAULT_NATS_STORAGE, EPP, EPP_GRPC_PORT,
                                         EPP_HEALTH_PORT, EPP_HEALTH_SERVICE, ETCD_CLIENT_PORT,
                                         HTTPROUTE_API_VERSION, INFERENCE_POOL_API_VERSION, L_DEPLOYMENT,
                                         L_GAIE_FRONTEND, MAIN, NATS_CLIENT_PORT, NATS_MONITOR_PORT, _Ctx,
                                         base_labels, component_labels, component_selector, drain_seconds,
                                         etcd_endpoint, grace_period_seconds, object_name, pool_labels,
                                         pool_selector, worker_label_selector)
from infera.operator.render_commands import epp_command, server_command, worker_command
from infera.operator.render_pods import _downward_env, _merge_env, _pod_template, _pool_image
from infera.operator.spec import ServiceSpec

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
