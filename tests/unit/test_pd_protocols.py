"""PD protocols: golden bodies per protocol (tests/fixtures/pd/<protocol>.json), error paths,
the client body never mutated, and resolve_protocol's same-protocol/same-engine rule.

Each fixture case names its client body and worker records (dicts in the same file), the room and
DP ranks, the prefill reply (serial protocols), and either the exact expected legs or the step that
must fail with which status and code. Steps run in the router's order: check_route,
leg_request_id, prefill_body, decode_body.
"""
from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest

from infera.discovery.record import WorkerRecord
from infera.router.pd import PdError, PdPair, protocol_registry, resolve_protocol
from infera.router.pd import _mori
from infera.router.pd.base import as_port, decode_remaining, prefill_single_token
from infera.router.pd.sglang_bootstrap import parse_bootstrap_addr
from infera.router.pd.vllm_mori_read import VllmMoriReadProtocol

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "pd"

# What the patched uuid4 returns, in call order: fixtures spell these out in forged ids.
FAKE_UUIDS = [uuid.UUID(f"{d * 8}-{d * 4}-4{d * 3}-8{d * 3}-{d * 12}") for d in "123456789"]

STEPS = ("check_route", "leg_request_id", "prefill_body", "decode_body")


def _fixture_docs() -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(FIXTURES.glob("*.json"))]


def _cases():
    for doc in _fixture_docs():
        for case in doc["cases"]:
            yield pytest.param(doc, case, id=f"{doc['protocol']}: {case['name']}")


def record(raw: dict[str, Any]) -> WorkerRecord:
    return msgspec.convert(raw, WorkerRecord)


@pytest.fixture(autouse=True)
def fake_uuid4(monkeypatch):
    """MoRI's random parts (forged id suffix, read-mode transfer id) made deterministic."""
    issued = iter(FAKE_UUIDS)
    monkeypatch.setattr(_mori, "uuid4", lambda: next(issued))


def _container_ids(value: Any) -> set[int]:
    if isinstance(value, dict):
        return {id(value)}.union(*(_container_ids(v) for v in value.values()))
    if isinstance(value, list):
        return {id(value)}.union(*(_container_ids(v) for v in value))
    return set()


def _run_case(doc: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    """Run the steps; return what each produced, or raise the first PdError (attributed in
    ``exc.step``)."""
    protocol = protocol_registry()[doc["protocol"]]
    body = case["body"]
    body = copy.deepcopy(doc["bodies"][body] if isinstance(body, str) else body)
    reply = copy.deepcopy(case.get("prefill_reply"))
    body_before, reply_before = copy.deepcopy(body), copy.deepcopy(reply)
    pair = PdPair(prefill=record(doc["workers"][case["prefill"]]), decode=record(doc["workers"][case["decode"]]),
                  room=case["room"], prefill_rank=case["prefill_rank"], decode_rank=case["decode_rank"])
    produced: dict[str, Any] = {}
    step = ""
    try:
        for step in STEPS:
            if step == "check_route":
                protocol.check_route(case["route"])
            elif step == "leg_request_id":
                produced[step] = protocol.leg_request_id(pair)
            elif step == "prefill_body":
                produced[step] = protocol.prefill_body(body, pair)
            else:
                produced[step] = protocol.decode_body(body, pair,
                                                      reply if protocol.topology == "serial" else None)
    except PdError as exc:
        exc.step = step
        raise
    finally:
        assert body == body_before, "the client body was mutated"
        assert reply == reply_before, "the prefill reply was mutated"
    # The legs are the router's to annotate further (priority): they must share nothing mutable
    # with the client body, the reply or each other.
    inputs = _container_ids(body) | _container_ids(reply)
    prefill_ids, decode_ids = _container_ids(produced["prefill_body"]), _container_ids(produced["decode_body"])
    assert not (prefill_ids & inputs) and not (decode_ids & inputs) and not (prefill_ids & decode_ids)
    return produced


@pytest.mark.parametrize("doc,case", list(_cases()))
def test_golden_legs(doc, case):
    assert ("expect" in case) != ("error" in case), "a case expects either legs or an error"
    if "error" in case:
        with pytest.raises(PdError) as caught:
            _run_case(doc, case)
        err = case["error"]
        assert (caught.value.step, caught.value.status, caught.value.code) == (err["at"], err["status"], err["code"])
        assert caught.value.message and str(caught.value) == caught.value.message
        return
    produced = _run_case(doc, case)
    expect = case["expect"]
    assert produced["leg_request_id"] == expect["leg_request_id"]
    assert produced["prefill_body"] == expect["prefill_body"]
    assert produced["decode_body"] == expect["decode_body"]
    # Bodies go out as JSON.
    for leg in ("prefill_body", "decode_body"):
        assert json.loads(msgspec.json.encode(produced[leg])) == expect[leg]


def test_every_registered_protocol_has_a_fixture_with_its_topology():
    docs = {doc["protocol"]: doc for doc in _fixture_docs()}
    registry = protocol_registry()
    assert set(docs) == set(registry)
    for name, protocol in registry.items():
        assert protocol.name == name and protocol.topology == docs[name]["topology"]
        assert any("error" in c for c in docs[name]["cases"]) and any("expect" in c for c in docs[name]["cases"])


# -- the registry and resolve_protocol ----------------------------------------------------------

def test_registry_builds_fresh_instances():
    first, second = protocol_registry(), protocol_registry()
    assert first.keys() == second.keys()
    assert all(first[name] is not second[name] for name in first)


def worker(worker_id: str, engine: str, protocol: str | None, mode: str) -> WorkerRecord:
    meta = {} if protocol is None else {"protocol": protocol, "params": {}}
    return WorkerRecord(worker_id=worker_id, url=f"http://{worker_id}", model_name="m", engine=engine,
                        disagg_mode=mode, disagg_meta=meta)


@pytest.mark.parametrize(
    "p_engine,p_protocol,d_engine,d_protocol,expected",
    [
        ("sglang", "sglang-bootstrap", "sglang", "sglang-bootstrap", "sglang-bootstrap"),
        ("vllm", "vllm-nixl", "vllm", "vllm-nixl", "vllm-nixl"),
        ("vllm", "vllm-mori-read", "vllm", "vllm-mori-read", "vllm-mori-read"),
        ("atom", "atom-mooncake", "atom", "atom-mooncake", "atom-mooncake"),
        # mismatches
        ("vllm", "vllm-mori-write", "vllm", "vllm-mori-read", None),  # one worker has the read-mode env
        ("vllm", "vllm-mooncake", "vllm", "vllm-nixl", None),
        ("sglang", "sglang-bootstrap", "vllm", "vllm-mooncake", None),
        ("vllm", "vllm-mooncake", "atom", "vllm-mooncake", None),  # same id, different engines
        ("vllm", "vllm-lmcache", "vllm", "vllm-lmcache", None),  # not a protocol the router speaks
        ("vllm", None, "vllm", None, None),  # neither advertises one
        ("vllm", "vllm-nixl", "vllm", None, None),
    ],
)
def test_resolve_protocol(p_engine, p_protocol, d_engine, d_protocol, expected):
    registry = protocol_registry()
    prefill = worker("10.0.0.1:8100", p_engine, p_protocol, "prefill")
    decode = worker("10.0.0.2:8200", d_engine, d_protocol, "decode")
    if expected is not None:
        assert resolve_protocol(prefill, decode, registry) is registry[expected]
        return
    with pytest.raises(PdError) as caught:
        resolve_protocol(prefill, decode, registry)
    assert (caught.value.status, caught.value.code) == (500, "pd_protocol_mismatch")
    for named in ("10.0.0.1:8100", "10.0.0.2:8200", repr(p_protocol), repr(d_protocol), p_engine, d_engine):
        assert named in caught.value.message


def test_resolve_protocol_only_knows_what_the_registry_holds():
    registry = protocol_registry()
    del registry["vllm-nixl"]
    with pytest.raises(PdError) as caught:
        resolve_protocol(worker("a:1", "vllm", "vllm-nixl", "prefill"), worker("b:2", "vllm", "vllm-nixl", "decode"),
                         registry)
    assert caught.value.code == "pd_protocol_mismatch"


# -- behaviour a golden case cannot show --------------------------------------------------------

def test_atom_serves_chat_and_completions_and_names_them_when_refusing():
    proto = protocol_registry()["atom-mooncake"]
    proto.check_route("/v1/chat/completions")  # ATOM v0.1.5 serves PD chat
    proto.check_route("/v1/completions")
    with pytest.raises(PdError) as caught:
        proto.check_route("/v1/embeddings")
    assert caught.value.status == 400 and caught.value.code == "unsupported_route"
    assert "/v1/chat/completions" in caught.value.message and "/v1/completions" in caught.value.message


def _mori_pair(protocol: str) -> PdPair:
    doc = json.loads((FIXTURES / f"{protocol}.json").read_text())
    return PdPair(prefill=record(doc["workers"]["p"]), decode=record(doc["workers"]["d"]), room=5)


@pytest.mark.parametrize("protocol", ["vllm-mori-write", "vllm-mori-read"])
def test_mori_forged_request_id_is_minted_once_per_pair(protocol):
    mori = protocol_registry()[protocol]
    pair = _mori_pair(protocol)
    first = mori.leg_request_id(pair)
    assert mori.leg_request_id(pair) == first and first.endswith(FAKE_UUIDS[0].hex)
    # Another pair gets its own.
    assert mori.leg_request_id(_mori_pair(protocol)).endswith(FAKE_UUIDS[1].hex)


def test_mori_read_keeps_one_transfer_id_per_pair():
    mori = VllmMoriReadProtocol()
    pair = _mori_pair("vllm-mori-read")
    body = {"model": "m", "prompt": "x", "max_tokens": 4}
    first = mori.prefill_body(body, pair)["kv_transfer_params"]["transfer_id"]
    assert mori.prefill_body(body, pair)["kv_transfer_params"]["transfer_id"] == first == f"tx-{FAKE_UUIDS[0].hex}"
    reply = {"kv_transfer_params": {"remote_engine_id": "e", "remote_block_ids": []}}
    assert mori.decode_body(body, pair, reply)["kv_transfer_params"]["transfer_id"] == first


def test_mori_read_decode_before_prefill_is_the_routers_bug():
    pair = _mori_pair("vllm-mori-read")
    with pytest.raises(PdError) as caught:
        VllmMoriReadProtocol().decode_body({"model": "m", "prompt": "x"}, pair,
                                           {"kv_transfer_params": {"remote_engine_id": "e", "remote_block_ids": []}})
    assert (caught.value.status, caught.value.code) == (500, "internal_error")


# -- the shared helpers ---------------------------------------------------------------------------

@pytest.mark.parametrize(
    "body,expected",
    [
        ({"max_tokens": 16, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 3},
         {"max_tokens": 1, "stream": False}),
        ({"max_completion_tokens": 9}, {"max_tokens": 1, "max_completion_tokens": 1, "stream": False}),
        ({"prompt": "p"}, {"prompt": "p", "max_tokens": 1, "stream": False}),
    ],
)
def test_prefill_single_token(body, expected):
    before = copy.deepcopy(body)
    assert prefill_single_token(body) == expected
    assert body == before


@pytest.mark.parametrize(
    "body,expected",
    [
        ({"max_tokens": 16, "min_tokens": 2}, {"max_tokens": 15, "min_tokens": 1}),
        ({"max_tokens": 1, "min_tokens": 1}, {"max_tokens": 1, "min_tokens": 0}),
        ({"max_completion_tokens": 5, "min_tokens": 5}, {"max_completion_tokens": 4, "min_tokens": 4}),
        ({"max_tokens": 4, "min_tokens": 0}, {"max_tokens": 3, "min_tokens": 0}),
        ({"prompt": "p"}, {"prompt": "p"}),  # no limit given: none invented
        # not integers: left alone
        ({"max_tokens": None, "min_tokens": True}, {"max_tokens": None, "min_tokens": True}),
    ],
)
def test_decode_remaining(body, expected):
    before = copy.deepcopy(body)
    assert decode_remaining(body) == expected
    assert body == before


@pytest.mark.parametrize(
    "addr,expected",
    [
        ("10.0.0.1:8998", ("10.0.0.1", 8998)),
        ("prefill-0.svc:8998", ("prefill-0.svc", 8998)),
        ("[::1]:8998", ("::1", 8998)),
        ("[fe80::1%eth0]:8998", ("fe80::1%eth0", 8998)),
        ("::1:8998", None),  # unbracketed IPv6: which part is the port?
        ("[::1]8998", None),
        ("[::1]", None),
        ("[not-v6]:8998", None),
        ("10.0.0.1", None),
        ("10.0.0.1:", None),
        (":8998", None),
        ("10.0.0.1:0", None),
        ("10.0.0.1:65536", None),
        ("10.0.0.1:-1", None),
        ("10.0.0.1:x", None),
        (None, None),
        (8998, None),
    ],
)
def test_parse_bootstrap_addr(addr, expected):
    assert parse_bootstrap_addr(addr) == expected


@pytest.mark.parametrize(
    "value,expected",
    [(6301, 6301), ("6301", 6301), (65535, 65535), (0, None), (65536, None), (True, None), ("63a", None),
     ("", None), (None, None), (6301.0, None)],
)
def test_as_port(value, expected):
    assert as_port(value) == expected
