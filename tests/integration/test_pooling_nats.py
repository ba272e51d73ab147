"""Pooling and utility routes to a worker on the NATS plane (its request server relays them to the
engine like chat): embeddings and tokenize through the router equal the engine's own answers."""
from __future__ import annotations

import aiohttp
import pytest

from tests.integration.conftest import wait_workers

pytestmark = pytest.mark.integration


async def test_embeddings_and_tokenize_over_nats(make_server, spawn_worker, nats_server):
    nats = ("--request-transport", "nats", "--nats-server", nats_server.url)
    worker = await spawn_worker("--runner", "pooling", "--convert", "embed", launcher_args=nats)
    server = await make_server(*nats)
    await wait_workers(server, {worker.worker_id})
    (record,) = server.fleet.all()
    assert record.request_transport == "nats" and record.tasks == ["embed", "score"]
    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as s:
        for route, body in (("/v1/embeddings", {"model": "sim-model", "input": ["a b", "c"]}),
                            ("/tokenize", {"model": "sim-model", "prompt": "hello there"}),
                            ("/v1/rerank", {"model": "sim-model", "query": "a", "documents": ["b", "a"]})):
            async with s.post(base + route, json=body) as routed, s.post(worker.url + route, json=body) as direct:
                assert routed.status == direct.status == 200, await routed.text()
                got, want = await routed.json(), await direct.json()
            got.pop("id", None), want.pop("id", None), got.pop("created", None), want.pop("created", None)
            assert got == want, route
