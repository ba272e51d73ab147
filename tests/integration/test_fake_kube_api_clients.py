"""Real clients against the fake Kubernetes API server: kubectl 1.37 (apply -k, apply -f, get,
patch, scale, delete), a minimal kopf operator, and plain HTTP for the documents and semantics
both rely on (discovery, watches of any kind, Status errors, graceful deletion)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, AsyncIterator

import aiohttp
import kopf
import pytest
import yaml

from tests.conftest import wait_for
from tests.fakes.kube_api import FakeKubeApi

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kube"


def find_kubectl() -> str:
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if not found:
        pytest.fail("kubectl is not installed next to the interpreter nor on PATH (the dev dependencies pin one)")
    return found


@pytest.fixture
async def fake_api() -> AsyncIterator[FakeKubeApi]:
    # kubectl (client-go) sends no bearer token over plain http, so this fake asks for none.
    api = await FakeKubeApi(token=None, namespace="demo").start()
    try:
        yield api
    finally:
        await api.stop()


class Kubectl:
    def __init__(self, api: FakeKubeApi, kubeconfig: str) -> None:
        self.binary = find_kubectl()
        self.api = api
        self.env = {**os.environ, "KUBECONFIG": kubeconfig, "HOME": str(Path(kubeconfig).parent)}

    async def __call__(self, *args: str, check: bool = True) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(self.binary, *args, env=self.env, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), 60)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        result = (proc.returncode, out.decode(), err.decode())
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {result}")
        return result

    async def json(self, *args: str) -> dict[str, Any]:
        return json.loads((await self(*args, "-o", "json"))[1])


@pytest.fixture
def kubectl(fake_api: FakeKubeApi, tmp_path: Path) -> Kubectl:
    return Kubectl(fake_api, fake_api.write_kubeconfig(tmp_path / "kubeconfig", namespace="demo"))


def applied(stdout: str) -> dict[str, str]:
    """kubectl apply's "kind/name verb" lines as {kind/name: verb}."""
    return dict(line.rsplit(" ", 1) for line in stdout.splitlines() if line.strip())


async def test_kubectl_apply_kustomization_twice_then_unchanged(fake_api: FakeKubeApi, kubectl: Kubectl) -> None:
    app = str(FIXTURES / "app")
    rc, out, err = await kubectl("apply", "-k", app, check=False)
    # As on a real cluster, kubectl maps every object before applying any: the Widget's kind is
    # unknown until its CRD, created by this same apply, is served. The rest is applied.
    assert rc == 1 and 'no matches for kind "Widget"' in err and "ensure CRDs are installed first" in err, err
    assert applied(out) == {"namespace/demo": "created",
                            "customresourcedefinition.apiextensions.k8s.io/widgets.example.infera.dev": "created",
                            "configmap/settings": "created", "deployment.apps/web": "created"}
    _, out, _ = await kubectl("apply", "-k", app)
    assert applied(out)["widget.example.infera.dev/demo"] == "created"
    assert set(applied(out).values()) == {"created", "unchanged"}
    mark = fake_api.rv
    _, out, _ = await kubectl("apply", "-k", app)
    assert set(applied(out).values()) == {"unchanged"} and len(applied(out)) == 5
    assert fake_api.rv == mark  # nothing was written
    widget = await kubectl.json("get", "widget", "demo")
    assert widget["spec"] == {"size": "small", "replicas": 1, "services": {"api": {"replicas": 2, "port": "http"}}}
    assert (await kubectl.json("get", "wdg", "demo"))["metadata"]["uid"] == widget["metadata"]["uid"]  # short name
    deployment = await kubectl.json("get", "deployment", "web")
    assert deployment["spec"]["replicas"] == 2 and deployment["metadata"]["generation"] == 1
    # kubectl get prints the server's Table: the CRD's printer columns, kubectl's own for a Deployment.
    widgets = fake_api.resource_type("example.infera.dev/v1", "Widget")
    fake_api.patch_object(widgets, "demo", "demo", "application/merge-patch+json", {"status": {
        "phase": "Running", "conditions": [{"type": "Progressing", "status": "False"},
                                           {"type": "Ready", "status": "True"}]}}, subresource="status")
    _, out, _ = await kubectl("get", "widgets")
    header, row = [line.split() for line in out.splitlines()][:2]
    assert header == ["NAME", "SIZE", "REPLICAS", "PHASE", "READY", "AGE"]
    assert row[:5] == ["demo", "small", "1", "Running", "True"] and re.fullmatch(r"\d+s", row[5])
    _, out, _ = await kubectl("get", "deployments", "-A")
    assert out.split("\n")[0].split() == ["NAMESPACE", "NAME", "READY", "UP-TO-DATE", "AVAILABLE", "AGE"]
    assert out.split("\n")[1].split()[:3] == ["demo", "web", "0/2"]


async def test_kubectl_refuses_a_typo_and_an_invalid_value_naming_the_field(fake_api: FakeKubeApi, kubectl: Kubectl,
                                                                             tmp_path: Path) -> None:
    await kubectl("apply", "-f", str(FIXTURES / "app" / "namespace.yaml"), "-f", str(FIXTURES / "app" / "crd.yaml"))
    rc, _, err = await kubectl("apply", "-f", str(FIXTURES / "widget-typo.yaml"), check=False)
    assert rc == 1 and 'strict decoding error: unknown field "spec.services.x.replica"' in err, err
    rc, _, err = await kubectl("apply", "-f", str(FIXTURES / "widget-invalid.yaml"), check=False)
    assert rc == 1, err
    assert 'spec.size: Unsupported value: "huge": supported values: "small", "large"' in err
    assert 'spec.replicas: Invalid value: "string": spec.replicas in body must be of type integer' in err
    assert fake_api.list("example.infera.dev/v1", "Widget") == []
    deployment = (FIXTURES / "app" / "deployment.yaml").read_text()
    typo = tmp_path / "deployment.yaml"
    typo.write_text(deployment.replace("image: infera:test", "image: infera:test\n          imagePullPolicyy: Always"))
    rc, _, err = await kubectl("apply", "-n", "demo", "-f", str(typo), check=False)
    assert rc == 1 and 'unknown field "spec.template.spec.containers[0].imagePullPolicyy"' in err, err
    assert fake_api.list("apps/v1", "Deployment") == []


async def test_kubectl_changes_scales_patches_and_deletes(fake_api: FakeKubeApi, kubectl: Kubectl,
                                                          tmp_path: Path) -> None:
    app = FIXTURES / "app"
    for name in ("namespace.yaml", "crd.yaml"):
        await kubectl("apply", "-f", str(app / name))
    await kubectl("apply", "-k", str(app))
    # A changed env value: client-side apply sends a strategic merge patch; the container keeps its ports.
    changed = tmp_path / "deployment.yaml"
    changed.write_text((app / "deployment.yaml").read_text().replace("value: test", "value: prod"))
    _, out, _ = await kubectl("apply", "-n", "demo", "-f", str(changed))
    assert applied(out) == {"deployment.apps/web": "configured"}
    deployment = await kubectl.json("get", "deployment", "web")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["env"] == [{"name": "MODE", "value": "prod"}] and container["ports"][0]["containerPort"] == 8080
    assert deployment["metadata"]["generation"] == 2
    await kubectl("scale", "deployment", "web", "--replicas=5")
    assert fake_api.get("apps/v1", "Deployment", "web", "demo")["spec"]["replicas"] == 5
    await kubectl("scale", "widget", "demo", "--replicas=3")
    assert fake_api.get("example.infera.dev/v1", "Widget", "demo", "demo")["spec"]["replicas"] == 3
    await kubectl("patch", "widget", "demo", "--type", "merge", "-p", '{"spec":{"size":"large"}}')
    widget = fake_api.get("example.infera.dev/v1", "Widget", "demo", "demo")
    assert widget["spec"]["size"] == "large" and widget["metadata"]["generation"] == 3
    rc, _, err = await kubectl("patch", "widget", "demo", "--type", "merge", "-p", '{"spec":{"size":"tiny"}}',
                               check=False)
    assert rc == 1 and 'spec.size: Unsupported value: "tiny"' in err
    _, out, _ = await kubectl("delete", "widget", "demo")
    assert 'widget.example.infera.dev "demo" deleted' in out
    await kubectl("delete", "-k", str(app), "--ignore-not-found")
    assert fake_api.list("apps/v1", "Deployment") == [] and fake_api.list("v1", "ConfigMap") == []
    _, out, _ = await kubectl("get", "crd", "-o", "name")
    assert out.strip() == ""
    rc, _, err = await kubectl("get", "widgets", check=False)
    assert rc == 1 and "widgets" in err  # the kind is no longer served


async def test_minimal_kopf_operator_writes_status_through_the_subresource() -> None:
    api = await FakeKubeApi(namespace="demo").start()
    crds = api.resource_type("apiextensions.k8s.io/v1", "CustomResourceDefinition")
    api.create_object(crds, None, yaml.safe_load((FIXTURES / "app" / "crd.yaml").read_text()))
    api.create_object(api.resource_type("v1", "Namespace"), None, {"metadata": {"name": "demo"}})
    registry = kopf.OperatorRegistry()
    handled: list[str] = []

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=api.url, token=api.token, insecure=True)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.level = logging.ERROR
        settings.watching.server_timeout = 30

    @kopf.on.create("example.infera.dev", "v1", "widgets", registry=registry)
    @kopf.on.update("example.infera.dev", "v1", "widgets", registry=registry)
    def reconcile(spec: kopf.Spec, name: str, patch: kopf.Patch, **_: Any) -> None:
        handled.append(name)
        patch.status["phase"] = f"ready-{spec['size']}"
        patch.status["replicas"] = spec["replicas"]

    widgets = api.resource_type("example.infera.dev/v1", "Widget")
    stop = asyncio.Event()
    operator = asyncio.create_task(kopf.operator(registry=registry, standalone=True, namespaces=["demo"],
                                                 stop_flag=stop))
    try:
        api.create_object(widgets, "demo", {"metadata": {"name": "w"}, "spec": {"size": "small"}})

        def phase() -> str | None:
            return (api.get("example.infera.dev/v1", "Widget", "w", "demo").get("status") or {}).get("phase")

        await wait_for(lambda: phase() == "ready-small", 30)
        widget = api.get("example.infera.dev/v1", "Widget", "w", "demo")
        assert widget["status"]["replicas"] == 1  # the schema's default reached the handler
        assert widget["metadata"]["generation"] == 1  # status and annotations move no generation
        assert any(method == "PATCH" and path.endswith("/widgets/w/status") for method, path, _ in api.access_log)
        api.patch_object(widgets, "demo", "w", "application/merge-patch+json", {"spec": {"size": "large"}})
        await wait_for(lambda: phase() == "ready-large", 30)
        assert handled == ["w", "w"]
    finally:
        stop.set()
        await asyncio.wait_for(operator, 30)
        await wait_for(lambda: api.open_watches == 0, 10)
        await api.stop()


async def test_http_discovery_watch_errors_and_graceful_delete() -> None:
    api = await FakeKubeApi(namespace="demo").start()
    headers = {"Authorization": f"Bearer {api.token}"}
    try:
        async with aiohttp.ClientSession(api.url, headers=headers) as http:
            async with http.get("/apis/apps/v1") as resp:
                names = {r["name"]: r for r in (await resp.json())["resources"]}
            assert {"deployments", "deployments/status", "deployments/scale"} <= names.keys()
            assert names["deployments"]["shortNames"] == ["deploy"] and names["deployments"]["namespaced"]
            async with http.get("/apis") as resp:
                assert "example.infera.dev" not in {g["name"] for g in (await resp.json())["groups"]}
            crd = yaml.safe_load((FIXTURES / "leaderworkerset-crd.yaml").read_text())
            async with http.post("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", json=crd) as resp:
                assert resp.status == 201
            async with http.get("/apis/leaderworkerset.x-k8s.io/v1") as resp:
                names = {r["name"] for r in (await resp.json())["resources"]}
            assert names == {"leaderworkersets", "leaderworkersets/status", "leaderworkersets/scale"}
            lws_watch = await http.get("/apis/leaderworkerset.x-k8s.io/v1/leaderworkersets", params={"watch": "1"})
            lws = {"metadata": {"name": "group"}, "spec": {"leaderWorkerTemplate": {"size": 2, "x": 1}}}
            async with http.post("/apis/leaderworkerset.x-k8s.io/v1/namespaces/demo/leaderworkersets",
                                 json=lws) as resp:
                spec = (await resp.json())["spec"]
            assert spec == {"replicas": 1, "startupPolicy": "LeaderCreated",
                            "leaderWorkerTemplate": {"size": 2, "x": 1}}  # defaults; unknown fields preserved
            async with http.delete("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                                   "leaderworkersets.leaderworkerset.x-k8s.io") as resp:
                assert resp.status == 200
            lines = [json.loads(line) async for line in lws_watch.content]  # the stream ends with the kind
            assert [(e["type"], e["object"]["metadata"]["name"]) for e in lines] == [("ADDED", "group"),
                                                                                     ("DELETED", "group")]
            lws_watch.close()
            async with http.get("/apis/leaderworkerset.x-k8s.io/v1") as resp:
                assert resp.status == 404

            # A watch of Deployments across namespaces, by label.
            watch = await http.get("/apis/apps/v1/deployments", params={"watch": "true", "labelSelector": "app=x"})
            body = {"metadata": {"name": "d", "labels": {"app": "x"}}, "spec": {"replicas": 1}}
            async with http.post("/apis/apps/v1/namespaces/demo/deployments", json=body) as resp:
                created = await resp.json()
            async with http.post("/apis/apps/v1/namespaces/demo/deployments", json=body) as resp:
                assert resp.status == 409 and (await resp.json())["reason"] == "AlreadyExists"
            async with http.patch("/apis/apps/v1/namespaces/demo/deployments/d/scale", data='{"spec":{"replicas":4}}',
                                  headers={"Content-Type": "application/merge-patch+json"}) as resp:
                assert (await resp.json())["spec"]["replicas"] == 4
            stale = {**created, "spec": {"replicas": 9}}
            async with http.put("/apis/apps/v1/namespaces/demo/deployments/d", json=stale) as resp:
                assert resp.status == 409 and (await resp.json())["reason"] == "Conflict"
            async with http.patch("/apis/apps/v1/namespaces/demo/deployments/d", data="{}",
                                  headers={"Content-Type": "text/plain"}) as resp:
                assert resp.status == 415
            async with http.delete("/apis/apps/v1/namespaces/demo/deployments/d") as resp:
                assert resp.status == 200
            async with http.get("/apis/apps/v1/namespaces/demo/deployments/d") as resp:
                status = await resp.json()
                assert resp.status == 404 and status["message"] == 'deployments.apps "d" not found'
            seen = []
            while len(seen) < 3:
                event = json.loads(await asyncio.wait_for(watch.content.readline(), 10))
                seen.append((event["type"], event["object"]["spec"]["replicas"]))
            assert seen == [("ADDED", 1), ("MODIFIED", 4), ("DELETED", 4)]

            # Binding, then graceful deletion of the bound Pod over HTTP, then the kubelet's grace-0 delete.
            pod = {"metadata": {"name": "p"}, "spec": {"terminationGracePeriodSeconds": 7}}
            async with http.post("/api/v1/namespaces/demo/pods", json=pod) as resp:
                assert resp.status == 201 and (await resp.json())["status"] == {"phase": "Pending"}
            binding = {"kind": "Binding", "metadata": {"name": "p"}, "target": {"kind": "Node", "name": "local"}}
            async with http.post("/api/v1/namespaces/demo/pods/p/binding", json=binding) as resp:
                assert resp.status == 201
            async with http.post("/api/v1/namespaces/demo/pods/p/binding", json=binding) as resp:
                assert resp.status == 409
            assert api.get_pod("p")["spec"]["nodeName"] == "local"
            async with http.delete("/api/v1/namespaces/demo/pods/p", json={"kind": "DeleteOptions"}) as resp:
                assert (await resp.json())["metadata"]["deletionGracePeriodSeconds"] == 7
            assert api.get_pod("p") is not None
            async with http.delete("/api/v1/namespaces/demo/pods/p", params={"gracePeriodSeconds": "0"}) as resp:
                assert resp.status == 200
            assert api.get_pod("p") is None

            # deletecollection by label; a watch-list (sendInitialEvents) ends its initial state with
            # an annotated BOOKMARK; a field a kind does not index is 400; protobuf bodies are 415.
            for name, tier in (("a", "x"), ("b", "x"), ("c", "y")):
                cm = {"metadata": {"name": name, "labels": {"tier": tier}}}
                async with http.post("/api/v1/namespaces/demo/configmaps", json=cm) as resp:
                    assert resp.status == 201
            async with http.delete("/api/v1/namespaces/demo/configmaps", params={"labelSelector": "tier=x"}) as resp:
                assert sorted(o["metadata"]["name"] for o in (await resp.json())["items"]) == ["a", "b"]
            async with http.get("/api/v1/configmaps", params={"watch": "true", "sendInitialEvents": "true",
                                                              "resourceVersionMatch": "NotOlderThan"}) as listing:
                first = json.loads(await asyncio.wait_for(listing.content.readline(), 10))
                end = json.loads(await asyncio.wait_for(listing.content.readline(), 10))
            assert (first["type"], first["object"]["metadata"]["name"]) == ("ADDED", "c")
            assert end["type"] == "BOOKMARK"
            assert end["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
            async with http.get("/api/v1/configmaps", params={"fieldSelector": "spec.nodeName=x"}) as resp:
                message = (await resp.json())["message"]
                assert resp.status == 400 and message == "field label not supported: spec.nodeName"
            async with http.post("/api/v1/namespaces/demo/configmaps", data=b"k8s\x00\x0a",
                                 headers={"Content-Type": "application/vnd.kubernetes.protobuf"}) as resp:
                assert resp.status == 415

            # An injected 403 reads as an RBAC denial.
            api.fail_next(403, kind="patch")
            async with http.patch("/apis/apps/v1/namespaces/demo/deployments/x/scale", data="{}",
                                  headers={"Content-Type": "application/merge-patch+json"}) as resp:
                denial = await resp.json()
            assert resp.status == 403 and denial["reason"] == "Forbidden"
            assert denial["message"] == ('deployments.apps "x" is forbidden: User "system:serviceaccount:demo:default" '
                                         'cannot patch resource "deployments/scale" in API group "apps" in the '
                                         'namespace "demo"')

            # Every watch ends when the server stops.
            assert api.open_watches == 1
            await api.stop()
            with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionError)):
                while await asyncio.wait_for(watch.content.readline(), 10):
                    pass
                raise ConnectionError("the stream ended")
            assert api.open_watches == 0
            watch.close()
    finally:
        await api.stop()
