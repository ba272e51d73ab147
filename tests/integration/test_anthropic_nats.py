"""Anthropic's Messages API to a worker on the NATS plane: its request server relays
``/v1/messages`` and ``/v1/messages/count_tokens`` to the engine like chat, so a round-robin server
(no router tokenizer) gets the engine's own count, equal to asking the engine directly."""
from __future__ import annotations

import aiohttp
import anthropic
import pytest

from tests.integration.conftest import wait_workers

pytestmark = pytest.mark.integration


async def test_count_tokens_and_messages_over_nats(make_server, spawn_worker, nats_server):
    nats = ("--request-transport", "nats", "--nats-server", nats_server.url)
    worker = await spawn_worker("--serve-anthropic", launcher_args=nats)
    server = await make_server("--router-policy", "round-robin", *nats)
    await wait_workers(server, {worker.worker_id})
    (record,) = server.fleet.all()
    assert record.request_transport == "nats" and record.anthropic_messages
    ask = {"model": record.model_name, "system": "be brief",
           "messages": [{"role": "user", "content": "count these words please"}]}
    base = f"http://127.0.0.1:{server.port}"
    async with anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0) as client, \
            aiohttp.ClientSession() as s:
        counted = await client.messages.count_tokens(**ask)
        async with s.post(worker.url + "/v1/messages/count_tokens", json=ask) as direct:
            assert direct.status == 200
            want = (await direct.json())["input_tokens"]
        reply = await client.messages.create(max_tokens=3, **ask)
    assert counted.input_tokens == want > 5
    assert reply.id.startswith("chatcmpl-")  # vLLM's passthrough reply, relayed over NATS
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == want
