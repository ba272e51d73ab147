"""A kv-aware server without --router-tokenizer-path tokenizes with the tokenizer its workers name.

Sim workers serve a model folder (a real BPE tokenizer and chat template, not the built-in one);
their records name it. A server that can load it predicts the engines' cache hits exactly; one that
cannot (the folder is not on its host) says so in /health and /v1/workers, and its self-check
flags the hash mismatch under traffic within a minute.
"""
from __future__ import annotations

import logging
import shutil

import aiohttp
import pytest

from infera.discovery.record import tokenizer_fingerprint
from tests.conftest import wait_for
from tests.e2e.tiny_model import build_tiny_model
from tests.integration.conftest import wait_workers

SYSTEM = ("You answer questions about the Infera router: workers register in etcd, the server routes each "
          "request to the worker holding the longest cached prefix of its prompt, balanced against load. ") * 6


@pytest.fixture
def model_dir(tmp_path):
    return str(build_tiny_model(tmp_path / "tiny"))


def chat(question: str) -> dict:
    return {"model": "tiny", "max_tokens": 2, "ignore_eos": True,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}


ADMIN_TOKEN = "tokenizer-discovery-admin"  # /v1/admin/* needs --admin-token


async def get_json(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def ask(s: aiohttp.ClientSession, base: str, question: str) -> int:
    async with s.post(base + "/v1/chat/completions", json=chat(question)) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_server_loads_the_tokenizer_its_workers_name(make_server, spawn_worker, model_dir):
    server = await make_server("--admin-token", ADMIN_TOKEN)  # kv-aware, no --router-tokenizer-path
    w = await spawn_worker("--served-model-name", "tiny", model=model_dir)
    await wait_workers(server, {w.worker_id})
    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as s:
        (record,) = (await get_json(s, base + "/v1/workers"))["workers"]
        assert record["tokenizer"] == model_dir
        assert record["tokenizer_sha256"] == tokenizer_fingerprint(model_dir)
        await wait_for(lambda: server.tokenizers.model_status("tiny")["status"] == "ok", 10,
                       message="the workers' tokenizer loaded")
        health = await get_json(s, base + "/health")
        assert health["kv_routing"] == {"status": "ok", "tokenizer": "workers",
                                        "models": {"tiny": {"status": "ok", "tokenizer": model_dir}}}
        assert (await get_json(s, base + "/v1/workers"))["workers"][0]["kv_routing"] == "ok"
        await wait_for(lambda: server.kv.subscriber.stats(w.worker_id).get("connected"), 10, message="subscribed")
        await ask(s, base, "first question")
        await wait_for(lambda: server.kv.index.block_count(w.worker_id) >= 10, 10, message="the view filled")
        cached = [await ask(s, base, f"question {i}") for i in range(3)]
        view = await get_json(s, f"{base}/v1/admin/cache-view/{w.worker_id}")
    assert all(c >= 10 * 16 for c in cached), cached
    # The router hashed the prompts as the engine did: every prediction exact.
    assert view["prediction"]["observations"] == 4 and view["prediction"]["exact"] == 4, view


async def test_unloadable_tokenizer_is_degraded_and_the_self_check_flags_it(make_server, spawn_worker, model_dir,
                                                                           tmp_path, caplog):
    watcher = await make_server("--router-policy", "round-robin")  # sees the record, loads nothing
    w = await spawn_worker("--served-model-name", "tiny", model=model_dir)
    await wait_workers(watcher, {w.worker_id})
    # The engine has its tokenizer loaded; on this server's "host" the folder is gone.
    shutil.move(model_dir, str(tmp_path / "elsewhere"))
    with caplog.at_level(logging.WARNING):
        server = await make_server()
        await wait_workers(server, {w.worker_id})
        base = f"http://127.0.0.1:{server.port}"
        async with aiohttp.ClientSession() as s:
            await wait_for(lambda: server.tokenizers.model_status("tiny")["status"] == "degraded", 10,
                           message="kv-aware routing marked degraded")
            health = await get_json(s, base + "/health")
            assert health["status"] == "ok"  # still serving
            assert health["kv_routing"]["status"] == "degraded"
            (reason, *_) = health["kv_routing"]["models"]["tiny"]["reasons"]
            assert model_dir in reason and "--router-tokenizer-path" in reason
            (record,) = (await get_json(s, base + "/v1/workers"))["workers"]
            assert record["kv_routing"] == "degraded" and model_dir in record["kv_routing_reason"]
            assert any(model_dir in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
            async with s.get(base + "/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
                assert 'infera_router_tokenizer_degraded{model="tiny"} 1.0' in await r.text()

            # Traffic: the engine caches the shared prefix, the router (built-in tokenizer) cannot
            # predict it. The self-check must say so within a minute.
            await wait_for(lambda: server.kv.subscriber.stats(w.worker_id).get("connected"), 10, message="subscribed")
            turn = 0

            async def diverged() -> bool:
                nonlocal turn
                turn += 1
                await ask(s, base, f"question number {turn}")
                return any("disagree" in r.getMessage() for r in caplog.records)

            took = await wait_for(diverged, 60, interval=0, message="the self-check to flag the hash mismatch")
    assert took < 60 and turn >= 20
