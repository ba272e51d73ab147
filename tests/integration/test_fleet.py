"""A routed fleet on a real etcd with real sim workers (launcher subprocesses)."""
from __future__ import annotations

import asyncio
import signal
import time
import aiohttp
import openai

from tests.conftest import wait_for, requests_by_worker
from tests.integration.conftest import wait_workers

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}


async def _healthy(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url + "/health") as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


async def test_worker_registers_within_2s_of_readiness(make_server, spawn_worker):
    server = await make_server()
    w = await spawn_worker()
    async with aiohttp.ClientSession() as s:
        await wait_for(lambda: _healthy(s, w.url), 30, interval=0.02, message="engine ready")
        took = await wait_workers(server, {w.worker_id}, timeout=10)
        assert took <= 2.0, f"registered {took:.2f}s after readiness"
        async with s.get(f"http://127.0.0.1:{server.port}/v1/workers") as r:
            workers = (await r.json())["workers"]
    assert [(x["worker_id"], x["engine"], x["model_name"], x["kv_block_size"], x["status"]) for x in workers] == [
        (w.worker_id, "sim", "sim-model", 16, "active")]


async def test_even_split_then_sigkill_leaves_within_ttl(make_server, spawn_worker):
    server = await make_server("--router-policy", "round-robin")
    a, b = await spawn_worker(), await spawn_worker()
    await wait_workers(server, {a.worker_id, b.worker_id})
    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as s:
        for _ in range(20):
            async with s.post(base + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200, await r.text()
                assert len(r.headers["X-Infera-Request-Id"]) == 32
        routed = await _requests_by_worker(s, base)
        assert routed == {a.worker_id: 10, b.worker_id: 10}

        # SIGKILL one launcher: its engine dies with it (PDEATHSIG) and its lease expires.
        killed_at = time.monotonic()
        a.signal(signal.SIGKILL)
        failures = 0
        gone = False
        while time.monotonic() - killed_at < 2.0 + 2.0 + 1.0:
            async with s.post(base + "/v1/chat/completions", json=CHAT) as r:
                failures += r.status != 200
            if a.worker_id not in {w.worker_id for w in server.fleet.all()}:
                gone = True
                break
            await asyncio.sleep(0.05)
        assert gone and time.monotonic() - killed_at <= 2.0 + 2.0, "killed worker not gone within TTL + 2 s"
        assert failures == 0, "requests failed while a worker was dying (retry before first byte)"
        for _ in range(5):
            async with s.post(base + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200


async def _requests_by_worker(s: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with s.get(base + "/metrics") as r:
        return requests_by_worker(await r.text())


async def test_sigterm_drains_streams_after_leaving_the_fleet(make_server, spawn_worker):
    server = await make_server()
    # slow engine (speedup 2): a 60-token stream takes well over a second
    w = await spawn_worker(speedup=2.0)
    await wait_workers(server, {w.worker_id})
    base = f"http://127.0.0.1:{server.port}"
    body = {**CHAT, "stream": True, "max_tokens": 60, "ignore_eos": True}
    left_before_done: list[bool] = []

    async def stream_one(s: aiohttp.ClientSession) -> str:
        text = b""
        async with s.post(base + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            async for chunk in r.content.iter_any():
                text += chunk
        left_before_done.append(w.worker_id not in {x.worker_id for x in server.fleet.all()})
        return text.decode()

    async with aiohttp.ClientSession() as s:
        tasks = [asyncio.ensure_future(stream_one(s)) for _ in range(3)]
        await wait_for(lambda: _running(s, w), 10, message="streams running on the engine")
        w.signal(signal.SIGTERM)
        await wait_for(lambda: w.worker_id not in {x.worker_id for x in server.fleet.all()}, 5,
                       message="record deleted on SIGTERM")
        texts = await asyncio.gather(*tasks)
    for t in texts:
        assert t.rstrip().endswith("data: [DONE]"), t[-200:]
        assert '"finish_reason":"length"' in t and '"error"' not in t
    assert left_before_done == [True, True, True]
    assert await asyncio.wait_for(w.proc.wait(), 30) == 0


async def _running(s: aiohttp.ClientSession, w) -> bool:
    try:
        return await w.engine_metric(s, "vllm:num_requests_running") >= 3
    except aiohttp.ClientError:
        return False


async def test_openai_client_stream_and_non_stream(make_server, spawn_worker):
    server = await make_server()
    w = await spawn_worker()
    await wait_workers(server, {w.worker_id})
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["sim-model"]
        chat = await client.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=5, extra_body={"ignore_eos": True})
        assert chat.choices[0].message.content and chat.usage.completion_tokens == 5
        stream = await client.chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=6, stream=True, stream_options={"include_usage": True},
                                                      extra_body={"ignore_eos": True})
        pieces, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
            if chunk.usage:
                usage = chunk.usage
        assert "".join(pieces).strip() and usage is not None and usage.completion_tokens == 6
        comp = await client.completions.create(model="sim-model", prompt="once upon a time", max_tokens=4,
                                               extra_body={"ignore_eos": True})
        assert comp.choices[0].text and comp.usage.completion_tokens == 4
        text = ""
        async for chunk in await client.completions.create(model="sim-model", prompt="x", max_tokens=3, stream=True,
                                                           extra_body={"ignore_eos": True}):
            text += chunk.choices[0].text if chunk.choices else ""
        assert len(text.split()) == 3
    finally:
        await client.close()


async def test_client_disconnect_cancels_upstream(make_server, spawn_worker):
    server = await make_server()
    w = await spawn_worker(speedup=1.0)
    await wait_workers(server, {w.worker_id})
    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as s:
        for stream in (True, False):
            body = {**CHAT, "stream": stream, "max_tokens": 2000, "ignore_eos": True}
            task = asyncio.ensure_future(s.post(base + "/v1/chat/completions", json=body))
            await wait_for(lambda: _engine_running(s, w, 1), 10, message="request running on the engine")
            task.cancel()  # the client goes away mid-request
            try:
                resp = await task
                resp.close()
            except asyncio.CancelledError:
                pass
            await wait_for(lambda: _engine_running(s, w, 0, exact=True), 5,
                           message="engine freed the slot after the client left")


async def _engine_running(s, w, n, exact=False) -> bool:
    v = await w.engine_metric(s, "vllm:num_requests_running")
    return v == n if exact else v >= n


async def test_server_keeps_fleet_while_etcd_down_and_converges(make_server, spawn_worker, etcd):
    server = await make_server()
    a, b = await spawn_worker(), await spawn_worker()
    await wait_workers(server, {a.worker_id, b.worker_id})
    base = f"http://127.0.0.1:{server.port}"
    etcd.stop()
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(4):  # still serving from the last known fleet
                async with s.post(base + "/v1/chat/completions", json=CHAT) as r:
                    assert r.status == 200
        b.signal(signal.SIGKILL)  # dies while etcd is down: its DELETE can only come later
        await asyncio.sleep(0.5)
    finally:
        etcd.start()
    # b's lease expires after etcd is back; a keeps its registration; no ghost remains.
    await wait_workers(server, {a.worker_id}, timeout=20)
    async with aiohttp.ClientSession() as s:
        async with s.post(base + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200


async def test_wiped_etcd_leaves_no_ghost(make_server, spawn_worker, etcd):
    """etcd loses its data while a worker died: re-list must drop the ghost; the live worker re-registers."""
    server = await make_server()
    a, b = await spawn_worker(), await spawn_worker()
    await wait_workers(server, {a.worker_id, b.worker_id})
    etcd.stop()
    b.signal(signal.SIGKILL)
    etcd.start(wipe=True)
    await wait_workers(server, {a.worker_id}, timeout=20)
