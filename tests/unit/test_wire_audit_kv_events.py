"""KV-event payloads checked against the engines' own schemas (mirrored in
tests/fixtures/kv_events/wire_schemas.py; versions and files there and in that folder's README).

* every fixture decodes with its engine's struct as well as with ours, to the same events;
* the mirrored vLLM 0.32 schema decodes the real vLLM captures (so the mirroring is right);
* the simulator's bytes, in both formats and straight from a publisher over a cache, decode with
  the vLLM 0.32 / SGLang 0.5.23 structs.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from infera.engine.sim.cache import KVCache
from infera.engine.sim.kv_events import KvEventPublisher, KvEventsConfig
from infera.kv.events import Cleared, Removed, Stored, decoder_for
from tests.fixtures.kv_events import wire_schemas as ws

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "kv_events"

# fixture -> (engine name for decoder_for, the engine release's schema)
PINNED = {
    "sglang_stored.msgpack": ("sglang", ws.SGLANG_0_5_23),
    "sglang_stored_child.msgpack": ("sglang", ws.SGLANG_0_5_23),
    "sglang_bigram.msgpack": ("sglang", ws.SGLANG_0_5_23),
    "sglang_removed_cleared.msgpack": ("sglang", ws.SGLANG_0_5_23),
    "sglang_salted.msgpack": ("sglang", ws.SGLANG_0_5_23),
    "sglang_metadata.msgpack": ("sglang", ws.SGLANG_0_5_19),
    "sglang_0_5_15.msgpack": ("sglang", ws.SGLANG_0_5_15),
    "sglang_0_4_10.msgpack": ("sglang", ws.SGLANG_0_4_10),
    "sglang_old.msgpack": ("sglang", ws.SGLANG_FIRST),
    "atom_0_1_5.msgpack": ("atom", ws.ATOM_0_1_5),
}


def _tokens(tokens: list) -> list[int]:
    return [t if isinstance(t, int) else t[0] for t in tokens]


def _normalized(engine_event: Any) -> Any:
    """An engine struct as our normalized event (None: a type we skip)."""
    kind = type(engine_event).__name__
    medium = getattr(engine_event, "medium", None)
    if "BlockStored" in kind:
        return Stored(list(engine_event.block_hashes), engine_event.parent_block_hash,
                      _tokens(engine_event.token_ids), engine_event.block_size,
                      getattr(engine_event, "kv_cache_spec_kind", None), medium)
    if "BlockRemoved" in kind:
        return Removed(list(engine_event.block_hashes), medium)
    if "AllBlocksCleared" in kind:
        return Cleared(medium)
    return None


def test_every_synthetic_fixture_names_its_schema():
    expected = json.loads((FIX / "synthetic_expected.json").read_text())
    unpinned = {"vllm_legacy_array.msgpack", "atom_map.msgpack", "sim_map.msgpack"}  # README: no release writes them
    assert set(expected) == set(PINNED) | unpinned


# Fixtures holding EAGLE/MTP bigram events: SGLang's recorder puts (t_i, t_i+1) tuples into a
# field its struct declares ``list[int]`` (mem_cache/events.py: "bigram pages expose tuples"), so
# its own typed decoder rejects them. Those are compared through a copy with the pairs flattened.
BIGRAM = {"sglang_bigram.msgpack", "sglang_metadata.msgpack"}


def _flatten_bigrams(payload: bytes) -> bytes:
    batch = msgspec.msgpack.decode(payload)
    for ev in batch[1]:
        tokens = ev["token_ids"] if isinstance(ev, dict) else (ev[3] if ev[0] == "BlockStored" else None)
        if tokens is not None:
            tokens[:] = _tokens(tokens)
    return msgspec.msgpack.encode(batch)


@pytest.mark.parametrize("name", sorted(BIGRAM))
def test_sglangs_own_typed_decoder_rejects_its_bigram_events_ours_does_not(name):
    payload = (FIX / name).read_bytes()
    with pytest.raises(msgspec.ValidationError, match="Expected `int`, got `array`"):
        msgspec.msgpack.decode(payload, type=PINNED[name][1].KVEventBatch)
    assert decoder_for("sglang")(payload) == decoder_for("sglang")(_flatten_bigrams(payload))


@pytest.mark.parametrize("name", sorted(PINNED))
def test_fixture_decodes_with_the_engines_schema_and_ours_alike(name):
    engine, schema = PINNED[name]
    payload = (FIX / name).read_bytes()
    theirs = msgspec.msgpack.decode(_flatten_bigrams(payload) if name in BIGRAM else payload, type=schema.KVEventBatch)
    ours = decoder_for(engine)(payload)
    assert ours.ts == theirs.ts
    assert ours.dp_rank == getattr(theirs, "attn_dp_rank", getattr(theirs, "data_parallel_rank", None))
    assert ours.events == [e for e in map(_normalized, theirs.events) if e is not None]


def test_sglang_0_5_19_metadata_extension_decodes_as_the_base_event_in_sglangs_own_union():
    """SGLang keeps BlockStoredWithMetadata out of KVEventBatch's union on purpose: its consumers
    read the shared tag as BlockStored and ignore the trailing metadata, as we do."""
    payload = _flatten_bigrams((FIX / "sglang_metadata.msgpack").read_bytes())
    theirs = msgspec.msgpack.decode(payload, type=ws.SGLANG_0_5_19.KVEventBatch)
    assert type(theirs.events[0]) is ws.SGLANG_0_5_19.BlockStored
    raw = msgspec.msgpack.decode((FIX / "sglang_metadata.msgpack").read_bytes())
    assert raw[1][0][-1] == {"cache_salt": "salt-1"}


def test_array_like_structs_write_every_field_whatever_omit_defaults_says():
    """Why array-form decoders must take trailing nulls: msgspec ignores omit_defaults for
    array_like structs (jcrist/msgspec#720), so ATOM's 11-field BlockStored is always 12 items."""
    stored = msgspec.msgpack.decode(msgspec.msgpack.encode(ws.ATOM_0_1_5.BlockStored([1], None, [1, 2], 2)))
    assert stored == ["BlockStored", [1], None, [1, 2], 2, None, "GPU", None, None, None, None, None]
    mapped = msgspec.msgpack.decode(msgspec.msgpack.encode(ws.SGLANG_0_5_23.BlockStored([1], None, [1, 2], 2, None)))
    assert mapped == {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2],
                      "block_size": 2, "lora_id": None}  # map form: defaults omitted, lora_id has none


@pytest.mark.parametrize("name", sorted(p.name for p in FIX.glob("vllm_seq*.msgpack")) +
                         sorted(p.name for p in FIX.glob("vllm_bytes_seq*.msgpack")))
def test_the_vllm_mirror_decodes_real_vllm_bytes(name):
    payload = (FIX / name).read_bytes()
    theirs = msgspec.msgpack.decode(payload, type=ws.VLLM_0_32.KVEventBatch)
    assert decoder_for("vllm")(payload).events == [_normalized(e) for e in theirs.events]


@pytest.mark.parametrize("fmt, schema", [("vllm", ws.VLLM_0_32), ("sglang", ws.SGLANG_0_5_23)])
async def test_the_simulators_published_batches_decode_with_the_engines_schema(fmt, schema):
    cfg = KvEventsConfig(enable_kv_cache_events=True, publisher="zmq")
    pub = KvEventPublisher(cfg, block_size=4, fmt=fmt, dp_rank=1)
    cache = KVCache(4, 3)
    pub.attach(cache)
    cache.allocate("a", list(range(100, 109)))  # 2 full blocks
    pub.flush()
    cache.free("a")
    cache.allocate("b", list(range(200, 212)))  # 3 blocks in a 3-block cache: a's are evicted
    pub.flush()
    cache.free("b")
    assert cache.reset_prefix_cache()
    pub.flush()
    kinds = set()
    for _, payload in pub.buffered():
        theirs = msgspec.msgpack.decode(payload, type=schema.KVEventBatch)
        dp = getattr(theirs, "attn_dp_rank", getattr(theirs, "data_parallel_rank", None))
        assert dp == 1
        ours = decoder_for(fmt if fmt == "sglang" else "sim")(payload)
        assert ours.events == [_normalized(e) for e in theirs.events]
        kinds |= {type(e).__name__ for e in ours.events}
        if fmt == "sglang":
            assert all(-(1 << 63) <= h < (1 << 63) for e in theirs.events for h in getattr(e, "block_hashes", []))
    assert kinds == {"Stored", "Removed", "Cleared"}


# -- ATOM v0.1.5 as the ATOM stand-in publishes it ------------------------------------------------------

def test_atom_format_is_atoms_array_layout():
    cfg = KvEventsConfig(enable_kv_cache_events=True, publisher="zmq")
    pub = KvEventPublisher(cfg, block_size=4, fmt="atom")
    cache = KVCache(4, 8)
    pub.attach(cache)
    cache.allocate("a", list(range(1, 9)))
    cache.free("a")
    assert cache.reset_prefix_cache()
    pub.flush()
    [(_, payload)] = pub.buffered()
    raw = msgspec.msgpack.decode(payload)
    assert [len(e) for e in raw[1]] == [12, 2]  # every ATOM field written (array_like)
    assert raw[1][0][5:] == [None, "GPU", None, None, None, None, None]
    theirs = msgspec.msgpack.decode(payload, type=ws.ATOM_0_1_5.KVEventBatch)
    ours = decoder_for("atom")(payload)
    assert ours.events == [_normalized(e) for e in theirs.events] and len(ours.events) == 2


@pytest.mark.parametrize("topic", ["kv-events", ""])
async def test_atom_frames_carry_no_sequence_and_no_empty_topic(topic):
    """ATOM's ZmqEventPublisher: [topic, payload] with a topic, the payload alone without one."""
    import zmq
    import zmq.asyncio

    from tests.conftest import free_port

    port = free_port()
    cfg = KvEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{port}", topic=topic)
    pub = KvEventPublisher(cfg, block_size=4, fmt="atom")
    cache = KVCache(4, 64)
    pub.attach(cache)
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        await pub.start()  # ATOM binds even a concrete address
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        frames = None
        for i in range(100):  # the slow-joiner window: publish until one arrives (bounded)
            cache.allocate(i, [1000 * i + t for t in range(4)])
            pub.flush()
            if await sub.poll(50):
                frames = await sub.recv_multipart()
                break
        assert frames is not None, "no ATOM-format message arrived"
        assert len(frames) == (2 if topic else 1) and (frames[0] == topic.encode() or not topic)
        batch = msgspec.msgpack.decode(frames[-1], type=ws.ATOM_0_1_5.KVEventBatch)
        assert type(batch.events[0]) is ws.ATOM_0_1_5.BlockStored
    finally:
        sub.close(linger=0)
        ctx.term()
        await pub.stop()


def test_atom_standin_reads_atoms_environment():
    from infera.engine.sim.atom_standin import atom_kv_events_config

    assert atom_kv_events_config({}) is None
    assert atom_kv_events_config({"ATOM_KV_EVENTS_ENABLE": "true"}) is None  # ATOM compares with "1"
    assert atom_kv_events_config({"ATOM_KV_EVENTS_ENABLE": "1", "ATOM_KV_EVENTS_PUBLISHER": "null"}) is None
    cfg = atom_kv_events_config({"ATOM_KV_EVENTS_ENABLE": "1"})
    assert (cfg.enabled, cfg.endpoint, cfg.topic, cfg.hwm, cfg.buffer_steps) == (
        True, "tcp://127.0.0.1:5557", "", 0, 10000)
    cfg = atom_kv_events_config({"ATOM_KV_EVENTS_ENABLE": "1", "ATOM_KV_EVENTS_ENDPOINT": "tcp://*:7001",
                                 "ATOM_KV_EVENTS_TOPIC": "kv-events", "ATOM_KV_EVENTS_HWM": "5"})
    assert (cfg.endpoint, cfg.topic, cfg.hwm) == ("tcp://*:7001", "kv-events", 5)
    for bad in ({"ATOM_KV_EVENTS_PUBLISHER": "kafka"}, {"ATOM_KV_EVENTS_HWM": "x"},
                {"ATOM_KV_EVENTS_BUFFER_STEPS": "0"}):
        with pytest.raises(ValueError):
            atom_kv_events_config({"ATOM_KV_EVENTS_ENABLE": "1", **bad})
