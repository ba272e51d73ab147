"""Requests over NATS: a real nats-server, real sim workers (launcher + NATS request server) and
an in-process router, driven by the real ``openai`` client and raw HTTP."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import openai

from tests.conftest import children_of, wait_for
from tests.integration.conftest import wait_workers

MODEL = "sim-model"


def nats_flags(url: str, *extra: str) -> tuple[str, ...]:
    return ("--request-transport", "nats", "--nats-server", url, *extra)


async def nats_fleet(make_server, spawn_worker, url: str, n: int = 1, *, server_flags=(), worker_flags=(),
                     speedup: float = 50.0):
    workers = [await spawn_worker(speedup=speedup, launcher_args=nats_flags(url, *worker_flags)) for _ in range(n)]
    server = await make_server(*nats_flags(url, "--router-policy", "round-robin", *server_flags))
    await wait_workers(server, {w.worker_id for w in workers})
    return server, workers


def engine_pid(worker) -> int:
    kids = children_of(worker.proc.pid)
    assert len(kids) == 1, kids
    return kids[0]


async def test_chat_and_completions_over_nats_with_the_openai_client(make_server, spawn_worker, nats_server):
    server, (w,) = await nats_fleet(make_server, spawn_worker, nats_server.url)
    rec = server.fleet.get(w.worker_id)
    assert rec is not None and rec.request_transport == "nats"
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
    chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello nats"}],
                                                max_tokens=8)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8
    text = await client.completions.create(model=MODEL, prompt="once upon", max_tokens=5)
    assert text.usage.completion_tokens == 5
    pieces = []
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "stream it"}],
                                                  max_tokens=12, stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert len(pieces) >= 2
    stream = await client.completions.create(model=MODEL, prompt="count", max_tokens=6, stream=True)
    assert len([c async for c in stream if c.choices and c.choices[0].text]) >= 2
    # Every one of them went over NATS (the worker's record says so; the router's client counts).
    assert server.transport.nats is not None and server.transport.nats.sent == 4
    async with aiohttp.ClientSession() as http:
        metrics = await (await http.get(f"http://127.0.0.1:{server.port}/metrics")).text()
        health = await (await http.get(f"http://127.0.0.1:{server.port}/health")).json()
    assert "infera_nats_requests_total 4.0" in metrics and "infera_nats_connected 1.0" in metrics
    assert health["nats"] == "connected"
    await client.close()


async def test_engine_error_before_the_first_byte_keeps_its_status(make_server, spawn_worker, nats_server):
    server, _ = await nats_fleet(make_server, spawn_worker, nats_server.url)
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as http:
        # The engine rejects a max_tokens past its context with a 400: upstream would answer 200
        # with an error body.
        async with http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 8192,
                                                      "stream": True}) as r:
            assert r.status == 400
            assert "error" in await r.json()


async def test_idle_timeout_gives_504_and_cancels_on_the_worker(make_server, spawn_worker, nats_server):
    server, (w,) = await nats_fleet(make_server, spawn_worker, nats_server.url,
                                    server_flags=("--nats-req-idle-timeout", "0.5", "--request-max-retries", "0"))
    engine = engine_pid(w)
    os.kill(engine, signal.SIGSTOP)  # a stalled engine: the worker forwards nothing
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as http:
            started = time.monotonic()
            async with http.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}) as r:
                body = await r.json()
            assert r.status == 504, body
            assert "idle timeout" in body["error"]["message"]
            assert time.monotonic() - started < 5
        nats = server.transport.nats
        await wait_for(lambda: nats.cancels_sent >= 1, 5, message="a cancel published")
    finally:
        os.kill(engine, signal.SIGCONT)


async def test_max_pending_gives_429_and_no_other_failure(make_server, spawn_worker, nats_server):
    # Two workers admitting one request each; four concurrent long streams: two are served, the
    # rest are refused with 429 + Retry-After after failing over — nothing else goes wrong.
    server, workers = await nats_fleet(make_server, spawn_worker, nats_server.url, n=2,
                                       worker_flags=("--nats-req-max-pending", "1"), speedup=5)
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as http:
        async def one(i: int) -> tuple[int, str | None]:
            async with http.post("/v1/completions", json={"model": MODEL, "prompt": f"p{i}", "max_tokens": 300,
                                                          "ignore_eos": True, "stream": True}) as r:
                await r.read()
                return r.status, r.headers.get("Retry-After")

        results = await asyncio.gather(*(one(i) for i in range(4)))
    statuses = sorted(s for s, _ in results)
    assert set(statuses) <= {200, 429}, results
    assert statuses.count(200) >= 2 and statuses.count(429) >= 1, results
    assert all(ra == "1" for s, ra in results if s == 429)
    # A full backlog is load, not a fault: the breaker kept both workers.
    assert {r.worker_id for r in server.fleet.active()} == {w.worker_id for w in workers}
    assert all(server.breaker.state(w.worker_id) == "closed" for w in workers)


async def test_client_disconnect_aborts_the_engine_request(make_server, spawn_worker, nats_server):
    server, (w,) = await nats_fleet(make_server, spawn_worker, nats_server.url, speedup=5)
    async with aiohttp.ClientSession(w.url) as engine, aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as http:
        resp = await http.post("/v1/completions", json={"model": MODEL, "prompt": "long", "max_tokens": 4000,
                                                        "ignore_eos": True, "stream": True})
        assert resp.status == 200
        assert (await resp.content.readline()).startswith(b"data: ")
        assert await w.engine_metric(engine, "vllm:num_requests_running") == 1
        resp.close()  # the client leaves mid-stream

        async def aborted() -> bool:
            return await w.engine_metric(engine, "vllm:num_requests_running") == 0

        await wait_for(aborted, 10, message="the engine request aborted")
        text = await (await engine.get("/metrics")).text()
        assert 'finished_reason="abort"' in text


async def test_server_without_nats_never_routes_to_a_nats_worker(make_server, spawn_worker, nats_server):
    w = await spawn_worker(launcher_args=nats_flags(nats_server.url))
    server = await make_server("--router-policy", "round-robin")  # dev plane: no NATS here
    await wait_for(lambda: server.fleet.get(w.worker_id) is not None, 30, message="worker listed")
    assert server.fleet.active() == ()
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as http:
        workers = (await (await http.get("/v1/workers")).json())["workers"]
        (listed,) = [x for x in workers if x["worker_id"] == w.worker_id]
        assert listed["routable"] is False and "--request-transport nats" in listed["unroutable_reason"]
        async with http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 503


async def test_mixed_planes_in_one_fleet(make_server, spawn_worker, nats_server):
    # One HTTP worker, one NATS worker, one server that has NATS: both are served.
    http_worker = await spawn_worker()
    nats_worker = await spawn_worker(launcher_args=nats_flags(nats_server.url))
    server = await make_server(*nats_flags(nats_server.url, "--router-policy", "round-robin"))
    await wait_workers(server, {http_worker.worker_id, nats_worker.worker_id})
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as http:
        for i in range(4):
            async with http.post("/v1/completions", json={"model": MODEL, "prompt": f"x{i}", "max_tokens": 2}) as r:
                assert r.status == 200
    served = {}
    async with aiohttp.ClientSession() as s:
        for w in (http_worker, nats_worker):
            async with s.get(w.url + "/metrics") as r:
                from infera.engine.base.prom import sample_sum
                served[w.worker_id] = sample_sum(await r.text(), "vllm:request_success_total")
    assert all(v == 2 for v in served.values()), served


async def test_nats_restart_under_load(make_server, spawn_worker, own_nats_server):
    """The broker restarts mid-traffic: every request ends (200, or a clear error), none hangs, and
    traffic resumes without restarting the server or the workers."""
    server, workers = await nats_fleet(make_server, spawn_worker, own_nats_server.url, n=2, speedup=20)
    url = f"http://127.0.0.1:{server.port}"
    outcomes: list[int] = []
    stop = asyncio.Event()

    async def load(http: aiohttp.ClientSession, i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                async with http.post("/v1/completions", json={"model": MODEL, "prompt": f"c{i}-{n}", "max_tokens": 16,
                                                              "stream": n % 2 == 0},
                                     timeout=aiohttp.ClientTimeout(total=30)) as r:
                    body = await r.read()
                    # A stream broken mid-way ends with an SSE error event, never silently short.
                    ok = r.status == 200 and (b"[DONE]" in body or b'"choices"' in body) and b'"error"' not in body
                    outcomes.append(200 if ok else (r.status if r.status != 200 else 599))
            except asyncio.TimeoutError:
                outcomes.append(-1)  # a hang: must never happen

    async with aiohttp.ClientSession(url) as http:
        tasks = [asyncio.ensure_future(load(http, i)) for i in range(4)]
        await wait_for(lambda: outcomes.count(200) >= 20, 30, message="traffic before the restart")
        own_nats_server.restart()
        before = len(outcomes)
        await wait_for(lambda: outcomes[before:].count(200) >= 20, 60, message="traffic after the restart")
        stop.set()
        await asyncio.gather(*tasks)
    assert -1 not in outcomes
    assert server.nats is not None and server.nats.disconnects >= 1
    assert all(w.proc.returncode is None for w in workers)


async def test_sigterm_drains_nats_requests_after_deregistering(make_server, spawn_worker, nats_server):
    """Deregister first, then the stream in flight over NATS finishes, then the worker exits 0."""
    server, (w,) = await nats_fleet(make_server, spawn_worker, nats_server.url, speedup=10)
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as http:
        resp = await http.post("/v1/completions", json={"model": MODEL, "prompt": "drain me", "max_tokens": 1500,
                                                        "ignore_eos": True, "stream": True})
        assert resp.status == 200
        assert (await resp.content.readline()).startswith(b"data: ")
        w.signal(signal.SIGTERM)
        await wait_for(lambda: server.fleet.get(w.worker_id) is None, 10, message="deregistered")
        assert w.proc.returncode is None  # still serving the stream
        body = await resp.read()
        assert b"data: [DONE]" in body and b'"error"' not in body
        resp.close()
    assert await asyncio.wait_for(w.proc.wait(), 30) == 0


async def test_a_dead_nats_worker_fails_over_before_its_record_expires(make_server, spawn_worker, nats_server):
    """SIGKILL a worker: its record outlives it (lease 30 s), NATS answers "no responders" for its
    subject, and every request fails over to the live worker; the breaker opens on the dead one."""
    workers = [await spawn_worker(lease_ttl=30, launcher_args=nats_flags(nats_server.url)) for _ in range(2)]
    server = await make_server(*nats_flags(nats_server.url, "--router-policy", "round-robin",
                                           "--breaker-failure-threshold", "2"))
    await wait_workers(server, {w.worker_id for w in workers})
    dead, alive = workers
    os.killpg(dead.proc.pid, signal.SIGKILL)
    await dead.proc.wait()
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as http:
        for i in range(6):
            async with http.post("/v1/completions", json={"model": MODEL, "prompt": f"f{i}", "max_tokens": 2,
                                                          "stream": i % 2 == 1}) as r:
                assert r.status == 200, await r.text()
    assert server.fleet.get(dead.worker_id) is not None  # still registered: NATS told us, not etcd
    assert server.breaker.state(dead.worker_id) == "open"
