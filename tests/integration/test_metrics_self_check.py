"""The KV self-check covers streams without usage: the router's predicted hit rate per worker is
compared with the engine's own prefix-cache counters (scraped from the sim workers' /metrics)."""
from __future__ import annotations

import aiohttp
import pytest

from infera.engine.base.prom import sample_sum
from tests.conftest import wait_for
from tests.integration.conftest import wait_workers

pytestmark = pytest.mark.integration

ADMIN_TOKEN = "self-check-test-admin"


def chat(group: int, turn: int) -> dict:
    system = " ".join(f"topic{group}-{i}" for i in range(200))
    # The SDKs' default stream: no stream_options, so no usage in any chunk.
    return {"model": "sim-model", "max_tokens": 3, "stream": True,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"question {turn}"}]}


async def full_blocks(s: aiohttp.ClientSession, engine_url: str, body: dict, block_size: int = 16) -> int:
    """The full blocks of a chat prompt as the engine tokenizes it (its /tokenize): what it stores."""
    async with s.post(engine_url + "/tokenize", json={"model": body["model"], "messages": body["messages"]}) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["count"] // block_size


async def stream(s: aiohttp.ClientSession, base: str, body: dict) -> bytes:
    async with s.post(base + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        data = await r.read()
    assert data.rstrip().endswith(b"data: [DONE]") and b'"usage"' not in data.replace(b'"usage":null', b"")
    return data


async def test_streams_without_usage_move_the_window_comparison(make_server, spawn_worker):
    server = await make_server("--engine-scrape-interval", "0.2", "--engine-scrape-window", "60",
                               "--admin-token", ADMIN_TOKEN)
    workers = [await spawn_worker() for _ in range(2)]
    await wait_workers(server, {w.worker_id for w in workers})
    base = f"http://127.0.0.1:{server.port}"
    window = server.engine_window
    async with aiohttp.ClientSession() as s:
        await wait_for(lambda: all(server.kv.subscriber.stats(w.worker_id).get("connected") for w in workers), 10,
                       message="KV-event subscriptions connected")
        # A baseline sample of each engine before any traffic, so the window holds all of it.
        await wait_for(lambda: all(len(window.windows.get(w.worker_id, ())) >= 1 for w in workers), 10,
                       message="a first scrape of every worker")
        stored = 0
        for group in range(2):
            await stream(s, base, chat(group, 0))  # cold
            stored += await full_blocks(s, workers[0].url, chat(group, 0))
        # every cold turn's blocks, not a count one group alone passes: a later turn predicted on
        # part of them would make the router's rate differ from the engine's
        await wait_for(lambda: sum(server.kv.index.block_count(w.worker_id) for w in workers) >= stored, 10,
                       message="views filled from KV events")
        for turn in range(1, 4):
            for group in range(2):
                await stream(s, base, chat(group, turn))  # the group's prefix is cached where it went

        # No reply carried usage: the per-reply check saw nothing …
        views = {w.worker_id: server.kv.cache_view(w.worker_id, None) for w in workers}
        assert sum(v["prediction"]["observations"] for v in views.values()) == 0
        # … yet every reply counts in the router's hit counters and in the window comparison.
        assert sum(server.kv.hit_totals(w.worker_id)[1] for w in workers) > 0

        served = [w for w in workers if server.kv.hit_totals(w.worker_id)[1] > 0]

        def compared() -> bool:
            """Both rates exist for every worker served, from a scrape made after the last reply."""
            for w in served:
                predicted, engine, _ = window.rates(w.worker_id)
                if predicted is None or engine is None:
                    return False
                if window.windows[w.worker_id][-1].prompt != server.kv.hit_totals(w.worker_id)[1]:
                    return False
            return True

        await wait_for(compared, 15, message="both rates over the window, after the last reply")
        engine_queries = 0.0
        for w in workers:
            predicted, engine, seconds = window.rates(w.worker_id)
            if predicted is None:
                continue
            # The sim caches exactly what its KV events said: the router's prediction is the engine's.
            first, last = window.windows[w.worker_id][0], window.windows[w.worker_id][-1]
            # The sim caches exactly what its KV events said, and this router is its only client:
            # the tokens the router predicted cached are the ones the engine found cached.
            assert last.predicted - first.predicted == last.hits - first.hits > 0, (w.worker_id, first, last)
            # The rates differ only by the router's prompt-length estimate past its tokenization
            # horizon (kv_aware.Horizon: a cold prompt is tokenized only up to its first block).
            assert engine == pytest.approx(predicted, abs=0.1), (w.worker_id, predicted, engine)
            async with s.get(w.url + "/metrics") as r:
                engine_queries += sample_sum(await r.text(), "vllm:prefix_cache_queries_total")
        assert engine_queries > 0
        hit_rates = [window.rates(w.worker_id)[1] for w in workers]
        assert max(r or 0 for r in hit_rates) > 0.5  # follow-up turns hit their group's prefix

        async with s.get(base + "/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
            text = await r.text()
    for w in workers:
        if window.rates(w.worker_id)[0] is not None:
            label = f'worker_id="{w.worker_id}"'
            assert sample_sum(text, "infera_kv_window_predicted_hit_rate", label) == pytest.approx(
                sample_sum(text, "infera_kv_window_engine_hit_rate", label), abs=0.1)
    assert sample_sum(text, "infera_engine_metrics_scrapes_total", 'outcome="ok"') >= 2
    assert sample_sum(text, "infera_kv_prompt_tokens_total") == sum(server.kv.hit_totals(w.worker_id)[1]
                                                                   for w in workers)
