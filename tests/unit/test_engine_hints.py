"""EngineHints (reference §3.9): what each engine is told about a request's cache retention, on the
bytes of a mixed request and on the dict of a PD leg; the client's own fields win; a body is left
alone (the same object) when nothing is added."""
from __future__ import annotations

import json
from typing import Optional

import msgspec
import pytest

from infera.api.cache_hints import LONG, NONE, SHORT
from infera.api.requests import parse_request
from infera.discovery.record import WorkerRecord
from infera.router.engine_hints import EngineHints, worker_has_kvd
from infera.router.pd import PdPair, protocol_registry
from infera.router.policy import RoutedRequest

CHAT = "/v1/chat/completions"


class KvdWorkerRecord(WorkerRecord, kw_only=True):
    """A record as launchers will publish it once kvd is wired: the engine's kvd socket."""

    kvd_socket: Optional[str] = None


def worker(engine: str, kvd: bool = False, **kw) -> WorkerRecord:
    return KvdWorkerRecord(worker_id=f"{engine}-0", url="http://127.0.0.1:1", model_name="m", engine=engine,
                           kvd_socket="/run/kvd.sock" if kvd else None, **kw)


def request(body: dict | bytes, route: str = CHAT) -> RoutedRequest:
    raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
    parsed = parse_request(route, raw, allow_kv_transfer_params=True)
    return RoutedRequest(route=route, body=raw, parsed=parsed, model=parsed.model, stream=bool(parsed.stream),
                         request_id="r1")


def chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def sent(hints: EngineHints, w: WorkerRecord, body: dict) -> dict:
    """What the engine receives on a mixed request (bytes path), checked against the PD path (dict)."""
    req = request(body)
    via_bytes = json.loads(hints.apply_bytes(req.body, w, req))
    via_dict = hints.apply_dict(msgspec.json.decode(req.body), w, request(body))
    assert via_bytes == via_dict
    return via_bytes


# (hint fields, retention the engines are told)
HINTS = [
    ({}, "long"),  # no hint: the default
    ({"prompt_cache_retention": "24h"}, "long"),
    ({"prompt_cache_retention": "5m"}, "short"),
    ({"prompt_cache_key": "conv"}, "short"),
    ({"prompt_cache_retention": "none"}, "none"),  # an explicit none stays none
]
PRIORITY = {"none": 0, "short": 50, "long": 100}


@pytest.mark.parametrize("fields, retention", HINTS)
def test_sglang_gets_priority_and_retention(fields, retention):
    got = sent(EngineHints(), worker("sglang"), chat(**fields))
    assert (got["priority"], got["infera_retention"]) == (PRIORITY[retention], retention)
    assert {k: v for k, v in got.items() if k not in ("priority", "infera_retention")} == chat(**fields)


@pytest.mark.parametrize("fields, retention", HINTS)
@pytest.mark.parametrize("engine", ["vllm", "sim"])
def test_vllm_with_kvd_gets_the_retention_in_kv_transfer_params(engine, fields, retention):
    got = sent(EngineHints(), worker(engine, kvd=True), chat(**fields))
    assert got == {**chat(**fields), "kv_transfer_params": {"infera_retention": retention}}


@pytest.mark.parametrize("engine, kvd", [("vllm", False), ("sim", False), ("atom", False), ("atom", True)])
def test_nothing_for_vllm_without_kvd_nor_atom(engine, kvd):
    """vLLM refuses a priority without priority scheduling and warns on kv_transfer_params without a
    connector: a plain vLLM worker gets its body untouched, the very same bytes."""
    hints = EngineHints()
    req = request(chat(prompt_cache_retention="24h"))
    assert hints.apply_bytes(req.body, worker(engine, kvd), req) is req.body
    body = msgspec.json.decode(req.body)
    assert hints.apply_dict(body, worker(engine, kvd), req) is body


def test_a_plain_record_has_no_kvd():
    assert not worker_has_kvd(WorkerRecord(worker_id="w", url="http://x", model_name="m", engine="vllm"))
    assert worker_has_kvd(worker("vllm", kvd=True)) and not worker_has_kvd(worker("vllm", kvd=False))


@pytest.mark.parametrize("default, retention", [(NONE, "none"), (SHORT, "short"), (LONG, "long")])
def test_the_default_applies_only_without_a_hint(default, retention):
    hints = EngineHints(default)
    assert sent(hints, worker("sglang"), chat())["infera_retention"] == retention
    assert sent(hints, worker("sglang"), chat(prompt_cache_key="k"))["infera_retention"] == "short"
    with pytest.raises(ValueError):
        EngineHints(7)


@pytest.mark.parametrize("argv, environ, expect", [
    ([], {}, "long"),
    ([], {"INFERA_ROUTER_DEFAULT_RETENTION": "none"}, "none"),
    (["--router-default-retention", "short"], {"INFERA_ROUTER_DEFAULT_RETENTION": "none"}, "short"),
])
def test_default_retention_flag_env_default(argv, environ, expect):
    from infera.server.cli import parse_args
    assert parse_args(["--etcd-endpoint", "x:1", *argv], environ=environ).router_default_retention == expect


@pytest.mark.parametrize("client, expect", [
    ({"infera_retention": "short"}, {"priority": 100, "infera_retention": "short"}),
    ({"priority": 7, "infera_retention": "none"}, {"priority": 100, "infera_retention": "none"}),
    # a client's priority is never its own: the router's takes its place (issue 27: 2147483647 jumped the queue)
    ({"priority": 2147483647}, {"priority": 100, "infera_retention": "long"}),
    ({"priority": -3, "prompt_cache_key": "k"}, {"priority": 50, "infera_retention": "short"}),
    ({"priority": None}, {"priority": 100, "infera_retention": "long"}),
])
def test_sglang_client_retention_wins_and_its_priority_is_the_routers(client, expect):
    got = sent(EngineHints(), worker("sglang"), chat(**client))
    assert {k: got[k] for k in expect} == expect


@pytest.mark.parametrize("engine, kvd", [("vllm", False), ("vllm", True), ("sim", False), ("atom", False),
                                         ("unknown", False)])
@pytest.mark.parametrize("value", [2147483647, -5, 7, "9", 1.5, None, True])
def test_a_clients_priority_is_dropped_for_every_other_engine(engine, kvd, value):
    got = sent(EngineHints(), worker(engine, kvd), chat(priority=value))
    assert "priority" not in got and got["messages"] == chat()["messages"]


@pytest.mark.parametrize("value, expect", [
    (2147483647, 100), (-2147483648, 0), (-3, 0), (0, 0), (37, 37), (100, 100), (101, 100),
    ("9", None), (1.5, None), (None, None), (True, None), ([1], None),  # not an integer: dropped
])
@pytest.mark.parametrize("engine", ["sglang", "vllm", "atom"])
def test_allowed_client_priority_is_clamped_to_the_routers_range(engine, value, expect):
    got = sent(EngineHints(allow_client_priority=True), worker(engine), chat(priority=value))
    if expect is None:  # dropped: SGLang gets the router's own, the others none
        assert got.get("priority") == (100 if engine == "sglang" else None)
    else:
        assert got["priority"] == expect


def test_the_priority_word_in_a_message_is_left_alone():
    body = chat(messages=[{"role": "user", "content": '"priority": 2147483647'}])
    hints, req = EngineHints(), request(body)
    assert hints.apply_bytes(req.body, worker("vllm"), req) is req.body  # decoded, nothing to drop: as sent
    assert sent(hints, worker("sglang"), body)["priority"] == 100


def test_sglang_untouched_when_the_client_set_both_and_may():
    hints, req = EngineHints(allow_client_priority=True), request(chat(priority=1, infera_retention="short"))
    assert hints.apply_bytes(req.body, worker("sglang"), req) == req.body


def test_allow_client_priority_flag_env_default():
    from infera.server.cli import parse_args
    base = ["--etcd-endpoint", "x:1"]
    assert parse_args(base, environ={}).allow_client_priority is False
    assert parse_args(base, environ={"INFERA_ALLOW_CLIENT_PRIORITY": "1"}).allow_client_priority is True
    assert parse_args([*base, "--allow-client-priority"], environ={}).allow_client_priority is True


@pytest.mark.parametrize("client, expect", [
    ({"kv_transfer_params": {"x": 1}}, {"x": 1, "infera_retention": "long"}),
    ({"kv_transfer_params": {"infera_retention": "none"}}, {"infera_retention": "none"}),
    ({"kv_transfer_params": None}, {"infera_retention": "long"}),
])
def test_vllm_kvd_merges_into_the_clients_kv_transfer_params(client, expect):
    assert sent(EngineHints(), worker("vllm", kvd=True), chat(**client))["kv_transfer_params"] == expect


def test_the_splice_handles_blanks_and_keeps_the_rest_byte_for_byte():
    hints = EngineHints()
    raw = b' \n {  "model":"m","messages":[{"role":"user","content":"priority"}]}'
    # "priority" as a value is not a key, but the check is textual: the slow path (decode) decides
    req = request(raw)
    out = hints.apply_bytes(raw, worker("sglang"), req)
    assert json.loads(out) == {**json.loads(raw), "priority": 100, "infera_retention": "long"}
    raw = b'\t{"model":"m","messages":[{"role":"user","content":"hi"}]}'
    out = hints.apply_bytes(raw, worker("sglang"), request(raw))
    assert out.endswith(raw[2:]) and json.loads(out)["priority"] == 100
    assert json.loads(hints.apply_bytes(b"{ }", worker("sglang"), request(raw))) == {"priority": 100,
                                                                                   "infera_retention": "long"}


def test_an_escaped_priority_key_never_reaches_the_hints():
    """``\\u0070riority`` is "priority" to a JSON parser but not to the textual scan: parse_request
    refuses it (a guarded key spelled with escapes), so the scan is sound."""
    from infera.api.errors import ApiError
    raw = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"\\u0070riority":5}'
    with pytest.raises(ApiError) as info:
        request(raw)
    assert (info.value.status, info.value.code, info.value.param) == (400, "duplicate_key", "priority")


def test_apply_dict_never_mutates_the_callers_body():
    kvp = {"do_remote_decode": True}
    body = chat(kv_transfer_params=kvp)
    out = EngineHints().apply_dict(body, worker("vllm", kvd=True), request(body))
    assert out is not body and out["kv_transfer_params"] is not kvp
    assert kvp == {"do_remote_decode": True} and "priority" not in body


def test_hints_are_parsed_once_per_request():
    hints, req = EngineHints(), request(chat(prompt_cache_key="k"))
    hints.apply_bytes(req.body, worker("sglang"), req)
    first = req.state["hints"]
    hints.apply_bytes(req.body, worker("sglang"), req)
    assert req.state["hints"] is first


# -- PD legs: the protocol's kv_transfer_params survive, ours join them ----------------------------------

def pd_worker(engine: str, mode: str, protocol: str, kvd: bool, params: dict) -> WorkerRecord:
    return worker(engine, kvd, disagg_mode=mode, disagg_meta={"protocol": protocol, "params": params})


PD_PARAMS = {
    "vllm-mooncake": {"engine_id": "p-engine", "bootstrap_addr": "http://127.0.0.1:8998"},
    "vllm-nixl": {"engine_id": "p-engine"},
    "vllm-mori-write": {"kv_connector_extra_config": {"handshake_port": 1, "notify_port": 2}},
}


@pytest.mark.parametrize("protocol", sorted(PD_PARAMS))
def test_pd_legs_keep_the_connectors_params(protocol):
    proto = protocol_registry()[protocol]
    p = pd_worker("vllm", "prefill", protocol, True, PD_PARAMS[protocol])
    d = pd_worker("vllm", "decode", protocol, True, PD_PARAMS[protocol])
    body = chat(prompt_cache_key="conv")
    req = request(body)
    pair = PdPair(p, d, room=12345)
    p_body = proto.prefill_body(body, pair)
    hints = EngineHints()
    p_sent = hints.apply_dict(p_body, p, req)
    assert p_sent["kv_transfer_params"] == {**p_body["kv_transfer_params"], "infera_retention": "short"}
    if proto.topology == "concurrent":
        d_body = proto.decode_body(body, pair, None)
        d_sent = hints.apply_dict(d_body, d, req)
        assert d_sent["kv_transfer_params"] == {**d_body["kv_transfer_params"], "infera_retention": "short"}
    # without kvd the legs go out exactly as the protocol built them
    plain = pd_worker("vllm", "prefill", protocol, False, PD_PARAMS[protocol])
    assert hints.apply_dict(p_body, plain, req) is p_body


def test_sglang_pd_legs_both_get_priority():
    proto = protocol_registry()["sglang-bootstrap"]
    p = pd_worker("sglang", "prefill", "sglang-bootstrap", False, {"bootstrap_addr": "127.0.0.1:8998"})
    d = pd_worker("sglang", "decode", "sglang-bootstrap", False, {})
    body = chat(prompt_cache_retention="1h")
    req = request(body)
    pair = PdPair(p, d, room=7)
    for leg, leg_body in ((p, proto.prefill_body(body, pair)), (d, proto.decode_body(body, pair, None))):
        out = EngineHints().apply_dict(leg_body, leg, req)
        assert (out["priority"], out["infera_retention"], out["bootstrap_room"]) == (100, "long", 7)
