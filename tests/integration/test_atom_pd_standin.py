"""ATOM PD end to end: the ATOM launcher with the ATOM stand-in (Mooncake handoff as ATOM v0.1.5
writes it, ``infera/engine/sim/atom_pd.py``), a real etcd and a real router. Chat and completions
both go through the pair (ATOM v0.1.5 serves PD on both routes), and each answer equals the one a
mixed ATOM worker gives for the same prompt."""
from __future__ import annotations

import json

import aiohttp
import openai
import pytest

from infera.engine.base.prom import sample_sum
from tests.conftest import free_port
from tests.integration.conftest import wait_workers
from tests.integration.test_standin_launchers import spawn  # noqa: F401  (fixture)

pytestmark = pytest.mark.integration

SYSTEM = "You are a meticulous assistant who answers in one sentence. " * 30
EXTERNAL = ('vllm:prompt_tokens_by_source_total', 'source="external_kv_transfer"')
ALLOW_TCP = ("--disaggregation-allow-tcp",)


def mooncake(role: str, handshake_port: int) -> tuple[str, str]:
    return "--kv-transfer-config", json.dumps({"kv_connector": "mooncake", "kv_role": role,
                                               "handshake_port": handshake_port})


async def moved(session: aiohttp.ClientSession, port: int) -> float:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
        return sample_sum(await r.text(), *EXTERNAL)


async def test_atom_mooncake_pair_serves_chat_and_completions(make_server, spawn):  # noqa: F811
    server = await make_server("--router-policy", "round-robin")
    p = await spawn("atom", "--model", "atom-pd", *mooncake("kv_producer", free_port()), launcher_args=ALLOW_TCP)
    d = await spawn("atom", "--model", "atom-pd", *mooncake("kv_consumer", free_port()), launcher_args=ALLOW_TCP)
    ref = await spawn("atom", "--model", "atom-ref")  # the same simulated model, served whole
    await wait_workers(server, {p.worker_id, d.worker_id, ref.worker_id})
    assert (server.fleet.get(p.worker_id).disagg_mode, server.fleet.get(d.worker_id).disagg_mode) == \
        ("prefill", "decode")
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
    try:
        async with aiohttp.ClientSession() as s:
            for i, stream in enumerate((False, True)):
                before = await moved(s, d.port)
                args = dict(messages=[{"role": "system", "content": f"[{i}] {SYSTEM}"},
                                      {"role": "user", "content": "What is a router?"}],
                            max_tokens=12, temperature=0)
                if stream:
                    chunks = [c async for c in await client.chat.completions.create(
                        model="atom-pd", stream=True, stream_options={"include_usage": True}, **args)]
                    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                    usage = chunks[-1].usage
                else:
                    reply = await client.chat.completions.create(model="atom-pd", **args)
                    text, usage = reply.choices[0].message.content, reply.usage
                expect = (await client.chat.completions.create(model="atom-ref", **args)).choices[0].message.content
                assert text == expect and usage.completion_tokens == 12
                # the decode took every full block of the prompt from the prefill
                assert await moved(s, d.port) - before >= usage.prompt_tokens - 16
            before = await moved(s, d.port)
            prompt = "handshake " * 60
            reply = await client.completions.create(model="atom-pd", prompt=prompt, max_tokens=5, temperature=0)
            expect = await client.completions.create(model="atom-ref", prompt=prompt, max_tokens=5, temperature=0)
            assert reply.choices[0].text == expect.choices[0].text and reply.usage.completion_tokens == 5
            assert await moved(s, d.port) - before >= reply.usage.prompt_tokens - 16
            assert await moved(s, ref.port) == 0  # the mixed worker computed its prompts itself
    finally:
        await client.close()
