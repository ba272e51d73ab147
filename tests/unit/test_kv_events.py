"""KV-event payload decoders: golden wire fixtures (real vLLM captures; SGLang and ATOM payloads
encoded with their releases' own schemas, see tests/fixtures/kv_events/README.md), map and array
forms, bigram flattening, media, unknown event types, malformed payloads."""
from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from infera.kv.events import (
    Cleared, EventBatch, KvEventDecodeError, Removed, Stored, decode_array_form, decode_map_form, decoder_for,
    encode_batch,
)

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "kv_events"
pack = msgspec.msgpack.encode


def _key(v):
    return bytes.fromhex(v["bytes"]) if isinstance(v, dict) else v


def _load(name: str) -> dict:
    return json.loads((FIX / name).read_text())


def _vllm_cases():
    for exp_file in ("vllm_expected.json", "vllm_bytes_expected.json"):
        for batch in _load(exp_file)["batches"]:
            yield pytest.param(batch, id=batch["file"])


def _normalize_vllm(ev: dict):
    if ev["type"] == "BlockStored":
        return Stored([_key(h) for h in ev["block_hashes"]], _key(ev["parent_block_hash"]), ev["token_ids"],
                      ev["block_size"], ev["kv_cache_spec_kind"], ev["medium"])
    if ev["type"] == "BlockRemoved":
        return Removed([_key(h) for h in ev["block_hashes"]], ev["medium"])
    assert ev["type"] == "AllBlocksCleared"
    return Cleared()


def _normalize_synthetic(ev: dict):
    if ev["type"] == "Stored":
        return Stored([_key(h) for h in ev["block_hashes"]], _key(ev["parent"]), ev["token_ids"], ev["block_size"],
                      ev["spec_kind"], ev["medium"])
    if ev["type"] == "Removed":
        return Removed([_key(h) for h in ev["block_hashes"]], ev["medium"])
    return Cleared(ev["medium"])


@pytest.mark.parametrize("batch", list(_vllm_cases()))
def test_real_vllm_payload_matches_vllms_own_decoding(batch):
    got = decoder_for("vllm")((FIX / batch["file"]).read_bytes())
    assert type(got) is EventBatch
    assert got.ts == batch["ts"]
    assert got.dp_rank == batch["data_parallel_rank"]
    assert got.events == [_normalize_vllm(e) for e in batch["events"]]
    assert all(type(e) in (Stored, Removed, Cleared) for e in got.events)


def test_real_vllm_fixture_set_covers_stored_removed_cleared_and_bytes():
    kinds = set()
    for exp_file in ("vllm_expected.json", "vllm_bytes_expected.json"):
        for batch in _load(exp_file)["batches"]:
            kinds |= {e["type"] for e in batch["events"]}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    b = decoder_for("vllm")((FIX / "vllm_bytes_seq001.msgpack").read_bytes())
    ev = b.events[0]
    assert isinstance(ev.block_hashes[0], bytes) and len(ev.block_hashes[0]) == 32
    assert isinstance(ev.parent, bytes)


@pytest.mark.parametrize("prefix", ["vllm", "vllm_bytes"])
def test_real_vllm_frames_topic_seq_and_payload(prefix):
    messages = msgspec.msgpack.decode((FIX / f"{prefix}_frames.msgpack").read_bytes())
    assert messages
    for i, frames in enumerate(messages):
        topic, seq, payload = frames
        assert topic == b"kv-events"
        assert seq == i.to_bytes(8, "big")
        assert payload == (FIX / f"{prefix}_seq{i:03d}.msgpack").read_bytes()
        decoder_for("vllm")(frames[-1])  # the payload is the last frame


@pytest.mark.parametrize("prefix", ["vllm", "vllm_bytes"])
def test_real_vllm_replay_exchange(prefix):
    rec = msgspec.msgpack.decode((FIX / f"{prefix}_replay.msgpack").read_bytes())
    assert rec["request"] == [b"", (0).to_bytes(8, "big")]
    *replies, end = rec["replies"]
    assert end == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    live = msgspec.msgpack.decode((FIX / f"{prefix}_frames.msgpack").read_bytes())
    assert [r[1:] for r in replies] == live  # [b"", topic, seq, payload]: the live messages again
    for r in replies:
        assert r[0] == b""
        decoder_for("vllm")(r[-1])


SYNTHETIC = _load("synthetic_expected.json")


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_synthetic_fixture_decodes(name):
    engine = {"sglang": "sglang", "atom": "atom", "sim": "sim"}.get(name.split("_")[0], "vllm")
    exp = SYNTHETIC[name]
    got = decoder_for(engine)((FIX / name).read_bytes())
    assert got.ts == exp["ts"]
    assert got.dp_rank == exp["dp_rank"]
    assert got.events == [_normalize_synthetic(e) for e in exp["events"]]
    assert all(type(e) in (Stored, Removed, Cleared) for e in got.events)


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_both_decoders_accept_every_form(name):
    payload = (FIX / name).read_bytes()
    assert decode_map_form(payload) == decode_array_form(payload)


def test_decoder_for_engines():
    assert decoder_for("vllm") is decoder_for("sim") is decode_map_form
    # SGLang switched to map-form events in 0.5.22, ATOM v0.1.5 publishes arrays: one decoder
    # that tries both, arrays first.
    assert decoder_for("sglang") is decoder_for("atom") is decode_array_form
    with pytest.raises(ValueError, match="trtllm"):
        decoder_for("trtllm")


MAP_STORED = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [5, 6, 7, 8],
              "block_size": 2, "lora_id": None}
ARRAY_STORED = ["BlockStored", [1, 2], None, [5, 6, 7, 8], 2, None]
WANT_STORED = Stored([1, 2], None, [5, 6, 7, 8], 2, None)


@pytest.mark.parametrize("events, want", [
    ([MAP_STORED], [WANT_STORED]),
    ([{**MAP_STORED, "medium": "GPU", "group_idx": 3, "kv_cache_spec_kind": "mla_attention", "extra_keys": [None, None],
       "lora_name": None, "locality": "LOCAL", "brand_new_field": {"x": [1]}}],
     [Stored([1, 2], None, [5, 6, 7, 8], 2, "mla_attention", "GPU")]),
    ([{"type": "BlockStored", "block_hashes": [b"\x01" * 32], "parent_block_hash": b"\x02" * 32, "token_ids": [1, 2],
       "block_size": 2}], [Stored([b"\x01" * 32], b"\x02" * 32, [1, 2], 2)]),  # lora_id omitted
    ([{"type": "BlockRemoved", "block_hashes": [9]}, {"type": "BlockRemoved", "block_hashes": [8], "medium": "CPU"},
      {"type": "AllBlocksCleared"}], [Removed([9]), Removed([8], "CPU"), Cleared()]),
    ([ARRAY_STORED], [WANT_STORED]),
    ([["BlockStored", [1, 2], None, [5, 6, 7, 8], 2]], [WANT_STORED]),  # lora_id omitted
    ([ARRAY_STORED + ["GPU", None, [None], 0, "full_attention", "extra"]],  # trailing items ignored
     [Stored([1, 2], None, [5, 6, 7, 8], 2, None, "GPU")]),
    ([["BlockRemoved", [3]], ["BlockRemoved", [4], "GPU"], ["AllBlocksCleared"], ["AllBlocksCleared", "CPU"]],
     [Removed([3]), Removed([4], "GPU"), Cleared(), Cleared("CPU")]),
    ([MAP_STORED, ARRAY_STORED, ["AllBlocksCleared"], {"type": "AllBlocksCleared"}],  # mixed forms in one batch
     [WANT_STORED, WANT_STORED, Cleared(), Cleared()]),
    ([], []),
], ids=["map", "map-extra-fields", "map-bytes-defaults-omitted", "map-removed-cleared", "array", "array-short",
        "array-trailing", "array-removed-cleared", "mixed", "empty"])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_map_and_array_forms(engine, events, want):
    got = decoder_for(engine)(pack([12.5, events, 3]))
    assert got == EventBatch(12.5, want, 3)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_batch_without_rank_and_with_null_rank(engine):
    assert decoder_for(engine)(pack([1.0, [ARRAY_STORED]])).dp_rank is None
    assert decoder_for(engine)(pack([1.0, [MAP_STORED], None])).dp_rank is None
    assert decoder_for(engine)(pack([1, []])).ts == 1.0  # an int timestamp is accepted


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_sglang_bigram_tokens_take_first_element(engine):
    pairs = [[10, 11], [11, 12], [12, 13], [13, 14]]
    got = decoder_for(engine)(pack([1.0, [["BlockStored", [7, 8], 6, pairs, 2, None, "GPU"], ["BlockRemoved", [5]]], 0]))
    assert got.events == [Stored([7, 8], 6, [10, 11, 12, 13], 2, None, "GPU"), Removed([5])]
    # SGLang >= 0.5.22 sends the same pairs inside a map-form event
    as_map = {**MAP_STORED, "block_hashes": [7, 8], "parent_block_hash": 6, "token_ids": pairs, "medium": "GPU",
              "cache_salt": "s"}
    got = decoder_for(engine)(pack([1.0, [as_map, {"type": "BlockRemoved", "block_hashes": [5]}], 0]))
    assert got.events == [Stored([7, 8], 6, [10, 11, 12, 13], 2, None, "GPU"), Removed([5])]
    mixed = [10, [11, 12], 12, [13, 14]]  # a mix of ints and pairs flattens too
    got = decoder_for(engine)(pack([1.0, [["BlockStored", [7, 8], None, mixed, 2, None]]]))
    assert got.events[0].token_ids == [10, 11, 12, 13]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_unknown_event_types_are_skipped(engine):
    payload = pack([2.0, [{"type": "BlockUpdated", "block_hashes": [1]}, MAP_STORED, ["BlockPinned", [1]],
                          {"type": "AllBlocksCleared"}], 0])
    assert decoder_for(engine)(payload).events == [WANT_STORED, Cleared()]


BAD_PAYLOADS = {
    "empty": b"",
    "not-msgpack": b"\xc1",
    "truncated": pack([1.0, [MAP_STORED]])[:-3],
    "top-level-map": pack({"ts": 1.0, "events": []}),
    "top-level-int": pack(5),
    "missing-events": pack([1.0]),
    "events-not-list": pack([1.0, {"a": 1}]),
    "ts-string": pack(["now", []]),
    "rank-string": pack([1.0, [], "zero"]),
    "event-int": pack([1.0, [5]]),
    "event-untagged-map": pack([1.0, [{"block_hashes": [1]}]]),
    "event-untagged-array": pack([1.0, [[[1], None, [1, 2], 2]]]),
    "stored-missing-tokens": pack([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                           "block_size": 2}]]),
    "stored-token-strings": pack([1.0, [{**MAP_STORED, "token_ids": ["a", "b"]}]]),
    "stored-hash-string": pack([1.0, [{**MAP_STORED, "block_hashes": ["h1"]}]]),
    "stored-block-size-null": pack([1.0, [{**MAP_STORED, "block_size": None}]]),
    "array-stored-too-short": pack([1.0, [["BlockStored", [1], None]]]),
    "array-token-triples": pack([1.0, [["BlockStored", [1], None, [[1, 2, 3]], 1, None]]]),
    "removed-hashes-not-list": pack([1.0, [{"type": "BlockRemoved", "block_hashes": 5}]]),
    "tag-not-string": pack([1.0, [[7, [1]]]]),
}


@pytest.mark.parametrize("name", sorted(BAD_PAYLOADS))
@pytest.mark.parametrize("engine", ["vllm", "atom", "sim", "sglang"])
def test_malformed_payloads_raise_one_error_type(engine, name):
    with pytest.raises(KvEventDecodeError):
        decoder_for(engine)(BAD_PAYLOADS[name])


def test_decode_error_is_a_value_error():
    assert issubclass(KvEventDecodeError, ValueError)


def test_encode_batch_round_trips_in_vllm_map_layout():
    batch = EventBatch(3.5, [Stored([1, b"\x00" * 32], 9, [1, 2, 3, 4], 2, "full_attention"), Removed([1]), Cleared()], 2)
    payload = encode_batch(batch)
    assert decode_map_form(payload) == batch
    raw = msgspec.msgpack.decode(payload)
    assert raw[0] == 3.5 and raw[2] == 2
    assert raw[1][0] == {"type": "BlockStored", "block_hashes": [1, b"\x00" * 32], "parent_block_hash": 9,
                         "token_ids": [1, 2, 3, 4], "block_size": 2, "kv_cache_spec_kind": "full_attention"}
    assert raw[1][2] == {"type": "AllBlocksCleared"}
