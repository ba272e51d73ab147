"""The fair queue on the dashboard: /v1/fleet carries each model's queue line (waiting, in flight of
its slots and reserve, the oldest wait) from a real server whose heavy tenant queues a backlog."""
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


async def test_the_fleet_view_shows_the_models_queue(fed_server, sim, tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"keys:\n  - sha256: {hashlib.sha256(b'sk-heavy').hexdigest()}\n    tenant: heavy\n")
    server, base = await fed_server("--api-keys-file", str(keys), "--max-inflight-per-worker", "2",
                                    "--queue-reserve-per-worker", "1")
    server.fleet.upsert(WorkerRecord(worker_id="sim-0", url=sim.url, model_name=MODEL, tokenizer=BUILTIN_TOKENIZER))
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-heavy", max_retries=0)
    backlog = [asyncio.ensure_future(client.completions.create(model=MODEL, prompt="hello", max_tokens=200,
                                                               extra_body={"ignore_eos": True})) for _ in range(3)]
    await wait_for(lambda: server.admission.snapshot().get(MODEL, {}).get("waiting") == 2, 10,
                   message="one heavy request in flight (the other slot is the reserve), two waiting")
    async with aiohttp.ClientSession() as s, s.get(base + "/v1/fleet") as r:
        doc = await r.json()
    line = next(m for m in doc["models"] if m["model"] == MODEL)["queue"]
    assert {k: line[k] for k in ("waiting", "in_flight", "capacity", "reserved", "tenants_waiting")} == {
        "waiting": 2, "in_flight": 1, "capacity": 2, "reserved": 1, "tenants_waiting": 1}
    assert line["oldest_wait_s"] >= 0 and line["timeouts_total"] == 0 and line["rejected_total"] == 0
    await asyncio.wait_for(asyncio.gather(*backlog), 60)
    async with aiohttp.ClientSession() as s, s.get(base + "/v1/fleet") as r:
        line = next(m for m in (await r.json())["models"] if m["model"] == MODEL)["queue"]
    assert line["waiting"] == 0 and line["in_flight"] == 0 and line["oldest_wait_s"] is None
    await client.close()
