"""Tenant limits shared by replicas, end to end: two server replicas over a real nats-server hold a
tenant to its requests/min within the stated slack (R − 1 = 1), a 429 carries Retry-After and the
x-ratelimit-* headers the openai SDK reads, and a tokens/min limit counts streamed usage."""
from __future__ import annotations

import asyncio
import hashlib

import openai
import pytest

from infera.discovery.record import BUILTIN_TOKENIZER, WorkerRecord
from infera.engine.sim.server import SimServer, parse_args
from tests.conftest import wait_for

pytestmark = pytest.mark.integration

MODEL = "sim-model"


def keys_file(tmp_path, **limits) -> str:
    path = tmp_path / "keys.yaml"
    extra = "".join(f"    {k}: {v}\n" for k, v in limits.items())
    path.write_text(f"keys:\n  - sha256: {hashlib.sha256(b'sk-a').hexdigest()}\n    tenant: team-a\n{extra}")
    return str(path)


@pytest.fixture
async def sim():
    server = SimServer(parse_args(["--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--speedup", "1000"]))
    async with server:
        yield server


async def keyed_server(fed_server, sim, *flags):
    server, base = await fed_server(*flags)
    server.fleet.upsert(WorkerRecord(worker_id="sim-0", url=sim.url, model_name=MODEL, tokenizer=BUILTIN_TOKENIZER))
    return server, openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-a", max_retries=0)


async def test_two_replicas_over_nats_hold_the_tenant_to_its_rpm(fed_server, sim, nats_server, tmp_path):
    path = keys_file(tmp_path, requests_per_minute=20)
    flags = ("--api-keys-file", path, "--replica-sync", "nats", "--nats-server", nats_server.url)
    (a, client_a), (b, client_b) = [await keyed_server(fed_server, sim, *flags) for _ in range(2)]
    # each limiter counts the other alive (their empty reports are heartbeats)
    await wait_for(lambda: a.limiter._live_peers(a.limiter.clock()) and b.limiter._live_peers(b.limiter.clock()),
                   10, message="the replicas hear each other")

    async def one(client) -> int:
        try:
            await client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
            return 200
        except openai.RateLimitError as exc:
            assert exc.response.headers["retry-after"].isdigit()
            assert exc.response.headers["x-ratelimit-limit-requests"] == "20"
            return 429

    statuses = await asyncio.gather(*[one(client_a if i % 2 else client_b) for i in range(60)])
    served = statuses.count(200)
    assert 20 <= served <= 21, statuses  # the limit, + R − 1 at most
    assert statuses.count(429) == 60 - served
    await client_a.close(), await client_b.close()


async def test_tokens_per_minute_counts_streamed_usage(fed_server, sim, tmp_path):
    server, client = await keyed_server(fed_server, sim, "--api-keys-file", keys_file(tmp_path, tokens_per_minute=30))
    stream = await client.chat.completions.create(model=MODEL, max_tokens=40, stream=True,
                                                  messages=[{"role": "user", "content": "count to forty"}],
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
    usage = [c.usage async for c in stream if c.usage is not None]
    assert usage and usage[-1].total_tokens > 30
    with pytest.raises(openai.RateLimitError) as err:
        await client.chat.completions.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert err.value.response.headers["x-ratelimit-limit-tokens"] == "30"
    assert server.limiter.refused == {("team-a", "tokens"): 1}
    await client.close()


async def test_max_concurrent_counts_requests_in_flight(fed_server, sim, tmp_path):
    server, client = await keyed_server(fed_server, sim, "--api-keys-file", keys_file(tmp_path, max_concurrent=1))
    stream = await client.completions.create(model=MODEL, prompt="hi", max_tokens=200, stream=True,
                                             extra_body={"ignore_eos": True})
    first = await stream.__anext__()  # the first request is in flight
    assert first is not None
    with pytest.raises(openai.RateLimitError):
        await client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    async for _ in stream:
        pass
    await wait_for(lambda: server.limiter._own.get("team-a") is None or server.limiter._own["team-a"].inflight == 0,
                   5, message="the stream's charge released")
    await client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    await client.close()
