"""PD end to end on simulated engines: real launchers registering in a real etcd, a real server,
KV handed over by the simulator's NIXL-style pull or SGLang-style bootstrap rooms."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from infera.engine.base.prom import sample_sum
from tests.conftest import free_port
from tests.integration.conftest import wait_workers
from tests.integration.test_standin_launchers import spawn  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

NIXL = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
SYSTEM = "You are a meticulous assistant who answers in one sentence. " * 30


def nixl(role: str) -> tuple[str, str]:
    return "--kv-transfer-config", json.dumps({**NIXL, "kv_role": role})


def messages(tag: str) -> list[dict]:
    return [{"role": "system", "content": f"[{tag}] {SYSTEM}"}, {"role": "user", "content": "What is a router?"}]


async def metric(session: aiohttp.ClientSession, url: str, name: str, label: str = "") -> float:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return sample_sum(text, name, label)


EXTERNAL = ('vllm:prompt_tokens_by_source_total', 'source="external_kv_transfer"')


async def test_1p1d_nixl_chat_equals_a_mixed_worker(make_server, spawn_worker):
    server = await make_server("--router-policy", "round-robin")
    p = await spawn_worker(*nixl("kv_producer"), model="pd")
    d = await spawn_worker(*nixl("kv_consumer"), model="pd")
    mixed = await spawn_worker(model="pd-ref")  # same simulated model, served whole
    await wait_workers(server, {p.worker_id, d.worker_id, mixed.worker_id})
    assert (server.fleet.get(p.worker_id).disagg_mode, server.fleet.get(d.worker_id).disagg_mode) == ("prefill", "decode")
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
    ref = openai.AsyncOpenAI(base_url=mixed.url + "/v1", api_key="x", max_retries=0)
    async with aiohttp.ClientSession() as s:
        for i, stream in enumerate((False, True)):
            before = await metric(s, d.url, *EXTERNAL)
            args = dict(messages=messages(f"nixl-{i}"), max_tokens=12, temperature=0)
            if stream:
                chunks = [c async for c in await client.chat.completions.create(
                    model="pd", stream=True, stream_options={"include_usage": True}, **args)]
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                usage = chunks[-1].usage
            else:
                reply = await client.chat.completions.create(model="pd", **args)
                text, usage = reply.choices[0].message.content, reply.usage
            expect = (await ref.chat.completions.create(model="pd-ref", **args)).choices[0].message.content
            assert text == expect and usage.completion_tokens == 12
            moved = await metric(s, d.url, *EXTERNAL) - before
            assert moved >= usage.prompt_tokens - 16  # every full block came over the transfer
            assert usage.prompt_tokens_details.cached_tokens == moved
    await client.close()
    await ref.close()


async def test_2p1d_and_1p2d_use_every_worker_of_each_pool(make_server, spawn_worker):
    server = await make_server("--router-policy", "round-robin")
    ps = [await spawn_worker(*nixl("kv_producer"), model="pd") for _ in range(2)]
    ds = [await spawn_worker(*nixl("kv_consumer"), model="pd") for _ in range(2)]
    await wait_workers(server, {w.worker_id for w in ps + ds[:1]} | {ds[1].worker_id})
    base = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        async def one(i: int) -> None:
            async with s.post(base, json={"model": "pd", "messages": messages(f"pool-{i}"), "max_tokens": 4}) as r:
                assert r.status == 200, await r.text()
        await asyncio.gather(*(one(i) for i in range(8)))
        prefills = [await metric(s, w.url, "vllm:request_success_total") for w in ps]
        decodes = [await metric(s, w.url, *EXTERNAL) for w in ds]
    assert prefills == [4, 4]  # round-robin rotates each pool on its own
    assert all(v > 0 for v in decodes)


async def test_sglang_bootstrap_pair_and_a_mixed_model_on_one_server(make_server, spawn, spawn_worker):
    server = await make_server("--router-policy", "kv-aware")
    flags = ("--disaggregation-allow-tcp",)
    p = await spawn("sglang", "--model-path", "sg", "--disaggregation-mode", "prefill", "--enable-metrics",
                    "--disaggregation-bootstrap-port", str(free_port()),
                    launcher_args=flags)
    d = await spawn("sglang", "--model-path", "sg", "--disaggregation-mode", "decode", "--enable-metrics",
                    launcher_args=flags)
    other = await spawn_worker(model="plain")
    await wait_workers(server, {p.worker_id, d.worker_id, other.worker_id})
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
    stream = await client.chat.completions.create(model="sg", messages=messages("sg"), max_tokens=6, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text
    reply = await client.completions.create(model="sg", prompt="bootstrap " * 50, max_tokens=5)
    assert reply.usage.completion_tokens == 5
    plain = await client.chat.completions.create(model="plain", messages=messages("plain"), max_tokens=3)
    assert plain.usage.completion_tokens == 3
    async with aiohttp.ClientSession() as s:
        # Both SGLang legs saw both requests; the mixed model's worker saw only its own.
        for w in (p, d):
            async with s.get(f"http://127.0.0.1:{w.port}/metrics") as r:
                text = await r.text()
            assert sample_sum(text, "sglang:num_requests_total") == 2
        assert await metric(s, other.url, "vllm:request_success_total") == 1
    await client.close()
