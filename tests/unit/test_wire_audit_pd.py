"""PD legs read the way each engine reads them.

Every test here feeds the bodies our protocols build to a small model of what the engine does with
them, written from the engine's own source (versions and files in tests/fixtures/pd/README.md):
which keys it indexes without a default, which defaults it falls back to, which value it takes as
the peer's TP degree or DP rank. A leg an engine would misread, or reject, fails here even when its
golden body in tests/fixtures/pd/*.json was updated along with the code.
"""
from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any, Optional, Union
from urllib.parse import urlsplit

import msgspec
import pytest

from infera.discovery.record import WorkerRecord
from infera.router.pd import PdPair, _mori, protocol_registry

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "pd"


def doc(protocol: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{protocol}.json").read_text())


def worker(protocol: str, name: str, **changes: Any) -> WorkerRecord:
    raw = dict(doc(protocol)["workers"][name], **changes)
    return msgspec.convert(raw, WorkerRecord)


@pytest.fixture(autouse=True)
def fixed_uuid4(monkeypatch):
    monkeypatch.setattr(_mori, "uuid4", lambda: uuid.UUID(int=0xABC))


BODY = {"model": "m", "prompt": "Once upon a time", "max_tokens": 8, "stream": False}


# -- SGLang 0.5.23 ------------------------------------------------------------------------------------

class SglangPdRoutingFields(msgspec.Struct):
    """``PDRoutingFields`` (sglang 0.5.23 entrypoints/openai/protocol.py), one request's types."""
    bootstrap_host: Optional[Union[list[str], str]] = None
    bootstrap_port: Optional[Union[list[Optional[int]], int]] = None
    bootstrap_room: Optional[Union[list[int], int]] = None
    routed_dp_rank: Optional[int] = None
    disagg_prefill_dp_rank: Optional[int] = None


@pytest.mark.parametrize("prefill_dp, prefill_rank", [(1, None), (4, 3)])
def test_sglang_bootstrap_fields_have_sglangs_types_and_rank_rules(prefill_dp, prefill_rank):
    proto = protocol_registry()["sglang-bootstrap"]
    prefill = worker("sglang-bootstrap", "p", dp_size=prefill_dp)
    room = (1 << 62) + (prefill_rank or 0)  # the router aligns room % dp_size to the pinned rank
    pair = PdPair(prefill, worker("sglang-bootstrap", "d"), room, prefill_rank=prefill_rank, decode_rank=None)
    legs = [proto.prefill_body(BODY, pair), proto.decode_body(BODY, pair, None)]
    for leg in legs:
        fields = msgspec.json.decode(msgspec.json.encode(leg), type=SglangPdRoutingFields)
        assert isinstance(fields.bootstrap_host, str) and type(fields.bootstrap_port) is int
        assert type(fields.bootstrap_room) is int and 0 <= fields.bootstrap_room < 1 << 63
        host, port = doc("sglang-bootstrap")["workers"]["p"]["disagg_meta"]["params"]["bootstrap_addr"].rsplit(":", 1)
        assert (fields.bootstrap_host, fields.bootstrap_port) == (host, int(port))
    # The prefill engine's follow_bootstrap_room scheduler puts the request on room % dp_size; the
    # decode resolves the prefill rank from disagg_prefill_dp_rank first.
    assert legs[0]["bootstrap_room"] % prefill_dp == (prefill_rank or 0)
    assert legs[1].get("disagg_prefill_dp_rank") == prefill_rank


# -- vLLM 0.32 MooncakeConnector ----------------------------------------------------------------------

def vllm_mooncake_decode_reads(params: dict[str, Any]) -> dict[str, Any]:
    """``update_state_after_alloc`` + ``add_new_req`` on the decode: all three keys or no transfer."""
    assert params.get("do_remote_prefill")
    missing = [k for k in ("remote_engine_id", "remote_bootstrap_addr", "transfer_id") if k not in params]
    assert not missing, f"vLLM ignores the transfer (\"Got invalid KVTransferParams\"): missing {missing}"
    url = urlsplit(params["remote_bootstrap_addr"] + "/query")  # _connect_to_prefiller_bootstrap
    assert url.scheme == "http" and url.hostname and url.port
    return params


def vllm_dp_engine_id(engine_id: str, dp_size: int, dp_rank: int) -> str:
    """vllm/v1/engine/core.py: with data_parallel_size > 1 (or rank > 0) each DP engine's KV
    connector id gets ``_dp<rank>``; the bootstrap server lists them under those ids."""
    return f"{engine_id}_dp{dp_rank}" if dp_size > 1 or dp_rank > 0 else engine_id


@pytest.mark.parametrize("dp_size, dp_rank, prefill_rank, room, want_rank", [
    (1, None, None, 5, 0),
    (4, None, 2, 4 * 7 + 2, 2),   # rank-multiplexed record: the router pinned rank 2, room aligned
    (4, 3, None, 8, 3),           # external-LB record for rank 3 of 4: that rank whatever the room
])
def test_vllm_mooncake_legs_as_vllm_reads_them(dp_size, dp_rank, prefill_rank, room, want_rank):
    proto = protocol_registry()["vllm-mooncake"]
    prefill = worker("vllm-mooncake", "p", dp_size=dp_size, dp_rank=dp_rank)
    pair = PdPair(prefill, worker("vllm-mooncake", "d"), room, prefill_rank=prefill_rank)
    p_params = proto.prefill_body(BODY, pair)["kv_transfer_params"]
    assert p_params["do_remote_decode"] and p_params["transfer_id"]  # "Missing transfer_id ... from router!"
    d_params = vllm_mooncake_decode_reads(proto.decode_body(BODY, pair, None)["kv_transfer_params"])
    assert d_params["transfer_id"] == p_params["transfer_id"]
    engine_id = prefill.disagg_meta["params"]["engine_id"]
    assert d_params["remote_engine_id"] == vllm_dp_engine_id(engine_id, dp_size, want_rank)


# -- vLLM 0.32 MoRIIOConnector --------------------------------------------------------------------------

# moriio_common.py: how each side finds its peer in the (vLLM-wrapped) request id.
PREFILL_ZMQ_RE = re.compile(r"___prefill_addr_(.+?)___decode_addr_")
DECODE_ZMQ_RE = re.compile(r"___decode_addr_(.+)_[0-9a-f]{32}(?:-.*)?$")


def mori_parse_zmq(address: str) -> tuple[str, int, int]:
    parts = dict(seg.partition(":")[::2] for seg in address.split(","))
    return parts["host"], int(parts["handshake"]), int(parts["notify"])


def mori_req_meta(request_id: str, params: dict[str, Any], *, producer: bool) -> dict[str, Any]:
    """``MoRIIOConnectorMetadata.add_new_req``: what the connector makes of one leg."""
    match = (DECODE_ZMQ_RE if producer else PREFILL_ZMQ_RE).search(request_id)
    if match:
        host, handshake, notify = mori_parse_zmq(match.group(1))
    else:
        host, handshake, notify = params["remote_host"], int(params["remote_handshake_port"]), \
            int(params["remote_notify_port"])
    return {
        "transfer_id": params["transfer_id"], "remote_block_ids": params["remote_block_ids"],
        "remote_engine_id": params["remote_engine_id"],  # indexed: KeyError when absent
        "host": host, "handshake_port": handshake, "notify_port": notify,
        "tp_size": int(params.get("remote_tp_size") or params.get("tp_size") or 0),
        "remote_dp_size": params.get("remote_dp_size", 1), "remote_dp_rank": params.get("remote_dp_rank", 0),
    }


def mori_pair(protocol: str, prefill: str = "p", decode: str = "d", **kw: Any) -> PdPair:
    return PdPair(worker(protocol, prefill), worker(protocol, decode), kw.pop("room", 12), **kw)


def _peer(protocol: str, name: str) -> tuple[str, int, int]:
    raw = doc(protocol)["workers"][name]
    extra = raw["disagg_meta"]["params"]["kv_connector_extra_config"]
    return (urlsplit(raw["url"]).hostname, int(extra.get("handshake_port") or 6301),
            int(extra.get("notify_port") or 61005))


@pytest.mark.parametrize("protocol", ["vllm-mori-write", "vllm-mori-read"])
def test_mori_request_id_names_each_side_its_peer(protocol):
    proto = protocol_registry()[protocol]
    pair = mori_pair(protocol, decode="d_v6")
    rid = f"cmpl-{proto.leg_request_id(pair)}-0-1a2b3c4d"  # vLLM wraps the router's X-Request-Id
    assert mori_parse_zmq(DECODE_ZMQ_RE.search(rid).group(1)) == _peer(protocol, "d_v6")
    assert mori_parse_zmq(PREFILL_ZMQ_RE.search(rid).group(1)) == _peer(protocol, "p")


@pytest.mark.parametrize("protocol", ["vllm-mori-write", "vllm-mori-read"])
def test_mori_ports_default_like_the_engine_and_host_ip_wins(protocol):
    proto = protocol_registry()[protocol]
    pair = PdPair(worker(protocol, "p"), worker(protocol, "d_no_notify_port"), 1)
    rid = proto.leg_request_id(pair)
    assert mori_parse_zmq(DECODE_ZMQ_RE.search(rid).group(1))[2] == 61005  # MoRIIOConstants.DEFAULT_NOTIFY_PORT
    raw = doc(protocol)["workers"]["p"]
    params = json.loads(json.dumps(raw["disagg_meta"]["params"]))
    params["kv_connector_extra_config"] = {"host_ip": "192.168.7.7"}  # the engine's resolve_host_ip
    prefill = msgspec.convert(dict(raw, disagg_meta=dict(raw["disagg_meta"], params=params)), WorkerRecord)
    rid = proto.leg_request_id(PdPair(prefill, worker(protocol, "d"), 1))
    assert mori_parse_zmq(PREFILL_ZMQ_RE.search(rid).group(1)) == ("192.168.7.7", 6301, 61005)


@pytest.mark.parametrize("prefill_rank", [None, 1])
def test_mori_write_legs_as_the_connector_reads_them(prefill_rank):
    proto = protocol_registry()["vllm-mori-write"]
    pair = mori_pair("vllm-mori-write", decode="d_v6", prefill_rank=prefill_rank, decode_rank=3)
    rid = proto.leg_request_id(pair)
    # the prefill (producer) side: add_new_req(write_mode=True) on the prefill leg
    meta = mori_req_meta(rid, proto.prefill_body(BODY, pair)["kv_transfer_params"], producer=True)
    assert (meta["host"], meta["handshake_port"], meta["notify_port"]) == _peer("vllm-mori-write", "d_v6")
    assert meta["tp_size"] == 8 and meta["remote_dp_size"] == 4  # the decode's parallelism
    # the decode side: notifies the prefill rank named by remote_dp_rank (default 0)
    d_params = proto.decode_body(BODY, pair, None)["kv_transfer_params"]
    assert d_params["transfer_id"] == meta["transfer_id"] and d_params["do_remote_prefill"]
    assert d_params.get("remote_dp_rank", 0) == (prefill_rank or 0)
    assert "remote_dp_rank_override" not in d_params  # it would gate the notify on decode rank == prefill rank


def test_mori_read_decode_reads_the_prefill_engines_own_handoff():
    proto = protocol_registry()["vllm-mori-read"]
    pair = mori_pair("vllm-mori-read", prefill_rank=1)
    rid = proto.leg_request_id(pair)
    transfer_id = proto.prefill_body(BODY, pair)["kv_transfer_params"]["transfer_id"]
    # what vLLM 0.32's MoRIIOConnectorScheduler.request_finished returns on prefill rank 1 (TP 4)
    reply = {"kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[4, 5]],
        "remote_engine_id": "10.0.0.1:6301", "remote_host": "10.0.0.1", "remote_handshake_port": 6301,
        "remote_notify_port": 61005, "remote_dp_rank": 1, "remote_dp_rank_override": True, "remote_dp_size": 2,
        "remote_dp_size_local": 2, "tp_size": 4, "transfer_id": transfer_id}}
    params = proto.decode_body(BODY, pair, reply)["kv_transfer_params"]
    meta = mori_req_meta(rid, params, producer=False)
    assert (meta["host"], meta["handshake_port"], meta["notify_port"]) == _peer("vllm-mori-read", "p")
    assert meta["remote_block_ids"] == [[4, 5]] and meta["remote_engine_id"] == "10.0.0.1:6301"
    assert meta["tp_size"] == 4  # the engine's TP, not the record's extra-config guess (2)
    assert (meta["remote_dp_rank"], meta["remote_dp_size"]) == (1, 2)
    assert params["remote_dp_rank_override"] is True and params["remote_dp_size_local"] == 2
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False


def test_mori_read_without_a_rank_in_the_reply_names_the_pinned_one():
    proto = protocol_registry()["vllm-mori-read"]
    pair = mori_pair("vllm-mori-read", prefill_rank=1)
    proto.prefill_body(BODY, pair)
    params = proto.decode_body(BODY, pair, {"kv_transfer_params": {"remote_engine_id": "e", "remote_block_ids": []}})
    assert params["kv_transfer_params"]["remote_dp_rank"] == 1


# -- vLLM 0.32 NixlConnector ------------------------------------------------------------------------------

def test_nixl_decode_carries_every_key_nixl_indexes():
    proto = protocol_registry()["vllm-nixl"]
    case = next(c for c in doc("vllm-nixl")["cases"] if "prefill_reply" in c and "expect" in c)
    pair = PdPair(worker("vllm-nixl", case["prefill"]), worker("vllm-nixl", case["decode"]), 1)
    p_params = proto.prefill_body(BODY, pair)["kv_transfer_params"]
    assert p_params["do_remote_decode"] is True and not p_params["do_remote_prefill"]
    params = proto.decode_body(BODY, pair, case["prefill_reply"])["kv_transfer_params"]
    for key in ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port"):
        assert key in params  # NixlConnectorMetadata.add_new_req indexes them
    assert params == case["prefill_reply"]["kv_transfer_params"]


# -- ATOM v0.1.5 MooncakeConnector ------------------------------------------------------------------------

def atom_req_meta(params: dict[str, Any]) -> dict[str, Any]:
    """``ConnectorMetadata._build_req_meta`` (atom/kv_transfer/disaggregation/types.py)."""
    return {
        "remote_host": params.get("remote_host"), "remote_handshake_port": params.get("remote_handshake_port"),
        "remote_dp_size": params.get("remote_dp_size", 1), "remote_dp_rank": params.get("remote_dp_rank", 0),
        "tp_size": params.get("tp_size") if "tp_size" in params else params.get("remote_tp_size", 1),
        "transfer_id": params.get("transfer_id", 0),
    }


def atom_request_finished(host: str, base_handshake_port: int, tp_size: int, dp_rank: int) -> dict[str, Any]:
    """The prefill's ``request_finished`` output: the reply's ``kv_transfer_params``."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [3, 4],
            "remote_engine_id": "atom-p", "remote_host": host,
            "remote_port": base_handshake_port + dp_rank * tp_size, "remote_handshake_port": base_handshake_port,
            "tp_size": tp_size, "dp_rank": dp_rank, "transfer_id": 77, "first_token_id": 5, "draft_token_ids": [],
            "local_slot_index": -1}


@pytest.mark.parametrize("with_tp_size", [True, False])
def test_atom_decode_targets_the_prefill_rank_and_tp(with_tp_size):
    proto = protocol_registry()["atom-mooncake"]
    prefill = worker("atom-mooncake", "p_dp2")  # tp 4, dp 2
    decode = worker("atom-mooncake", "d")  # tp 4, dp 2
    decode = msgspec.structs.replace(decode, disagg_meta={**decode.disagg_meta, "params": {
        **decode.disagg_meta["params"], "tp_size": 2}})  # a decode TP unlike the prefill's
    pair = PdPair(prefill, decode, 9, prefill_rank=1, decode_rank=0)
    reply_params = atom_request_finished("10.0.0.3", 6301, 4, 1)
    if not with_tp_size:
        del reply_params["tp_size"]
    meta = atom_req_meta(proto.decode_body(BODY, pair, {"kv_transfer_params": reply_params})["kv_transfer_params"])
    assert meta["tp_size"] == 4  # the prefill's: the decode dials remote_handshake_port + rank * tp + tp_rank
    assert meta["remote_dp_rank"] == 1 and meta["remote_dp_size"] == 2
    assert (meta["remote_host"], meta["remote_handshake_port"], meta["transfer_id"]) == ("10.0.0.3", 6301, 77)


def test_atom_prefill_leg_names_the_decode():
    proto = protocol_registry()["atom-mooncake"]
    pair = PdPair(worker("atom-mooncake", "p"), worker("atom-mooncake", "d"), 1)
    params = proto.prefill_body(BODY, pair)["kv_transfer_params"]
    assert params["do_remote_decode"] is True and params.get("do_remote_prefill") is False
    meta = atom_req_meta(params)
    assert meta["tp_size"] == 4 and meta["remote_dp_size"] == 2 and meta["remote_handshake_port"] == 6302


def test_atom_chat_legs_read_as_atom_reads_them():
    """ATOM v0.1.5's chat endpoint (``api_server.py`` ``chat_completions``) hands the body's
    kv_transfer_params to the engine like /v1/completions does, so a chat pair gets the same legs."""
    proto = protocol_registry()["atom-mooncake"]
    proto.check_route("/v1/chat/completions")
    chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    pair = PdPair(worker("atom-mooncake", "p_dp2"), worker("atom-mooncake", "d"), 9, prefill_rank=1, decode_rank=0)
    prefill = proto.prefill_body(chat, pair)
    assert prefill["messages"] == chat["messages"] and prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert atom_req_meta(prefill["kv_transfer_params"])["remote_handshake_port"] == 6302
    decode = proto.decode_body(chat, pair, {"kv_transfer_params": atom_request_finished("10.0.0.3", 6301, 4, 1)})
    assert decode["messages"] == chat["messages"] and decode["max_tokens"] == 8
    meta = atom_req_meta(decode["kv_transfer_params"])
    assert (meta["remote_host"], meta["remote_dp_rank"], meta["tp_size"], meta["transfer_id"]) == ("10.0.0.3", 1, 4, 77)
