"""Request migration and the SIGKILL chaos test: real sim workers (launcher + engine) killed
mid-generation under 50 concurrent streams, over HTTP and over NATS."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp

from tests.conftest import children_of, wait_for
from tests.integration.conftest import wait_workers

MODEL = "sim-model"
MAX_TOKENS = 60
# Slow enough that every stream is still generating when the kill lands.
SPEEDUP = 0.25


class StreamResult:
    def __init__(self) -> None:
        self.content_events = 0
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.ids: set[str] = set()
        self.errors: list[dict] = []
        self.usage: dict | None = None
        self.done = False
        self.ended_at = 0.0

    @property
    def content(self) -> str:
        return "".join(self.text)


async def stream_chat(http: aiohttp.ClientSession, i: int, started: asyncio.Event | None = None, *,
                      token_ids: bool = False) -> StreamResult:
    """Stream chat ``i``; with ``token_ids`` the client asks for the output's ids itself (the router
    then passes them on verbatim, across a move too), else none may reach it."""
    out = StreamResult()
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"story {i}"}], "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if token_ids:
        body["return_token_ids"] = True
    async with http.post("/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        buf = b""
        async for data in r.content.iter_any():
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                payload = event[6:]
                if payload == b"[DONE]":
                    out.done = True
                    continue
                obj = json.loads(payload)
                if not token_ids:
                    assert "token_ids" not in json.dumps(obj)  # the router's ids never reach the client
                if "error" in obj:
                    out.errors.append(obj["error"])
                    continue
                out.ids.add(obj["id"])
                if obj.get("usage"):
                    out.usage = obj["usage"]
                for c in obj["choices"]:
                    if c["delta"].get("content"):
                        out.content_events += 1
                        out.text.append(c["delta"]["content"])
                    out.token_ids.extend(c.get("token_ids") or [])
                if out.content_events >= 3 and started is not None:
                    started.set()
    out.ended_at = time.monotonic()
    return out


async def unbroken(server, streams: int) -> list[StreamResult]:
    """Each of the ``streams`` chats run once with no worker killed (ids asked for): the reference a
    migrated stream must equal, token for token (the sims are greedy and all share a seed)."""
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}",
                                     timeout=aiohttp.ClientTimeout(total=60)) as http:
        refs = await asyncio.wait_for(asyncio.gather(*(stream_chat(http, i, token_ids=True)
                                                       for i in range(streams))), 60)
    for r in refs:
        assert not r.errors and r.done and len(r.token_ids) == r.content_events == MAX_TOKENS
    assert len({r.content for r in refs}) == streams  # distinct prompts, distinct answers
    return refs


def assert_same_as_unbroken(results: list[StreamResult], refs: list[StreamResult]) -> None:
    """Not just the count: every stream's text is the unbroken run's, and so are its token ids where
    the client asked for them (the odd streams). A continuation that repeated or dropped a token at
    the seam fails this even with the right count."""
    for i, (r, ref) in enumerate(zip(results, refs)):
        assert r.content == ref.content, (i, r.content, ref.content)
        assert r.token_ids == (ref.token_ids if i % 2 else []), i


def kill_worker(worker) -> None:
    """SIGKILL a worker's launcher and engine at once: a machine that died. (Killing only the
    launcher makes the engine drain: it ends its streams with finish_reason "abort".)"""
    # The engines first: killed after the launcher, an engine could get the launcher's death
    # signal (SIGTERM) in between and drain, ending its streams cleanly (1 run in ~5 here).
    for pid in children_of(worker.proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.killpg(worker.proc.pid, signal.SIGKILL)


async def fleet(make_server, spawn_worker, n: int, *server_flags: str, launcher_args: tuple[str, ...] = ()):
    workers = [await spawn_worker(speedup=SPEEDUP, launcher_args=launcher_args) for _ in range(n)]
    server = await make_server("--router-policy", "round-robin", *server_flags)
    await wait_workers(server, {w.worker_id for w in workers})
    return server, workers


async def run_kill(server, victim, streams: int = 50) -> tuple[list[StreamResult], float]:
    """``streams`` concurrent chats (the odd ones asking for token ids); once all have tokens
    flowing, SIGKILL ``victim``'s launcher and engine together. Every stream must end (no hang)
    within a bound."""
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}",
                                     timeout=aiohttp.ClientTimeout(total=60)) as http:
        flags = [asyncio.Event() for _ in range(streams)]
        tasks = [asyncio.ensure_future(stream_chat(http, i, flags[i], token_ids=bool(i % 2))) for i in range(streams)]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 30)
        killed_at = time.monotonic()
        kill_worker(victim)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    return results, killed_at


async def metric(server, name: str) -> float:
    text = server.metrics.render().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


async def test_sigkill_under_50_streams_with_migration_every_client_gets_its_full_completion(make_server, spawn_worker):
    server, workers = await fleet(make_server, spawn_worker, 3, "--migration-limit", "2")
    refs = await unbroken(server, 50)
    results, _ = await run_kill(server, workers[0])
    for r in results:
        assert not r.errors, r.errors
        assert r.done and len(r.ids) == 1  # one uninterrupted stream
        assert r.content_events == MAX_TOKENS
        assert r.usage is not None and r.usage["completion_tokens"] == MAX_TOKENS
    assert_same_as_unbroken(results, refs)
    moved = await metric(server, "infera_migrations_total")
    assert moved >= 10  # a third of the 50 streams were on the killed worker
    assert await metric(server, "infera_migrations_failed_total") == 0


async def test_sigkill_without_migration_ends_broken_streams_with_an_error_event_in_time(make_server, spawn_worker):
    server, workers = await fleet(make_server, spawn_worker, 3)
    results, killed_at = await run_kill(server, workers[0])
    broken = [r for r in results if r.errors]
    assert len(broken) >= 10
    for r in broken:
        assert r.errors[0]["code"] == "worker_failed_midstream"
        assert r.ended_at - killed_at < 5
    for r in results:
        if not r.errors:
            assert r.done and r.content_events == MAX_TOKENS


async def test_migration_over_nats(make_server, spawn_worker, nats_server):
    flags = ("--request-transport", "nats", "--nats-server", nats_server.url)
    server, workers = await fleet(make_server, spawn_worker, 2, "--migration-limit", "1", *flags, launcher_args=flags)
    assert {r.request_transport for r in server.fleet.all()} == {"nats"}
    refs = await unbroken(server, 10)
    results, _ = await run_kill(server, workers[0], streams=10)
    for r in results:
        assert not r.errors and r.done and r.content_events == MAX_TOKENS, (r.errors, r.content_events)
    assert_same_as_unbroken(results, refs)
    assert await metric(server, "infera_migrations_total") >= 3


async def serving(workers, http: aiohttp.ClientSession):
    """The live workers whose engine is generating."""
    out = []
    for w in workers:
        if w.proc.returncode is None:
            try:
                if await w.engine_metric(http, "vllm:num_requests_running") > 0:
                    out.append(w)
            except aiohttp.ClientError:
                pass
    return out


async def test_a_stream_moves_at_most_limit_times(make_server, spawn_worker):
    server, workers = await fleet(make_server, spawn_worker, 3, "--migration-limit", "1")
    (ref,) = await unbroken(server, 1)
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as http, aiohttp.ClientSession() as probe:
        started = asyncio.Event()
        task = asyncio.ensure_future(stream_chat(http, 0, started, token_ids=True))
        await asyncio.wait_for(started.wait(), 30)
        (first,) = await serving(workers, probe)
        kill_worker(first)
        await wait_for(lambda: metric(server, "infera_migrations_total"), 10, message="the one move")
        await wait_for(lambda: serving(workers, probe), 10, message="the continuation running")
        (second,) = await serving(workers, probe)
        assert second is not first
        kill_worker(second)
        result = await asyncio.wait_for(task, 30)
    assert result.errors and not result.done and result.errors[0]["code"] == "worker_failed_midstream"
    assert 0 < result.content_events < MAX_TOKENS
    # What did arrive, across the one move, is the unbroken run's beginning, id for id.
    assert ref.content.startswith(result.content) and result.token_ids == ref.token_ids[:len(result.token_ids)]
    assert len(result.token_ids) == result.content_events
    assert 'reason="limit"' in server.metrics.render().decode()


async def test_a_dead_nats_worker_ends_its_streams_within_seconds_not_the_idle_timeout(make_server, spawn_worker,
                                                                                       nats_server):
    """Over NATS no connection breaks when a worker dies: its missed heartbeats end its streams."""
    flags = ("--request-transport", "nats", "--nats-server", nats_server.url)
    server, workers = await fleet(make_server, spawn_worker, 2, *flags, launcher_args=flags)
    results, killed_at = await run_kill(server, workers[0], streams=10)
    broken = [r for r in results if r.errors]
    assert len(broken) >= 3
    for r in broken:
        assert r.errors[0]["code"] == "worker_failed_midstream"
        assert r.ended_at - killed_at < 6  # heartbeats every 1 s, dead after 3.5 s
    assert all(r.done and r.content_events == MAX_TOKENS for r in results if not r.errors)
