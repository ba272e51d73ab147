"""P/D between real simulated engines on loopback, each leg driven by hand exactly as a router would.

vLLM NIXL (serial): the prefill gets the client body with max_tokens 1, stream false and a
``kv_transfer_params`` asking for a remote decode; the decode gets the client body plus the prefill
reply's ``kv_transfer_params`` verbatim. SGLang bootstrap (concurrent): both legs get the client
body plus bootstrap_host/port/room, in either order.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import time
from typing import Any

import aiohttp
import msgspec
import pytest

from infera.engine.base.prom import samples
from infera.engine.sim import sglang_standin
from infera.engine.sim.pd import KV_PULL_PATH
from infera.engine.sim.server import SimEngine, SimServer, parse_args
from tests.conftest import free_port, wait_for

pytestmark = pytest.mark.integration

MODEL = "sim-model"
SPEEDUP = 1000
BLOCK = 16
# 100+ tokens that do not end on a block boundary, so "the prompt's full blocks" is a strict prefix.
PROMPT = " ".join(f"token{i % 11} shared by both legs {i}." for i in range(14))
PREFILL_ASKS_FOR_REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
VLLM_NIXL_REPLY_KEYS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                        "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
                        "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode",
                        "remote_prefill_cached_tokens"}


def nixl_config(role: str, **extra: Any) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, **extra})


def sim_args(*extra: str):
    return parse_args(["--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--speedup", str(SPEEDUP),
                       "--block-size", str(BLOCK), *extra])


@pytest.fixture
async def servers():
    """``await servers(args, engine=None)`` starts a SimServer that is stopped after the test."""
    async with contextlib.AsyncExitStack() as stack:
        async def start(args, engine: SimEngine | None = None) -> SimServer:
            return await stack.enter_async_context(SimServer(args, engine))

        yield start


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


def client_body(route: str, *, stream: bool = False, max_tokens: int = 12) -> dict:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def path(route: str) -> str:
    return "/v1/chat/completions" if route == "chat" else "/v1/completions"


def nixl_prefill_body(body: dict) -> dict:
    """What the router's vllm-nixl protocol sends the prefill."""
    out = copy.deepcopy(body)
    out.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_ASKS_FOR_REMOTE_DECODE))
    out.pop("stream_options", None)
    return out


async def post(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, Any]:
    """(status, JSON body) or, for a stream, (status, {"text", "usage", "finish_reason"}) from its SSE."""
    async with http.post(url, json=body) as resp:
        if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            return resp.status, await resp.json()
        text, usage, finish = "", None, None
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data: "):])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                text += choice.get("text") or choice.get("delta", {}).get("content") or ""
                finish = choice.get("finish_reason") or finish
        return resp.status, {"text": text, "usage": usage, "finish_reason": finish}


def output_text(reply: dict) -> str:
    if "text" in reply:
        return reply["text"]
    choice = reply["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


async def metric(http: aiohttp.ClientSession, server: SimServer, name: str, **labels: str) -> float:
    async with http.get(server.url + "/metrics") as resp:
        text = await resp.text()
    found = [v for n, series, v in samples(text)
             if n == name and all(f'{k}="{v}"' in series for k, v in labels.items())]
    assert found, f"{name}{labels} not exported"
    return sum(found)


async def metric_is(http: aiohttp.ClientSession, server: SimServer, name: str, value: float) -> bool:
    return await metric(http, server, name) == value


# ============================================================================ vLLM NIXL


@pytest.fixture
async def nixl_pair(servers):
    prefill = await servers(sim_args("--kv-transfer-config", nixl_config("kv_producer", engine_id="prefill-1")))
    decode = await servers(sim_args("--kv-transfer-config", nixl_config("kv_consumer")))
    mixed = await servers(sim_args())
    return prefill, decode, mixed


@pytest.mark.parametrize("route, stream", [("completions", False), ("chat", False), ("chat", True),
                                           ("completions", True)])
async def test_nixl_serial_flow(nixl_pair, http, route, stream):
    prefill, decode, mixed = nixl_pair
    body = client_body(route, stream=stream)

    status, p_reply = await post(http, prefill.url + path(route), nixl_prefill_body(body))
    assert status == 200, p_reply
    params = p_reply["kv_transfer_params"]
    prompt_tokens = p_reply["usage"]["prompt_tokens"]
    full_block_tokens = prompt_tokens // BLOCK * BLOCK
    assert prompt_tokens % BLOCK and p_reply["usage"]["completion_tokens"] == 1
    assert set(params) == VLLM_NIXL_REPLY_KEYS
    assert (params["do_remote_prefill"], params["do_remote_decode"], params["transfer_mode"]) == (True, False, "pull")
    assert (params["remote_engine_id"], params["remote_host"], params["remote_port"]) == ("prefill-1", "127.0.0.1",
                                                                                          prefill.port)
    assert params["remote_num_tokens"] == prompt_tokens and params["tp_size"] == 1
    assert len(params["remote_block_ids"]) == 1 and len(params["remote_block_ids"][0]) == prompt_tokens // BLOCK
    assert await metric(http, prefill, "vllm:kv_cache_usage_perc") > 0  # the blocks are held for the decode

    status, d_reply = await post(http, decode.url + path(route), {**body, "kv_transfer_params": params})
    assert status == 200, d_reply
    status, m_reply = await post(http, mixed.url + path(route), body)
    assert status == 200, m_reply
    assert output_text(d_reply) == output_text(m_reply) and output_text(d_reply)
    assert d_reply["usage"]["completion_tokens"] == m_reply["usage"]["completion_tokens"] == 12
    assert d_reply["usage"]["prompt_tokens_details"]["cached_tokens"] == full_block_tokens
    assert m_reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    sources = {s: await metric(http, decode, "vllm:prompt_tokens_by_source_total", source=s)
               for s in ("external_kv_transfer", "local_cache_hit", "local_compute")}
    assert sources == {"external_kv_transfer": full_block_tokens, "local_cache_hit": 0,
                       "local_compute": prompt_tokens - full_block_tokens}
    assert await metric(http, decode, "vllm:external_prefix_cache_hits_total") == full_block_tokens
    assert await metric(http, decode, "vllm:external_prefix_cache_queries_total") == prompt_tokens
    assert await metric(http, decode, "vllm:nixl_num_failed_transfers_total") == 0
    assert await metric(http, decode, "vllm:nixl_bytes_transferred_count") == 1
    assert await metric(http, decode, "vllm:nixl_bytes_transferred_sum") == full_block_tokens * 131072

    # The pull released the hold: nothing referenced on the prefill, and a second pull finds nothing.
    assert await metric(http, prefill, "vllm:kv_cache_usage_perc") == 0
    async with http.post(prefill.url + KV_PULL_PATH, json={"remote_request_id": params["remote_request_id"],
                                                           "remote_engine_id": "prefill-1"}) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["type"] == "NotFoundError"


async def test_nixl_decode_publishes_transferred_blocks_as_stored(servers, http):
    prefill = await servers(sim_args("--kv-transfer-config", nixl_config("kv_producer")))
    events = '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:*"}'
    decode = await servers(sim_args("--kv-transfer-config", nixl_config("kv_consumer"), "--kv-events-config", events))
    body = client_body("completions", max_tokens=2)
    _, p_reply = await post(http, prefill.url + "/v1/completions", nixl_prefill_body(body))
    # Learn the prompt's token ids (and so its full blocks) from the engine itself.
    async with http.post(decode.url + "/tokenize", json={"model": MODEL, "prompt": PROMPT}) as resp:
        tokens = (await resp.json())["tokens"]
    status, _ = await post(http, decode.url + "/v1/completions",
                           {**body, "kv_transfer_params": p_reply["kv_transfer_params"]})
    assert status == 200
    batches = [msgspec.msgpack.decode(payload) for _, payload in decode.engine.kv_events.buffered()]
    stored = [e for e in batches[0][1] if e["type"] == "BlockStored"]
    full = len(tokens) // BLOCK
    # The first batch is the import itself, before the request ran a single step: every full
    # prompt block (consecutive blocks share one event, as in vLLM).
    assert sum(len(e["block_hashes"]) for e in stored) == full
    assert [t for e in stored for t in e["token_ids"]] == tokens[: full * BLOCK]


@pytest.mark.parametrize("case", ["unknown id", "other engine", "prefill gone", "missing side channel"])
async def test_nixl_failed_pull_recomputes_locally(nixl_pair, http, case):
    prefill, decode, mixed = nixl_pair
    body = client_body("completions")
    _, p_reply = await post(http, prefill.url + "/v1/completions", nixl_prefill_body(body))
    params = dict(p_reply["kv_transfer_params"])
    if case == "unknown id":
        params["remote_request_id"] = "cmpl-never-prefilled"
    elif case == "other engine":
        params["remote_engine_id"] = "someone-else"
    elif case == "prefill gone":
        params["remote_port"] = free_port()  # nothing listens there
    else:
        del params["remote_host"]
    started = time.monotonic()
    status, d_reply = await post(http, decode.url + "/v1/completions", {**body, "kv_transfer_params": params})
    assert status == 200, d_reply
    assert time.monotonic() - started < 5
    _, m_reply = await post(http, mixed.url + "/v1/completions", body)
    assert output_text(d_reply) == output_text(m_reply)
    assert d_reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert await metric(http, decode, "vllm:nixl_num_failed_transfers_total") == 1
    assert await metric(http, decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0


async def test_nixl_hold_expires_then_the_decode_recomputes(servers, http):
    prefill = await servers(sim_args("--kv-transfer-config", nixl_config("kv_producer"), "--kv-hold-timeout", "0.2"))
    decode = await servers(sim_args("--kv-transfer-config", nixl_config("kv_consumer")))
    body = client_body("completions")
    _, p_reply = await post(http, prefill.url + "/v1/completions", nixl_prefill_body(body))
    assert await metric(http, prefill, "vllm:kv_cache_usage_perc") > 0
    await wait_for(lambda: metric_is(http, prefill, "vllm:nixl_num_kv_expired_reqs_total", 1), 5.0,
                   message="the prefill's hold to expire")
    assert await metric(http, prefill, "vllm:kv_cache_usage_perc") == 0
    status, d_reply = await post(http, decode.url + "/v1/completions",
                                 {**body, "kv_transfer_params": p_reply["kv_transfer_params"]})
    assert status == 200 and d_reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert await metric(http, decode, "vllm:nixl_num_failed_transfers_total") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_nixl_fail_policy_answers_an_error(servers, http, stream):
    decode = await servers(sim_args("--kv-transfer-config",
                                    nixl_config("kv_consumer", kv_load_failure_policy="fail")))
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "gone",
              "remote_request_id": "cmpl-x", "remote_host": "127.0.0.1", "remote_port": free_port(),
              "remote_block_ids": [[0]]}
    status, reply = await post(http, decode.url + "/v1/completions",
                               {**client_body("completions", stream=stream), "kv_transfer_params": params})
    assert status == 500
    assert reply["error"]["type"] == "InternalServerError"
    assert reply["error"]["message"].startswith("KV transfer failed")


async def test_nixl_transfer_time_follows_the_bandwidth(servers, http):
    prefill = await servers(sim_args("--kv-transfer-config", nixl_config("kv_producer")))
    # 5e-5 GB/s: the prompt's ~100 full-block tokens x 131072 bytes take ~0.26 s even at --speedup 1000.
    slow = await servers(sim_args("--kv-transfer-config", nixl_config("kv_consumer"),
                                  "--kv-transfer-bandwidth", "0.00005"))
    fast = await servers(sim_args("--kv-transfer-config", nixl_config("kv_consumer")))
    body = client_body("completions", max_tokens=2)

    async def decode_seconds(decode: SimServer) -> tuple[float, int]:
        _, p_reply = await post(http, prefill.url + "/v1/completions", nixl_prefill_body(body))
        started = time.monotonic()
        status, d_reply = await post(http, decode.url + "/v1/completions",
                                     {**body, "kv_transfer_params": p_reply["kv_transfer_params"]})
        assert status == 200
        return time.monotonic() - started, d_reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    slow_task = asyncio.ensure_future(decode_seconds(slow))
    # While the KV moves, the decode counts the request as waiting (as vLLM does).
    await wait_for(lambda: metric_is(http, slow, "vllm:num_requests_waiting", 1), 5.0, interval=0.01,
                   message="the slow decode's transfer to be in flight")
    slow_s, moved = await slow_task
    fast_s, _ = await decode_seconds(fast)
    expected = moved * 131072 / (0.00005 * 1e9) / SPEEDUP
    assert expected > 0.2 and slow_s >= expected
    assert fast_s < slow_s - expected / 2


# ======================================================================== SGLang bootstrap


def standin(*extra: str):
    args, flavor = sglang_standin.parse_standin_args(
        ["--model-path", MODEL, "--host", "127.0.0.1", "--port", "0", "--page-size", str(BLOCK), "--speedup",
         str(SPEEDUP), "--enable-metrics", *extra])
    return args, SimEngine(args, metrics_flavor=flavor, kv_events_format="sglang")


@pytest.fixture
async def sglang_trio(servers):
    p_args, p_engine = standin("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0")
    d_args, d_engine = standin("--disaggregation-mode", "decode", "--kv-transfer-timeout", "5")
    m_args, m_engine = standin()
    return (await servers(p_args, p_engine), await servers(d_args, d_engine), await servers(m_args, m_engine))


def sglang_leg(body: dict, prefill: SimServer, room: int) -> dict:
    """What the router's sglang-bootstrap protocol sends each leg."""
    return {**copy.deepcopy(body), "bootstrap_host": "127.0.0.1",
            "bootstrap_port": prefill.engine.disagg.bootstrap_port, "bootstrap_room": room}


@pytest.mark.parametrize("order, route, stream", [
    ("together", "chat", False),
    ("decode first", "completions", False),
    ("prefill first", "chat", True),
    ("decode first", "chat", True),
])
async def test_sglang_bootstrap_flow(sglang_trio, http, order, route, stream):
    prefill, decode, mixed = sglang_trio
    body = client_body(route, stream=stream)
    leg = sglang_leg(body, prefill, room=(1 << 62) + 12345)
    decode_leg = {**leg, "disagg_prefill_dp_rank": 0}
    send_prefill = lambda: post(http, prefill.url + path(route), leg)  # noqa: E731
    send_decode = lambda: post(http, decode.url + path(route), decode_leg)  # noqa: E731

    if order == "together":
        (p_status, p_reply), (d_status, d_reply) = await asyncio.gather(send_prefill(), send_decode())
    elif order == "decode first":
        decoding = asyncio.ensure_future(send_decode())
        await wait_for(lambda: metric_is(http, decode, "sglang:num_decode_prealloc_queue_reqs", 1), 5.0,
                       interval=0.01, message="the decode to wait for its room")
        p_status, p_reply = await send_prefill()
        d_status, d_reply = await decoding
    else:
        p_status, p_reply = await send_prefill()
        assert await metric(http, prefill, "sglang:num_prefill_inflight_queue_reqs") == 1  # offered, not fetched
        d_status, d_reply = await send_decode()
    assert (p_status, d_status) == (200, 200), (p_reply, d_reply)
    assert p_reply["usage"]["completion_tokens"] == 1  # the prefill answers with the first token only

    _, m_reply = await post(http, mixed.url + path(route), body)
    assert output_text(d_reply) == output_text(m_reply) and output_text(d_reply)
    prompt_tokens = m_reply["usage"]["prompt_tokens"]
    assert d_reply["usage"]["completion_tokens"] == 12
    assert d_reply["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_tokens // BLOCK * BLOCK
    for name in ("sglang:num_prefill_inflight_queue_reqs", "sglang:num_decode_prealloc_queue_reqs",
                 "sglang:num_decode_transfer_queue_reqs"):
        assert await metric(http, prefill, name) == 0 and await metric(http, decode, name) == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_sglang_decode_without_a_prefill_fails_within_the_timeout(servers, http, stream):
    d_args, d_engine = standin("--disaggregation-mode", "decode", "--kv-transfer-timeout", "0.3")
    decode = await servers(d_args, d_engine)
    p_args, p_engine = standin("--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0")
    prefill = await servers(p_args, p_engine)  # its bootstrap server is up, but the room never comes
    started = time.monotonic()
    status, reply = await post(http, decode.url + "/v1/chat/completions",
                               sglang_leg(client_body("chat", stream=stream), prefill, room=7))
    elapsed = time.monotonic() - started
    assert status == 500 and 0.3 <= elapsed < 3
    assert reply["error"]["type"] == "InternalServerError"
    assert reply["error"]["message"].startswith("KV transfer failed") and reply["error"]["code"] == 500
    assert await metric(http, decode, "sglang:num_decode_prealloc_queue_reqs") == 0


async def test_sglang_decode_with_no_bootstrap_server_fails_fast(servers, http):
    d_args, d_engine = standin("--disaggregation-mode", "decode")
    decode = await servers(d_args, d_engine)
    leg = {**client_body("chat"), "bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(), "bootstrap_room": 1}
    status, reply = await post(http, decode.url + "/v1/chat/completions", leg)
    assert status == 500 and reply["error"]["message"].startswith("KV transfer failed")


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("missing", ["bootstrap_host", "bootstrap_port", "bootstrap_room"])
async def test_sglang_pd_legs_need_bootstrap_fields(servers, http, mode, missing):
    args, engine = standin("--disaggregation-mode", mode, "--disaggregation-bootstrap-port", "0")
    server = await servers(args, engine)
    leg = {**client_body("completions"), "bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 1}
    del leg[missing]
    status, reply = await post(http, server.url + "/v1/completions", leg)
    assert status == 400
    assert reply["error"]["type"] == "BadRequestError" and missing in reply["error"]["message"]
