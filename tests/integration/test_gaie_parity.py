"""The EPP picks as ``infera.server`` does: one kv-aware workload (8 documents, each asked several
questions: a long shared prefix per document) through Envoy + EPP, then, on the same sims with
their caches reset, through ``infera.server``; the hit rates, computed from the sims' own
``usage.prompt_tokens_details.cached_tokens``, agree within 1 percentage point.

The workload goes round by round (every document's first question, then every document's second,
...) one request at a time, so each router has heard the KV events of a document's previous turn
(seven requests ago) before it routes the next: the picks are deterministic, not a race."""
from __future__ import annotations

import aiohttp
import pytest

from tests.conftest import wait_for
from tests.integration.conftest import wait_workers
from tests.integration.test_gaie_failures import gateway  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()
DOCUMENTS = 8
QUESTIONS = ("What is it about?", "Who wrote it?", "Summarise the second part.", "What is the conclusion?")


def document(n: int, words: int = 250) -> str:
    return " ".join(f"{WORDS[(n * 7 + i) % len(WORDS)]}{(n * 31 + i) % 97}" for i in range(words))


def workload() -> list[dict]:
    return [{"model": "sim-model", "max_tokens": 2, "ignore_eos": True,
             "messages": [{"role": "system", "content": f"Document {d}: {document(d)}"},
                          {"role": "user", "content": question}]}
            for question in QUESTIONS for d in range(DOCUMENTS)]


async def run(s: aiohttp.ClientSession, base: str) -> tuple[int, int]:
    """(cached, prompt) tokens summed over the workload, as the sims reported them."""
    cached = prompt = 0
    for body in workload():
        async with s.post(base + "/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=10)) as r:
            assert r.status == 200, await r.text()
            usage = (await r.json())["usage"]
        prompt += usage["prompt_tokens"]
        cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return cached, prompt


async def test_epp_hit_rate_equals_the_servers_on_the_same_workload(gateway, make_server, spawn_worker):
    workers = [await spawn_worker("--num-gpu-blocks", "4096") for _ in range(3)]
    gw = await gateway()  # kv-aware, the default policy, as the server's
    await wait_for(lambda: gw.has_workers(3), 30, message="the EPP sees 3 workers")
    server = await make_server()
    await wait_workers(server, {w.worker_id for w in workers})
    async with aiohttp.ClientSession() as s:
        epp_cached, epp_prompt = await run(s, gw.url)
        # same sims, caches emptied (their AllBlocksCleared events empty the routers' views too)
        for w in workers:
            async with s.post(w.url + "/reset_prefix_cache", timeout=aiohttp.ClientTimeout(total=5)) as r:
                assert r.status == 200, await r.text()
        await wait_for(lambda: all(server.kv.subscriber.stats(w.worker_id).get("connected") for w in workers), 10,
                       message="the server's KV-event subscriptions connected")
        await wait_for(lambda: sum(server.kv.index.block_count(w.worker_id) for w in workers) == 0, 10,
                       message="the server's view emptied by the reset")
        server_cached, server_prompt = await run(s, f"http://127.0.0.1:{server.port}")
    assert epp_prompt == server_prompt  # the same prompts, tokenized by the same sims
    epp_rate, server_rate = epp_cached / epp_prompt, server_cached / server_prompt
    # every follow-up must have hit, or the comparison says nothing
    assert server_rate > 0.5 * (len(QUESTIONS) - 1) / len(QUESTIONS), server_rate
    assert abs(epp_rate - server_rate) <= 0.01, f"EPP {epp_rate:.3%} vs server {server_rate:.3%}"
    print(f"hit rate: EPP {epp_rate:.2%}, infera.server {server_rate:.2%}")
