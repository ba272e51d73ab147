"""The operator's pure parts: status from owned workloads, condition transitions, the state table,
prune selection, the status merge patch, kopf credentials from a kubeconfig, and one reconcile pass
against an in-memory API (no HTTP)."""
from __future__ import annotations

import asyncio
import copy

import pytest
from lightkube import KubeConfig

from infera.operator import apply as ops_apply
from infera.operator.apply import KubeApiError, ListResult, select_prunable
from infera.operator.controller import NamespaceScope, Reconciler, build_parser, connection_info, owner_keys
from infera.operator.status import (DEGRADED, FAILED, INITIALIZING, PENDING, READY, Outcome, WorkloadReadiness,
                                    compute_status, gaie_status, merge_conditions, next_state, status_merge_patch,
                                    workload_readiness)

T0, T1, T2 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", "2026-01-01T00:02:00Z"
MANAGED = {"app.kubernetes.io/managed-by": "infera-operator", "infera.amd.com/deployment": "demo"}


def deployment(name: str, service: str, replicas: int, ready: int | None = None, *, generation: int = 1,
               observed: int | None = None, uid: str = "cr-uid", kind: str = "Deployment") -> dict:
    status = {} if ready is None else {"readyReplicas": ready}
    if observed is not None:
        status["observedGeneration"] = observed
    return {"apiVersion": "apps/v1", "kind": kind,
            "metadata": {"name": name, "generation": generation,
                         "labels": {**MANAGED, "infera.amd.com/service": service},
                         "ownerReferences": [{"apiVersion": "infera.amd.com/v1alpha1", "kind": "InferaDeployment",
                                              "name": "demo", "uid": uid, "controller": True}]},
            "spec": {"replicas": replicas}, "status": status}


# ---- workload readiness ----
def test_workload_readiness_reads_wanted_and_ready_and_the_service_name():
    w = workload_readiness(deployment("demo-decode", "decode", 2, 1))
    assert (w.name, w.kind, w.replicas, w.ready_replicas, w.ready) == ("decode", "Deployment", 2, 1, False)
    assert workload_readiness(deployment("demo-decode", "decode", 2, 2)).ready
    # No status yet (nothing runs it): 0 ready.
    assert workload_readiness(deployment("demo-decode", "decode", 2)).ready_replicas == 0


def test_a_spec_change_not_yet_observed_by_the_workload_controller_is_not_ready():
    stale = workload_readiness(deployment("d", "decode", 2, 2, generation=3, observed=2))
    assert not stale.up_to_date and not stale.ready
    assert workload_readiness(deployment("d", "decode", 2, 2, generation=3, observed=3)).ready


def test_plane_statefulset_is_named_by_its_component_and_zero_replicas_is_ready():
    nats = deployment("demo-nats", "x", 1, 1, kind="StatefulSet")
    del nats["metadata"]["labels"]["infera.amd.com/service"]
    nats["metadata"]["labels"]["infera.amd.com/component"] = "nats"
    assert workload_readiness(nats).name == "nats" and not workload_readiness(nats).pool
    assert workload_readiness(deployment("d", "idle", 0)).ready
    # The plane gates readiness (named in the messages) but is not a pool in status.services.
    status = compute_status(None, Outcome(generation=1, applied=True, workloads=(
        workload_readiness(nats), workload_readiness(deployment("demo-decode", "decode", 1, 1)))), T0)
    assert set(status["services"]) == {"decode"} and status["state"] == READY
    nats["status"]["readyReplicas"] = 0
    status = compute_status(None, Outcome(generation=1, applied=True, workloads=(
        workload_readiness(nats), workload_readiness(deployment("demo-decode", "decode", 1, 1)))), T0)
    assert status["state"] == PENDING and status["message"] == "waiting for nats 0/1 ready"


# ---- the state table ----
@pytest.mark.parametrize("previous,spec_error,applied,all_ready,spec_changed,expected", [
    (None, False, False, False, True, INITIALIZING),     # first pass, apply failed transiently
    (None, False, True, False, True, PENDING),           # applied, nothing ready yet
    (PENDING, False, True, True, False, READY),
    (READY, False, True, False, False, DEGRADED),        # a pool lost a replica, spec unchanged
    (DEGRADED, False, True, False, False, DEGRADED),
    (DEGRADED, False, True, True, False, READY),         # recovered
    (READY, False, True, False, True, PENDING),          # a scale-up is progress, not degradation
    (READY, True, True, True, False, FAILED),            # bad spec wins
    (FAILED, False, True, False, True, PENDING),         # spec fixed
    (FAILED, False, False, False, True, INITIALIZING),
    (READY, False, False, False, False, READY),          # transient apply failure keeps a running fleet's state
])
def test_state_table(previous, spec_error, applied, all_ready, spec_changed, expected):
    assert next_state(previous, spec_error=spec_error, applied=applied, all_ready=all_ready,
                      spec_changed=spec_changed) == expected


# ---- conditions ----
def test_condition_transition_time_changes_only_when_its_status_flips():
    first = merge_conditions(None, [("Ready", "False", "Pending", "waiting"), ("Degraded", "False", "Pending", "")], T0)
    second = merge_conditions(first, [("Ready", "False", "Pending", "waiting for x"),
                                      ("Degraded", "False", "AllReady", "")], T1)
    assert [c["lastTransitionTime"] for c in second] == [T0, T0]
    assert second[0]["message"] == "waiting for x"  # message updates without a transition
    third = merge_conditions(second, [("Ready", "True", "AllReady", "ok"), ("Degraded", "False", "AllReady", "")], T2)
    assert [c["lastTransitionTime"] for c in third] == [T2, T0]


def conditions(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status["conditions"]}


def test_status_walks_pending_ready_degraded_and_keeps_unchanged_status_equal():
    pending = compute_status(None, Outcome(generation=1, applied=True, workloads=(
        workload_readiness(deployment("demo-frontend", "frontend", 2, 0)),
        workload_readiness(deployment("demo-decode", "decode", 2, 1)))), T0)
    assert pending["state"] == PENDING and pending["observedGeneration"] == 1
    assert pending["services"] == {"decode": {"kind": "Deployment", "replicas": 2, "readyReplicas": 1},
                                   "frontend": {"kind": "Deployment", "replicas": 2, "readyReplicas": 0}}
    c = conditions(pending)
    assert (c["Ready"]["status"], c["Progressing"]["status"], c["Degraded"]["status"]) == ("False", "True", "False")
    assert "decode 1/2 ready" in c["Progressing"]["message"] and "frontend 0/2 ready" in c["Progressing"]["message"]

    all_ready = (workload_readiness(deployment("demo-frontend", "frontend", 2, 2)),
                 workload_readiness(deployment("demo-decode", "decode", 2, 2)))
    ready = compute_status(pending, Outcome(generation=1, applied=True, workloads=all_ready), T1)
    c = conditions(ready)
    assert ready["state"] == READY and c["Ready"]["status"] == "True" and c["Ready"]["lastTransitionTime"] == T1
    assert c["Degraded"]["lastTransitionTime"] == T0  # stayed False

    # The same world again: an equal status, so the operator writes nothing.
    again = compute_status(ready, Outcome(generation=1, applied=True, workloads=all_ready), T2)
    assert again == ready and status_merge_patch(ready, again) == {}

    degraded = compute_status(ready, Outcome(generation=1, applied=True, workloads=(
        all_ready[0], workload_readiness(deployment("demo-decode", "decode", 2, 1)))), T2)
    c = conditions(degraded)
    assert degraded["state"] == DEGRADED and c["Degraded"]["status"] == "True"
    assert c["Degraded"]["lastTransitionTime"] == T2 and "decode 1/2 ready" in c["Degraded"]["message"]


def test_spec_error_fails_with_its_message_and_keeps_other_writers_fields():
    previous = {"state": READY, "observedGeneration": 1, "gaie": {"ready": True},
                "services": {"decode": {"kind": "Deployment", "replicas": 1, "readyReplicas": 1}}}
    failed = compute_status(previous, Outcome(generation=2, spec_error="spec.services.decode.replicas: must be >= 0"), T1)
    assert failed["state"] == FAILED and failed["observedGeneration"] == 2 and failed["gaie"] == {"ready": True}
    c = conditions(failed)
    assert c["Degraded"]["status"] == "True" and c["Degraded"]["reason"] == "InvalidSpec"
    assert c["Degraded"]["message"] == "spec.services.decode.replicas: must be >= 0"
    assert c["Ready"]["status"] == "False" and failed["message"] == "spec.services.decode.replicas: must be >= 0"
    assert c["Ready"]["observedGeneration"] == 2
    # No objects were applied: no services reported; the merge patch nulls the removed pool.
    assert failed["services"] == {}
    assert status_merge_patch(previous, failed)["services"] == {"decode": None}


def test_transient_error_before_any_apply_is_initializing_with_the_error():
    status = compute_status(None, Outcome(generation=1, transient_error="connection refused"), T0)
    assert status["state"] == INITIALIZING
    assert conditions(status)["Progressing"]["message"] == "connection refused"
    running = {"state": READY, "observedGeneration": 1, "conditions": []}
    assert compute_status(running, Outcome(generation=1, transient_error="boom"), T1) == running


def test_status_merge_patch_nulls_removed_keys_and_replaces_lists():
    old = {"state": "pending", "services": {"a": {"replicas": 1}, "b": {"replicas": 2}}, "conditions": [{"type": "X"}]}
    new = {"state": "ready", "services": {"a": {"replicas": 1}}, "conditions": [{"type": "Y"}]}
    assert status_merge_patch(old, new) == {"state": "ready", "services": {"b": None}, "conditions": [{"type": "Y"}]}


# ---- prune selection ----
def test_prune_selects_only_owned_labelled_objects_missing_from_the_render():
    rendered = [deployment("demo-frontend", "frontend", 2), deployment("demo-decode", "decode", 2)]
    live = [
        deployment("demo-frontend", "frontend", 2),                # rendered: kept
        deployment("demo-prefill", "prefill", 1),                  # removed pool: pruned
        deployment("demo-old", "old", 1, uid="another-cr-uid"),     # same name, older CR: not ours
        {**deployment("demo-mine", "x", 1), "metadata": {**deployment("demo-mine", "x", 1)["metadata"],
                                                         "labels": {"infera.amd.com/deployment": "demo"}}},  # not managed
        {**deployment("demo-gone", "y", 1), "metadata": {**deployment("demo-gone", "y", 1)["metadata"],
                                                         "deletionTimestamp": T0}},  # being deleted already
    ]
    other_cr = deployment("other-prefill", "prefill", 1)
    other_cr["metadata"]["labels"]["infera.amd.com/deployment"] = "other"
    pruned = select_prunable(live + [other_cr], rendered, "demo", "cr-uid")
    assert [o["metadata"]["name"] for o in pruned] == ["demo-prefill"]


def test_resource_paths_for_core_and_group_kinds_and_a_clear_error_for_unknown_kinds():
    assert ops_apply.resource_path({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s"}}, "ns") \
        == "/api/v1/namespaces/ns/services/s"
    assert ops_apply.collection_path("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "ns") \
        == "/apis/leaderworkerset.x-k8s.io/v1/namespaces/ns/leaderworkersets"
    with pytest.raises(ValueError, match="unknown kind 'Widget'"):
        ops_apply.collection_path("example.com/v1", "Widget", "ns")


# ---- kopf wiring ----
def test_connection_info_from_a_kubeconfig_file(tmp_path):
    (tmp_path / "ca.crt").write_text("x")
    config = KubeConfig.from_dict({
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443", "certificate-authority": "ca.crt"}}],
        "users": [{"name": "u", "user": {"token": "secret-token"}}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u", "namespace": "team"}}],
        "current-context": "ctx"}, fname=tmp_path / "config")
    info = connection_info(config)
    assert (info.server, info.token, info.scheme, info.default_namespace) == \
        ("https://127.0.0.1:6443", "secret-token", "Bearer", "team")
    assert info.ca_path == str(tmp_path / "ca.crt")


def test_connection_info_rereads_the_service_account_token_file(tmp_path):
    token = tmp_path / "token"
    token.write_text("first\n")
    config = KubeConfig.from_dict({
        "clusters": [{"name": "c", "cluster": {"server": "https://10.0.0.1:443"}}],
        "users": [{"name": "u", "user": {"tokenFile": str(token)}}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}], "current-context": "ctx"})
    assert connection_info(config).token == "first"
    token.write_text("rotated\n")
    assert connection_info(config).token == "rotated"


def test_owner_keys_route_a_workload_event_to_its_cr():
    assert owner_keys(deployment("demo-decode", "decode", 1), "ns") == [("ns", "demo")]
    foreign = deployment("x", "x", 1)
    foreign["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs"}]
    assert owner_keys(foreign, "ns") == []


def test_flags_env_and_precedence():
    env = {"INFERA_OPERATOR_RESYNC_S": "3", "INFERA_OPERATOR_SIM_ENGINES": "true"}
    args = build_parser(env).parse_args(["--namespace", "a", "-n", "b"])
    assert (args.namespace, args.resync_s, args.sim_engines, args.all_namespaces) == (["a", "b"], 3.0, True, False)
    assert build_parser(env).parse_args(["--resync-s", "7"]).resync_s == 7.0
    assert build_parser({}).parse_args([]).resync_s == 15.0
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["--all-namespaces", "--namespace", "a"])


# ---- one reconcile pass against an in-memory API ----
class SpecError(Exception):
    pass


class MemoryRest:
    """Just enough of KubeRest: objects by path, a resourceVersion bumped only on a real change."""

    def __init__(self, cr: dict) -> None:
        self.objects: dict[str, dict] = {ops_apply.resource_path(cr): cr}
        self.status_writes: list[dict] = []
        self.events: list[dict] = []
        self.applies = 0
        self.fail_apply: KubeApiError | None = None

    async def get(self, path):
        return copy.deepcopy(self.objects.get(path))

    async def list(self, path, label_selector=None):
        requirements = [kv.split("=") for kv in label_selector.split(",")] if label_selector else []
        items = [copy.deepcopy(o) for p, o in self.objects.items() if p.rsplit("/", 1)[0] == path
                 and all((o["metadata"].get("labels") or {}).get(k) == v for k, v in requirements)]
        return ListResult(items=items, served=True)

    async def apply(self, obj, namespace):
        if self.fail_apply is not None:
            raise self.fail_apply
        self.applies += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["namespace"] = namespace
        path = ops_apply.resource_path(obj)
        before = self.objects.get(path)
        if before is not None:
            obj["status"] = before.get("status", {})
        self.objects[path] = obj

    async def delete(self, obj, namespace):
        self.objects.pop(ops_apply.resource_path(obj, namespace), None)

    async def post_event(self, event):
        self.events.append(event)

    async def patch_status(self, cr, patch):
        self.status_writes.append(patch)
        current = self.objects[ops_apply.resource_path(cr)]
        current["status"] = merge(current.get("status") or {}, patch)


def merge(target: dict, patch: dict) -> dict:
    out = dict(target)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def fake_render(cr: dict) -> list[dict]:
    if cr["spec"].get("bad"):
        raise SpecError("spec.bad: not allowed")
    return [deployment(f"demo-{svc}", svc, n) for svc, n in sorted(cr["spec"]["services"].items())]


def cr_object(services: dict[str, int], generation: int = 1) -> dict:
    return {"apiVersion": "infera.amd.com/v1alpha1", "kind": "InferaDeployment",
            "metadata": {"name": "demo", "namespace": "ns", "uid": "cr-uid", "generation": generation},
            "spec": {"services": services}}


async def test_reconcile_applies_prunes_and_writes_status_only_on_change():
    rest = MemoryRest(cr_object({"frontend": 1, "decode": 2}))
    reconciler = Reconciler(rest, fake_render, SpecError, clock=lambda: T0)
    await reconciler.reconcile(("ns", "demo"))
    cr_path = "/apis/infera.amd.com/v1alpha1/namespaces/ns/inferadeployments/demo"
    assert rest.objects[cr_path]["status"]["state"] == PENDING
    assert "/apis/apps/v1/namespaces/ns/deployments/demo-decode" in rest.objects
    await reconciler.reconcile(("ns", "demo"))
    assert len(rest.status_writes) == 1  # nothing changed: no second write

    for path, ready in (("demo-decode", 2), ("demo-frontend", 1)):
        rest.objects[f"/apis/apps/v1/namespaces/ns/deployments/{path}"]["status"] = {"readyReplicas": ready}
    await reconciler.reconcile(("ns", "demo"))
    assert rest.objects[cr_path]["status"]["state"] == READY

    # Remove a pool: its Deployment is pruned and its status entry goes.
    rest.objects[cr_path]["spec"] = {"services": {"frontend": 1}}
    rest.objects[cr_path]["metadata"]["generation"] = 2
    await reconciler.reconcile(("ns", "demo"))
    assert "/apis/apps/v1/namespaces/ns/deployments/demo-decode" not in rest.objects
    assert set(rest.objects[cr_path]["status"]["services"]) == {"frontend"}
    assert rest.objects[cr_path]["status"]["observedGeneration"] == 2

    # A bad spec: failed with the message, nothing applied, nothing pruned.
    rest.objects[cr_path]["spec"] = {"services": {}, "bad": True}
    applies = rest.applies
    await reconciler.reconcile(("ns", "demo"))
    status = rest.objects[cr_path]["status"]
    assert status["state"] == FAILED and rest.applies == applies
    assert conditions(status)["Degraded"]["message"] == "spec.bad: not allowed"
    # One Event per state change, a Warning for failed, on the CR.
    assert [(e["type"], e["reason"]) for e in rest.events] == \
        [("Normal", "Pending"), ("Normal", "AllReady"), ("Warning", "InvalidSpec")]
    assert rest.events[-1]["message"] == "state failed: spec.bad: not allowed"
    assert rest.events[-1]["involvedObject"]["uid"] == "cr-uid"
    assert "/apis/apps/v1/namespaces/ns/deployments/demo-frontend" in rest.objects


async def test_refused_apply_is_failed_and_a_transient_one_is_retried():
    rest = MemoryRest(cr_object({"frontend": 1}))
    reconciler = Reconciler(rest, fake_render, SpecError, retry_s=0.01, clock=lambda: T0)
    rest.fail_apply = KubeApiError(422, "PATCH", "/x", "spec.replicas: Invalid value")
    await reconciler.reconcile(("ns", "demo"))
    cr_path = "/apis/infera.amd.com/v1alpha1/namespaces/ns/inferadeployments/demo"
    status = rest.objects[cr_path]["status"]
    assert status["state"] == FAILED and "spec.replicas: Invalid value" in conditions(status)["Degraded"]["message"]

    rest.objects[cr_path]["status"] = {}
    rest.fail_apply = KubeApiError(503, "PATCH", "/x", "etcd unavailable")
    reconciler.kick(("ns", "demo"))
    await reconciler.idle()
    assert rest.objects[cr_path]["status"]["state"] == INITIALIZING
    rest.fail_apply = None  # the retry (after retry_s) succeeds without any new event
    deadline = asyncio.get_running_loop().time() + 5
    while rest.objects[cr_path]["status"]["state"] != PENDING:
        assert asyncio.get_running_loop().time() < deadline, "no retry after a transient failure"
        await asyncio.sleep(0.01)
    await reconciler.close()


async def test_a_deleted_or_deleting_cr_is_not_applied():
    cr = cr_object({"frontend": 1})
    cr["metadata"]["deletionTimestamp"] = T0
    rest = MemoryRest(cr)
    reconciler = Reconciler(rest, fake_render, SpecError, clock=lambda: T0)
    await reconciler.reconcile(("ns", "demo"))
    assert rest.applies == 0 and rest.status_writes == []
    reconciler.track(("ns", "gone"))
    await reconciler.reconcile(("ns", "gone"))  # 404: forgotten, no error
    assert ("ns", "gone") not in reconciler._known


def test_workload_readiness_describe():
    assert WorkloadReadiness("decode", "Deployment", 2, 1, False).describe() == \
        "decode 1/2 ready (rollout not observed yet)"


async def test_a_rendered_workload_the_list_does_not_show_yet_counts_as_not_ready():
    class LaggingRest(MemoryRest):
        async def apply(self, obj, namespace):
            self.applies += 1  # accepted, but not visible in lists yet

    rest = LaggingRest(cr_object({"frontend": 1}))
    await Reconciler(rest, fake_render, SpecError, clock=lambda: T0).reconcile(("ns", "demo"))
    status = rest.objects["/apis/infera.amd.com/v1alpha1/namespaces/ns/inferadeployments/demo"]["status"]
    assert status["state"] == PENDING
    assert status["services"] == {"frontend": {"kind": "Deployment", "replicas": 1, "readyReplicas": 0}}


# ---- the install's RBAC against what the renderer writes ----
def _cluster_role() -> list[dict]:
    import pathlib

    import yaml

    path = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "rbac.yaml"
    role = next(d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "ClusterRole")
    return role["rules"]


def _granted(rules: list[dict], group: str, resource: str) -> set[str]:
    verbs: set[str] = set()
    for rule in rules:
        if group in rule.get("apiGroups", []) and resource in rule.get("resources", []):
            verbs |= set(rule["verbs"])
    return verbs


def test_the_operator_cluster_role_covers_every_rendered_kind_and_what_the_fleet_role_grants():
    from infera.operator.render import KIND_ORDER, RenderOptions, render

    rules = _cluster_role()
    for api_version, kind in ops_apply.PRUNE_KINDS:
        assert kind in KIND_ORDER, f"{kind} is pruned but never rendered"
    for kind in KIND_ORDER:
        api_version, plural = next((k[0], p) for k, p in ops_apply.RESOURCES.items() if k[1] == kind)
        assert (api_version, kind) in ops_apply.PRUNE_KINDS, f"{kind} is rendered but never pruned"
        group = api_version.rpartition("/")[0]
        assert {"get", "list", "watch", "create", "patch", "delete"} <= _granted(rules, group, plural), kind
    assert {"get", "list", "watch"} <= _granted(rules, "infera.amd.com", "inferadeployments")
    assert "patch" in _granted(rules, "infera.amd.com", "inferadeployments/status")
    assert "update" in _granted(rules, "infera.amd.com", "inferadeployments/finalizers")  # blockOwnerDeletion
    # RBAC's escalation check: the operator may only create a Role granting what it holds itself.
    example = {"apiVersion": "infera.amd.com/v1alpha1", "kind": "InferaDeployment",
               "metadata": {"name": "demo", "namespace": "ns", "uid": "u"},
               "spec": {"backendFramework": "sim", "services": {
                   "frontend": {"componentType": "server"}, "decode": {"componentType": "worker"}}}}
    fleet_roles = [o for o in render(example, RenderOptions()) if o["kind"] == "Role"]
    assert fleet_roles
    for role in fleet_roles:
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    assert set(rule["verbs"]) <= _granted(rules, group, resource), (group, resource, rule["verbs"])


def test_namespace_scope_exact_names_globs_and_negations():
    assert NamespaceScope(("a", "b")).list_namespaces() == ["a", "b"]
    globbed = NamespaceScope(("team-*", "!team-secret"))
    assert globbed.list_namespaces() == [None]
    assert globbed.includes("team-x") and not globbed.includes("team-secret") and not globbed.includes("other")
    assert NamespaceScope(("!kube-system",)).includes("default") and not NamespaceScope(("!kube-system",)).includes("kube-system")
    assert NamespaceScope().list_namespaces() == [None] and NamespaceScope().includes("any")


async def test_resync_lists_the_crs_so_a_cr_no_event_announced_is_reconciled():
    rest = MemoryRest(cr_object({"frontend": 1}))
    reconciler = Reconciler(rest, fake_render, SpecError, clock=lambda: T0)
    resync = asyncio.create_task(reconciler.resync_forever(0.01, NamespaceScope(("ns",))))
    cr_path = "/apis/infera.amd.com/v1alpha1/namespaces/ns/inferadeployments/demo"
    deadline = asyncio.get_running_loop().time() + 5
    while (rest.objects[cr_path].get("status") or {}).get("state") != PENDING:
        assert asyncio.get_running_loop().time() < deadline, "the resync did not reconcile the listed CR"
        await asyncio.sleep(0.01)
    resync.cancel()
    await asyncio.gather(resync, return_exceptions=True)
    await reconciler.close()


def test_main_refuses_without_a_scope_or_a_kube_config(monkeypatch, capsys, tmp_path):
    from infera.discovery.kubernetes import load_kube_config
    from infera.operator import controller

    monkeypatch.delenv("INFERA_OPERATOR_NAMESPACES", raising=False)
    monkeypatch.delenv("INFERA_OPERATOR_ALL_NAMESPACES", raising=False)
    assert controller.main([]) == 2
    assert "--namespace NS" in capsys.readouterr().err
    # The scope from the environment; no API config anywhere: a clear error, not a kopf retry loop.
    monkeypatch.setenv("INFERA_OPERATOR_NAMESPACES", "a, b")
    assert controller._namespaces(controller.build_parser().parse_args([]), {"INFERA_OPERATOR_NAMESPACES": "a, b"}) \
        == ["a", "b"]
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    no_service_account = str(tmp_path)  # no token files here: not inside a Pod
    monkeypatch.setattr(controller, "load_kube_config", lambda: load_kube_config(no_service_account))
    assert controller.main([]) == 2
    assert "no Kubernetes API config" in capsys.readouterr().err


def _parents(*statuses: str) -> dict:
    return {"metadata": {"name": "x"}, "status": {"parents": [
        {"conditions": [{"type": "Accepted", "status": s}]} for s in statuses]}}


@pytest.mark.parametrize("epp_ready, pool, route, ready", [
    (1, _parents("True"), _parents("True"), True),
    (0, _parents("True"), _parents("True"), False),  # the picker not ready
    (1, _parents("False", "True"), _parents("True"), True),  # accepted by one of its parents
    (1, _parents("False"), _parents("True"), False),
    (1, {"metadata": {"name": "x"}}, _parents("True"), False),  # no gateway controller has written status
    (1, None, _parents("True"), False),  # the pool not listed (yet)
])
def test_gaie_status(epp_ready, pool, route, ready):
    epp = WorkloadReadiness(name="epp", kind="Deployment", replicas=1, ready_replicas=epp_ready, up_to_date=True,
                            pool=False)
    status = gaie_status(epp, pool, route)
    assert status["ready"] is ready
    assert status["eppReadyReplicas"] == epp_ready
    assert ("inferencePoolName" in status) == (pool is not None)


def test_gaie_status_is_ours_and_dropped_when_off():
    gaie = {"eppReplicas": 1, "eppReadyReplicas": 0, "ready": False}
    on = compute_status({}, Outcome(generation=1, applied=True, gaie=gaie), "2026-12-03T00:00:00Z")
    assert on["gaie"] == gaie
    off = compute_status(on, Outcome(generation=2, applied=True), "2026-12-03T00:00:01Z")
    assert "gaie" not in off
    kept = compute_status(on, Outcome(generation=1, transient_error="boom"), "2026-12-03T00:00:01Z")
    assert kept["gaie"] == gaie  # a failed reconcile reports nothing new
