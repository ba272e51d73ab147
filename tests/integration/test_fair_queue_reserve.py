"""--queue-reserve-per-worker end to end: a sim, a server with API keys, a heavy tenant that fills
the open slots and queues a backlog behind them, and a light tenant whose request takes a reserved
slot at once: it is answered while the heavy request in flight is still streaming and the heavy
backlog still waits (a work-conserving queue would have held it until a heavy request ended)."""
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


async def test_a_light_request_takes_a_reserved_slot_while_the_heavy_backlog_waits(fed_server, sim, tmp_path):
    server, base = await fed_server("--api-keys-file", keys(tmp_path), "--max-inflight-per-worker", "2",
                                    "--queue-reserve-per-worker", "1")
    assert server.admission.reserved_share == 0.5  # the flag reaches the queue
    server.fleet.upsert(WorkerRecord(worker_id="sim-0", url=sim.url, model_name=MODEL, tokenizer=BUILTIN_TOKENIZER))
    heavy = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-heavy", max_retries=0)
    light = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-light", max_retries=0)
    done: list[str] = []

    async def request(client, name, max_tokens):
        await client.completions.create(model=MODEL, prompt="hello", max_tokens=max_tokens,
                                        extra_body={"ignore_eos": True})
        done.append(name)

    # ~200 decode steps each (over a second): the one in flight is still streaming when the light one ends
    backlog = [asyncio.ensure_future(request(heavy, f"heavy{i}", 200)) for i in range(4)]
    await wait_for(lambda: server.admission.snapshot().get(MODEL) == {"inflight": 1, "waiting": 3, "capacity": 2},
                   10, message="the heavy tenant alone holds the open slot, not the reserved one; three wait")
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        assert f'infera_queue_waiting{{model="{MODEL}"}} 3.0' in await r.text()
    await asyncio.wait_for(request(light, "light", 4), 30)
    assert done == ["light"]  # before any heavy request ended: it did not wait for their slot
    assert server.admission.snapshot()[MODEL]["waiting"] == 3  # and the heavy backlog still waits
    await asyncio.wait_for(asyncio.gather(*backlog), 60)
    assert sorted(done) == ["heavy0", "heavy1", "heavy2", "heavy3", "light"]
    assert server.admission.snapshot()[MODEL] == {"inflight": 0, "waiting": 0, "capacity": 2}
    await heavy.close(), await light.close()

