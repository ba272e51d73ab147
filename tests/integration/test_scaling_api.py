"""The scaling API (infera/server/scaling.py, spec §9.3) against an API server on loopback: a real
server process with --enable-scaling-api and --admin-token, its Pod and its InferaDeployment.

GET answers the snapshot (with the blocked reason of a Pending Pod); POST takes decode from 2 to 3
with exactly one JSON merge patch of the CR; the admin token guards both; the flag off is a 404;
an RBAC 403 names the missing verb and resource; the CR gone is a 404, the API's 5xx a 502, the
API away a 503 — and no answer carries the API server's address or token.

The API server here is ``CrApiStub`` below: the shared fake (tests/fakes/kube_api.py) serves Pods
only until it learns CRDs; the stub serves just what these tests need (Pods: get, list with a label
selector, an idle watch for discovery; the CR: get and merge patch)."""
from __future__ import annotations

import asyncio
import copy
import json
import os
import sys
from typing import Any, AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from infera.server.scaling import DeploymentScaler
from tests.conftest import free_port, stop_process_group, wait_for
from tests.fakes.kube_api import merge_patch, parse_selector, selector_matches

pytestmark = pytest.mark.integration

NS = "infera"
TOKEN = "scale-admin-token"
API_TOKEN = "kube-sa-token-do-not-leak"
IDEP = "demo"
CR_PATH = f"/apis/infera.amd.com/v1alpha1/namespaces/{NS}/inferadeployments/{IDEP}"
MERGE_PATCH = "application/merge-patch+json"


def labels(service: str | None = None, **extra: str) -> dict[str, str]:
    out = {"infera.amd.com/deployment": IDEP, **extra}
    if service:
        out["infera.amd.com/service"] = service
    return out


def demo_cr() -> dict[str, Any]:
    return {
        "apiVersion": "infera.amd.com/v1alpha1", "kind": "InferaDeployment",
        "metadata": {"name": IDEP, "namespace": NS, "resourceVersion": "1", "generation": 1},
        "spec": {"backendFramework": "sim", "services": {
            "frontend": {"componentType": "server", "replicas": 2},
            "prefill": {"componentType": "worker", "role": "prefill", "replicas": 2},
            "decode": {"componentType": "worker", "role": "decode", "replicas": 2},
        }},
        "status": {"state": "pending", "services": {
            "frontend": {"kind": "Deployment", "replicas": 2, "readyReplicas": 2},
            "prefill": {"kind": "Deployment", "replicas": 2, "readyReplicas": 1},
            "decode": {"kind": "Deployment", "replicas": 2, "readyReplicas": 2},
        }},
    }


def pod(name: str, pod_labels: dict[str, str], phase: str = "Running", conditions: list | None = None,
        created: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": pod_labels, "creationTimestamp": created,
                         "resourceVersion": "1"},
            "status": {"phase": phase, "conditions": conditions or []}}


class CrApiStub:
    """Pods and InferaDeployments in memory; Bearer token required; ``fail_next`` answers the next
    request of a kind with an error Status; ``request_log`` holds (method, path, content type, body)."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.crs: dict[str, dict[str, Any]] = {}
        self.request_log: list[tuple[str, str, str, Any]] = []
        self._failures: list[tuple[int, str]] = []  # (status, "get-cr" | "patch-cr" | "get-pod" | "list-pods")
        self._hang: set[str] = set()
        self._closing = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path) -> str:
        config = {"apiVersion": "v1", "kind": "Config", "current-context": "stub",
                  "clusters": [{"name": "stub", "cluster": {"server": self.url}}],
                  "users": [{"name": "sa", "user": {"token": API_TOKEN}}],
                  "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "sa", "namespace": NS}}]}
        with open(path, "w") as f:
            json.dump(config, f)
        return str(path)

    def fail_next(self, status: int, kind: str) -> None:
        self._failures.append((status, kind))

    def hang(self, kind: str) -> None:
        self._hang.add(kind)

    def patches(self) -> list[tuple[str, str, Any]]:
        return [(path, ctype, body) for method, path, ctype, body in self.request_log if method == "PATCH"]

    async def start(self, port: int | None = None) -> "CrApiStub":
        self._closing = asyncio.Event()
        app = web.Application(middlewares=[self._middleware])
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._list_pods)
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}", self._get_pod)
        base = "/apis/infera.amd.com/v1alpha1/namespaces/{ns}/inferadeployments/{name}"
        app.router.add_get(base, self._get_cr)
        app.router.add_patch(base, self._patch_cr)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port or self.port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self._closing.set()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    @staticmethod
    def _status(code: int, reason: str, message: str) -> web.Response:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
                "reason": reason, "code": code}
        return web.json_response(body, status=code)

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        self.request_log.append((request.method, request.path, request.content_type, body))
        if request.headers.get("Authorization") != f"Bearer {API_TOKEN}":
            return self._status(401, "Unauthorized", "Unauthorized")
        cr = "/apis/" in request.path
        kind = {("GET", True): "get-cr", ("PATCH", True): "patch-cr",
                ("GET", False): "get-pod" if "name" in request.match_info else "list-pods"}.get((request.method, cr))
        if kind in self._hang:
            await self._closing.wait()
        for i, (status, only) in enumerate(self._failures):
            if only == kind:
                del self._failures[i]
                reason = {403: "Forbidden", 404: "NotFound"}.get(status, "InternalError")
                message = (f'inferadeployments.infera.amd.com "{IDEP}" is forbidden: User "system:serviceaccount:'
                           f'{NS}:demo-infera" cannot patch resource' if status == 403 else f"injected {status}")
                return self._status(status, reason, message)
        return await handler(request)

    async def _list_pods(self, request: web.Request) -> web.StreamResponse:
        selector = parse_selector(request.query.get("labelSelector"))
        if request.query.get("watch") in ("true", "1"):  # discovery's watch: open, quiet, closed on stop
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await self._closing.wait()
            return resp
        items = [copy.deepcopy(p) for _, p in sorted(self.pods.items())
                 if selector_matches(selector, p["metadata"].get("labels"))]
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                                  "items": items})

    async def _get_pod(self, request: web.Request) -> web.Response:
        found = self.pods.get(request.match_info["name"])
        return web.json_response(found) if found else self._status(404, "NotFound", "pods not found")

    async def _get_cr(self, request: web.Request) -> web.Response:
        found = self.crs.get(request.match_info["name"])
        return web.json_response(found) if found else self._status(404, "NotFound", "not found")

    async def _patch_cr(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if request.content_type != MERGE_PATCH:
            return self._status(415, "UnsupportedMediaType", request.content_type)
        if name not in self.crs:
            return self._status(404, "NotFound", "not found")
        old = self.crs[name]
        new = merge_patch(old, await request.json())
        new["status"] = old["status"]  # the main resource cannot change status
        new["metadata"]["generation"] = old["metadata"]["generation"] + (new["spec"] != old["spec"])
        self.crs[name] = new
        return web.json_response(new)


@pytest.fixture
async def kube() -> AsyncIterator[CrApiStub]:
    api = await CrApiStub().start()
    api.pods["demo-frontend-0"] = pod("demo-frontend-0", labels("frontend", **{"infera.amd.com/component": "server"}))
    api.pods["demo-prefill-0"] = pod("demo-prefill-0", labels("prefill"))
    api.pods["demo-prefill-1"] = pod("demo-prefill-1", labels("prefill"), phase="Pending", conditions=[
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/2 nodes are available:\n2 Insufficient amd.com/gpu."}])
    api.pods["demo-decode-0"] = pod("demo-decode-0", labels("decode"))
    api.crs[IDEP] = demo_cr()
    yield api
    await api.stop()


class Server:
    def __init__(self, proc: asyncio.subprocess.Process, port: int, log_path) -> None:
        self.proc, self.log_path = proc, log_path
        self.base = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
async def start_server(kube: CrApiStub, tmp_path):
    servers: list[Server] = []

    async def factory(*flags: str, pod_name: str = "demo-frontend-0") -> Server:
        port = free_port()
        log_path = tmp_path / f"server-{port}.log"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("INFERA_", "KUBERNETES_", "POD_")) and k != "NATS_SERVER"}
        env.update(KUBECONFIG=kube.write_kubeconfig(tmp_path / "kubeconfig"), POD_NAME=pod_name, POD_NAMESPACE=NS,
                   INFERA_ADMIN_TOKEN=TOKEN)
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


def assert_no_leak(kube: CrApiStub, payload: dict) -> None:
    text = json.dumps(payload)
    assert API_TOKEN not in text and str(kube.port) not in text and "127.0.0.1" not in text, text


async def test_snapshot_scale_and_mapped_errors(kube: CrApiStub, start_server):
    server = await start_server("--enable-scaling-api")

    # The admin token guards both methods.
    for headers in (None, {"Authorization": "Bearer wrong"}):
        for method in ("GET", "POST"):
            status, body = await call(server, method, {"services": {"decode": 3}}, headers=headers)
            assert status == 401 and body["error"]["code"] == "invalid_admin_token"
    assert kube.patches() == []

    # GET: the snapshot; prefill is short one ready replica and tells why (its Pending Pod).
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
    pod_lists = [p for m, p, _, _ in kube.request_log if m == "GET" and p.endswith("/pods")]
    assert pod_lists  # read with the service's label selector (the stub honours it)

    # POST: decode 2 → 3 with exactly one merge patch of the CR, nothing else in it.
    spec_before = copy.deepcopy(kube.crs[IDEP]["spec"])
    status, snap = await call(server, "POST", {"services": {"decode": 3}})
    assert status == 200, snap
    assert snap["services"]["decode"]["replicas"] == 3 and snap["services"]["decode"]["current_replicas"] == 2
    assert kube.patches() == [(CR_PATH, MERGE_PATCH, {"spec": {"services": {"decode": {"replicas": 3}}}})]
    expected = copy.deepcopy(spec_before)
    expected["services"]["decode"]["replicas"] = 3
    assert kube.crs[IDEP]["spec"] == expected

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
            assert r.status == 413 and r.headers.get("Content-Length") is not None
    assert len(kube.patches()) == 1

    # Several services in one patch, the server's own service among them (it is a service too).
    status, snap = await call(server, "POST", {"services": {"frontend": 3, "prefill": {"replicas": 1}}})
    assert status == 200 and snap["services"]["frontend"]["replicas"] == 3, snap
    assert snap["services"]["prefill"]["replicas"] == 1 and "blocked" not in snap["services"]["prefill"]
    assert kube.patches()[1:] == [(CR_PATH, MERGE_PATCH, {"spec": {"services": {"frontend": {"replicas": 3},
                                                                                 "prefill": {"replicas": 1}}}})]

    # RBAC: the patch is forbidden → 403 naming the verb and the resource, nothing leaked.
    kube.fail_next(403, "patch-cr")
    status, body = await call(server, "POST", {"services": {"decode": 4}})
    assert status == 403 and body["error"]["code"] == "kubernetes_forbidden", body
    assert "'patch'" in body["error"]["message"] and "inferadeployments.infera.amd.com" in body["error"]["message"]
    assert_no_leak(kube, body)
    kube.fail_next(403, "get-cr")
    status, body = await call(server, "GET")
    assert status == 403 and "'get'" in body["error"]["message"], body
    assert kube.crs[IDEP]["spec"]["services"]["decode"]["replicas"] == 3

    # The API's own 5xx → 502.
    kube.fail_next(500, "patch-cr")
    status, body = await call(server, "POST", {"services": {"decode": 4}})
    assert status == 502 and body["error"]["code"] == "kubernetes_error", body
    assert_no_leak(kube, body)

    # The CR gone → 404.
    cr = kube.crs.pop(IDEP)
    for method in ("GET", "POST"):
        status, body = await call(server, method, {"services": {"decode": 4}})
        assert status == 404 and body["error"]["code"] == "deployment_not_found", body
    kube.crs[IDEP] = cr

    # The API away → 503, without its address; back → served again (the deployment name was cached).
    await kube.stop()
    status, body = await call(server, "GET")
    assert status == 503 and body["error"]["code"] == "kubernetes_unavailable", body
    assert_no_leak(kube, body)
    await kube.start()
    status, snap = await call(server, "GET")
    assert status == 200 and snap["services"]["decode"]["replicas"] == 3
    assert sum(1 for m, p, _, _ in kube.request_log if m == "GET" and p.endswith("/pods/demo-frontend-0")) == 1
    assert API_TOKEN not in server.log()


async def test_flag_off_is_404_after_the_token_check(kube: CrApiStub, start_server):
    server = await start_server()
    status, body = await call(server, "GET", headers=None)
    assert status == 401
    for method in ("GET", "POST"):
        status, body = await call(server, method, {"services": {"decode": 3}})
        assert status == 404 and body["error"]["code"] == "scaling_disabled", body
        assert "--enable-scaling-api" in body["error"]["message"]
    assert not any("/apis/" in p for _, p, _, _ in kube.request_log)


async def test_flag_without_admin_token_refuses_to_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERA_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infera.server", "--enable-scaling-api", "--discovery-backend", "etcd",
        "--etcd-endpoint", "127.0.0.1:1", stderr=asyncio.subprocess.PIPE, env=env)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and b"needs --admin-token" in err


# -- DeploymentScaler in-process: finding the deployment, timeouts --------------------------------

async def scaler_for(kube: CrApiStub, tmp_path, pod_name: str | None, timeout: float = 5.0) -> DeploymentScaler:
    from lightkube import KubeConfig

    return DeploymentScaler(NS, pod_name, config=KubeConfig.from_file(kube.write_kubeconfig(tmp_path / "kc")),
                            request_timeout=timeout)


async def test_no_pod_name_is_503_and_an_unlabelled_pod_409(kube: CrApiStub, tmp_path):
    from infera.api.errors import ApiError

    kube.pods["loose"] = pod("loose", {"app": "hand-made"})
    for pod_name, status, code in [(None, 503, "pod_name_unknown"), ("loose", 409, "not_an_infera_deployment"),
                                   ("missing", 503, "pod_not_found")]:
        scaler = await scaler_for(kube, tmp_path, pod_name)
        try:
            with pytest.raises(ApiError) as caught:
                await scaler.snapshot()
            assert (caught.value.status, caught.value.code) == (status, code)
            assert scaler.deployment is None
        finally:
            await scaler.close()
    assert not any("/apis/" in p for _, p, _, _ in kube.request_log)


async def test_a_silent_api_is_503_within_the_timeout(kube: CrApiStub, tmp_path):
    from infera.api.errors import ApiError

    scaler = await scaler_for(kube, tmp_path, "demo-frontend-0", timeout=0.5)
    try:
        assert (await scaler.snapshot())["deployment"] == IDEP
        kube.hang("get-cr")
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(ApiError) as caught:
            await scaler.scale({"decode": 3})
        assert caught.value.status == 503 and loop.time() - started < 3.0
        assert kube.patches() == []
    finally:
        await scaler.close()


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
