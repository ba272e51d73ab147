"""The ATOM stand-in's Mooncake PD (infera/engine/sim/atom_pd.py) against ATOM v0.1.5's own
contract: the config it reads, the handoff its prefill returns (``request_finished``'s keys) and
where its decode goes for the KV (``remote_handshake_port + remote_dp_rank * tp_size``)."""
from __future__ import annotations

import json

import aiohttp
import pytest

from infera.engine.sim import server as sim
from infera.engine.sim.atom_pd import ATOM_ENGINE_ID, AtomKvTransferConfig
from infera.engine.sim.atom_standin import atom_engine, parse_standin_args

# ATOM v0.1.5 MooncakeConnectorScheduler.request_finished: seq.kv_transfer_params_output
REQUEST_FINISHED_KEYS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                         "remote_host", "remote_port", "remote_handshake_port", "tp_size", "dp_rank", "transfer_id",
                         "first_token_id", "draft_token_ids", "local_slot_index"}
CHAT = {"model": "atom-pd", "messages": [{"role": "user", "content": "tell me about routers " * 8}],
        "max_tokens": 1, "stream": False}


@pytest.mark.parametrize(
    "cfg, producer, port",
    [
        ({"kv_connector": "mooncake"}, True, 6301),  # ATOM's defaults: kv_producer, 6301
        ({"kv_connector": "mooncake", "kv_role": "kv_producer", "handshake_port": 7000}, True, 7000),
        ({"kv_connector": "mooncake", "kv_role": "kv_consumer"}, False, 6301),
        ({"kv_connector": "mooncake", "kv_role": "kv_both", "proxy_ip": "10.0.0.1"}, False, 6301),  # not producer
    ],
)
def test_config_reads_like_atom(cfg, producer, port):
    got = AtomKvTransferConfig.from_dict(cfg)
    assert (got.is_producer, got.handshake_port) == (producer, port)


@pytest.mark.parametrize("cfg, why", [
    ({}, "'moriio' is not simulated"),  # ATOM's default connector
    ({"kv_connector": "MooncakeConnector"}, "not simulated"),
    ({"kv_connector": "mooncake", "handshake_port": "6301"}, "handshake_port"),
    ({"kv_connector": "mooncake", "handshake_port": True}, "handshake_port"),
    ([], "JSON object"),
])
def test_config_refusals(cfg, why):
    with pytest.raises(ValueError, match=why):
        AtomKvTransferConfig.from_dict(cfg)


def test_a_bad_config_exits_2(capsys):
    with pytest.raises(SystemExit) as caught:
        parse_standin_args(["--model", "m", "--kv-transfer-config", '{"kv_connector": "nixl"}'], {})
    assert caught.value.code == 2 and "--kv-transfer-config" in capsys.readouterr().err


def standin(role: str, tp: int = 1) -> sim.SimServer:
    cfg = json.dumps({"kv_connector": "mooncake", "kv_role": role, "handshake_port": 0})
    args, pd_config, tp_size = parse_standin_args(["--model", "atom-pd", "--host", "127.0.0.1", "--server-port", "0",
                                                   "--speedup", "100", "-tp", str(tp), "--kv-transfer-config", cfg],
                                                  {})
    return sim.SimServer(args, atom_engine(args, pd_config, tp_size))


async def post(s: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with s.post(url, json=body) as r:
        return r.status, await r.json()


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_prefill_hands_off_as_atom_and_the_decode_takes_it(route):
    body = dict(CHAT) if route.endswith("chat/completions") else \
        {"model": "atom-pd", "prompt": "tell me about routers " * 8, "max_tokens": 1, "stream": False}
    async with standin("kv_producer", tp=2) as p, standin("kv_consumer") as d, aiohttp.ClientSession() as s:
        status, reply = await post(s, p.url + route, {**body, "kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_host": "127.0.0.1",
            "remote_port": d.port, "remote_handshake_port": 1, "remote_dp_size": 1, "remote_tp_size": 1}})
        assert status == 200, reply
        handoff = reply["kv_transfer_params"]
        assert set(handoff) == REQUEST_FINISHED_KEYS
        hs = p.engine.disagg.handshake_port
        assert (handoff["remote_host"], handoff["remote_handshake_port"], handoff["tp_size"], handoff["dp_rank"]) == \
            ("127.0.0.1", hs, 2, 0)
        assert handoff["remote_engine_id"] == ATOM_ENGINE_ID and handoff["do_remote_prefill"] is True
        assert isinstance(handoff["transfer_id"], int) and isinstance(handoff["first_token_id"], int)
        assert len(p.engine.disagg.holds) == 1
        # the decode dials remote_handshake_port + remote_dp_rank * tp_size: rank 0 of TP 2 is the base port
        status, out = await post(s, d.url + route, {**body, "max_tokens": 4,
                                                    "kv_transfer_params": {**handoff, "remote_dp_rank": 0}})
        assert status == 200, out
        assert out["usage"]["completion_tokens"] == 4
        assert len(p.engine.disagg.holds) == 0 and d.engine.disagg.num_transfers == 1
        # the same transfer again: taken already, so the decode fails the request
        status, out = await post(s, d.url + route, {**body, "kv_transfer_params": handoff})
        assert status == 500 and "KV transfer failed" in out["error"]["message"]


async def test_legs_on_the_wrong_role_are_refused_and_plain_requests_served():
    async with standin("kv_producer") as p, standin("kv_consumer") as d, aiohttp.ClientSession() as s:
        status, out = await post(s, p.url + "/v1/chat/completions",
                                 {**CHAT, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": 1}})
        assert status == 400 and "consumer" in out["error"]["message"]
        status, out = await post(s, d.url + "/v1/chat/completions",
                                 {**CHAT, "kv_transfer_params": {"do_remote_decode": True}})
        assert status == 400 and "kv_producer" in out["error"]["message"]
        for url in (p.url, d.url):
            status, out = await post(s, url + "/v1/chat/completions", {**CHAT, "max_tokens": 3})
            assert status == 200 and out["usage"]["completion_tokens"] == 3 and out.get("kv_transfer_params") is None
        status, out = await post(s, d.url + "/v1/completions", {"model": "atom-pd", "prompt": "x y z", "max_tokens": 2,
                                                                "kv_transfer_params": {"do_remote_prefill": True}})
        assert status == 500 and "transfer_id" in out["error"]["message"]
