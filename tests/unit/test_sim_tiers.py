"""The simulator's host KV tier (``--kv-offload-blocks``): GPU evictions copied there (LRU,
bounded), prefixes loaded back instead of computed (cached tokens, load time), and the KV events
each engine format publishes for it, down to a router index that scores them."""
from __future__ import annotations

import asyncio

import msgspec
import pytest

from infera.engine.sim.cache import KVCache, block_hashes
from infera.engine.sim.kv_events import HOST_MEDIUM, KvEventPublisher, KvEventsConfig
from infera.engine.sim.scheduler import (SOURCE_EXTERNAL_KV_TRANSFER, SOURCE_LOCAL_CACHE_HIT, SOURCE_LOCAL_COMPUTE,
                                         Scheduler, default_load_ms_per_block, prefill_time_ms)
from infera.engine.sim.server import SimEngine, parse_args
from infera.kv.events import decoder_for
from infera.kv.index import KvIndex
from tests.fixtures.kv_events import wire_schemas

BS = 4


def prompt(base: int, n_blocks: int, extra: int = 1) -> list[int]:
    return list(range(base, base + n_blocks * BS + extra))


class Log:
    """Records every cache hook in order."""

    def __init__(self, cache: KVCache) -> None:
        self.calls: list[tuple] = []
        cache.on_stored = lambda hs, parent, toks: self.calls.append(("stored", tuple(hs)))
        cache.on_removed = lambda hs: self.calls.append(("removed", tuple(hs)))
        cache.on_offloaded = lambda h, parent, toks: self.calls.append(("offloaded", h, parent, tuple(toks)))
        cache.on_offload_evicted = lambda hs: self.calls.append(("host-evicted", tuple(hs)))

    def kinds(self, kind: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == kind]


def evict_all(cache: KVCache, base: int = 9000) -> None:
    """Fill every GPU block with another prompt, so whatever was cached is evicted."""
    cache.allocate("filler", list(range(base, base + cache.num_blocks * BS)))
    cache.free("filler")


# --- the cache ---------------------------------------------------------------------------------

def test_no_host_tier_by_default():
    cache = KVCache(BS, 4)
    log = Log(cache)
    a = prompt(100, 3)
    cache.allocate("a", a)
    cache.free("a")
    evict_all(cache)
    assert not log.kinds("offloaded") and cache.num_host_blocks == 0
    assert cache.match_prefix(a) == 0


def test_evicted_blocks_go_to_host_before_leaving_the_gpu():
    cache = KVCache(BS, 4, host_blocks=16)
    log = Log(cache)
    a = prompt(100, 3)
    hashes = block_hashes(a[:3 * BS], BS)
    cache.allocate("a", a)
    cache.free("a")
    log.calls.clear()
    evict_all(cache)
    offloaded = log.kinds("offloaded")
    assert {c[1] for c in offloaded} == set(hashes) and cache.num_host_blocks == 3
    for h in hashes:  # each copy is announced before the GPU's removal of the same block
        order = [i for i, c in enumerate(log.calls) if (c[0] == "offloaded" and c[1] == h) or
                 (c[0] == "removed" and c[1] == (h,))]
        assert len(order) == 2 and log.calls[order[0]][0] == "offloaded"
    by_hash = {c[1]: c for c in offloaded}
    assert by_hash[hashes[1]][2] == hashes[0] and by_hash[hashes[1]][3] == tuple(a[BS:2 * BS])  # parent, tokens


def test_host_prefix_is_loaded_counted_cached_and_promoted():
    cache = KVCache(BS, 4, host_blocks=16)
    a = prompt(100, 3)
    cache.allocate("a", a)
    cache.free("a")
    evict_all(cache)
    log = Log(cache)
    hits_before = cache.prefix_cache_hits
    assert cache.match_prefix(a) == 3 * BS  # what allocate would serve: all from the host
    assert cache.allocate("a2", a) == 3 * BS
    assert cache.loaded_tokens("a2") == 3 * BS and cache.host_loaded_tokens == 3 * BS
    assert cache.prefix_cache_hits == hits_before  # vLLM's GPU counter: loaded tokens are not GPU hits
    assert set(log.kinds("stored")[0][1]) <= set(block_hashes(a[:3 * BS], BS))  # promoted to the GPU
    assert all(cache.is_cached(h) for h in block_hashes(a[:3 * BS], BS))
    assert cache.num_host_blocks >= 3 and all(cache.in_host(h) for h in block_hashes(a[:3 * BS], BS))  # inclusive


def test_load_continues_after_a_gpu_hit_and_stops_at_a_host_miss():
    cache = KVCache(BS, 8, host_blocks=16)
    a = prompt(100, 4)
    h = block_hashes(a[:4 * BS], BS)
    cache.allocate("a", a)
    cache.free("a")
    evict_all(cache)
    # the first block back on the GPU (a shorter prompt loaded it), the fourth gone from the host
    cache.allocate("b", a[:BS + 1])
    cache.free("b")
    cache._host.pop(h[3])
    assert cache.is_cached(h[0]) and not cache.is_cached(h[1])
    assert cache.allocate("a2", a) == 3 * BS  # 1 GPU hit + 2 loaded; the 4th block computed
    assert cache.loaded_tokens("a2") == 2 * BS


def test_one_token_is_always_computed_with_host_hits_too():
    cache = KVCache(BS, 4, host_blocks=16)
    a = list(range(100, 100 + 3 * BS))  # block-aligned
    cache.allocate("a", a)
    cache.free("a")
    evict_all(cache)
    assert cache.allocate("a2", a) == 2 * BS  # the last block holds the token that produces logits


def test_host_tier_is_lru_bounded():
    cache = KVCache(BS, 4, host_blocks=2)
    log = Log(cache)
    a = prompt(100, 3)
    cache.allocate("a", a)
    cache.free("a")
    evict_all(cache)
    assert cache.num_host_blocks == 2
    evicted = log.kinds("host-evicted")
    assert len(evicted) >= 1 and all(not cache.in_host(c[1][0]) for c in evicted)


def test_reset_clears_the_host_tier():
    cache = KVCache(BS, 4, host_blocks=8)
    cache.allocate("a", prompt(100, 3))
    cache.free("a")
    evict_all(cache)
    assert cache.num_host_blocks and cache.reset_prefix_cache()
    assert cache.num_host_blocks == 0 and cache.match_prefix(prompt(100, 3)) == 0


# --- the scheduler ------------------------------------------------------------------------------

def test_scheduler_counts_loaded_tokens_as_cached_and_external():
    async def run():
        cache = KVCache(BS, 8, host_blocks=32)
        sched = Scheduler(cache, speedup=1000.0, kv_connector=True, load_ms_per_block=2.0)
        sched.start()
        a = prompt(100, 5)
        first = sched.submit(a, 1)
        async for _ in first.stream():
            pass
        filler = sched.submit(list(range(9000, 9000 + 7 * BS + 3)), 1)  # all 8 GPU blocks
        async for _ in filler.stream():
            pass
        again = sched.submit(a, 4, ignore_eos=True)
        async for _ in again.stream():
            pass
        await sched.stop()
        return cache, sched, again

    cache, sched, again = asyncio.run(run())
    assert again.num_cached_tokens == 5 * BS and again.num_external_tokens == 5 * BS
    by_source = sched.stats.prompt_tokens_by_source
    assert by_source[SOURCE_EXTERNAL_KV_TRANSFER] == 5 * BS
    assert by_source[SOURCE_LOCAL_CACHE_HIT] == 0
    assert by_source[SOURCE_LOCAL_COMPUTE] == (5 * BS + 1) + (7 * BS + 3) + 1
    assert sched.stats.external_prefix_cache_hits == 5 * BS


def test_schedule_reports_the_blocks_a_step_loads():
    cache = KVCache(BS, 8, host_blocks=32)
    sched = Scheduler(cache, load_ms_per_block=1.0)
    a = prompt(100, 5)
    cache.allocate("old", a)
    cache.free("old")
    evict_all(cache)
    sched._waiting.append(_seq(sched, a))
    prefill, _, prefill_tokens = sched._schedule()
    assert len(prefill) == 1 and prefill_tokens == 1 and sched._loaded_blocks_in_step == 5
    sched._waiting.append(_seq(sched, prompt(5000, 2)))
    sched._schedule()
    assert sched._loaded_blocks_in_step == 0


def _seq(sched: Scheduler, tokens: list[int]):
    from infera.engine.sim.scheduler import Context, Sequence

    return Sequence(seq_id=id(tokens), request_id="", prompt_token_ids=tokens, max_tokens=4, ignore_eos=True,
                    context=Context(0, tokens, sched._vocab_set))


def test_default_load_time_is_a_few_percent_of_prefill():
    for bs in (16, 64):
        per_block = default_load_ms_per_block(bs)
        assert 0 < per_block < 0.1 * (prefill_time_ms(bs) - prefill_time_ms(1) + 0.0152)


def test_server_flags():
    args = parse_args(["--model", "m", "--kv-offload-blocks", "100", "--kv-offload-load-ms-per-block", "0.5"])
    engine = SimEngine(args)
    assert engine.cache.host_blocks == 100 and engine.scheduler.load_ms_per_block == 0.5
    assert engine.scheduler.kv_connector  # vLLM runs an OffloadingConnector for it
    default = SimEngine(parse_args(["--model", "m", "--block-size", "16"]))
    assert default.cache.host_blocks == 0 and not default.scheduler.kv_connector
    assert default.scheduler.load_ms_per_block == default_load_ms_per_block(16)
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--kv-offload-blocks", "-1"])


# --- the events, down to a router index ----------------------------------------------------------

def _publisher(fmt: str, num_blocks: int = 4, host_blocks: int = 16):
    cfg = KvEventsConfig(enable_kv_cache_events=True, publisher="zmq")
    pub = KvEventPublisher(cfg, block_size=BS, seed=3, fmt=fmt)
    cache = KVCache(BS, num_blocks, host_blocks=host_blocks)
    pub.attach(cache)
    return pub, cache


def _events(pub: KvEventPublisher) -> list:
    seq = pub.flush()
    return msgspec.msgpack.decode(dict(pub.buffered())[seq])[1]


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "atom"])
def test_offload_events_carry_the_host_medium_and_the_gpu_engine_hash(fmt):
    pub, cache = _publisher(fmt)
    a = prompt(100, 3)
    cache.allocate("a", a)
    cache.free("a")
    [stored] = _events(pub)
    gpu_hashes = stored["block_hashes"] if fmt != "atom" else stored[1]
    evict_all(cache)
    events = _events(pub)
    medium = HOST_MEDIUM[fmt]
    if fmt == "atom":  # tagged arrays: [tag, hashes, parent, tokens, bs, lora, medium, ...] / [tag, hashes, medium, ..]
        host_stored = [e for e in events if e[0] == "BlockStored" and e[6] == medium]
        assert sorted(h for e in host_stored for h in e[1]) == sorted(gpu_hashes)
    else:
        host_stored = [e for e in events if e["type"] == "BlockStored" and e["medium"] == medium]
        gpu_removed = [e for e in events if e["type"] == "BlockRemoved" and e["medium"] == "GPU"]
        assert sorted(h for e in host_stored for h in e["block_hashes"]) == sorted(gpu_hashes)
        assert sorted(h for e in gpu_removed for h in e["block_hashes"]) == sorted(gpu_hashes)


def test_vllm_offload_events_decode_with_vllms_schema():
    pub, cache = _publisher("vllm", host_blocks=1)
    cache.allocate("a", prompt(100, 3))
    cache.free("a")
    pub.flush()
    evict_all(cache)
    seq = pub.flush()
    got = msgspec.msgpack.decode(dict(pub.buffered())[seq], type=wire_schemas.VLLM_0_32.KVEventBatch)
    schema = wire_schemas.VLLM_0_32
    media = {(type(e), getattr(e, "medium", None)) for e in got.events}
    assert (schema.BlockStored, "CPU") in media and (schema.BlockRemoved, "CPU") in media  # host bound at 1 block
    assert (schema.BlockRemoved, "GPU") in media


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_router_index_sees_the_host_tier_and_its_promotion(fmt):
    """Events from the sim, decoded by the router's decoder into the router's index: match_lower
    finds the evicted prefix on the host; after a load it is back in the GPU view."""
    pub, cache = _publisher(fmt, num_blocks=6)
    decode = decoder_for(fmt)
    idx = KvIndex()
    idx.add_target("w", BS)

    def pump():
        seq = pub.flush()
        if seq is not None:
            idx.apply("w", decode(dict(pub.buffered())[seq]))

    a = prompt(100, 4)
    h = block_hashes(a[:4 * BS], BS)
    cache.allocate("a", a)
    cache.free("a")
    pump()
    assert idx.match(h, ["w"]) == [4] and idx.match_lower(h, ["w"], [4]) == [0]
    evict_all(cache)
    pump()
    assert idx.match(h, ["w"]) == [0]
    assert idx.match_lower(h, ["w"], [0]) == [4]
    assert idx.tier_block_counts("w") == {HOST_MEDIUM[fmt]: 4}
    assert idx.stats("w").dropped_events == 0
    cache.allocate("a2", a)
    pump()
    assert idx.match(h, ["w"]) == [4]  # loaded back: on the GPU again (the last block was computed)
