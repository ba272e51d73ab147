"""The operator as a process (``python -m infera.operator run --namespace ns``) against the fake API
server (tests/fakes/kube_api.py), with the CRD from infera.operator.crd applied to it. No kubelet:
nothing becomes ready by itself, so the test writes the workloads' ``/status`` as their controllers
would.

One CR's life: rendered objects created (owner references, labels), status pending → ready →
degraded → ready with conditions, no status write and no kopf finalizer in a steady state; a hand
edit undone; a replica change touches only its pool's Deployment (the others' resourceVersion
stays, through several re-applies); a removed pool's Deployment is pruned; a bad spec is ``failed``
with its message and nothing changes; deleting the CR removes everything it owned. Then: as
installed (``--all-namespaces --sim-engines``, CRD applied after the start, liveness endpoint), and
a multi-node pool without, then with, the LeaderWorkerSet CRD."""
from __future__ import annotations

import asyncio
import os
import sys
import urllib.request
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import pytest

from infera.operator.crd import build_crd
from tests.conftest import free_port, stop_process_group, wait_for
from tests.fakes.kube_api import FakeKubeApi

pytestmark = pytest.mark.integration

NS = "ns"
T = 20.0  # deadline for each convergence (the operator reacts to watch events in milliseconds)
API = "infera.amd.com/v1alpha1"
KIND = "InferaDeployment"
MANAGED = "app.kubernetes.io/managed-by"


def spec() -> dict[str, Any]:
    return {"backendFramework": "sim", "services": {
        "frontend": {"componentType": "server", "replicas": 2},
        "pool-a": {"componentType": "worker", "replicas": 1},
        "pool-b": {"componentType": "worker", "replicas": 1},
    }}


def cr(name: str = "demo") -> dict[str, Any]:
    return {"apiVersion": API, "kind": KIND, "metadata": {"name": name, "namespace": NS}, "spec": spec()}


def create_namespace(api: FakeKubeApi, name: str) -> None:
    api.create_object(api.resource_type("v1", "Namespace"), None,
                      {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})


def apply_crd(api: FakeKubeApi) -> None:
    api.create_object(api.resource_type("apiextensions.k8s.io/v1", "CustomResourceDefinition"), None, build_crd())


@pytest.fixture
async def bare_api() -> AsyncIterator[FakeKubeApi]:
    server = await FakeKubeApi(namespace=NS).start()
    create_namespace(server, NS)
    yield server
    await server.stop()


@pytest.fixture
async def api(bare_api: FakeKubeApi) -> FakeKubeApi:
    apply_crd(bare_api)
    return bare_api


@asynccontextmanager
async def run_operator(api: FakeKubeApi, tmp_path, *args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig", NS)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("INFERA_OPERATOR_") and k != "KUBERNETES_SERVICE_HOST"}  # only the flags count
    env.update(KUBECONFIG=kubeconfig, INFERA_LOG_LEVEL="info")
    log = open(tmp_path / "operator.log", "wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infera.operator", "run", "--resync-s", "1", *args,
        env=env, stdout=log, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        await stop_process_group(proc, grace=15)
        log.close()
        print((tmp_path / "operator.log").read_text()[-6000:])  # shown when the test fails
    assert proc.returncode == 0, "the operator did not exit cleanly on SIGTERM"


@pytest.fixture
async def operator(api: FakeKubeApi, tmp_path) -> AsyncIterator[asyncio.subprocess.Process]:
    async with run_operator(api, tmp_path, "--namespace", NS) as proc:
        yield proc


def owned(api: FakeKubeApi, uid: str) -> list[dict[str, Any]]:
    """Every namespaced object whose owner references name ``uid``."""
    found = []
    for objects in api.store.values():
        for obj in objects.values():
            refs = obj.get("metadata", {}).get("ownerReferences") or []
            if any(r.get("uid") == uid for r in refs):
                found.append(obj)
    return found


def deployments(api: FakeKubeApi) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in api.list("apps/v1", "Deployment", NS)}


def the_cr(api: FakeKubeApi, name: str = "demo") -> dict[str, Any] | None:
    return api.get(API, KIND, name, NS)


def state(api: FakeKubeApi, name: str = "demo") -> str | None:
    obj = the_cr(api, name)
    return ((obj or {}).get("status") or {}).get("state")


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in obj["status"].get("conditions", [])}


def make_ready(api: FakeKubeApi, uid: str) -> None:
    """What the workload controllers would write once every replica is ready."""
    for obj in owned(api, uid):
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        meta, replicas = obj["metadata"], obj["spec"].get("replicas", 1)
        status = {"observedGeneration": meta.get("generation", 1), "replicas": replicas,
                  "readyReplicas": replicas, "updatedReplicas": replicas, "availableReplicas": replicas}
        if obj.get("status") != {**(obj.get("status") or {}), **status}:
            api.patch_object(api.resource_type(obj["apiVersion"], obj["kind"]), NS, meta["name"],
                             "application/merge-patch+json", {"status": status}, subresource="status")


def applies_to(api: FakeKubeApi, name: str) -> int:
    """Server-side applies the fake has answered for Deployment ``name``."""
    path = f"/apis/apps/v1/namespaces/{NS}/deployments/{name}?"
    return sum(1 for method, target, code in api.access_log
               if method == "PATCH" and target.startswith(path) and "fieldManager=infera-operator" in target
               and code < 300)


def status_writes(api: FakeKubeApi, name: str = "demo") -> int:
    path = f"/apis/{API}/namespaces/{NS}/inferadeployments/{name}/status"
    return sum(1 for method, target, _ in api.access_log if method == "PATCH" and target.split("?")[0] == path)


def patch_cr(api: FakeKubeApi, patch: dict[str, Any], name: str = "demo") -> None:
    api.patch_object(api.resource_type(API, KIND), NS, name, "application/merge-patch+json", patch)


async def test_operator_reconciles_one_crs_life(api: FakeKubeApi, operator: asyncio.subprocess.Process):
    crs = api.resource_type(API, KIND)
    api.create_object(crs, NS, cr())
    uid = the_cr(api)["metadata"]["uid"]

    # Rendered objects, each labelled and owned by the CR; nothing is ready without a kubelet.
    await wait_for(lambda: {"demo-frontend", "demo-pool-a", "demo-pool-b"} <= set(deployments(api)), T,
                   message="the pools' Deployments")
    await wait_for(lambda: state(api) == "pending", T, message="state pending")
    for obj in owned(api, uid):
        labels = obj["metadata"].get("labels", {})
        assert labels.get(MANAGED) == "infera-operator" and labels.get("infera.amd.com/deployment") == "demo", obj
        ref = next(r for r in obj["metadata"]["ownerReferences"] if r["uid"] == uid)
        assert (ref["kind"], ref["name"], ref.get("controller")) == (KIND, "demo", True)
    kinds = {o["kind"] for o in owned(api, uid)}
    assert {"Deployment", "Service", "StatefulSet"} <= kinds, kinds  # server + NATS plane at least
    status = the_cr(api)["status"]
    assert status["observedGeneration"] == the_cr(api)["metadata"]["generation"]
    assert status["services"]["pool-b"] == {"kind": "Deployment", "replicas": 1, "readyReplicas": 0}
    assert conditions(the_cr(api))["Progressing"]["status"] == "True"

    # Readiness, as the controllers would report it: Ready follows from the workloads' watch.
    make_ready(api, uid)
    await wait_for(lambda: state(api) == "ready", T, message="state ready")
    c = conditions(the_cr(api))
    assert (c["Ready"]["status"], c["Progressing"]["status"], c["Degraded"]["status"]) == ("True", "False", "False")
    # Steady state: resyncs re-apply (every 1 s) but write no status, and kopf left no marks on the CR.
    writes, applied = status_writes(api), applies_to(api, "demo-frontend")
    await wait_for(lambda: applies_to(api, "demo-frontend") >= applied + 2, T, message="two resyncs")
    assert status_writes(api) == writes, "status written although nothing changed"
    meta = the_cr(api)["metadata"]
    assert not meta.get("finalizers") and not any(k.startswith("kopf.") for k in meta.get("annotations") or {})
    # The workload watches (Deployments, StatefulSets) are filtered on the server: the operator never
    # streams other Deployments of the cluster.
    selected = [q for q in api.watch_params if q.get("labelSelector") == f"{MANAGED}=infera-operator"]
    assert len(selected) >= 2, api.watch_params

    # A pool drops below its count: degraded; back: ready again.
    api.patch_object(api.resource_type("apps/v1", "Deployment"), NS, "demo-pool-a", "application/merge-patch+json",
                     {"status": {"readyReplicas": 0}}, subresource="status")
    await wait_for(lambda: state(api) == "degraded", T, message="state degraded")
    assert conditions(the_cr(api))["Degraded"]["status"] == "True"
    make_ready(api, uid)
    await wait_for(lambda: state(api) == "ready", T, message="ready again")

    # Drift: a hand edit of an owned object is undone (level-triggered: the operator re-applies).
    api.patch_object(api.resource_type("apps/v1", "Deployment"), NS, "demo-pool-a", "application/merge-patch+json",
                     {"spec": {"replicas": 5}})
    await wait_for(lambda: deployments(api)["demo-pool-a"]["spec"]["replicas"] == 1, T, message="drift undone")
    make_ready(api, uid)
    await wait_for(lambda: state(api) == "ready", T, message="ready after the drift")

    # One pool's replicas change: only its Deployment changes, through several re-applies.
    before = {name: d["metadata"]["resourceVersion"] for name, d in deployments(api).items()}
    applied_before = applies_to(api, "demo-pool-a")
    patch_cr(api, {"spec": {"services": {"pool-b": {"replicas": 2}}}})
    await wait_for(lambda: deployments(api)["demo-pool-b"]["spec"]["replicas"] == 2, T, message="pool-b scaled")
    await wait_for(lambda: applies_to(api, "demo-pool-a") >= applied_before + 3, T,
                   message="more reconciles (resync every 1 s)")
    after = {name: d["metadata"]["resourceVersion"] for name, d in deployments(api).items()}
    assert after["demo-pool-b"] != before["demo-pool-b"]
    assert {n: after[n] for n in ("demo-frontend", "demo-pool-a")} == \
        {n: before[n] for n in ("demo-frontend", "demo-pool-a")}, "an untouched pool's Deployment changed"
    await wait_for(lambda: (the_cr(api)["status"].get("services", {}).get("pool-b") or {}).get("replicas") == 2,
                   T, message="status shows pool-b's new count")
    assert the_cr(api)["status"]["state"] == "pending"  # a scale-up is progress, not degradation

    # Removing a pool deletes its Deployment (and only it).
    patch_cr(api, {"spec": {"services": {"pool-b": None}}})
    await wait_for(lambda: "demo-pool-b" not in deployments(api), T, message="pool-b pruned")
    assert {"demo-frontend", "demo-pool-a"} <= set(deployments(api))
    await wait_for(lambda: "pool-b" not in the_cr(api)["status"].get("services", {}), T,
                   message="pool-b gone from status")

    # A bad spec (valid for the schema, refused by the renderer): failed with the message, nothing applied.
    versions = {name: d["metadata"]["resourceVersion"] for name, d in deployments(api).items()}
    patch_cr(api, {"spec": {"services": {"frontend": {"role": "prefill"}}}})
    await wait_for(lambda: state(api) == "failed", T, message="state failed")
    c = conditions(the_cr(api))
    assert c["Degraded"]["status"] == "True" and "spec.services.frontend.role" in c["Degraded"]["message"], c
    assert c["Ready"]["status"] == "False"
    assert {name: d["metadata"]["resourceVersion"] for name, d in deployments(api).items()} == versions
    assert operator.returncode is None, "the operator crashed on a bad spec"
    await wait_for(lambda: any(e.get("reason") == "InvalidSpec" and e["involvedObject"].get("uid") == uid
                               and e.get("type") == "Warning" for e in api.list("v1", "Event", NS)), T,
                   message="a Warning Event on the CR (kubectl describe shows it)")
    patch_cr(api, {"spec": {"services": {"frontend": {"role": None}}}})
    await wait_for(lambda: state(api) in ("pending", "ready"), T, message="recovery from the bad spec")

    # Deleting the CR removes everything it owned, and the operator recreates nothing.
    assert owned(api, uid)
    api.delete_object(crs, NS, "demo")
    assert owned(api, uid) == []
    api.create_object(crs, NS, cr("other"))  # the operator handles events in order: once this one
    await wait_for(lambda: state(api, "other") == "pending", T, message="the next CR reconciled")
    assert owned(api, uid) == [] and not any(n.startswith("demo-") for n in deployments(api))


async def test_all_namespaces_a_crd_installed_after_start_and_the_liveness_endpoint(bare_api: FakeKubeApi, tmp_path):
    """As installed (``--all-namespaces``, plus components/sim's ``--sim-engines``): the operator may
    start before the CRD is established (``kubectl apply -k`` sends both at once); it serves CRs in
    any namespace once the CRD appears, and renders a vLLM pool as the simulated engine."""
    api = bare_api
    port = free_port()
    async with run_operator(api, tmp_path, "--all-namespaces", "--sim-engines",
                            "--liveness", f"http://127.0.0.1:{port}/healthz"):
        def live() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as answer:
                    return answer.status == 200
            except OSError:
                return False
        await wait_for(lambda: asyncio.to_thread(live), T, message="the liveness endpoint")
        apply_crd(api)
        create_namespace(api, "team-b")
        crs = api.resource_type(API, KIND)
        api.create_object(crs, NS, cr())
        vllm = {**cr(), "metadata": {"name": "demo", "namespace": "team-b"}}
        vllm["spec"] = {**spec(), "backendFramework": "vllm"}
        for pool in ("pool-a", "pool-b"):
            vllm["spec"]["services"][pool]["args"] = ["--model", "sim-model"]
        api.create_object(crs, "team-b", vllm)
        for namespace in (NS, "team-b"):
            await wait_for(lambda: ((api.get(API, KIND, "demo", namespace) or {}).get("status") or {}).get("state")
                           == "pending", T, message=f"the CR in {namespace} reconciled")
            assert api.get("apps/v1", "Deployment", "demo-pool-a", namespace) is not None
        container = api.get("apps/v1", "Deployment", "demo-pool-a", "team-b")["spec"]["template"]["spec"]["containers"][0]
        assert container["command"][-1] == "infera.engine.sim", container["command"]


LWS_CRD = {  # the LeaderWorkerSet CRD, reduced to what the API server needs to serve the kind
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "leaderworkersets.leaderworkerset.x-k8s.io"},
    "spec": {"group": "leaderworkerset.x-k8s.io", "scope": "Namespaced",
             "names": {"plural": "leaderworkersets", "singular": "leaderworkerset", "kind": "LeaderWorkerSet"},
             "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                           "schema": {"openAPIV3Schema": {"type": "object",
                                                          "x-kubernetes-preserve-unknown-fields": True}}}]},
}


async def test_multi_node_pool_without_then_with_the_leaderworkerset_crd(api: FakeKubeApi, operator):
    """A multi-node pool is a LeaderWorkerSet: without its CRD the CR is failed with a message that
    says so (not a crash or a silent retry loop); once the CRD is installed the next resync applies
    it, and the LWS's readiness (ready groups) makes the CR ready."""
    wide = cr("wide")
    wide["spec"]["services"] = {"frontend": {"componentType": "server", "replicas": 1},
                                "wide": {"componentType": "worker", "numberOfNodes": 2, "replicas": 1}}
    api.create_object(api.resource_type(API, KIND), NS, wide)
    await wait_for(lambda: state(api, "wide") == "failed", T, message="failed without the LWS CRD")
    message = conditions(the_cr(api, "wide"))["Degraded"]["message"]
    assert "LeaderWorkerSet" in message and "CRD" in message, message

    api.create_object(api.resource_type("apiextensions.k8s.io/v1", "CustomResourceDefinition"), None, LWS_CRD)
    await wait_for(lambda: api.get("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "wide-wide", NS) is not None,
                   T, message="the LWS applied after its CRD appeared")
    await wait_for(lambda: state(api, "wide") == "pending", T, message="pending")
    uid = the_cr(api, "wide")["metadata"]["uid"]
    make_ready(api, uid)  # Deployments and the NATS StatefulSet
    api.patch_object(api.resource_type("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"), NS, "wide-wide",
                     "application/merge-patch+json", {"status": {"readyReplicas": 1, "replicas": 1}},
                     subresource="status")
    await wait_for(lambda: state(api, "wide") == "ready", T, message="ready with the LWS ready")
    assert the_cr(api, "wide")["status"]["services"]["wide"] == \
        {"kind": "LeaderWorkerSet", "replicas": 1, "readyReplicas": 1}


async def kustomize(directory) -> list[dict[str, Any]]:
    import yaml

    kubectl = os.path.join(os.path.dirname(sys.executable), "kubectl")
    proc = await asyncio.create_subprocess_exec(kubectl, "kustomize", str(directory), stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return [d for d in yaml.safe_load_all(out) if d]


async def test_install_manifests_build_validate_and_the_sim_component_adds_the_flag(tmp_path):
    import kubernetes_validate

    root = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "kubernetes")
    objects = await kustomize(root)
    assert {(o["kind"], o["metadata"]["name"]) for o in objects} == {
        ("CustomResourceDefinition", "inferadeployments.infera.amd.com"), ("Namespace", "infera-system"),
        ("ServiceAccount", "infera-operator"), ("ClusterRole", "infera-operator"),
        ("ClusterRoleBinding", "infera-operator"), ("Deployment", "infera-operator")}
    for obj in objects:
        kubernetes_validate.validate(obj, "1.37.0", strict=True)
    operator_pod = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    container = operator_pod["containers"][0]
    assert container["command"] + container["args"][:2] == ["python3", "-m", "infera.operator", "run", "--all-namespaces"]
    assert "--sim-engines" not in container["args"] and operator_pod["securityContext"]["runAsNonRoot"] is True
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"

    overlay = tmp_path / "sim"
    overlay.mkdir()
    relative = os.path.relpath(root, overlay)  # kustomize takes relative paths only
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{relative}]\ncomponents: [{relative}/components/sim]\n")
    simulated = next(o for o in await kustomize(overlay) if o["kind"] == "Deployment")
    assert simulated["spec"]["template"]["spec"]["containers"][0]["args"][-1] == "--sim-engines"
