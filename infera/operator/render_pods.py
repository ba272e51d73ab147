"""The Pods the renderer builds: a pool's Pod template (the main container's command, env with the
downward API, probes with a cold-start budget, resources, shared memory, kvd's socket, preStop
and the grace period from the drain budget, the GAIE frontend sidecar), and the merge of a
pool's ``extraPodSpec`` into it (its main container merged into ours, named lists by name).
"""
from __future__ import annotations

import copy
import math
from typing import Any

from infera.operator.render_base import (DEFAULT_DRAIN_SECONDS, FRONTEND, L_GAIE_FRONTEND, MAIN,
                                         STARTUP_FAILURE_THRESHOLD, STARTUP_PERIOD_S, _Ctx, drain_seconds,
                                         grace_period_seconds, pool_labels, worker_label_selector)
from infera.operator.render_commands import frontend_command
from infera.operator.spec import ServiceSpec, SpecError

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
