"""The production plane end to end, with no plane flags anywhere: inside a "Pod"
(KUBERNETES_SERVICE_HOST set) a sim worker's launcher and a server pick kubernetes + nats + nats by
themselves. The worker writes its record into its own Pod's annotation on the fake API server, serves
requests over a real nats-server and relays its KV events into JetStream; the server discovers it
from the Pod, routes streaming chat over NATS, and stops routing as soon as the Pod is terminating
(deletionTimestamp) — before the worker is signalled."""
from __future__ import annotations

import asyncio
import os
import signal
import sys

import aiohttp
import openai
import pytest

from infera.server.cli import parse_args
from infera.server.main import InferaServer
from tests.conftest import free_port, wait_for
from tests.fakes.kube_api import FakeKubeApi

pytestmark = pytest.mark.integration

NS = "infera"
LABELS = {"infera.amd.com/deployment": "demo"}
SELECTOR = "infera.amd.com/deployment=demo"


@pytest.fixture
async def kube_api():
    api = await FakeKubeApi(namespace=NS).start()
    yield api
    await api.stop()


def pod_env(kube_api: FakeKubeApi, kubeconfig: str, nats_url: str, **extra: str) -> dict[str, str]:
    """What a Pod's container sees: the kubelet's service host, the Downward API, the operator's env."""
    return {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443", "POD_NAMESPACE": NS,
            "NATS_SERVER": nats_url, "INFERA_K8S_LABEL_SELECTOR": SELECTOR, "KUBECONFIG": kubeconfig, **extra}


async def test_production_plane_without_flags(kube_api, nats_server, tmp_path, monkeypatch):
    kubeconfig = kube_api.write_kubeconfig(tmp_path / "kubeconfig")
    port = free_port()
    kube_api.add_pod("worker-0", LABELS, ip="127.0.0.1")
    env = {**os.environ, **pod_env(kube_api, kubeconfig, nats_server.url, POD_NAME="worker-0", POD_IP="127.0.0.1")}
    for key in ("INFERA_DISCOVERY_BACKEND", "INFERA_REQUEST_TRANSPORT", "INFERA_KV_EVENT_TRANSPORT"):
        env.pop(key, None)
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "infera.engine.sim", "--drain-settle", "0.3", "--model", "sim-model",
        "--port", str(port), "--host", "127.0.0.1", "--speedup", "20", env=env, start_new_session=True)
    # The server process would read these from its Pod; in-process, the test hands them over.
    server_env = pod_env(kube_api, kubeconfig, nats_server.url)
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    args = parse_args(["--host", "127.0.0.1", "--port", "0"], environ=server_env)
    assert (args.discovery_backend, args.request_transport, args.kv_event_transport) == ("kubernetes", "nats", "nats")
    server = InferaServer(args)
    await server.start()
    worker_id = f"127.0.0.1:{port}"
    try:
        await wait_for(lambda: worker.returncode is not None or any(r.worker_id == worker_id
                                                                    for r in server.fleet.active()), 60,
                       message="the worker discovered from its Pod")
        assert worker.returncode is None
        record = server.fleet.get(worker_id)
        assert (record.request_transport, record.kv_event_transport) == ("nats", "nats")

        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
        words = []
        stream = await client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "the production plane " * 20}],
            max_tokens=8, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                words.append(chunk.choices[0].delta.content)
        assert words
        assert server.transport.nats is not None and server.transport.nats.sent >= 1

        # The KV events of that request came through the launcher's JetStream relay.
        async def view_has_blocks() -> bool:
            view = server.kv.cache_view(worker_id, None) if server.kv else None
            return bool(view and view["block_count"] > 0)

        await wait_for(view_has_blocks, 10, message="the cache view fed over NATS")

        # Drain before signal: the Pod is terminating; routing stops at once, the worker still runs.
        kube_api.begin_graceful_delete("worker-0")
        await wait_for(lambda: not server.fleet.active(), 5, message="the terminating Pod left routing")
        assert server.fleet.get(worker_id).status == "draining" and worker.returncode is None
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", json={
                    "model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) as r:
                assert r.status == 503
        # Then the kubelet signals the worker: it clears its annotation, drains and exits 0.
        worker.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(worker.wait(), 30) == 0
        kube_api.finish_delete("worker-0")
        await wait_for(lambda: server.fleet.get(worker_id) is None, 5, message="the worker removed")
        await client.close()
    finally:
        await server.stop()
        if worker.returncode is None:
            os.killpg(worker.pid, signal.SIGKILL)
            await worker.wait()
