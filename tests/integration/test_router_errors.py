"""Router error semantics against in-process fake workers over real loopback HTTP.

The fleet is fed directly (a no-op discovery), so each test sets up exactly the workers it needs.
"""
from __future__ import annotations


import aiohttp
import openai
import pytest
from aiohttp import web

from infera.discovery.record import WorkerRecord
from tests.integration.conftest import LoopbackEngine

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SSE_OK = [b'data: {"choices":[{"index":0,"delta":{"content":" a"}}]}\n\n',
          b'data: {"choices":[{"index":0,"delta":{"content":" b"}}]}\n\n', b"data: [DONE]\n\n"]


class FakeWorker(LoopbackEngine):
    """A tiny OpenAI-ish worker whose behaviour each test chooses."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.hits = 0
        self.seen_request_ids: list[str] = []
        self.seen_dp_ranks: list[str | None] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        self.seen_request_ids.append(request.headers.get("X-Request-Id", ""))
        self.seen_dp_ranks.append(request.headers.get("X-Data-Parallel-Rank"))
        body = await request.json()
        if self.mode == "500":
            return web.json_response({"error": {"message": "engine exploded"}}, status=500)
        if self.mode == "400":
            return web.json_response({"error": {"message": "bad sampling params", "code": 400}}, status=400)
        if not body.get("stream"):
            return web.json_response({"id": "x", "choices": [{"message": {"content": "ok"}}], "worker": self.port})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, frame in enumerate(SSE_OK):
            if self.mode == "midstream" and i == 1:
                request.transport.abort()  # die after the first byte
                return resp
            await resp.write(frame)
        return resp

    def record(self, model: str = "m") -> WorkerRecord:
        return WorkerRecord(worker_id=f"fake-{self.mode}-{self.port}", url=f"http://127.0.0.1:{self.port}", model_name=model)


@pytest.fixture
async def env(fed_server):
    workers = []

    async def worker(mode: str = "ok") -> FakeWorker:
        w = await FakeWorker(mode).start()
        workers.append(w)
        return w

    async with aiohttp.ClientSession() as session:
        yield fed_server, worker, session
    for w in workers:
        await w.stop()


def _refused_record() -> WorkerRecord:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: connecting is refused
    return WorkerRecord(worker_id=f"dead-{port}", url=f"http://127.0.0.1:{port}", model_name="m")


def assert_openai_error(payload: dict, code: str | None = None) -> dict:
    err = payload["error"]
    assert set(err) >= {"message", "type", "code"} and err["message"]
    if code:
        assert err["code"] == code
    return err


@pytest.mark.parametrize(
    "data, fragment",
    [
        (b"{nope", "malformed JSON"),
        (b'{"model":"m","messages":"hi"}', "messages"),
        (b'{"model":"m","messages":[],"stream":"yes"}', "stream"),
        (b'{"model":"m","messages":[],"max_tokens":-1}', "max_tokens"),
        (b"", "empty"),
    ],
)
async def test_bad_input_is_400(env, data, fragment):
    server, worker, s = env
    srv, base = await server()
    srv.fleet.upsert((await worker()).record())
    async with s.post(base + "/v1/chat/completions", data=data, headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        err = assert_openai_error(await r.json())
        assert err["type"] == "invalid_request_error" and fragment in err["message"]
        assert r.headers["X-Infera-Request-Id"]


async def test_unknown_model_404_and_empty_fleet_503(env):
    server, worker, s = env
    srv, base = await server()
    async with s.post(base + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert_openai_error(await r.json(), "no_active_worker")
    srv.fleet.upsert((await worker()).record())
    async with s.post(base + "/v1/chat/completions", json={**CHAT, "model": "other"}) as r:
        assert r.status == 404
        assert_openai_error(await r.json(), "model_not_found")


async def test_draining_only_model_is_503(env):
    server, worker, s = env
    srv, base = await server()
    srv.fleet.upsert((await worker()).record(model="busy"))
    w2 = await worker()
    rec = w2.record()
    rec.status = "draining"
    srv.fleet.upsert(rec)
    async with s.post(base + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 503 and "Retry-After" in r.headers


async def test_body_over_limit_is_413(env):
    server, worker, s = env
    srv, base = await server("--max-request-bytes", "1024")
    srv.fleet.upsert((await worker()).record())
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    async with s.post(base + "/v1/chat/completions", json=big) as r:
        assert r.status == 413
        assert_openai_error(await r.json(), "request_too_large")

    async def chunks():  # no Content-Length: the limit must hold for chunked bodies too
        for _ in range(10):
            yield b"x" * 500

    async with s.post(base + "/v1/completions", data=chunks()) as r:
        assert r.status == 413


async def test_unknown_route_and_method_use_openai_shape(env):
    server, _, s = env
    _, base = await server()
    async with s.get(base + "/v1/nope") as r:
        assert r.status == 404
        assert_openai_error(await r.json())
    async with s.get(base + "/v1/chat/completions") as r:
        assert r.status == 405
        assert_openai_error(await r.json())


async def test_request_id_echoed_and_forwarded(env):
    server, worker, s = env
    srv, base = await server()
    w = await worker()
    srv.fleet.upsert(w.record())
    async with s.post(base + "/v1/chat/completions", json=CHAT, headers={"X-Infera-Request-Id": "abc123"}) as r:
        assert r.status == 200 and r.headers["X-Infera-Request-Id"] == "abc123"
    assert w.seen_request_ids == ["abc123"]


@pytest.mark.parametrize("policy", ["round-robin", "kv-aware"])
@pytest.mark.parametrize("bad", ["refused", "500"])
@pytest.mark.parametrize("stream", [False, True])
async def test_failure_before_first_byte_is_retried(env, bad, stream, policy):
    server, worker, s = env
    srv, base = await server("--request-max-retries", "1", "--router-policy", policy)
    good = await worker()
    bad_rec = _refused_record() if bad == "refused" else (await worker("500")).record()
    srv.fleet.upsert(bad_rec)
    srv.fleet.upsert(good.record())
    for _ in range(6):  # round-robin hits the bad worker first half the time
        async with s.post(base + "/v1/chat/completions", json={**CHAT, "stream": stream}) as r:
            assert r.status == 200
            body = await r.read()
            assert (b"[DONE]" in body) if stream else (b'"ok"' in body)
    assert good.hits == 6
    metrics = await (await s.get(base + "/metrics")).text()
    assert "infera_request_retries_total" in metrics


async def test_no_retries_left_returns_last_error(env):
    server, worker, s = env
    srv, base = await server("--request-max-retries", "0")
    srv.fleet.upsert(_refused_record())
    async with s.post(base + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 502
        assert "unreachable" in assert_openai_error(await r.json())["message"]
    srv2, base2 = await server("--request-max-retries", "3")
    w500 = await worker("500")
    srv2.fleet.upsert(w500.record())
    async with s.post(base2 + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 500 and w500.hits == 1  # only one distinct worker to try


async def test_client_error_from_engine_is_returned_not_retried(env):
    server, worker, s = env
    srv, base = await server("--request-max-retries", "2")
    w400, good = await worker("400"), await worker()
    srv.fleet.upsert(w400.record())
    srv.fleet.upsert(good.record())
    statuses = []
    for _ in range(2):
        async with s.post(base + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            statuses.append(r.status)
    assert sorted(statuses) == [200, 400] and w400.hits == 1 and good.hits == 1


async def test_midstream_failure_ends_with_error_event(env):
    server, worker, s = env
    srv, base = await server("--request-max-retries", "3")
    w = await worker("midstream")
    srv.fleet.upsert(w.record())
    async with s.post(base + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        assert r.status == 200
        body = await r.read()
    assert body.startswith(SSE_OK[0])
    assert body.rstrip().endswith(b"}") and b'"error"' in body and b"mid-stream" in body
    assert w.hits == 1  # never retried after the first byte
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError, match="mid-stream"):
        async for _ in await client.chat.completions.create(model="m", messages=CHAT["messages"], stream=True):
            pass
    await client.close()


async def test_direct_mode_honours_worker_header(env):
    server, worker, s = env
    srv, base = await server("--router-mode", "direct")
    a, b = await worker(), await worker()
    srv.fleet.upsert(a.record())
    srv.fleet.upsert(b.record())
    for _ in range(3):
        async with s.post(base + "/v1/chat/completions", json=CHAT,
                           headers={"x-worker-instance-id": b.record().worker_id}) as r:
            assert (await r.json())["worker"] == b.port
    assert (a.hits, b.hits) == (0, 3)
    async with s.post(base + "/v1/chat/completions", json=CHAT, headers={"x-worker-instance-id": "gone:1"}) as r:
        assert r.status == 503
        assert_openai_error(await r.json(), "worker_not_found")
    async with s.post(base + "/v1/chat/completions", json=CHAT) as r:  # no header: policy pick
        assert r.status == 200


async def test_models_workers_health_metrics(env):
    server, worker, s = env
    srv, base = await server()
    a = await worker()
    srv.fleet.upsert(a.record("m1"))
    srv.fleet.upsert((await worker()).record("m2"))
    async with s.get(base + "/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == ["m1", "m2"]
    async with s.get(base + "/v1/workers") as r:
        assert len((await r.json())["workers"]) == 2
    async with s.get(base + "/health") as r:
        assert r.status == 200 and (await r.json())["active_workers"] == 2
    async with s.post(base + "/v1/chat/completions", json={**CHAT, "model": "m1", "stream": True}) as r:
        await r.read()
    async with s.get(base + "/metrics") as r:
        text = await r.text()
    for needle in ('infera_requests_total{route="/v1/chat/completions",status="200",worker_id="' + a.record().worker_id,
                   "infera_request_duration_seconds_bucket", "infera_time_to_first_token_seconds_bucket",
                   "infera_worker_inflight_requests", 'infera_workers{disagg_mode="mixed",status="active"} 2.0'):
        assert needle in text, needle


async def test_rank_multiplexed_worker_gets_the_chosen_dp_rank_header(env):
    server, worker, s = env
    srv, base = await server("--router-policy", "kv-aware")
    w, pinned = await worker(), await worker()
    rec = w.record()
    rec.dp_size, rec.kv_block_size = 2, 16  # DP attention: one endpoint, ranks picked by the router
    srv.fleet.upsert(rec)
    for i in range(4):
        async with s.post(base + "/v1/chat/completions", json={**CHAT, "messages": [
                {"role": "user", "content": f"distinct prompt number {i} " * 20}]}) as r:
            assert r.status == 200
    assert sorted(set(w.seen_dp_ranks)) == ["0", "1"]  # both ranks used, each pinned by header
    srv.fleet.remove(rec.worker_id)
    prec = pinned.record()
    prec.dp_size, prec.dp_rank = 2, 1  # external LB: the record is one rank; no header
    srv.fleet.upsert(prec)
    async with s.post(base + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200
    assert pinned.seen_dp_ranks == [None]
