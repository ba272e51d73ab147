"""PD end to end on simulated engines: real launchers registering in a real etcd, a real server,
KV handed over by the simulator's NIXL-style pull or SGLang-style bootstrap rooms."""
from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp
import openai
import pytest

from infera.engine.base.prom import sample_sum
from tests.conftest import children_of, free_port
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


@pytest.mark.parametrize("plane", ["http", "nats"])
async def test_1p1d_nixl_chat_equals_a_mixed_worker(make_server, spawn_worker, plane, request):
    # Both PD legs go the way their workers serve: over NATS on the production plane.
    flags: tuple[str, ...] = ()
    if plane == "nats":
        flags = ("--request-transport", "nats", "--nats-server", request.getfixturevalue("nats_server").url)
    server = await make_server("--router-policy", "round-robin", *flags)
    p = await spawn_worker(*nixl("kv_producer"), model="pd", launcher_args=flags)
    d = await spawn_worker(*nixl("kv_consumer"), model="pd", launcher_args=flags)
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
    if plane == "nats":
        assert server.transport.nats is not None and server.transport.nats.sent == 4  # 2 requests × 2 legs
    await client.close()
    await ref.close()


@pytest.mark.parametrize("n_prefill, n_decode", [(2, 1), (1, 2)])
async def test_2p1d_and_1p2d_use_every_worker_of_each_pool(make_server, spawn_worker, n_prefill, n_decode):
    server = await make_server("--router-policy", "round-robin")
    ps = [await spawn_worker(*nixl("kv_producer"), model="pd") for _ in range(n_prefill)]
    ds = [await spawn_worker(*nixl("kv_consumer"), model="pd") for _ in range(n_decode)]
    await wait_workers(server, {w.worker_id for w in ps + ds})
    base = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        async def one(i: int) -> None:
            async with s.post(base, json={"model": "pd", "messages": messages(f"pool-{i}"), "max_tokens": 4}) as r:
                assert r.status == 200, await r.text()
        await asyncio.gather(*(one(i) for i in range(8)))
        prefills = [await metric(s, w.url, "vllm:request_success_total") for w in ps]
        moved = [await metric(s, w.url, *EXTERNAL) for w in ds]
        served = [await metric(s, w.url, "vllm:request_success_total") for w in ds]
    assert prefills == [8 // n_prefill] * n_prefill  # round-robin rotates each pool on its own
    assert served == [8 // n_decode] * n_decode and all(v > 0 for v in moved)


async def test_frozen_prefill_is_bounded_and_the_pair_retried(make_server, spawn_worker):
    """A prefill engine that stops answering (SIGSTOP) costs at most --pd-prefill-timeout: the
    request is retried on the other prefill, and every client request succeeds."""
    server = await make_server("--router-policy", "round-robin", "--pd-prefill-timeout", "1",
                               "--breaker-failure-threshold", "0")
    ps = [await spawn_worker(*nixl("kv_producer"), model="pd", lease_ttl=30) for _ in range(2)]
    d = await spawn_worker(*nixl("kv_consumer"), model="pd")
    await wait_workers(server, {ps[0].worker_id, ps[1].worker_id, d.worker_id})
    frozen = children_of(ps[0].proc.pid)
    assert frozen, "the prefill launcher has no engine child"
    base = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    try:
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        async with aiohttp.ClientSession() as s:
            for i in range(4):  # round-robin sends every other one to the frozen prefill first
                async with s.post(base, json={"model": "pd", "messages": messages(f"frozen-{i}"),
                                              "max_tokens": 4}, timeout=aiohttp.ClientTimeout(total=20)) as r:
                    assert r.status == 200, await r.text()
            async with s.get(f"http://127.0.0.1:{server.port}/metrics") as r:
                text = await r.text()
        assert sample_sum(text, "infera_request_retries_total", 'reason="prefill_prefill_timeout"') == 2
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)


async def test_decode_dying_mid_stream_ends_with_an_error_event(make_server, spawn_worker):
    server = await make_server("--router-policy", "round-robin")
    p = await spawn_worker(*nixl("kv_producer"), model="pd")
    d = await spawn_worker(*nixl("kv_consumer"), model="pd", speedup=1.0)  # a stream that lasts seconds
    await wait_workers(server, {p.worker_id, d.worker_id})
    engine = children_of(d.proc.pid)
    assert engine
    body = {"model": "pd", "messages": messages("midstream"), "max_tokens": 2000, "ignore_eos": True, "stream": True}
    events = []
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", json=body,
                          timeout=aiohttp.ClientTimeout(total=30)) as r:
            assert r.status == 200
            async for line in r.content:
                if not line.startswith(b"data:"):
                    continue
                events.append(line)
                if len(events) == 3:
                    os.kill(engine[0], signal.SIGKILL)
    assert len(events) > 3 and b"[DONE]" not in events[-1]
    assert json.loads(events[-1][5:])["error"]["code"] == "worker_failed_midstream"


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
