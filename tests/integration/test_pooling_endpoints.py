"""Pooling and utility endpoints through the server to sim engines over loopback: a mixed fleet
(generative, embed and classify workers, registered by their launchers with the tasks read from
the engines), each route landing only on the workers that serve it, spread by load; the engine's
answers relayed as written; the errors of a model without a worker for the task; failover; API
keys; and the ``openai`` SDK's ``embeddings.create``."""
from __future__ import annotations

import asyncio
import base64
import hashlib
import struct

import aiohttp
import openai
import pytest

from infera.discovery.record import WorkerRecord
from infera.engine.sim.server import SimServer, parse_args
from tests.conftest import free_port, wait_for
from tests.integration.conftest import wait_workers

pytestmark = pytest.mark.integration

MODEL = "pool-model"
EMBED = ["--runner", "pooling", "--convert", "embed"]
CLASSIFY = ["--runner", "pooling", "--convert", "classify"]


def served_by(server, route: str) -> dict[str, int]:
    """Replies to ``route`` per worker, from the server's own request counter."""
    counts: dict[str, int] = {}
    for (r, status, worker), n in server.metrics.requests.items():
        if r == route and status == "200":
            counts[worker] = counts.get(worker, 0) + n
    return counts


async def post(session: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None):
    async with session.post(url, json=body, headers=headers) as r:
        return r.status, await r.json()


async def test_mixed_fleet_routes_each_task_to_its_workers(make_server, spawn_worker):
    """Launched sims: the records carry the tasks their engines serve, and every route of one model
    goes only to the workers serving its task (tokenize to any), spread over them by load."""
    gen = await spawn_worker(model=MODEL)
    emb1 = await spawn_worker(*EMBED, model=MODEL)
    emb2 = await spawn_worker(*EMBED, model=MODEL)
    cls = await spawn_worker(*CLASSIFY, model=MODEL)
    server = await make_server("--router-policy", "round-robin")
    await wait_workers(server, {w.worker_id for w in (gen, emb1, emb2, cls)}, timeout=60)
    tasks = {r.worker_id: r.tasks for r in server.fleet.all()}
    assert tasks == {gen.worker_id: [], emb1.worker_id: ["embed", "score"], emb2.worker_id: ["embed", "score"],
                     cls.worker_id: ["classify"]}
    base = f"http://127.0.0.1:{server.port}"
    embedders = {emb1.worker_id, emb2.worker_id}
    async with aiohttp.ClientSession() as s:
        replies = await asyncio.gather(*(post(s, base + "/v1/embeddings", {"model": MODEL, "input": f"text {i}"})
                                         for i in range(16)))
        assert all(status == 200 and body["data"][0]["object"] == "embedding" for status, body in replies)
        for route, body in [("/score", {"model": MODEL, "queries": "a", "documents": ["a", "b"]}),
                            ("/v1/score", {"model": MODEL, "text_1": "a", "text_2": "b"}),
                            ("/rerank", {"model": MODEL, "query": "a", "documents": ["b", "a"]}),
                            ("/v1/rerank", {"model": MODEL, "query": "a", "documents": ["b", "a"]}),
                            ("/v2/rerank", {"model": MODEL, "query": "a", "documents": ["b", "a"]})]:
            for _ in range(4):
                status, reply = await post(s, base + route, body)
                assert status == 200, reply
        for i in range(4):
            status, reply = await post(s, base + "/classify", {"model": MODEL, "input": f"c {i}"})
            assert status == 200 and reply["data"][0]["label"] in ("LABEL_0", "LABEL_1")
        for i in range(8):
            status, reply = await post(s, base + "/tokenize", {"model": MODEL, "prompt": f"hello {i}"})
            assert status == 200 and reply["count"] >= 1
        status, reply = await post(s, base + "/detokenize", {"model": MODEL, "tokens": reply["tokens"]})
        assert status == 200 and isinstance(reply["prompt"], str)
    embeds = served_by(server, "/v1/embeddings")
    assert set(embeds) == embedders and sum(embeds.values()) == 16
    assert min(embeds.values()) >= 4  # by load: neither embedder is left idle
    for route in ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"):
        assert set(served_by(server, route)) == embedders, route
    assert set(served_by(server, "/classify")) == {cls.worker_id}
    assert set(served_by(server, "/tokenize")) == {gen.worker_id, emb1.worker_id, emb2.worker_id, cls.worker_id}
    async with aiohttp.ClientSession() as s:  # /v1/models lists the model once
        async with s.get(base + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == [MODEL]


@pytest.fixture
async def sims():
    started = []

    async def start(*flags: str, model: str = MODEL) -> SimServer:
        server = SimServer(parse_args(["--model", model, "--host", "127.0.0.1", "--port", "0", "--speedup", "1000",
                                       *flags]))
        await server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        await server.stop()


async def test_errors_for_a_model_without_a_worker_for_the_task(fed_server, sims):
    gen, emb = await sims(model="llm"), await sims(*EMBED, model="emb")
    server, base = await fed_server()
    server.fleet.upsert(WorkerRecord(worker_id="gen", url=gen.url, model_name="llm"))
    server.fleet.upsert(WorkerRecord(worker_id="emb", url=emb.url, model_name="emb", tasks=["embed", "score"]))
    async with aiohttp.ClientSession() as s:
        status, body = await post(s, base + "/v1/embeddings", {"model": "nope", "input": "x"})
        assert status == 404 and body["error"]["code"] == "model_not_found"
        status, body = await post(s, base + "/v1/embeddings", {"model": "llm", "input": "x"})
        assert status == 400 and body["error"]["code"] == "task_not_supported"
        assert "'embed'" in body["error"]["message"] and "'llm'" in body["error"]["message"]
        status, body = await post(s, base + "/classify", {"model": "emb", "input": "x"})
        assert status == 400 and "'classify'" in body["error"]["message"] and "'emb'" in body["error"]["message"]
        status, body = await post(s, base + "/v1/rerank", {"model": "llm", "query": "q", "documents": ["d"]})
        assert status == 400 and "'score'" in body["error"]["message"]
        status, body = await post(s, base + "/v1/embeddings", {"input": "x"})
        assert status == 400 and body["error"]["param"] == "model"
        # the engine's own 4xx comes back as it wrote it
        status, body = await post(s, base + "/v1/embeddings", {"model": "emb", "input": 5})
        async with s.post(emb.url + "/v1/embeddings", json={"model": "emb", "input": 5}) as direct:
            assert (status, body) == (direct.status, await direct.json()) and status == 400
        # tokenize goes to any worker of the model, generative or pooling
        for model, worker in (("llm", "gen"), ("emb", "emb")):
            status, body = await post(s, base + "/tokenize", {"model": model, "prompt": "hello there"})
            assert status == 200 and body["count"] >= 2
            assert served_by(server, "/tokenize").get(worker) == 1


async def test_failover_to_another_embedder(fed_server, sims):
    emb = await sims(*EMBED)
    server, base = await fed_server("--request-max-retries", "1")
    dead = f"http://127.0.0.1:{free_port()}"
    server.fleet.upsert(WorkerRecord(worker_id="a-dead", url=dead, model_name=MODEL, tasks=["embed", "score"]))
    server.fleet.upsert(WorkerRecord(worker_id="b-live", url=emb.url, model_name=MODEL, tasks=["embed", "score"]))
    async with aiohttp.ClientSession() as s:
        for i in range(4):
            status, body = await post(s, base + "/v1/embeddings", {"model": MODEL, "input": f"x {i}"})
            assert status == 200, body
    assert served_by(server, "/v1/embeddings") == {"b-live": 4}


async def test_openai_sdk_embeddings_match_the_engine(fed_server, sims):
    emb = await sims(*EMBED)
    server, base = await fed_server()
    server.fleet.upsert(WorkerRecord(worker_id="emb", url=emb.url, model_name=MODEL, tasks=["embed", "score"]))
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    try:
        reply = await client.embeddings.create(model=MODEL, input=["the quick fox", "a lazy dog"])  # base64 on the wire
        floats = await client.embeddings.create(model=MODEL, input="the quick fox", encoding_format="float")
        with pytest.raises(openai.BadRequestError) as refused:
            await client.embeddings.create(model=MODEL, input="x", dimensions=8)
    finally:
        await client.close()
    async with aiohttp.ClientSession() as s:
        status, direct = await post(s, emb.url + "/v1/embeddings",
                                    {"model": MODEL, "input": ["the quick fox", "a lazy dog"], "encoding_format": "float"})
        assert status == 200
    for got, want in zip(reply.data, direct["data"], strict=True):
        assert got.embedding == pytest.approx(want["embedding"], rel=1e-6)
    assert floats.data[0].embedding == direct["data"][0]["embedding"]
    assert reply.usage.prompt_tokens == direct["usage"]["prompt_tokens"] and reply.model == MODEL
    assert "does not support Matryoshka embeddings" in str(refused.value)  # the engine's own words
    raw = base64.b64decode(  # and the base64 itself is the engine's float32 bytes
        (await _raw_embedding(base, {"model": MODEL, "input": "a lazy dog", "encoding_format": "base64"})))
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(direct["data"][1]["embedding"], rel=1e-6)


async def _raw_embedding(base: str, body: dict) -> str:
    async with aiohttp.ClientSession() as s:
        status, reply = await post(s, base + "/v1/embeddings", body)
    assert status == 200
    return reply["data"][0]["embedding"]


async def test_api_keys_guard_the_pooling_routes(fed_server, sims, tmp_path):
    emb = await sims(*EMBED)
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys:\n  - sha256: {hashlib.sha256(b'sk-a').hexdigest()}\n    tenant: a\n    models: [\"{MODEL}\"]\n"
                    f"  - sha256: {hashlib.sha256(b'sk-b').hexdigest()}\n    tenant: b\n    models: [\"other\"]\n")
    server, base = await fed_server("--api-keys-file", str(path))
    server.fleet.upsert(WorkerRecord(worker_id="emb", url=emb.url, model_name=MODEL, tasks=["embed", "score"]))
    body = {"model": MODEL, "input": "x"}
    async with aiohttp.ClientSession() as s:
        for route in ("/v1/embeddings", "/tokenize"):
            assert (await post(s, base + route, body))[0] == 401
            assert (await post(s, base + route, body, {"Authorization": "Bearer sk-b"}))[0] == 403
        status, reply = await post(s, base + "/v1/embeddings", body, {"Authorization": "Bearer sk-a"})
        assert status == 200 and len(reply["data"][0]["embedding"]) > 0
    await wait_for(lambda: served_by(server, "/v1/embeddings") == {"emb": 1}, 5, message="counted")


async def test_load_decides_between_a_slow_and_a_fast_embedder(fed_server, sims):
    """By load, not in turn: under steady concurrency the embedder that answers sooner has fewer in
    flight, so it is picked more (round-robin would split evenly)."""
    slow = await sims(*EMBED)
    slow.args.speedup = 0.1  # its modelled prefill: ~170 ms a request
    fast = await sims(*EMBED)
    server, base = await fed_server()
    server.fleet.upsert(WorkerRecord(worker_id="slow", url=slow.url, model_name=MODEL, tasks=["embed", "score"]))
    server.fleet.upsert(WorkerRecord(worker_id="fast", url=fast.url, model_name=MODEL, tasks=["embed", "score"]))

    async def client(s: aiohttp.ClientSession, n: int) -> None:
        for i in range(n):
            status, body = await post(s, base + "/v1/embeddings", {"model": MODEL, "input": f"load {i}"})
            assert status == 200, body

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(client(s, 10) for _ in range(3)))
    counts = served_by(server, "/v1/embeddings")
    assert sum(counts.values()) == 30 and counts.get("fast", 0) >= 2 * counts.get("slow", 0), counts  # RR: 15 each
