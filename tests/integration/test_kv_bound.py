"""The KV index's byte bound on a live server: two sim engines publish their KV events over ZMQ,
distinct conversations fill the server's index past ``--kv-index-max-bytes``, and /metrics shows the
bytes held (under the bound), the bound, and the entries evicted (per worker in the index, and the
self-check's count of under-predictions the bound explains)."""
from __future__ import annotations

import re

import aiohttp
import pytest

from tests.conftest import wait_for
from tests.integration.conftest import wait_workers

pytestmark = pytest.mark.integration

BOUND = 24 * 1024  # ~500 blocks of one worker by the model (infera/kv/bound.py)
CONVERSATIONS = 60  # ~20 blocks each, distinct: ~1,200 blocks, over twice the bound


def chat(group: int) -> dict:
    system = " ".join(f"topic{group}-{i}" for i in range(150))
    return {"model": "sim-model", "max_tokens": 2, "messages": [{"role": "system", "content": system},
                                                             {"role": "user", "content": "hello"}]}


def sample(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m is not None, f"{name} not in /metrics"
    return float(m.group(1))


async def test_the_bound_holds_and_metrics_show_it(make_server, spawn_worker):
    server = await make_server("--kv-index-max-bytes", f"{BOUND // 1024}Ki")
    workers = [await spawn_worker() for _ in range(2)]
    await wait_workers(server, {w.worker_id for w in workers})
    base = f"http://127.0.0.1:{server.port}"
    index = server.kv.index
    assert index.bound_stats().max_bytes == BOUND  # the flag reached the server's index
    async with aiohttp.ClientSession() as s:
        await wait_for(lambda: all(server.kv.subscriber.stats(w.worker_id).get("connected") for w in workers), 10,
                       message="KV-event subscriptions connected")
        for group in range(CONVERSATIONS):
            async with s.post(base + "/v1/chat/completions", json=chat(group)) as r:
                assert r.status == 200, await r.text()
                await r.read()
        await wait_for(lambda: index.bound_stats().evicted_entries > 0, 10,
                       message="the engines' events filled the index past its bound")
        async with s.get(base + "/metrics") as r:
            assert r.status == 200
            text = await r.text()
    held = sample(text, "infera_kv_index_bytes")
    assert 0 < held <= BOUND
    assert sample(text, "infera_kv_index_max_bytes") == BOUND
    assert sample(text, "infera_kv_index_evicted_entries_total") >= index.bound_stats().evicted_entries > 0
    assert re.search(r'^infera_kv_predictions_evicted_total\{worker_id="[^"]+"\} \S+$', text, re.M)
    assert sum(index.evicted_entries(w.worker_id) for w in workers) > 0
