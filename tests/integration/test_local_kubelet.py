"""The local test cluster end to end: FakeKubeApi (tests/fakes/kube_api.py) + LocalKubelet
(tests/fakes/kubelet.py) run Deployments, StatefulSets and LeaderWorkerSets as local processes,
with probes, Services, DNS and graceful deletion, and leave no process behind."""
from __future__ import annotations

import asyncio
import json
import textwrap

import aiohttp
import pytest

from tests.conftest import process_group_members, wait_for
from tests.fakes.kube_api import FakeKubeApi
from tests.fakes.kubelet import (DAEMONSETS, DEPLOYMENTS, LEADERWORKERSETS, PODS, SERVICES, STATEFULSETS,
                                 ApiClient, ApiError, LocalKubelet, pod_is_ready)

NS = "default"

# A Pod's program: an HTTP server on argv[1]:argv[2] answering its name (/), its env (/env) and
# what its resolver says of a name (/resolve?name=x); /health fails while a marker file
# <name>.unready exists; on SIGTERM it writes a marker and exits.
POD_SERVER = textwrap.dedent("""
    import http.server, json, os, signal, socket, sys, time, urllib.parse
    host, port = sys.argv[1], int(sys.argv[2])
    name = os.environ.get("POD_NAME", "?")
    def on_term(signum, frame):
        with open(os.path.join(os.environ["MARKER_DIR"], name + ".term"), "w") as f:
            f.write(repr(time.time()))
        os._exit(0)
    signal.signal(signal.SIGTERM, on_term)
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            url = urllib.parse.urlsplit(self.path)
            if url.path == "/health" and os.path.exists(os.path.join(os.environ["MARKER_DIR"], name + ".unready")):
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if url.path == "/env":
                body = json.dumps(dict(os.environ))
            elif url.path == "/resolve":
                body = socket.gethostbyname(urllib.parse.parse_qs(url.query)["name"][0])
            else:
                body = name
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def log_message(self, *args):
            pass
    http.server.ThreadingHTTPServer((host, port), Handler).serve_forever()
""")
PRE_STOP = ("import os, time; open(os.path.join(os.environ['MARKER_DIR'], os.environ['POD_NAME'] + '.prestop'), "
            "'w').write(repr(time.time()))")


def server_template(app: str, extra_env: list[dict] | None = None) -> dict:
    return {
        "metadata": {"labels": {"app": app}},
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "volumes": [{"name": "markers", "hostPath": {"path": "/var/markers"}}],
            "containers": [{
                "name": "main", "image": "registry.example/pod-server:1",
                "command": ["python3", "-c", POD_SERVER, "0.0.0.0", "8080"],
                "ports": [{"name": "http", "containerPort": 8080}],
                "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                        {"name": "MARKER_DIR", "value": "/var/markers"}] + (extra_env or []),
                "volumeMounts": [{"name": "markers", "mountPath": "/var/markers"}],
                "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10},
                "lifecycle": {"preStop": {"exec": {"command": ["python3", "-c", PRE_STOP]}}},
            }],
        },
    }


@pytest.fixture
async def cluster(tmp_path):
    # (Service IPs start at a random address by default: runs side by side rarely share clusterIP:port.)
    api = await FakeKubeApi(namespace=NS).start()
    client = ApiClient(api.url, api.token)
    await client.open()
    kubelet = LocalKubelet(api.url, api.token, tmp_path / "cluster", probe_period_cap=0.2,
                           restart_backoff=(0.2, 1.0), stop_grace=1.0)
    await kubelet.start()
    try:
        yield api, client, kubelet
    except BaseException:
        raise
    finally:
        pids = kubelet.process_ids()
        logs = kubelet.all_logs()
        await kubelet.stop()
        await client.close()
        await api.stop()
        assert pids, "the kubelet started no process"
        left = {pgid: process_group_members(pgid) for pgid in pids if process_group_members(pgid)}
        assert not left, f"processes left after stop (by process group): {left}\n{logs}"


async def pods_of(client: ApiClient, selector: str) -> list[dict]:
    return (await client.get(PODS.collection(NS), params={"labelSelector": selector}))["items"]


async def ready_pods(client: ApiClient, selector: str, count: int, kubelet: LocalKubelet,
                     timeout: float = 30) -> list[dict]:
    found: list[dict] = []

    async def check() -> bool:
        nonlocal found
        found = [p for p in await pods_of(client, selector)
                 if pod_is_ready(p) and not p["metadata"].get("deletionTimestamp")]
        return len(found) == count and len(await pods_of(client, selector)) == count

    try:
        await wait_for(check, timeout, interval=0.1, message=f"{count} ready pods {selector}")
    except BaseException:
        print(kubelet.all_logs())
        raise
    return found


async def http_get(url: str) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            assert resp.status == 200, url
            return await resp.text()


async def test_deployment_scale_service_dns_graceful_delete_and_rollout(cluster, tmp_path):
    api, client, kubelet = cluster
    await client.create(SERVICES.collection(NS), {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 8000, "targetPort": "http"}]}})
    await client.create(DEPLOYMENTS.collection(NS), {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}}, "template": server_template("web")}})

    pods = await ready_pods(client, "app=web", 2, kubelet)
    ips = {p["status"]["podIP"] for p in pods}
    assert len(ips) == 2 and all(ip.startswith("127.0.") and int(ip.split(".")[2]) < 200 for ip in ips)
    for pod in pods:
        assert pod["spec"]["nodeName"] == "local-node"
        assert pod["metadata"]["name"].startswith("web-" + pod["metadata"]["labels"]["pod-template-hash"] + "-")
        assert pod["status"]["phase"] == "Running"
        assert pod["status"]["containerStatuses"][0]["started"] is True
        # Each Pod serves on its own IP (0.0.0.0 rewritten) and got its own name and IP from the Downward API.
        env = json.loads(await http_get(f"http://{pod['status']['podIP']}:8080/env"))
        assert env["POD_NAME"] == pod["metadata"]["name"] and env["POD_IP"] == pod["status"]["podIP"]
        assert env["APP"] == "web" and env["MARKER_DIR"].startswith(str(tmp_path))
    await wait_for(lambda: _status_is(client, DEPLOYMENTS, "web", readyReplicas=2, replicas=2, updatedReplicas=2),
                   15, message="deployment status readyReplicas 2")

    # The Service: its cluster IP proxies round-robin to both Pods; the DNS hook inside a Pod
    # resolves its name; so does the kubelet for the test.
    svc = await client.get(SERVICES.item(NS, "web"))
    cluster_ip = svc["spec"]["clusterIP"]
    assert cluster_ip.startswith("127.0.") and cluster_ip not in ips
    names = {await http_get(f"http://{cluster_ip}:8000/") for _ in range(4)}
    assert names == {p["metadata"]["name"] for p in pods}
    first_ip = pods[0]["status"]["podIP"]
    for name in ("web", "web.default", "web.default.svc.cluster.local"):
        assert await http_get(f"http://{first_ip}:8080/resolve?name={name}") == cluster_ip
    assert kubelet.resolve("web") == [cluster_ip]

    async def endpoints_ready() -> bool:
        try:
            eps = await client.get(f"/api/v1/namespaces/{NS}/endpoints/web")
        except ApiError:
            return False
        subsets = eps.get("subsets") or [{}]
        return ({a["ip"] for a in subsets[0].get("addresses") or []} == ips
                and subsets[0]["ports"] == [{"port": 8080, "protocol": "TCP"}])
    await wait_for(endpoints_ready, 10, message="Endpoints of web list both Pods")

    # Readiness is followed live: an unready Pod leaves the Service's rotation, and comes back.
    markers = tmp_path / "cluster" / "node" / "hostpath" / "var" / "markers"
    unready = pods[1]["metadata"]["name"]
    (markers / f"{unready}.unready").touch()

    async def only_ready_one_serves() -> bool:
        pod = await client.get(PODS.item(NS, unready))
        return not pod_is_ready(pod) and {await http_get(f"http://{cluster_ip}:8000/") for _ in range(3)} == {
            pods[0]["metadata"]["name"]}
    await wait_for(only_ready_one_serves, 10, message=f"{unready} unready and out of the Service")
    (markers / f"{unready}.unready").unlink()
    await ready_pods(client, "app=web", 2, kubelet)

    # Scale through /scale.
    await client.merge_patch(DEPLOYMENTS.item(NS, "web", "scale"), {"spec": {"replicas": 3}})
    pods = await ready_pods(client, "app=web", 3, kubelet)
    await wait_for(lambda: _status_is(client, DEPLOYMENTS, "web", readyReplicas=3), 15, message="readyReplicas 3")

    # Graceful delete: preStop, then SIGTERM, then the Pod is gone and replaced.
    victim = pods[0]["metadata"]["name"]
    await client.delete(PODS.item(NS, victim))

    async def victim_gone() -> bool:
        names = [p["metadata"]["name"] for p in await pods_of(client, "app=web")]
        return victim not in names
    await wait_for(victim_gone, 20, message=f"{victim} deleted")
    pre_stop, term = (markers / f"{victim}.prestop"), (markers / f"{victim}.term")
    assert pre_stop.exists() and term.exists(), kubelet.logs(victim)
    assert float(pre_stop.read_text()) <= float(term.read_text())
    pods = await ready_pods(client, "app=web", 3, kubelet)
    assert victim not in {p["metadata"]["name"] for p in pods}

    # A template change rolls every Pod onto the new template.
    old_names = {p["metadata"]["name"] for p in pods}
    await client.merge_patch(DEPLOYMENTS.item(NS, "web"), {"spec": {"template": server_template(
        "web", [{"name": "VERSION", "value": "2"}])}})

    ready_during_rollout = []

    async def rolled() -> bool:
        current = [p for p in await pods_of(client, "app=web") if not p["metadata"].get("deletionTimestamp")]
        ready_during_rollout.append(sum(pod_is_ready(p) for p in current))
        return (len(current) == 3 and all(pod_is_ready(p) for p in current)
                and not old_names & {p["metadata"]["name"] for p in current}
                and await _status_is(client, DEPLOYMENTS, "web", updatedReplicas=3, readyReplicas=3, replicas=3))
    await wait_for(rolled, 40, interval=0.05, message="rollout to the new template")
    assert min(ready_during_rollout) >= 3, ready_during_rollout  # maxUnavailable 0: never below 3 ready
    assert len(ready_during_rollout) > 1  # the rollout was watched, not just its end
    pod = (await ready_pods(client, "app=web", 3, kubelet))[0]
    env = json.loads(await http_get(f"http://{pod['status']['podIP']}:8080/env"))
    assert env["VERSION"] == "2"

    # Deleting the Deployment: the API server's garbage collector deletes its Pods gracefully and
    # the kubelet stops them (each writes its SIGTERM marker) and removes them.
    last = {p["metadata"]["name"] for p in await pods_of(client, "app=web")}
    await client.delete(DEPLOYMENTS.item(NS, "web"))
    await wait_for(lambda: _no_pods(client, "app=web"), 20, message="the Deployment's Pods gone")
    assert all((markers / f"{name}.term").exists() for name in last)


async def _no_pods(client: ApiClient, selector: str) -> bool:
    return not await pods_of(client, selector)


async def _status_is(client: ApiClient, kind, name: str, **want) -> bool:
    status = (await client.get(kind.item(NS, name))).get("status") or {}
    return all(status.get(k) == v for k, v in want.items())


async def test_nats_statefulset_reachable_through_its_service(cluster, tmp_path):
    api, client, kubelet = cluster
    await client.create(SERVICES.collection(NS), {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "nats"},
        "spec": {"selector": {"app": "nats"}, "ports": [{"name": "client", "port": 4222}]}})
    await client.create(STATEFULSETS.collection(NS), {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "nats"},
        "spec": {"replicas": 1, "serviceName": "nats", "selector": {"matchLabels": {"app": "nats"}},
                 "template": {"metadata": {"labels": {"app": "nats"}}, "spec": {"containers": [{
                     "name": "main", "image": "nats:2.10",
                     # As the renderer writes it: no listen address (the kubelet binds it to the Pod IP).
                     "args": ["-js", "-sd", "/data/jetstream", "-m", "8222"],
                     "ports": [{"name": "client", "containerPort": 4222}, {"name": "monitor", "containerPort": 8222}],
                     "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                     "startupProbe": {"tcpSocket": {"port": "client"}, "periodSeconds": 5, "failureThreshold": 60},
                     "readinessProbe": {"httpGet": {"path": "/healthz?js-enabled-only=true", "port": "monitor"}}}]}},
                 "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {"accessModes": ["ReadWriteOnce"]}}]}})
    pods = await ready_pods(client, "app=nats", 1, kubelet)
    assert pods[0]["metadata"]["name"] == "nats-0"
    cluster_ip = (await client.get(SERVICES.item(NS, "nats")))["spec"]["clusterIP"]
    reader, writer = await asyncio.wait_for(asyncio.open_connection(cluster_ip, 4222), 5)
    try:
        line = await asyncio.wait_for(reader.readline(), 5)
        assert line.startswith(b"INFO ") and b"jetstream" in line, line
    finally:
        writer.close()
    # JetStream stores under the claim's directory (the /data mount rewritten), which outlives the Pod.
    await wait_for(lambda: (tmp_path / "cluster" / "pvc" / NS / "data-nats-0" / "jetstream").exists(), 10,
                   message="jetstream store in the claim directory")
    await wait_for(lambda: _status_is(client, STATEFULSETS, "nats", readyReplicas=1, replicas=1), 15,
                   message="statefulset status")

    # Scaled through /scale: the next ordinal, its own claim directory and its own DNS name.
    await client.merge_patch(STATEFULSETS.item(NS, "nats", "scale"), {"spec": {"replicas": 2}})
    pods = {p["metadata"]["name"]: p for p in await ready_pods(client, "app=nats", 2, kubelet)}
    assert set(pods) == {"nats-0", "nats-1"}
    assert pods["nats-1"]["spec"]["hostname"] == "nats-1" and pods["nats-1"]["spec"]["subdomain"] == "nats"
    assert (tmp_path / "cluster" / "pvc" / NS / "data-nats-1" / "jetstream").is_dir()
    assert kubelet.resolve("nats-1.nats") == [pods["nats-1"]["status"]["podIP"]]
    # A headless Service resolves to its ready Pods' IPs.
    await client.create(SERVICES.collection(NS), {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "nats-pods"},
        "spec": {"clusterIP": "None", "selector": {"app": "nats"}, "ports": [{"port": 4222}]}})
    want = sorted(p["status"]["podIP"] for p in pods.values())
    await wait_for(lambda: sorted(kubelet.resolve("nats-pods.default.svc") or []) == want, 10,
                   message="the headless Service resolves to both Pod IPs")

    # A DaemonSet: one Pod on the one node, and its status.
    await client.create("/apis/apps/v1/namespaces/default/daemonsets", {
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "agent"},
        "spec": {"selector": {"matchLabels": {"app": "agent"}}, "template": server_template("agent")}})
    [agent] = await ready_pods(client, "app=agent", 1, kubelet)
    assert agent["metadata"]["name"].startswith("agent-")
    await wait_for(lambda: _status_is(client, DAEMONSETS, "agent", numberReady=1, desiredNumberScheduled=1), 15,
                   message="daemonset status")


LWS_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "leaderworkersets.leaderworkerset.x-k8s.io"},
    "spec": {"group": "leaderworkerset.x-k8s.io", "scope": "Namespaced",
             "names": {"plural": "leaderworkersets", "singular": "leaderworkerset", "kind": "LeaderWorkerSet",
                       "shortNames": ["lws"]},
             "versions": [{"name": "v1", "served": True, "storage": True,
                           "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.replicas",
                                                                    "statusReplicasPath": ".status.replicas"}},
                           "schema": {"openAPIV3Schema": {"type": "object",
                                                          "x-kubernetes-preserve-unknown-fields": True}}}]},
}


async def test_leaderworkerset_leader_and_follower_env(cluster):
    api, client, kubelet = cluster
    await client.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", LWS_CRD)
    template = server_template("lws")
    await client.create(LEADERWORKERSETS.collection(NS), {
        "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "metadata": {"name": "lws"},
        "spec": {"replicas": 1, "leaderWorkerTemplate": {"size": 2, "workerTemplate": template}}})
    pods = {p["metadata"]["name"]: p for p in await ready_pods(client, "app=lws", 2, kubelet)}
    assert set(pods) == {"lws-0", "lws-0-1"}
    assert pods["lws-0-1"]["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/worker-index"] == "1"
    assert pods["lws-0"]["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/group-index"] == "0"
    assert pods["lws-0-1"]["metadata"]["annotations"]["leaderworkerset.sigs.k8s.io/leader-name"] == "lws-0"
    follower_ip = pods["lws-0-1"]["status"]["podIP"]
    env = json.loads(await http_get(f"http://{follower_ip}:8080/env"))
    lws_env = (env["LWS_WORKER_INDEX"], env["LWS_GROUP_SIZE"], env["LWS_LEADER_ADDRESS"])
    assert lws_env == ("1", "2", "lws-0.lws.default")
    leader_env = json.loads(await http_get(f"http://{pods['lws-0']['status']['podIP']}:8080/env"))
    assert leader_env["LWS_WORKER_INDEX"] == "0"
    # The follower resolves its leader's address to the leader Pod's IP.
    leader_ip = pods["lws-0"]["status"]["podIP"]
    assert await http_get(f"http://{follower_ip}:8080/resolve?name=lws-0.lws.default") == leader_ip
    await wait_for(lambda: _status_is(client, LEADERWORKERSETS, "lws", readyReplicas=1, replicas=1), 15,
                   message="lws status")


async def test_crash_restarts_with_backoff_and_liveness_kills(cluster):
    api, client, kubelet = cluster
    # A bare Pod (bound by the scheduler): its container exits 3 each time.
    await client.create(PODS.collection(NS), {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "crasher", "labels": {"app": "crasher"}},
        "spec": {"containers": [{"name": "main", "image": "x",
                                 "command": ["python3", "-c", "import sys; sys.exit(3)"]}]}})

    async def crash_looping() -> bool:
        pod = await client.get(PODS.item(NS, "crasher"))
        statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
        st = statuses[0]
        return (pod["spec"].get("nodeName") == "local-node" and st.get("restartCount", 0) >= 2
                and (st.get("lastState") or {}).get("terminated", {}).get("exitCode") == 3)
    await wait_for(crash_looping, 20, interval=0.1, message="crash loop with restarts")
    seen_backoff = False

    async def backoff_reason() -> bool:
        nonlocal seen_backoff
        pod = await client.get(PODS.item(NS, "crasher"))
        st = pod["status"]["containerStatuses"][0]
        seen_backoff = (st["state"].get("waiting") or {}).get("reason") == "CrashLoopBackOff"
        return seen_backoff
    await wait_for(backoff_reason, 10, interval=0.02, message="CrashLoopBackOff waiting reason")

    # Liveness: a server whose /health never answers 2xx gets killed and restarted.
    await client.create(PODS.collection(NS), {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "stuck", "labels": {"app": "stuck"}},
        "spec": {"nodeName": "local-node", "containers": [{
            "name": "main", "image": "x", "command": ["python3", "-m", "http.server", "--bind", "0.0.0.0", "8081"],
            "livenessProbe": {"httpGet": {"path": "/missing", "port": 8081}, "failureThreshold": 2,
                              "initialDelaySeconds": 1}}]}})

    async def restarted() -> bool:
        pod = await client.get(PODS.item(NS, "stuck"))
        statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
        return statuses[0].get("restartCount", 0) >= 1
    await wait_for(restarted, 20, interval=0.1, message="liveness restart")
    assert "liveness probe failed" in kubelet.logs("stuck")

    # A process (and its child) that ignore SIGTERM: stop() escalates to SIGKILL for the whole
    # process group (the fixture checks that nothing of any group is left).
    stubborn = ("import signal, subprocess, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "subprocess.Popen(['sleep', '300']); print('child started', flush=True); time.sleep(300)")
    await client.create(PODS.collection(NS), {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "stubborn"},
        "spec": {"containers": [{"name": "main", "image": "x", "command": ["python3", "-c", stubborn]}]}})
    await wait_for(lambda: "child started" in kubelet.logs("stubborn"), 10, message="stubborn child started")


async def test_start_against_no_api_server_fails_clearly(tmp_path):
    from tests.conftest import free_port

    kubelet = LocalKubelet(f"http://127.0.0.1:{free_port()}", "t", tmp_path, start_timeout=0.5)
    before = len(asyncio.all_tasks())
    with pytest.raises(RuntimeError, match="could not list Pods and Services.*pods: .*(Connect|refused)"):
        await kubelet.start()
    assert len(asyncio.all_tasks()) == before  # nothing left running


async def test_etcd_statefulset_as_rendered(cluster, tmp_path):
    api, client, kubelet = cluster
    await client.create(SERVICES.collection(NS), {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "etcd"},
        "spec": {"selector": {"app": "etcd"}, "ports": [{"name": "client", "port": 2379}]}})
    await client.create(STATEFULSETS.collection(NS), {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "etcd"},
        "spec": {"replicas": 1, "serviceName": "etcd", "selector": {"matchLabels": {"app": "etcd"}},
                 "template": {"metadata": {"labels": {"app": "etcd"}}, "spec": {"containers": [{
                     "name": "main", "image": "quay.io/coreos/etcd:v3.5.17", "command": ["etcd"],
                     "args": ["--listen-client-urls", "http://0.0.0.0:2379",
                              "--advertise-client-urls", "http://etcd.default.svc:2379", "--data-dir", "/var/lib/etcd"],
                     "ports": [{"name": "client", "containerPort": 2379}],
                     "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
                     "readinessProbe": {"httpGet": {"path": "/health", "port": "client"}, "periodSeconds": 5},
                     "livenessProbe": {"httpGet": {"path": "/health", "port": "client"}, "periodSeconds": 10,
                                       "failureThreshold": 6}}]}},
                 "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {"accessModes": ["ReadWriteOnce"]}}]}})
    [pod] = await ready_pods(client, "app=etcd", 1, kubelet)
    cluster_ip = (await client.get(SERVICES.item(NS, "etcd")))["spec"]["clusterIP"]
    assert json.loads(await http_get(f"http://{cluster_ip}:2379/health"))["health"] == "true"
    # Its data dir is the claim's directory; its peer port is on the Pod's IP, not localhost.
    assert (tmp_path / "cluster" / "pvc" / NS / "data-etcd-0" / "member").is_dir()
    assert f"--listen-peer-urls http://{pod['status']['podIP']}:2380" in kubelet.logs("etcd-0")


async def test_api_failures_and_outage_are_retried(cluster):
    api, client, kubelet = cluster
    bare = server_template("bare")
    await client.create(PODS.collection(NS), {"apiVersion": "v1", "kind": "Pod",
                                              "metadata": {"name": "bare", **bare["metadata"]}, "spec": bare["spec"]})
    await ready_pods(client, "app=bare", 1, kubelet)
    # The kubelet's final DELETE (grace 0) fails twice: it is retried and the Pod goes.
    await client.delete(PODS.item(NS, "bare"))
    api.fail_next(503, count=2, kind="delete")
    await wait_for(lambda: _no_pods(client, "app=bare"), 20, message="bare deleted despite failed DELETEs")
    assert any("final delete of default/bare" in line for line in kubelet.errors), kubelet.errors

    # An API server outage: the watches drop and come back; a Pod created afterwards runs.
    await api.stop()
    await api.start()
    again = server_template("again")
    await client.create(PODS.collection(NS), {"apiVersion": "v1", "kind": "Pod", "spec": again["spec"],
                                              "metadata": {"name": "again", **again["metadata"]}})
    await ready_pods(client, "app=again", 1, kubelet, timeout=20)


async def test_a_container_that_exits_during_prestop_is_not_restarted(cluster, tmp_path):
    api, client, kubelet = cluster
    # The process exits as soon as preStop writes its marker; preStop then sleeps on.
    done = tmp_path / "prestop-done"
    main = f"import os, time\nwhile not os.path.exists({str(done)!r}): time.sleep(0.02)\nprint('exiting', flush=True)"
    await client.create(PODS.collection(NS), {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "quitter", "labels": {"app": "quitter"}},
        "spec": {"terminationGracePeriodSeconds": 10, "containers": [{
            "name": "main", "image": "x", "command": ["python3", "-c", main],
            "lifecycle": {"preStop": {"exec": {"command": ["sh", "-c", f"touch {done}; sleep 1"]}}}}]}})
    await ready_pods(client, "app=quitter", 1, kubelet)
    await client.delete(PODS.item(NS, "quitter"))
    await wait_for(lambda: _no_pods(client, "app=quitter"), 20, message="quitter deleted")
    log = kubelet.logs("quitter")
    assert log.count(" start quitter/main") == 1 and "exiting" in log, log


async def test_init_container_volumes_and_env_sources(cluster):
    api, client, kubelet = cluster
    await client.create("/api/v1/namespaces/default/configmaps", {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"},
        "data": {"app.conf": "bind 0.0.0.0\nstate /work/data/state\n", "MODE": "fast"}})
    await client.create("/api/v1/namespaces/default/secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "sec"}, "data": {"token": "czNjcmV0"}})
    show = ("import os, time\n"
            "print('CONF', '=', open('/etc/app/app.conf').read().replace(chr(10), '|'))\n"
            "print('INIT', '=', open('/work/data/init-was-here').read())\n"
            "print('ENV', '=', os.environ['TOKEN'], os.environ['MODE'], os.environ['ADDR'], flush=True)\n"
            "time.sleep(300)")
    await client.create(PODS.collection(NS), {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "mounts", "labels": {"app": "mounts"}},
        "spec": {
            "volumes": [{"name": "cfg",
                         "configMap": {"name": "cfg", "items": [{"key": "app.conf", "path": "app.conf"}]}},
                        {"name": "work", "emptyDir": {}}],
            "initContainers": [{"name": "init", "image": "x", "command": [
                "python3", "-c", "open('/work/data/init-was-here', 'w').write('yes')"],
                "volumeMounts": [{"name": "work", "mountPath": "/work/data"}]}],
            "containers": [{"name": "main", "image": "x", "command": ["python3", "-c", show],
                            "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "token"}}},
                                    {"name": "ADDR", "value": "$(POD_IP_ALIAS):1"},
                                    {"name": "POD_IP_ALIAS", "value": "unused"}],
                            "envFrom": [{"configMapRef": {"name": "cfg"}}],
                            "volumeMounts": [{"name": "cfg", "mountPath": "/etc/app"},
                                             {"name": "work", "mountPath": "/work/data"}]}]}})
    [pod] = await ready_pods(client, "app=mounts", 1, kubelet)
    await wait_for(lambda: "ENV = " in kubelet.logs("mounts"), 10, message="the main container's output")
    log = kubelet.logs("mounts")
    work = kubelet.runtime("mounts").volume_dirs["work"]
    # The mounted file has the Pod's IP for 0.0.0.0 and the emptyDir's directory for its mount path.
    assert f"CONF = bind {pod['status']['podIP']}|state {work}/state|" in log, log
    assert "INIT = yes" in log
    # $(VAR) refers only to variables defined before it: ADDR keeps the reference as written.
    assert "ENV = s3cret fast $(POD_IP_ALIAS):1" in log
    assert pod["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
