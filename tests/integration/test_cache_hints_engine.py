"""Cache hints as the ENGINE receives them (reference §3.9, §8.6): real ``openai`` and ``anthropic``
SDKs through a real router to simulated engines over loopback HTTP, each engine recording the
bodies it got. SGLang workers (the stand-in) get ``priority`` + ``infera_retention``; vLLM-API
workers (the sim) get ``kv_transfer_params.infera_retention`` only when they have kvd, merged with
the PD connector's params; the client's own fields win; both PD legs carry them."""
from __future__ import annotations

import contextlib
import json
from typing import Optional

import anthropic
import openai
import pytest

from infera.discovery.record import WorkerRecord
from infera.engine.sim import sglang_standin
from infera.engine.sim.server import SimEngine, SimServer, parse_args
from tests.integration.sim_recording import EngineBodies

pytestmark = pytest.mark.integration

MODEL = "sim-model"
FIXED = {"ignore_eos": True}
HINT_KEYS = ("priority", "infera_retention", "kv_transfer_params")


class KvdWorkerRecord(WorkerRecord, kw_only=True):
    """A worker record naming its engine's kvd socket, as launchers will publish it once kvd is
    wired into them (the router reads ``kvd_socket``; see infera/router/engine_hints.py)."""

    kvd_socket: Optional[str] = None


@pytest.fixture
async def sims():
    """``await sims(kind, *flags) -> SimServer`` with ``.bodies`` (what it received); kind "vllm"
    is the sim (vLLM's API), "sglang" the SGLang stand-in."""
    async with contextlib.AsyncExitStack() as stack:
        async def start(kind: str, *flags: str) -> SimServer:
            if kind == "sglang":
                args, flavor = sglang_standin.parse_standin_args(
                    ["--model-path", MODEL, "--host", "127.0.0.1", "--port", "0", "--speedup", "1000", *flags])
                server = SimServer(args, SimEngine(args, metrics_flavor=flavor, kv_events_format="sglang"))
            else:
                server = SimServer(parse_args(["--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--speedup",
                                               "1000", *flags]))
            server.bodies = EngineBodies()
            server.app.middlewares.append(server.bodies.record)
            return await stack.enter_async_context(server)

        yield start


def record(worker_id: str, sim: SimServer, engine: str, *, kvd: bool = False, **fields) -> WorkerRecord:
    return KvdWorkerRecord(worker_id=worker_id, url=sim.url, model_name=MODEL, engine=engine,
                           kvd_socket="/run/infera-kvd.sock" if kvd else None, **fields)


def hints_of(body: dict) -> dict:
    return {k: body[k] for k in HINT_KEYS if k in body}


async def openai_chat(base: str, **kwargs) -> None:
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as client:
        reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=3, **kwargs)
        assert reply.usage.completion_tokens == 3


async def anthropic_message(base: str, system: list[dict], **kwargs) -> None:
    async with anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0) as client:
        msg = await client.messages.create(model=MODEL, max_tokens=3, system=system,
                                           messages=[{"role": "user", "content": "hi"}], **kwargs)
        assert msg.usage.output_tokens == 3


def system(**cache_control) -> list[dict]:
    block = {"type": "text", "text": "You are terse."}
    if cache_control:
        block["cache_control"] = cache_control
    return [block]


# -- mixed workers ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, expect", [
    ({}, {"priority": 100, "infera_retention": "long"}),  # no hint: the default, long
    ({"prompt_cache_retention": "24h"}, {"priority": 100, "infera_retention": "long"}),
    ({"prompt_cache_retention": "5m"}, {"priority": 50, "infera_retention": "short"}),
    ({"prompt_cache_key": "conversation-7"}, {"priority": 50, "infera_retention": "short"}),
    ({"prompt_cache_retention": "none"}, {"priority": 0, "infera_retention": "none"}),
    # a client's own priority is the router's (issue 27), its own infera_retention wins
    ({"priority": -4}, {"priority": 100, "infera_retention": "long"}),
    ({"priority": 9, "infera_retention": "none", "prompt_cache_retention": "1h"},
     {"priority": 100, "infera_retention": "none"}),
])
async def test_openai_request_reaches_sglang_with_priority(fed_server, sims, extra, expect):
    sim = await sims("sglang")
    server, base = await fed_server()
    server.fleet.upsert(record("sg-0", sim, "sglang"))
    await openai_chat(base, extra_body={**FIXED, **extra})
    (got,) = sim.bodies.bodies
    assert hints_of(got) == expect
    own = {k: v for k, v in extra.items() if k != "priority"}
    assert {k: got[k] for k in own} == own  # the client's other fields arrive as it sent them


@pytest.mark.parametrize("cache_control, extra, expect", [
    ({}, {}, {"priority": 100, "infera_retention": "long"}),
    ({"type": "ephemeral"}, {}, {"priority": 50, "infera_retention": "short"}),
    ({"type": "ephemeral", "ttl": "5m"}, {}, {"priority": 50, "infera_retention": "short"}),
    ({"type": "ephemeral", "ttl": "1h"}, {}, {"priority": 100, "infera_retention": "long"}),
    ({"type": "ephemeral"}, {"priority": 3}, {"priority": 50, "infera_retention": "short"}),  # the router's
])
async def test_anthropic_request_reaches_sglang_with_priority(fed_server, sims, cache_control, extra, expect):
    sim = await sims("sglang")
    server, base = await fed_server()
    server.fleet.upsert(record("sg-0", sim, "sglang"))
    await anthropic_message(base, system(**cache_control), extra_body={**FIXED, **extra})
    (got,) = sim.bodies.bodies
    assert hints_of(got) == expect


async def test_the_default_retention_flag(fed_server, sims):
    sim = await sims("sglang")
    server, base = await fed_server("--router-default-retention", "short")
    server.fleet.upsert(record("sg-0", sim, "sglang"))
    await openai_chat(base, extra_body=FIXED)
    await openai_chat(base, extra_body={**FIXED, "prompt_cache_retention": "1h"})
    assert [hints_of(b) for b in sim.bodies.bodies] == [{"priority": 50, "infera_retention": "short"},
                                                        {"priority": 100, "infera_retention": "long"}]


@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_vllm_worker_with_kvd_gets_the_retention_and_one_without_gets_nothing(fed_server, sims, api):
    with_kvd, plain = await sims("vllm"), await sims("vllm")
    server, base = await fed_server()
    server.fleet.upsert(record("a-kvd", with_kvd, "vllm", kvd=True))
    server.fleet.upsert(record("b-plain", plain, "vllm"))
    for _ in range(2):  # round-robin: one request each
        if api == "openai":
            await openai_chat(base, extra_body={**FIXED, "prompt_cache_key": "conv"})
        else:
            await anthropic_message(base, system(type="ephemeral", ttl="1h"), extra_body=FIXED)
    retention = "short" if api == "openai" else "long"
    (got,), (untouched,) = with_kvd.bodies.bodies, plain.bodies.bodies
    assert hints_of(got) == {"kv_transfer_params": {"infera_retention": retention}}
    assert hints_of(untouched) == {}  # vLLM refuses a priority it does not schedule by


async def test_vllm_kvd_retention_joins_a_clients_kv_transfer_params(fed_server, sims):
    sim = await sims("vllm")
    server, base = await fed_server("--allow-client-kv-transfer-params")
    server.fleet.upsert(record("a-kvd", sim, "vllm", kvd=True))
    await openai_chat(base, extra_body={**FIXED, "kv_transfer_params": {"note": 1}})
    await openai_chat(base, extra_body={**FIXED, "kv_transfer_params": {"infera_retention": "none"}})
    assert [b["kv_transfer_params"] for b in sim.bodies.bodies] == [{"note": 1, "infera_retention": "long"},
                                                                    {"infera_retention": "none"}]


# -- PD: both legs -----------------------------------------------------------------------------------------

async def test_sglang_pd_legs_both_carry_priority(fed_server, sims):
    prefill = await sims("sglang", "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0")
    decode = await sims("sglang", "--disaggregation-mode", "decode", "--kv-transfer-timeout", "5")
    server, base = await fed_server()
    bootstrap = f"127.0.0.1:{prefill.engine.disagg.bootstrap_port}"
    server.fleet.replace_all([
        record("p0", prefill, "sglang", disagg_mode="prefill",
               disagg_meta={"protocol": "sglang-bootstrap", "params": {"bootstrap_addr": bootstrap}}),
        record("d0", decode, "sglang", disagg_mode="decode",
               disagg_meta={"protocol": "sglang-bootstrap", "params": {}}),
    ])
    await openai_chat(base, extra_body={**FIXED, "prompt_cache_retention": "5m"})
    await anthropic_message(base, system(type="ephemeral", ttl="1h"), extra_body={**FIXED, "priority": 1})  # dropped
    for sim in (prefill, decode):
        first, second = sim.bodies.bodies
        assert hints_of(first) == {"priority": 50, "infera_retention": "short"}
        assert hints_of(second) == {"priority": 100, "infera_retention": "long"}
        assert first["bootstrap_host"] == "127.0.0.1"
        assert first["bootstrap_room"] == decode.bodies.bodies[0]["bootstrap_room"]


async def test_nixl_pd_legs_carry_the_retention_beside_the_connectors_params(fed_server, sims):
    """The vLLM NIXL pair (serial): the prefill asks for a remote decode, the decode passes the
    prefill's handoff back; both keep every connector key, and the KV still moves (the decode
    engine accepts the merged params, as vLLM's connectors ignore keys they do not read)."""
    nixl = lambda role, **kw: json.dumps({"kv_connector": "NixlConnector", "kv_role": role, **kw})  # noqa: E731
    prefill = await sims("vllm", "--kv-transfer-config", nixl("kv_producer", engine_id="p-engine"))
    decode = await sims("vllm", "--kv-transfer-config", nixl("kv_consumer"))
    server, base = await fed_server()
    meta = {"protocol": "vllm-nixl", "params": {}}
    server.fleet.replace_all([record("p0", prefill, "sim", kvd=True, disagg_mode="prefill", disagg_meta=meta),
                              record("d0", decode, "sim", kvd=True, disagg_mode="decode", disagg_meta=meta)])
    prompt = "a prompt long enough to span a few blocks " * 8
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as client:
        reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                     max_tokens=4, extra_body={**FIXED, "prompt_cache_key": "c"})
    assert reply.usage.completion_tokens == 4 and reply.usage.prompt_tokens_details.cached_tokens > 0
    (p_body,), (d_body,) = prefill.bodies.bodies, decode.bodies.bodies
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                            "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                                            "remote_port": None, "infera_retention": "short"}
    handoff = d_body["kv_transfer_params"]
    assert handoff["infera_retention"] == "short" and handoff["remote_engine_id"] == "p-engine"
    assert handoff["do_remote_prefill"] is True and handoff["remote_block_ids"]
    assert "priority" not in p_body and "priority" not in d_body
