"""The scaling API (infera/server/scaling.py, spec §9.3) against the fake API server
(tests/fakes/kube_api.py) with the real CRD (infera/operator/crd.py) applied: a real server process
with --enable-scaling-api and --admin-token, its Pod and its InferaDeployment.

GET answers the snapshot (with the blocked reason of a Pending Pod); POST takes decode from 2 to 3
with exactly one JSON merge patch of the CR; the admin token guards both; the flag off is a 404;
an RBAC 403 names the missing verb and resource; the CR gone is a 404, the API's 5xx a 502, the
API away or silent a 503 — and no answer carries the API server's address or token."""
from __future__ import annotations

import asyncio
import copy
import json
import os
import sys
from typing import Any, AsyncIterator

import aiohttp
import pytest

from infera.operator.crd import build_crd
from infera.server.scaling import DeploymentScaler
from tests.conftest import free_port, stop_process_group, wait_for
from tests.fakes.kube_api import FakeKubeApi

pytestmark = pytest.mark.integration

NS = "infera"
TOKEN = "scale-admin-token"
API_TOKEN = "kube-sa-token-do-not-leak"
IDEP = "demo"
API_VERSION = "infera.amd.com/v1alpha1"
CR_PATH = f"/apis/infera.amd.com/v1alpha1/namespaces/{NS}/inferadeployments/{IDEP}"
MERGE_PATCH = "application/merge-patch+json"


def labels(service: str, **extra: str) -> dict[str, str]:
    return {"infera.amd.com/deployment": IDEP, "infera.amd.com/service": service, **extra}


def demo_cr() -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION, "kind": "InferaDeployment",
        "metadata": {"name": IDEP, "namespace": NS},
        "spec": {"backendFramework": "sim", "services": {
            "frontend": {"componentType": "server", "replicas": 2},
            "prefill": {"componentType": "worker", "role": "prefill", "replicas": 2},
            "decode": {"componentType": "worker", "role": "decode", "replicas": 2},
        }},
    }


DEMO_STATUS = {"state": "pending", "services": {
    "frontend": {"kind": "Deployment", "replicas": 2, "readyReplicas": 2},
    "prefill": {"kind": "Deployment", "replicas": 2, "readyReplicas": 1},
    "decode": {"kind": "Deployment", "replicas": 2, "readyReplicas": 2},
}}


class Kube:
    """The fake API server with the CRD applied, and what these tests do to it."""

    def __init__(self, api: FakeKubeApi) -> None:
        self.api = api
        self.cr_patches: list[tuple[str, Any]] = []  # (content type, body) of every PATCH of the CR
        patch_object = api.patch_object

        def recording_patch(rtype, namespace, name, content_type, patch, **kw):
            if rtype.kind == "InferaDeployment" and kw.get("subresource") is None:
                self.cr_patches.append((content_type, copy.deepcopy(patch)))
            return patch_object(rtype, namespace, name, content_type, patch, **kw)

        api.patch_object = recording_patch  # the fake's PATCH handler calls it: every CR patch is seen here

    @property
    def crs(self):
        return self.api.resource_type(API_VERSION, "InferaDeployment")

    def create_cr(self) -> None:
        self.api.create_object(self.crs, NS, demo_cr())
        self.api.patch_object(self.crs, NS, IDEP, MERGE_PATCH, {"status": DEMO_STATUS}, subresource="status")

    def cr(self) -> dict[str, Any] | None:
        return self.api.get(API_VERSION, "InferaDeployment", IDEP, NS)

    def add_pod(self, name: str, pod_labels: dict[str, str], phase: str = "Running",
                conditions: list | None = None) -> None:
        self.api.add_pod(name, pod_labels, phase=phase, namespace=NS)
        if conditions:
            self.api.patch_object(self.api.resource_type("v1", "Pod"), NS, name, MERGE_PATCH,
                                  {"status": {"conditions": conditions}}, subresource="status")

    def gets_of(self, path: str) -> int:
        return sum(1 for method, path_qs, _ in self.api.access_log if method == "GET" and path_qs == path)


@pytest.fixture
async def kube() -> AsyncIterator[Kube]:
    api = await FakeKubeApi(namespace=NS, token=API_TOKEN).start()
    api.create_object(api.resource_type("apiextensions.k8s.io/v1", "CustomResourceDefinition"), None, build_crd())
    k = Kube(api)
    k.create_cr()
    k.add_pod("demo-frontend-0", labels("frontend", **{"infera.amd.com/component": "server"}))
    k.add_pod("demo-prefill-0", labels("prefill"))
    k.add_pod("demo-prefill-1", labels("prefill"), phase="Pending", conditions=[
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/2 nodes are available:\n2 Insufficient amd.com/gpu."}])
    k.add_pod("demo-decode-0", labels("decode"))
    k.add_pod("elsewhere-prefill-0", {"infera.amd.com/deployment": "other", "infera.amd.com/service": "prefill"},
              phase="Pending", conditions=[{"type": "PodScheduled", "status": "False", "reason": "Wrong",
                                            "message": "another deployment's Pod"}])
    yield k
    await api.stop()


class Server:
    def __init__(self, proc: asyncio.subprocess.Process, port: int, log_path) -> None:
        self.proc, self.log_path = proc, log_path
        self.base = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
async def start_server(kube: Kube, tmp_path):
    servers: list[Server] = []

    async def factory(*flags: str, pod_name: str = "demo-frontend-0") -> Server:
        port = free_port()
        log_path = tmp_path / f"server-{port}.log"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("INFERA_", "KUBERNETES_", "POD_")) and k != "NATS_SERVER"}
        env.update(KUBECONFIG=kube.api.write_kubeconfig(tmp_path / "kubeconfig"), POD_NAME=pod_name,
                   POD_NAMESPACE=NS, INFERA_ADMIN_TOKEN=TOKEN)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "infera.server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            "--discovery-backend", "kubernetes", "--request-transport", "http", "--kv-event-transport", "zmq",
            "--router-policy", "round-robin",
            "--k8s-label-selector", f"infera.amd.com/deployment={IDEP},infera.amd.com/component=worker", *flags,
            stdout=open(log_path, "wb"), stderr=asyncio.subprocess.STDOUT, start_new_session=True, env=env)
        server = Server(proc, port, log_path)
        servers.append(server)

        async def ready() -> bool:
            assert proc.returncode is None, server.log()
            try:
                async with aiohttp.ClientSession() as s, s.get(server.base + "/health",
                                                               timeout=aiohttp.ClientTimeout(total=3)) as r:
                    return r.status == 200
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                return False

        await wait_for(ready, 60, interval=0.1, message="the server answers /health")
        return server

    yield factory
    for server in servers:
        await stop_process_group(server.proc, 20)


ADMIN = {"Authorization": f"Bearer {TOKEN}"}


async def call(server: Server, method: str, payload: Any = None, headers: dict | None = ADMIN,
               raw: bytes | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        data = raw if raw is not None else (json.dumps(payload).encode() if payload is not None else None)
        async with s.request(method, server.base + "/v1/admin/scale", data=data, headers=headers or {},
                             timeout=aiohttp.ClientTimeout(total=30)) as r:
            return r.status, await r.json()


def assert_no_leak(kube: Kube, payload: dict) -> None:
    text = json.dumps(payload)
    assert API_TOKEN not in text and str(kube.api.port) not in text and "127.0.0.1" not in text, text


def decode_patch(n: int) -> tuple[str, dict]:
    return (MERGE_PATCH, {"spec": {"services": {"decode": {"replicas": n}}}})


async def test_snapshot_scale_and_mapped_errors(kube: Kube, start_server):
    server = await start_server("--enable-scaling-api")

    # The admin token guards both methods.
    for headers in (None, {"Authorization": "Bearer wrong"}):
        for method in ("GET", "POST"):
            status, body = await call(server, method, {"services": {"decode": 3}}, headers=headers)
            assert status == 401 and body["error"]["code"] == "invalid_admin_token"
    assert kube.cr_patches == []

    # GET: the snapshot; prefill is short one ready replica and tells why (its own Pending Pod, not
    # the other deployment's).
    status, snap = await call(server, "GET")
    assert status == 200, snap
    assert snap == {"deployment": IDEP, "namespace": NS, "state": "pending", "services": {
        "frontend": {"role": "mixed", "replicas": 2, "current_replicas": 2, "ready_replicas": 2,
                     "nodes_per_replica": 1},
        "prefill": {"role": "prefill", "replicas": 2, "current_replicas": 2, "ready_replicas": 1,
                    "nodes_per_replica": 1,
                    "blocked": "Unschedulable: 0/2 nodes are available: 2 Insufficient amd.com/gpu."},
        "decode": {"role": "decode", "replicas": 2, "current_replicas": 2, "ready_replicas": 2,
                   "nodes_per_replica": 1}}}

    # POST: decode 2 → 3 with exactly one merge patch of the CR, nothing else in it.
    before = kube.cr()
    status, snap = await call(server, "POST", {"services": {"decode": 3}})
    assert status == 200, snap
    assert snap["services"]["decode"]["replicas"] == 3 and snap["services"]["decode"]["current_replicas"] == 2
    assert kube.cr_patches == [decode_patch(3)]
    assert [m for m, p, _ in kube.api.access_log if p.startswith(CR_PATH) and m != "GET"] == ["PATCH"]
    after = kube.cr()
    expected = copy.deepcopy(before["spec"])
    expected["services"]["decode"]["replicas"] = 3
    assert after["spec"] == expected and after["status"] == before["status"]
    assert after["metadata"]["generation"] == before["metadata"]["generation"] + 1

    # Refused before any patch: bad values, unknown names (listing the real ones), scale to zero.
    for payload, words in [({"services": {"decode": True}}, "integer"), ({"services": {"decode": 0}}, "zero"),
                           ({"services": {"decode": {"replicas": 2, "x": 1}}}, "only"),
                           ({"services": {"decoder": 2}}, "decode, frontend, prefill"), ({"services": {}}, "empty")]:
        status, body = await call(server, "POST", payload)
        assert status == 400 and words in body["error"]["message"], (payload, body)
        assert set(body["error"]) >= {"message", "type", "code"}
    status, body = await call(server, "POST", raw=b"[1, 2")
    assert status == 400 and body["error"]["code"] == "invalid_json"
    # A body over several reads is read whole (its last bytes decide); past 64 KiB it is a 413.
    status, body = await call(server, "POST", raw=b'{"services": {"decode": ' + b" " * 40_000 + b"0}}")
    assert status == 400 and "zero" in body["error"]["message"], body
    status, body = await call(server, "POST", raw=b'{"services": {"decode": ' + b" " * 70_000 + b"3}}")
    assert status == 413, body

    async def chunked():  # no Content-Length: refused as it streams in
        for _ in range(10):
            yield b" " * 10_000

    async with aiohttp.ClientSession() as s:
        async with s.post(server.base + "/v1/admin/scale", data=chunked(), headers=ADMIN) as r:
            assert r.status == 413
    assert len(kube.cr_patches) == 1

    # Several services in one patch, the server's own service among them (it is a service too).
    status, snap = await call(server, "POST", {"services": {"frontend": 3, "prefill": {"replicas": 1}}})
    assert status == 200 and snap["services"]["frontend"]["replicas"] == 3, snap
    assert snap["services"]["prefill"]["replicas"] == 1 and "blocked" not in snap["services"]["prefill"]
    assert kube.cr_patches[1:] == [(MERGE_PATCH, {"spec": {"services": {"frontend": {"replicas": 3},
                                                                        "prefill": {"replicas": 1}}}})]

    # RBAC: the patch is forbidden → 403 naming the verb and the resource, nothing leaked, nothing changed.
    kube.api.fail_next(403, kind="patch")
    status, body = await call(server, "POST", {"services": {"decode": 4}})
    assert status == 403 and body["error"]["code"] == "kubernetes_forbidden", body
    assert "'patch'" in body["error"]["message"] and "inferadeployments.infera.amd.com" in body["error"]["message"]
    assert_no_leak(kube, body)
    kube.api.fail_next(403, kind="get")  # the Pod's label is cached: this is the CR's read
    status, body = await call(server, "GET")
    assert status == 403 and "'get'" in body["error"]["message"], body
    assert kube.cr()["spec"]["services"]["decode"]["replicas"] == 3

    # The API's own 5xx → 502.
    kube.api.fail_next(500, kind="patch")
    status, body = await call(server, "POST", {"services": {"decode": 4}})
    assert status == 502 and body["error"]["code"] == "kubernetes_error", body
    assert_no_leak(kube, body)
    assert kube.cr()["spec"]["services"]["decode"]["replicas"] == 3

    # The CR gone → 404.
    kube.api.delete_object(kube.crs, NS, IDEP)
    for method in ("GET", "POST"):
        status, body = await call(server, method, {"services": {"decode": 4}})
        assert status == 404 and body["error"]["code"] == "deployment_not_found", body
    kube.create_cr()

    # The API away → 503, without its address; back → served again (the deployment name was cached).
    await kube.api.stop()
    status, body = await call(server, "GET")
    assert status == 503 and body["error"]["code"] == "kubernetes_unavailable", body
    assert_no_leak(kube, body)
    await kube.api.start()
    status, snap = await call(server, "GET")
    assert status == 200 and snap["services"]["decode"]["replicas"] == 2  # the re-created CR
    assert kube.gets_of(f"/api/v1/namespaces/{NS}/pods/demo-frontend-0") == 1
    assert API_TOKEN not in server.log()


async def test_flag_off_is_404_after_the_token_check(kube: Kube, start_server):
    server = await start_server()
    status, body = await call(server, "GET", headers=None)
    assert status == 401
    for method in ("GET", "POST"):
        status, body = await call(server, method, {"services": {"decode": 3}})
        assert status == 404 and body["error"]["code"] == "scaling_disabled", body
        assert "--enable-scaling-api" in body["error"]["message"]
    assert not any(p.startswith(CR_PATH) for _, p, _ in kube.api.access_log)
    assert kube.cr()["spec"]["services"]["decode"]["replicas"] == 2


async def test_flag_without_admin_token_refuses_to_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERA_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infera.server", "--enable-scaling-api", "--discovery-backend", "etcd",
        "--etcd-endpoint", "127.0.0.1:1", stderr=asyncio.subprocess.PIPE, env=env)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and b"needs --admin-token" in err


# -- DeploymentScaler in-process: finding the deployment, timeouts, no config ----------------------

def scaler_for(url: str, tmp_path, pod_name: str | None, timeout: float = 5.0) -> DeploymentScaler:
    from lightkube import KubeConfig

    config = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
              "clusters": [{"name": "c", "cluster": {"server": url}}],
              "users": [{"name": "u", "user": {"token": API_TOKEN}}],
              "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": NS}}]}
    return DeploymentScaler(NS, pod_name, config=KubeConfig.from_dict(config), request_timeout=timeout)


async def test_no_pod_name_is_503_and_an_unlabelled_pod_409(kube: Kube, tmp_path):
    from infera.api.errors import ApiError

    kube.add_pod("loose", {"app": "hand-made"})
    for pod_name, status, code in [(None, 503, "pod_name_unknown"), ("loose", 409, "not_an_infera_deployment"),
                                   ("missing", 503, "pod_not_found")]:
        scaler = scaler_for(kube.api.url, tmp_path, pod_name)
        try:
            with pytest.raises(ApiError) as caught:
                await scaler.snapshot()
            assert (caught.value.status, caught.value.code) == (status, code)
            assert scaler.deployment is None
        finally:
            await scaler.close()
    assert not any(p.startswith(CR_PATH) for _, p, _ in kube.api.access_log)


async def test_a_silent_api_is_503_within_the_timeout(tmp_path):
    """An API server that accepts and never answers (a half-open path, a wedged proxy)."""
    from infera.api.errors import ApiError

    held: list[asyncio.StreamWriter] = []

    async def accept_and_say_nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    silent = await asyncio.start_server(accept_and_say_nothing, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    scaler = scaler_for(f"http://127.0.0.1:{port}", tmp_path, "demo-frontend-0", timeout=0.5)
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        with pytest.raises(ApiError) as caught:
            await scaler.scale({"decode": 3})
        assert caught.value.status == 503 and caught.value.code == "kubernetes_unavailable"
        assert loop.time() - started < 3.0 and held  # it connected, then gave up at the bound
        assert str(port) not in caught.value.message
    finally:
        await scaler.close()
        for writer in held:
            writer.close()
        silent.close()
        await silent.wait_closed()


async def test_no_kubernetes_config_is_503(tmp_path, monkeypatch):
    from infera.api.errors import ApiError

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not "inside a Pod" even when CI runs in one
    scaler = DeploymentScaler(NS, "demo-frontend-0")
    try:
        with pytest.raises(ApiError) as caught:
            await scaler.scale({"decode": 3})
        assert (caught.value.status, caught.value.code) == (503, "kubernetes_unavailable")
        assert "no Kubernetes API configuration" in caught.value.message
    finally:
        await scaler.close()
