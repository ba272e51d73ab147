"""LoRA-aware routing on sims (issue 32 item 3): sims started with vLLM's LoRA flags register the
adapters they hold; a request for an adapter is always served by a holder (the others would answer
404), /v1/models lists each adapter with its base, an adapter nobody holds is a 404, and kv-aware
predictions are exact per adapter, with base and adapter prefixes never cross-predicted. The
launcher's watch follows runtime loads and unloads into the record."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from infera.discovery.record import WorkerRecord
from infera.engine.base.lora_watch import POLL_INTERVAL_ENV, LoraWatch, probe_lora_adapters
from infera.engine.sim.lora import RUNTIME_UPDATING_ENV
from infera.engine.sim.server import SimServer, parse_args
from tests.conftest import wait_for
from tests.integration.conftest import wait_workers
from tests.integration.test_kv_routing import ADMIN_TOKEN, cache_view, chat, full_blocks

pytestmark = pytest.mark.integration

LORA = ("--enable-lora", "--max-loras", "4")


async def _prompt_tokens(s: aiohttp.ClientSession, worker) -> float:
    return await worker.engine_metric(s, "vllm:prompt_tokens_total")


@pytest.mark.parametrize("policy", ["round-robin", "kv-aware"])
async def test_adapter_requests_go_only_to_holders(make_server, spawn_worker, policy):
    server = await make_server("--router-policy", policy)
    w_sql = await spawn_worker(*LORA, "--lora-modules", "sql=/adapters/sql")
    w_both = await spawn_worker(*LORA, "--lora-modules", "sql=/adapters/sql", '{"name": "poet", "path": "/p"}')
    w_base = await spawn_worker()
    await wait_workers(server, {w_sql.worker_id, w_both.worker_id, w_base.worker_id})
    records = {r.worker_id: r for r in server.fleet.all()}
    assert records[w_sql.worker_id].lora_adapters == ["sql"]
    assert records[w_both.worker_id].lora_adapters == ["poet", "sql"]
    assert records[w_base.worker_id].lora_adapters == []
    assert [records[w.worker_id].lora_max for w in (w_sql, w_both, w_base)] == [4, 4, 0]
    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/v1/models") as r:
            listed = {m["id"]: m.get("parent") for m in (await r.json())["data"]}
        assert listed == {"sim-model": None, "sql": "sim-model", "poet": "sim-model"}

        for model, holders in (("sql", {w_sql, w_both}), ("poet", {w_both})):
            before = {w.worker_id: await _prompt_tokens(s, w) for w in (w_sql, w_both, w_base)}
            for i in range(6):
                async with s.post(base + "/v1/chat/completions", json=chat(i, "q", model=model)) as r:
                    assert r.status == 200, await r.text()  # a non-holder would have answered 404
                    assert (await r.json())["model"] == model
            after = {w.worker_id: await _prompt_tokens(s, w) for w in (w_sql, w_both, w_base)}
            served = {wid for wid in after if after[wid] > before[wid]}
            assert served <= {w.worker_id for w in holders} and served
            if policy == "round-robin":
                assert served == {w.worker_id for w in holders}  # spread over every holder

        async with s.post(base + "/v1/chat/completions", json=chat(0, "q", model="nope")) as r:
            assert r.status == 404
            err = (await r.json())["error"]
            assert err["code"] == "model_not_found" and "sql" in err["message"]


async def test_cached_tokens_predicted_exactly_per_adapter(make_server, spawn_worker):
    server = await make_server("--admin-token", ADMIN_TOKEN)  # kv-aware is the default policy
    worker = await spawn_worker(*LORA, "--num-gpu-blocks", "2048", "--lora-modules", "sql=/a", "poet=/b")
    await wait_workers(server, {worker.worker_id})
    base = f"http://127.0.0.1:{server.port}"
    wid = worker.worker_id
    async with aiohttp.ClientSession() as s:
        await wait_for(lambda: server.kv.stats(wid).get("connected"), 10, message="KV events subscribed")

        async def ask(model: str) -> tuple[int, int, int]:
            before = server.kv.hit_totals(wid)[0]
            async with s.post(base + "/v1/chat/completions", json=chat(3, "the same question", model=model)) as r:
                assert r.status == 200, await r.text()
                reply = await r.json()
            predicted = server.kv.hit_totals(wid)[0] - before
            return reply["usage"]["prompt_tokens_details"]["cached_tokens"], predicted, full_blocks(reply)

        # The same prompt under the base model and two adapters: three cold starts on one engine,
        # then a hit each, every one predicted exactly (never another's prefix).
        for n, model in enumerate(("sim-model", "sql", "poet"), start=1):
            cached, predicted, blocks = await ask(model)
            assert cached == predicted == 0, model
            await wait_for(lambda: server.kv.index.block_count(wid) >= n * blocks, 10,
                           message=f"{model}'s blocks in the view, apart from the others'")
            cached, predicted, _ = await ask(model)
            assert cached >= 16 * (blocks - 1) and predicted == cached, model
        view = await cache_view(s, base, wid)
    assert view["prediction"]["observations"] == 6 and view["prediction"]["exact"] == 6


class _Registration:
    def __init__(self) -> None:
        self.updates: list[WorkerRecord] = []

    async def update(self, record: WorkerRecord) -> bool:
        self.updates.append(record)
        return True


async def test_watch_follows_runtime_loads_and_unloads(monkeypatch):
    monkeypatch.setenv(RUNTIME_UPDATING_ENV, "True")
    args = parse_args(["--model", "m", "--port", "0", "--host", "127.0.0.1", "--speedup", "100", *LORA[:1],
                       "--max-loras", "2", "--lora-modules", "sql=/a"])
    async with SimServer(args) as sim, aiohttp.ClientSession() as s:
        url = f"http://127.0.0.1:{sim.port}"
        assert await probe_lora_adapters(s, url, ["m"]) == ["sql"]
        record = WorkerRecord(worker_id="w", url=url, model_name="m", lora_adapters=["sql"])
        holder = {"record": record}
        reg = _Registration()
        watch = LoraWatch(s, url, ["m"], lambda: holder["record"], lambda r: holder.__setitem__("record", r),
                          reg.update, interval=0.05)
        assert await watch.check() is False  # nothing changed: nothing written

        async def post(path: str, body: dict) -> tuple[int, object]:
            async with s.post(url + path, json=body) as r:
                return r.status, (await r.json() if r.content_type == "application/json" else await r.text())

        assert await post("/v1/load_lora_adapter", {"lora_name": "poet", "lora_path": "/b"}) == (
            200, "Success: LoRA adapter 'poet' added successfully.")
        status, err = await post("/v1/load_lora_adapter", {"lora_name": "poet", "lora_path": "/b"})
        assert status == 400 and "already been loaded" in err["error"]["message"]
        status, err = await post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/c"})
        assert status == 400 and "--max-loras=2" in err["error"]["message"]  # the bound the router can rely on
        status, err = await post("/v1/load_lora_adapter", {"lora_name": "m", "lora_path": "/c"})
        assert status == 400 and "conflicts with a served base model" in err["error"]["message"]
        watch.start()
        try:
            await wait_for(lambda: holder["record"].lora_adapters == ["poet", "sql"], 5, message="load seen")
            assert reg.updates[-1].lora_adapters == ["poet", "sql"]
            async with s.post(url + "/v1/completions", json={"model": "poet", "prompt": "hi", "max_tokens": 1}) as r:
                assert r.status == 200 and (await r.json())["model"] == "poet"
            assert await post("/v1/unload_lora_adapter", {"lora_name": "sql"}) == (
                200, "Success: LoRA adapter 'sql' removed successfully.")
            status, err = await post("/v1/unload_lora_adapter", {"lora_name": "sql"})
            assert status == 404 and err["error"]["type"] == "NotFoundError"
            await wait_for(lambda: holder["record"].lora_adapters == ["poet"], 5, message="unload seen")
            async with s.post(url + "/v1/completions", json={"model": "sql", "prompt": "hi", "max_tokens": 1}) as r:
                assert r.status == 404  # the engine no longer serves it
        finally:
            await watch.stop()
        assert len(reg.updates) == 2


async def test_records_follow_runtime_loads_through_the_launcher(make_server, spawn_worker, monkeypatch):
    monkeypatch.setenv(RUNTIME_UPDATING_ENV, "true")  # (the spawned launcher and engine inherit them)
    monkeypatch.setenv(POLL_INTERVAL_ENV, "0.1")
    server = await make_server("--router-policy", "round-robin")
    holder = await spawn_worker(*LORA, "--lora-modules", "sql=/a")
    other = await spawn_worker(*LORA)
    await wait_workers(server, {holder.worker_id, other.worker_id})
    base = f"http://127.0.0.1:{server.port}"

    def adapters(worker) -> list[str]:
        record = server.fleet.get(worker.worker_id)
        return record.lora_adapters if record is not None else []

    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/completions", json={"model": "poet", "prompt": "x", "max_tokens": 1}) as r:
            assert r.status == 404  # nobody holds it yet
        async with s.post(other.url + "/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": "/p"}) as r:
            assert r.status == 200, await r.text()
        await wait_for(lambda: adapters(other) == ["poet"], 10, message="the load reached the record")
        for _ in range(4):
            async with s.post(base + "/v1/completions", json={"model": "poet", "prompt": "x", "max_tokens": 1}) as r:
                assert r.status == 200, await r.text()
        async with s.post(holder.url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}) as r:
            assert r.status == 200
        await wait_for(lambda: adapters(holder) == [], 10, message="the unload reached the record")
        async with s.post(base + "/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 1}) as r:
            assert r.status == 404


def _mixed_router(server):
    return server.stack.router.mixed


async def test_dynamic_loading_loads_once_on_the_least_loaded_worker(make_server, spawn_worker, monkeypatch):
    from infera.router.lora_loading import AdapterLoader

    monkeypatch.setenv(RUNTIME_UPDATING_ENV, "true")
    server = await make_server("--router-policy", "round-robin", "--lora-dynamic-loading",
                               "--lora-adapter-dir", "/adapters")
    loader = _mixed_router(server).lora_loader
    assert isinstance(loader, AdapterLoader)
    w1 = await spawn_worker("--enable-lora", "--max-loras", "1")
    w2 = await spawn_worker("--enable-lora", "--max-loras", "1")
    await wait_workers(server, {w1.worker_id, w2.worker_id})
    base = f"http://127.0.0.1:{server.port}"

    async def held(s, worker) -> dict:
        async with s.get(worker.url + "/v1/models") as r:
            return {m["id"]: m["root"] for m in (await r.json())["data"] if m.get("parent")}

    async with aiohttp.ClientSession() as s:
        async def ask(model: str) -> tuple[int, dict]:
            async with s.post(base + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1}) as r:
                return r.status, await r.json()

        replies = await asyncio.gather(*(ask("sql") for _ in range(8)))  # concurrent first requests
        assert [st for st, _ in replies] == [200] * 8 and {b["model"] for _, b in replies} == {"sql"}
        assert loader.loads == 1  # one load, not eight
        holdings = [await held(s, w1), await held(s, w2)]
        assert sorted(map(len, holdings)) == [0, 1] and {"sql": "/adapters/sql"} in holdings
        # the next adapter goes to the other worker (fewest adapters), again one load
        assert (await ask("poet"))[0] == 200 and loader.loads == 2
        holdings = [await held(s, w1), await held(s, w2)]
        assert sorted(k for h in holdings for k in h) == ["poet", "sql"] and all(len(h) == 1 for h in holdings)
        for _ in range(3):
            assert (await ask("sql"))[0] == 200 and (await ask("poet"))[0] == 200
        assert loader.loads == 2
        # both engines are at --max-loras: a third adapter is refused by each (bounded tries), then remembered
        status, body = await ask("third")
        assert status == 503 and body["error"]["code"] == "adapter_load_failed"
        assert loader.loads == 4
        assert (await ask("third"))[0] == 503 and loader.loads == 4
        # a name that is no adapter folder name never reaches an engine
        status, body = await ask("../etc")
        assert status == 404 and loader.loads == 4


async def test_dynamic_loading_skips_a_worker_at_its_max_loras(make_server, spawn_worker, monkeypatch):
    """One worker holds one adapter at --max-loras 1, another two of 4: fewest-held alone would try
    the full one first (which refuses); its record's lora_max sends the one load to the other."""
    monkeypatch.setenv(RUNTIME_UPDATING_ENV, "true")
    server = await make_server("--router-policy", "round-robin", "--lora-dynamic-loading",
                               "--lora-adapter-dir", "/adapters")
    full = await spawn_worker("--enable-lora", "--max-loras", "1", "--lora-modules", "sql=/adapters/sql")
    roomy = await spawn_worker(*LORA, "--lora-modules", "poet=/adapters/poet", "chef=/adapters/chef")
    await wait_workers(server, {full.worker_id, roomy.worker_id})
    assert {r.worker_id: r.lora_max for r in server.fleet.all()} == {full.worker_id: 1, roomy.worker_id: 4}
    loader = _mixed_router(server).lora_loader
    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/completions", json={"model": "third", "prompt": "hi", "max_tokens": 1}) as r:
            assert r.status == 200, await r.text()
        async with s.get(roomy.url + "/v1/models") as r:
            held = {m["id"] for m in (await r.json())["data"] if m.get("parent")}
    assert loader.loads == 1 and held == {"chef", "poet", "third"}


@pytest.mark.parametrize("policy", ["kv-aware", "round-robin"])
async def test_count_tokens_for_an_adapter_is_its_base_models_count(make_server, spawn_worker, policy):
    """Anthropic's count_tokens for an adapter: the kv-aware server counts with the base model's
    tokenizer (an adapter changes weights, not tokens); the round-robin one asks a worker holding the
    adapter, whose engine serves the Messages API. Either way the base model's count; an adapter
    nobody holds is a 404."""
    import anthropic

    server = await make_server("--router-policy", policy)
    worker = await spawn_worker(*LORA, "--serve-anthropic", "--lora-modules", "sql=/adapters/sql")
    await wait_workers(server, {worker.worker_id})
    ask = {"system": "be brief", "messages": [{"role": "user", "content": "count these words please"}]}
    async with anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="x",
                                        max_retries=0) as client:
        base = (await client.messages.count_tokens(model="sim-model", **ask)).input_tokens
        adapter = (await client.messages.count_tokens(model="sql", **ask)).input_tokens
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.count_tokens(model="poet", **ask)
        reply = await client.messages.create(model="sql", max_tokens=2, **ask)  # and served under it
    assert adapter == base > 5
    assert reply.model == "sql" and reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == base
