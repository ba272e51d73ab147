"""--max-inflight-per-worker end to end: a sim, a heavy tenant's backlog and a light tenant's
request through a real server with API keys: the light request is admitted at the next free slot
(not behind the backlog), every request is served or refused with Retry-After, and the queue shows
in /metrics."""
from __future__ import annotations

import asyncio
import hashlib

import aiohttp
import openai
import pytest

from infera.discovery.record import BUILTIN_TOKENIZER, WorkerRecord
from infera.engine.sim.server import SimServer, parse_args
from tests.conftest import wait_for

pytestmark = pytest.mark.integration

MODEL = "sim-model"


@pytest.fixture
async def sim():
    server = SimServer(parse_args(["--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--speedup", "1"]))
    async with server:
        yield server


def keys(tmp_path) -> str:
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n" + "".join(
        f"  - sha256: {hashlib.sha256(k.encode()).hexdigest()}\n    tenant: {t}\n" for k, t in
        (("sk-heavy", "heavy"), ("sk-light", "light"))))
    return str(path)


async def fair_server(fed_server, sim, tmp_path, *flags):
    server, base = await fed_server("--api-keys-file", keys(tmp_path), "--max-inflight-per-worker", "1", *flags)
    server.fleet.upsert(WorkerRecord(worker_id="sim-0", url=sim.url, model_name=MODEL, tokenizer=BUILTIN_TOKENIZER))
    return server, base


async def test_a_light_request_is_admitted_before_the_heavy_backlog(fed_server, sim, tmp_path):
    server, base = await fair_server(fed_server, sim, tmp_path)
    heavy = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-heavy", max_retries=0)
    light = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-light", max_retries=0)
    done: list[str] = []

    async def request(client, name):
        await client.completions.create(model=MODEL, prompt="hello", max_tokens=30, extra_body={"ignore_eos": True})
        done.append(name)

    backlog = [asyncio.ensure_future(request(heavy, f"heavy{i}")) for i in range(5)]
    await wait_for(lambda: server.admission.snapshot().get(MODEL, {}).get("waiting") == 4, 10,
                   message="one heavy request in the engine, four waiting")
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        assert f'infera_queue_waiting{{model="{MODEL}"}} 4.0' in await r.text()
    light_request = asyncio.ensure_future(request(light, "light"))
    await asyncio.wait_for(asyncio.gather(*backlog, light_request), 60)
    # the heavy request in flight (and, in a race with the light one's arrival, the next), then the
    # light one: not behind the heavy tenant's backlog of four
    assert done.index("light") <= 2 and len(done) == 6, done
    await heavy.close(), await light.close()


async def test_a_request_that_waits_too_long_gets_429_with_retry_after(fed_server, sim, tmp_path):
    server, base = await fair_server(fed_server, sim, tmp_path, "--queue-timeout", "0.2")
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-heavy", max_retries=0)
    long = asyncio.ensure_future(client.completions.create(model=MODEL, prompt="hello", max_tokens=200,
                                                           extra_body={"ignore_eos": True}))
    await wait_for(lambda: server.admission.snapshot().get(MODEL, {}).get("inflight") == 1, 10, message="in flight")
    with pytest.raises(openai.RateLimitError) as err:
        await client.completions.create(model=MODEL, prompt="hello", max_tokens=1)
    assert err.value.body["code"] == "queue_timeout" and err.value.response.headers["retry-after"].isdigit()
    await asyncio.wait_for(long, 60)
    assert server.admission.snapshot()[MODEL] == {"inflight": 0, "waiting": 0, "capacity": 1}
    await client.close()


async def test_weights_from_the_keys_file_share_the_freed_slots(fed_server, sim, tmp_path):
    """Tenant 'gold' (weight: 3 in the keys file) and 'bronze' (no weight: 1), both backlogged behind
    one request in flight on a one-slot model: of the first eight admitted, six are gold's."""
    path = tmp_path / "weighted.yaml"
    path.write_text("keys:\n" + "".join(
        f"  - sha256: {hashlib.sha256(k.encode()).hexdigest()}\n    tenant: {t}\n{w}" for k, t, w in
        (("sk-gold", "gold", "    weight: 3\n"), ("sk-bronze", "bronze", ""))))
    server, base = await fed_server("--api-keys-file", str(path), "--max-inflight-per-worker", "1")
    server.fleet.upsert(WorkerRecord(worker_id="sim-0", url=sim.url, model_name=MODEL, tokenizer=BUILTIN_TOKENIZER))
    gold = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-gold", max_retries=0)
    bronze = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-bronze", max_retries=0)
    done: list[str] = []

    async def request(client, name, tokens=3):
        await client.completions.create(model=MODEL, prompt="hello", max_tokens=tokens, extra_body={"ignore_eos": True})
        done.append(name)

    first = asyncio.ensure_future(request(bronze, "first", 60))
    await wait_for(lambda: server.admission.snapshot().get(MODEL, {}).get("inflight") == 1, 10, message="in flight")
    backlog = [asyncio.ensure_future(request(c, n)) for _ in range(8) for c, n in ((gold, "gold"), (bronze, "bronze"))]
    await wait_for(lambda: server.admission.snapshot().get(MODEL, {}).get("waiting") == 16, 10,
                   message="sixteen waiting behind the one in flight")
    await asyncio.wait_for(asyncio.gather(first, *backlog), 60)
    admitted = done[1:9]  # one slot: completion order is admission order
    assert done[0] == "first" and admitted.count("gold") == 6, done
    await gold.close(), await bronze.close()
