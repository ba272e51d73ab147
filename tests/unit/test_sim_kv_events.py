"""The simulator's KV-event encoding: vLLM 0.32 and SGLang 0.5.23 maps (checked against those
engines' own schemas), engine hashes, seq, replay buffer, and the sim launcher's KV-event flags."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import msgspec
import pytest

from infera.engine.sim.cache import KVCache, block_hashes
from infera.engine.sim.kv_events import (ClearedEvent, KvEventPublisher, KvEventsConfig, RemovedEvent, StoredEvent,
                                         binds, encode_batch, engine_root_hash, parse_kv_events_config)
from infera.engine.sim.scheduler import Scheduler
from infera.engine.sim.server import parse_args
from tests.fixtures.kv_events import wire_schemas
from tests.unit.sim_launcher_fakes import FakeSimSession, prepare

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kv_events"

BS = 4


def decode(payload: bytes):
    return msgspec.msgpack.decode(payload)  # plain Python objects: what any subscriber sees


def publisher(fmt="vllm", seed=0, buffer_steps=10000, num_blocks=8) -> tuple[KvEventPublisher, KVCache]:
    cfg = KvEventsConfig(enable_kv_cache_events=True, publisher="zmq", buffer_steps=buffer_steps)
    pub = KvEventPublisher(cfg, block_size=BS, seed=seed, fmt=fmt)
    cache = KVCache(BS, num_blocks)
    pub.attach(cache)
    return pub, cache


def events_of(pub: KvEventPublisher, seq: int) -> list:
    return decode(dict(pub.buffered())[seq])[1]


# -- config ---------------------------------------------------------------------------------------------

def test_config_vllm_schema():
    cfg = parse_kv_events_config('{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557",'
                                 '"replay_endpoint":"tcp://*:5558","topic":"kv-events"}')
    assert cfg.enabled and cfg.publisher == "zmq"  # zmq is the default publisher once enabled
    assert (cfg.buffer_steps, cfg.topic, cfg.replay_endpoint) == (10000, "kv-events", "tcp://*:5558")
    assert KvEventsConfig.from_dict({}).enabled is False
    assert KvEventsConfig.from_dict({"enable_kv_cache_events": True, "publisher": "null"}).enabled is False
    assert KvEventsConfig.from_dict({"enable_kv_cache_events": True}).topic == ""
    for bad in ('{"enable_kv_cache_events":true,"bogus":1}', '{"publisher":"kafka"}', "[1]", "nope",
                '{"buffer_steps":0}'):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_kv_events_config(bad)


def test_config_sglang_schema():
    cfg = KvEventsConfig.from_dict({"publisher": "zmq", "endpoint": "tcp://*:9", "topic": "kv-events"}, sglang=True)
    assert cfg.enabled and cfg.replay_endpoint is None
    assert not KvEventsConfig.from_dict({"endpoint": "tcp://*:9"}, sglang=True).enabled
    # SGLang 0.5.23's own fields: bind (force bind/connect) and format
    cfg = KvEventsConfig.from_dict({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:9", "bind": True,
                                    "format": "dynamo"}, sglang=True)
    assert (cfg.bind, cfg.format) == (True, "dynamo")
    for bad in ({"bind": "yes"}, {"format": "msgpack"}):
        with pytest.raises(ValueError):
            KvEventsConfig.from_dict({"publisher": "zmq", **bad}, sglang=True)
    with pytest.raises(ValueError, match="unknown field"):  # not vLLM's
        KvEventsConfig.from_dict({"enable_kv_cache_events": True, "bind": True})


def test_sim_server_flag():
    args = parse_args(["--model", "m", "--kv-events-config", '{"enable_kv_cache_events":true}'])
    assert args.kv_events_config.enabled
    assert parse_args(["--model", "m"]).kv_events_config is None
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--kv-events-config", "{bad"])


@pytest.mark.parametrize("endpoint, bound", [("tcp://*:5557", True), ("tcp://[::]:1", True), ("ipc:///tmp/x", True),
                                             ("inproc://x", True), ("tcp://10.0.0.1:5557", False)])
def test_bind_or_connect(endpoint, bound):
    assert binds(endpoint) is bound
    assert binds(endpoint, "sglang") is bound


def test_sglang_binds_0_0_0_0_and_obeys_bind():
    assert binds("tcp://0.0.0.0:5557", "sglang") and not binds("tcp://0.0.0.0:5557", "vllm")
    assert binds("tcp://127.0.0.1:5557", "sglang", bind=True)
    assert not binds("tcp://*:5557", "sglang", bind=False)


# -- encoding -------------------------------------------------------------------------------------------

def test_vllm_batch_is_array_of_ts_events_rank_with_tagged_maps():
    events = [StoredEvent([11, 12], None, list(range(8)), BS), RemovedEvent([11]), ClearedEvent(),
              StoredEvent([13], 12, [1, 2, 3, 4], BS)]
    batch = decode(encode_batch(events, "vllm", ts=12.5, dp_rank=3))
    assert batch[0] == 12.5 and batch[2] == 3
    # Key for key what vLLM 0.32 writes for a full-attention model (its real captures in
    # tests/fixtures/kv_events/vllm_seq*.msgpack have these keys).
    stored = {"type": "BlockStored", "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
              "kv_cache_spec_kind": "full_attention", "block_size": BS}
    assert batch[1] == [
        {**stored, "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": list(range(8)),
         "extra_keys": [None, None]},
        {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
        {**stored, "block_hashes": [13], "parent_block_hash": 12, "token_ids": [1, 2, 3, 4], "extra_keys": [None]},
    ]


def test_vllm_batch_has_the_keys_of_a_real_vllm_capture():
    real = decode((FIXTURES / "vllm_seq006.msgpack").read_bytes())
    real_kinds = {e["type"]: set(e) for e in real[1]}
    ours = decode(encode_batch([StoredEvent([1], None, [1, 2, 3, 4], BS), ClearedEvent()], "vllm", ts=1.0))
    assert {e["type"]: set(e) for e in ours[1]} == real_kinds
    removed_real = decode((FIXTURES / "vllm_seq004.msgpack").read_bytes())[1][0]
    removed_ours = decode(encode_batch([RemovedEvent([1])], "vllm", ts=1.0))[1][0]
    assert set(removed_ours) == set(removed_real) and removed_real["type"] == "BlockRemoved"


def test_sglang_batch_uses_sglang_0_5_23_tagged_maps_and_signed_hashes():
    events = [StoredEvent([2**64 - 1], 7, [1, 2, 3, 4], BS), RemovedEvent([2**64 - 1]), ClearedEvent()]
    batch = decode(encode_batch(events, "sglang", ts=1.0))
    assert batch == [1.0, [{"type": "BlockStored", "block_hashes": [-1], "parent_block_hash": 7,
                            "token_ids": [1, 2, 3, 4], "block_size": BS, "lora_id": None, "medium": "GPU"},
                           {"type": "BlockRemoved", "block_hashes": [-1], "medium": "GPU"},
                           {"type": "AllBlocksCleared"}], 0]
    with pytest.raises(ValueError):
        encode_batch(events, "trt")


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_both_formats_decode_with_the_engines_own_schema(fmt):
    """The engines' structs (mirrored field for field by the fixture generator) accept the sim's bytes."""
    schema = wire_schemas.VLLM_0_32 if fmt == "vllm" else wire_schemas.SGLANG_0_5_23
    events = [StoredEvent([2**63 + 5, 3], None, list(range(8)), BS), RemovedEvent([3]), ClearedEvent()]
    got = msgspec.msgpack.decode(encode_batch(events, fmt, ts=2.0, dp_rank=1), type=schema.KVEventBatch)
    stored, removed, cleared = got.events
    assert type(stored) is schema.BlockStored and type(removed) is schema.BlockRemoved
    assert type(cleared) is schema.AllBlocksCleared
    assert stored.token_ids == list(range(8)) and stored.block_size == BS and stored.medium == "GPU"


# -- the publisher over a real cache --------------------------------------------------------------------

def test_engine_hashes_are_not_router_hashes_but_a_reseeded_chain():
    pub, cache = publisher(seed=7)
    prompt = list(range(100, 100 + 3 * BS + 1))  # 3 full blocks + 1
    cache.allocate("a", prompt)
    assert pub.flush() == 0
    [ev] = events_of(pub, 0)  # one event for the whole chain, like vLLM
    router = block_hashes(prompt, BS)  # the cache's (= the router's) hash space
    assert ev["type"] == "BlockStored" and ev["parent_block_hash"] is None
    assert ev["token_ids"] == prompt[: 3 * BS] and len(ev["token_ids"]) == len(ev["block_hashes"]) * BS
    assert not set(ev["block_hashes"]) & set(router)
    assert ev["block_hashes"] == block_hashes(prompt, BS, parent_hash=engine_root_hash(7))
    other, cache2 = publisher(seed=8)
    cache2.allocate("a", prompt)
    other.flush()
    assert events_of(other, 0)[0]["block_hashes"] != ev["block_hashes"]  # seed-dependent


def test_generated_tokens_eviction_clear_and_seq():
    pub, cache = publisher(num_blocks=4)
    assert pub.flush() is None and pub.next_seq == 0  # nothing pending: no batch, no seq used
    cache.allocate("a", list(range(1, 2 * BS + 2)))  # 2 full blocks + 1 token
    assert pub.flush() == 0
    first = events_of(pub, 0)[0]["block_hashes"]
    for t in range(BS - 1):  # fill the third block with "generated" tokens
        cache.append_token("a", 900 + t)
    assert pub.flush() == 1
    [ev] = events_of(pub, 1)
    assert ev["parent_block_hash"] == first[-1] and ev["token_ids"] == [2 * BS + 1, 900, 901, 902]
    assert cache.match_prefix(list(range(1, 2 * BS + 2))) == 2 * BS  # the cache's own matching is intact
    cache.free("a")
    cache.allocate("b", list(range(500, 500 + 3 * BS)))  # needs 3 fresh blocks: evicts 2 cached ones
    assert pub.flush() == 2
    batch = events_of(pub, 2)
    removed = [e["block_hashes"][0] for e in batch if e["type"] == "BlockRemoved"]
    assert len(removed) == 2 and set(removed) <= set(first + ev["block_hashes"])
    assert [e["type"] for e in batch].count("BlockStored") == 1
    cache.free("b")
    assert cache.reset_prefix_cache()
    assert pub.flush() == 3 and events_of(pub, 3) == [{"type": "AllBlocksCleared"}]
    assert len(pub.hashes) == 0
    assert [s for s, _ in pub.buffered()] == [0, 1, 2, 3]


def test_sglang_publisher_over_a_cache():
    pub, cache = publisher(fmt="sglang")
    cache.allocate("a", list(range(10, 10 + BS)))
    pub.flush()
    [ev] = events_of(pub, 0)
    assert ev["type"] == "BlockStored" and ev["parent_block_hash"] is None
    assert ev["token_ids"] == list(range(10, 10 + BS)) and (ev["block_size"], ev["lora_id"], ev["medium"]) == (BS, None, "GPU")
    assert all(-(1 << 63) <= h < (1 << 63) for h in ev["block_hashes"])  # SGLang's signed int64 hashes


def test_replay_buffer_is_bounded():
    pub, cache = publisher(buffer_steps=3, num_blocks=16)
    for i in range(5):
        cache.allocate(i, [1000 * (i + 1) + t for t in range(BS)])
        assert pub.flush() == i
    assert [s for s, _ in pub.buffered()] == [2, 3, 4] and pub.next_seq == 5


async def test_one_batch_per_scheduler_step():
    cfg = KvEventsConfig(enable_kv_cache_events=True, publisher="zmq")
    cache = KVCache(BS, 64)
    sched = Scheduler(cache, speedup=10000)
    pub = KvEventPublisher(cfg, block_size=BS)
    pub.attach(cache, sched)
    sched.start()
    try:
        seqs = [sched.submit(list(range(k * 100, k * 100 + 3 * BS)), 2 * BS, ignore_eos=True) for k in range(3)]
        for s in seqs:
            async for _ in s.stream():
                pass
    finally:
        await sched.stop()
    assert 0 < pub.next_seq <= sched.num_steps
    batches = [decode(p) for _, p in pub.buffered()]
    # The first step admits all three prompts: their stored blocks come in ONE batch.
    assert len([e for e in batches[0][1] if e["type"] == "BlockStored"]) == 3
    stored = sum(len(e["block_hashes"]) for b in batches for e in b[1] if e["type"] == "BlockStored")
    # Per request: 3 prompt blocks + 1 filled by generated tokens (the last of the 8 generated
    # tokens never enters the cache, as in vLLM: 12 + 7 = 19 tokens = 4 full blocks).
    assert stored == 3 * 4


# -- the sim launcher -----------------------------------------------------------------------------------

async def test_sim_launcher_injects_kv_events_and_registers_endpoints():
    a, args, spec = prepare(["--model", "m", "--port", "9001", "--host", "0.0.0.0"])
    i = spec.argv.index("--kv-events-config")
    cfg = json.loads(spec.argv[i + 1])
    assert cfg["enable_kv_cache_events"] and cfg["publisher"] == "zmq" and cfg["topic"] == "kv-events"
    pub, replay = a.kv_events
    # bound to the advertise address (loopback for a wildcard --host), not every interface
    assert (cfg["endpoint"], cfg["replay_endpoint"]) == (f"tcp://*:0;127.0.0.1:{pub}", f"tcp://*:0;127.0.0.1:{replay}")
    assert parse_args(spec.argv).kv_events_config.enabled  # the engine accepts what was injected
    fields = await a.describe(FakeSimSession(), "http://x", spec.argv, args)
    assert fields["kv_events_endpoint"] == f"tcp://127.0.0.1:{pub}"
    assert fields["kv_events_replay_endpoint"] == f"tcp://127.0.0.1:{replay}"

    a, args, spec = prepare(["--model", "m", "--host", "0.0.0.0"], "--advertise-host", "node-7")
    fields = await a.describe(FakeSimSession(), "http://x", spec.argv, args)
    assert fields["kv_events_endpoint"] == f"tcp://node-7:{a.kv_events[0]}"


async def test_sim_launcher_kv_events_off_or_user_given():
    a, args, spec = prepare(["--model", "m"], "--no-enable-kv-events")
    assert "--kv-events-config" not in spec.argv and a.kv_events is None
    fields = await a.describe(FakeSimSession(), "http://x", spec.argv, args)
    assert "kv_events_endpoint" not in fields and "kv_events_replay_endpoint" not in fields

    user = '{"enable_kv_cache_events":true,"endpoint":"tcp://*:6000","topic":"kv-events"}'
    a, args, spec = prepare(["--model", "m", "--kv-events-config", user])
    assert spec.argv.count("--kv-events-config") == 1 and a.kv_events == (6000, None)
    fields = await a.describe(FakeSimSession(), "http://x", spec.argv, args)
    assert fields["kv_events_endpoint"] == "tcp://127.0.0.1:6000" and "kv_events_replay_endpoint" not in fields

    a, _, _ = prepare(["--model", "m", "--kv-events-config", '{"enable_kv_cache_events":false}'])
    assert a.kv_events is None
