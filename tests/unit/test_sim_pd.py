"""The simulator's P/D pieces without a network: transfer time, holds and expiry, config validation,
the cache/scheduler hooks, the stand-in's and the launcher's PD flags."""
from __future__ import annotations

import json
import re

import pytest

from infera.engine.sim import sglang_standin
from infera.engine.sim.cache import KVCache
from infera.engine.sim.pd import (KvHoldTable, KvTransferConfig, NixlDisaggregation, SglangDisaggregation,
                                  build_disaggregation, transfer_seconds)
from infera.engine.sim.scheduler import ImportedKv, Scheduler, Sequence
from infera.engine.sim.server import parse_args
from tests.conftest import wait_for
from tests.unit.sim_launcher_fakes import FakeSimSession, prepare

FAST = 1e5
NIXL = "NixlConnector"


# -- transfer time ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens, bytes_per_token, gbps, speedup, seconds", [
    (0, 131072, 25.0, 1.0, 0.0),
    (-3, 131072, 25.0, 1.0, 0.0),
    (1000, 131072, 25.0, 1.0, 1000 * 131072 / 25e9),
    (1000, 131072, 25.0, 10.0, 1000 * 131072 / 25e9 / 10),
    (1, 1_000_000, 0.001, 1.0, 1.0),  # 1 MB over 1 MB/s
    (4096, 2, 1.0, 2.0, 4096 * 2 / 1e9 / 2),
])
def test_transfer_seconds(tokens, bytes_per_token, gbps, speedup, seconds):
    assert transfer_seconds(tokens, bytes_per_token, gbps, speedup) == pytest.approx(seconds)


# -- --kv-transfer-config ---------------------------------------------------------------------------------

@pytest.mark.parametrize("obj, role, producer, consumer, policy", [
    ({"kv_connector": NIXL, "kv_role": "kv_producer"}, "kv_producer", True, False, "recompute"),
    ({"kv_connector": NIXL, "kv_role": "kv_consumer", "engine_id": "d1"}, "kv_consumer", False, True, "recompute"),
    ({"kv_connector": NIXL, "kv_role": "kv_both", "kv_buffer_device": "cpu"}, "kv_both", True, True, "recompute"),
    ({"kv_connector": NIXL, "kv_role": "kv_consumer", "kv_load_failure_policy": "fail"},
     "kv_consumer", False, True, "fail"),
])
def test_kv_transfer_config_accepts(obj, role, producer, consumer, policy):
    cfg = KvTransferConfig.from_dict(obj)
    assert (cfg.kv_role, cfg.is_producer, cfg.is_consumer, cfg.kv_load_failure_policy) == (role, producer, consumer,
                                                                                            policy)


@pytest.mark.parametrize("obj, message", [
    ([], "JSON object"),
    ({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"}, "supported: NixlConnector"),
    ({"kv_role": "kv_producer"}, "supported: NixlConnector"),
    ({"kv_connector": NIXL}, "kv_role must be one of"),
    ({"kv_connector": NIXL, "kv_role": "producer"}, "kv_role must be one of"),
    ({"kv_connector": NIXL, "kv_role": "kv_both", "kv_rol": 1}, "unknown field(s): kv_rol"),
    ({"kv_connector": NIXL, "kv_role": "kv_both", "engine_id": 7}, "engine_id"),
    ({"kv_connector": NIXL, "kv_role": "kv_both", "kv_connector_extra_config": []}, "kv_connector_extra_config"),
    ({"kv_connector": NIXL, "kv_role": "kv_both", "kv_load_failure_policy": "retry"}, "kv_load_failure_policy"),
])
def test_kv_transfer_config_rejects(obj, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        KvTransferConfig.from_dict(obj)


def test_sim_flag_errors_name_what_is_supported(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", "m", "--kv-transfer-config",
                    '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-transfer-config" in err and "LMCacheConnectorV1" in err and "supported: NixlConnector" in err


@pytest.mark.parametrize("flags", [
    ["--kv-transfer-bandwidth", "0"], ["--kv-bytes-per-token", "0"], ["--kv-hold-timeout", "-1"],
    ["--kv-transfer-timeout", "0"], ["--kv-transfer-config", "{nope"],
])
def test_sim_pd_flag_validation(flags):
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", *flags])


@pytest.mark.parametrize("flags, kind, role", [
    ([], type(None), None),
    (["--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'], NixlDisaggregation,
     "kv_producer"),
    (["--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_consumer","engine_id":"e"}'],
     NixlDisaggregation, "kv_consumer"),
])
def test_build_disaggregation_from_sim_flags(flags, kind, role):
    args = parse_args(["--model", "m", *flags])
    assert (args.kv_transfer_bandwidth, args.kv_bytes_per_token, args.kv_hold_timeout) == (25.0, 131072, 480.0)
    disagg = build_disaggregation(args, KVCache(16, 64))
    assert isinstance(disagg, kind)
    if disagg is not None:
        assert disagg.config.kv_role == role and disagg.engine_id  # a random one when not configured


# -- holds --------------------------------------------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def finished_prefill(cache: KVCache, prompt: list[int]) -> Sequence:
    """A sequence that still holds its blocks, as the scheduler calls a kv_hold hook."""
    seq = Sequence(seq_id=1, request_id="r", prompt_token_ids=prompt, max_tokens=1, ignore_eos=True)
    assert cache.allocate(seq.seq_id, prompt) is not None
    seq.num_cached_tokens = 0
    return seq


def test_hold_pins_full_prompt_blocks_until_taken():
    cache = KVCache(4, 8)
    prompt = list(range(10, 20))  # 2 full blocks + 2 tokens
    seq = finished_prefill(cache, prompt)
    holds = KvHoldTable(cache, 60.0, clock=FakeClock())
    held = holds.pin("k", seq)
    cache.free(seq.seq_id)
    assert held.token_ids == prompt[:8] and len(held.block_ids) == 2 and held.prompt_len == 10
    assert all(cache.ref_count(b) == 1 for b in held.block_ids)  # pinned: not evictable
    assert cache.num_free_blocks == 6
    assert holds.take("k") is held and len(holds) == 0
    assert all(cache.ref_count(b) == 0 for b in held.block_ids) and cache.num_free_blocks == 8
    assert holds.take("k") is None and holds.num_taken == 1  # a second pull finds nothing


def test_hold_expires_at_its_deadline():
    cache = KVCache(4, 8)
    clock = FakeClock()
    holds = KvHoldTable(cache, 5.0, clock=clock)
    held = holds.pin("k", finished_prefill(cache, list(range(8))))
    cache.free(1)
    clock.now += 5.0
    assert holds.take("k") is None and holds.num_expired == 1
    assert all(cache.ref_count(b) == 0 for b in held.block_ids)


def test_repinning_a_key_releases_the_older_hold():
    cache = KVCache(4, 8)
    holds = KvHoldTable(cache, 60.0, clock=FakeClock())
    first = holds.pin(7, finished_prefill(cache, list(range(8))))
    cache.free(1)
    second = holds.pin(7, finished_prefill(cache, list(range(100, 108))))
    cache.free(1)
    assert all(cache.ref_count(b) == 0 for b in first.block_ids)
    assert all(cache.ref_count(b) == 1 for b in second.block_ids) and len(holds) == 1
    holds.clear()
    assert cache.num_free_blocks == 8 and len(holds) == 0


async def test_hold_timer_frees_blocks_without_a_take():
    cache = KVCache(4, 8)
    holds = KvHoldTable(cache, 0.05)
    held = holds.pin("k", finished_prefill(cache, list(range(8))))
    cache.free(1)
    await wait_for(lambda: len(holds) == 0, 2.0, interval=0.01, message="the hold to expire")
    assert holds.num_expired == 1 and all(cache.ref_count(b) == 0 for b in held.block_ids)


# -- cache and scheduler hooks ------------------------------------------------------------------------------

def test_import_blocks_registers_only_full_blocks_and_reuses_cached_ones():
    stored: list[list[int]] = []
    cache = KVCache(4, 8, on_stored=lambda hashes, parent, tokens: stored.append(tokens))
    assert cache.allocate("local", list(range(4))) == 0  # block 0 already here
    cache.free("local")
    stored.clear()
    tokens = list(range(14))  # 3 full blocks + 2
    assert cache.match_full_blocks(tokens) == 4
    filled = cache.import_blocks("imp", tokens)
    assert filled is not None and len(filled) == 2  # blocks 1 and 2 came by transfer
    assert stored == [list(range(4, 8)), list(range(8, 12))]  # BlockStored as if computed here
    assert cache.match_full_blocks(tokens) == 12 and cache.match_prefix(tokens) == 12
    cache.free("imp")
    assert cache.match_prefix(tokens) == 12  # still cached after the hold ends


def test_import_blocks_without_room_changes_nothing():
    cache = KVCache(4, 2)
    assert cache.import_blocks("imp", list(range(12))) is None
    assert cache.num_free_blocks == 2 and cache.num_cached_blocks == 0


async def test_imported_prefix_counts_as_external_and_hold_is_called_at_finish_only():
    cache = KVCache(4, 64)
    sched = Scheduler(cache, speedup=FAST, kv_connector=True)
    prompt = list(range(1, 15))  # 3 full blocks + 2
    cache.allocate("warm", prompt[:4])  # block 0 cached locally beforehand
    cache.free("warm")
    filled = cache.import_blocks("imp", prompt)
    held: list[list[int]] = []

    def hold(seq: Sequence) -> None:
        held.append(cache.hold_prefix_blocks("pin", seq.seq_id, seq.prompt_len // 4))

    sched.start()
    try:
        seq = sched.submit(prompt, 3, ignore_eos=True, kv_import=ImportedKv("imp", frozenset(filled)), kv_hold=hold)
        async for _token, reason in seq.stream():
            pass
        aborted = sched.submit(prompt, 3, ignore_eos=True, kv_hold=hold)
        sched.abort(aborted)
    finally:
        await sched.stop()
    assert reason == "length" and (seq.num_cached_tokens, seq.num_external_tokens) == (12, 8)
    assert not cache.has_seq("imp") and seq.kv_import is None  # released at admission
    assert len(held) == 1 and len(held[0]) == 3  # pinned at the normal finish, not at the abort
    by_source = sched.stats.prompt_tokens_by_source
    assert (by_source["local_compute"], by_source["local_cache_hit"], by_source["external_kv_transfer"]) == (2, 4, 8)
    assert (sched.stats.external_prefix_cache_queries, sched.stats.external_prefix_cache_hits) == (14, 8)


async def test_aborting_a_waiting_decode_releases_its_imported_kv():
    cache = KVCache(4, 64)
    sched = Scheduler(cache, speedup=FAST)  # not started: the sequence stays waiting
    filled = cache.import_blocks("imp", list(range(8)))
    seq = sched.submit(list(range(8)), 2, kv_import=ImportedKv("imp", frozenset(filled)))
    sched.abort(seq)
    assert not cache.has_seq("imp") and cache.num_free_blocks == 64
    assert sched.stats.external_prefix_cache_queries == 0  # no connector: never counted


# -- the SGLang stand-in's PD flags -------------------------------------------------------------------------

@pytest.mark.parametrize("argv, mode, port, backend", [
    ([], None, None, None),
    (["--disaggregation-mode", "null"], None, None, None),
    (["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "9100"], "prefill", 9100, "mooncake"),
    (["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "nixl"], "decode", 8998, "nixl"),
    # SGLang 0.5.23 added these two to its choices
    (["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake_tcp"], "decode", 8998,
     "mooncake_tcp"),
    (["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "fake"], "prefill", 8998, "fake"),
])
def test_standin_pd_flags(argv, mode, port, backend):
    args, flavor = sglang_standin.parse_standin_args(["--model-path", "m", *argv])
    cfg = getattr(args, "sglang_disaggregation", None)
    assert flavor is None and (args.kv_hold_timeout, args.kv_transfer_timeout) == (300.0, 300.0)
    if mode is None:
        assert cfg is None and build_disaggregation(args, KVCache(1, 8)) is None
    else:
        assert (cfg.mode, cfg.bootstrap_port, cfg.transfer_backend) == (mode, port, backend)
        assert isinstance(build_disaggregation(args, KVCache(1, 8)), SglangDisaggregation)


def test_standin_passes_transfer_knobs_to_the_simulator():
    args, flavor = sglang_standin.parse_standin_args(
        ["--model-path", "m", "--enable-metrics", "--kv-transfer-bandwidth", "0.5", "--kv-bytes-per-token", "64",
         "--kv-hold-timeout", "2", "--kv-transfer-timeout", "3"])
    assert flavor == "sglang"
    assert (args.kv_transfer_bandwidth, args.kv_bytes_per_token, args.kv_hold_timeout,
            args.kv_transfer_timeout) == (0.5, 64, 2.0, 3.0)


@pytest.mark.parametrize("argv", [
    ["--disaggregation-transfer-backend", "tcp"],
    ["--disaggregation-mode", "both"],
    ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "70000"],
])
def test_standin_rejects_bad_pd_flags(argv):
    with pytest.raises(SystemExit):
        sglang_standin.parse_standin_args(["--model-path", "m", *argv])


# -- the sim launcher: record and pinned engine id ------------------------------------------------------------

@pytest.mark.parametrize("cfg, mode, pinned", [
    (None, "mixed", False),
    ({"kv_connector": NIXL, "kv_role": "kv_producer"}, "prefill", True),
    ({"kv_connector": NIXL, "kv_role": "kv_consumer", "engine_id": "dec-1"}, "decode", False),
    ({"kv_connector": NIXL, "kv_role": "kv_both"}, "mixed", False),
])
async def test_sim_launcher_registers_the_nixl_role(cfg, mode, pinned):
    extra = [] if cfg is None else ["--kv-transfer-config", json.dumps(cfg)]
    adapter, args, spec = prepare(["--model", "m", "--host", "127.0.0.1", *extra], "--no-enable-kv-events")
    fields = await adapter.describe(FakeSimSession(), "http://x", spec.argv, args)
    assert fields["disagg_mode"] == mode
    if cfg is None:
        assert fields["disagg_meta"] == {} and "--kv-transfer-config" not in spec.argv
        return
    forwarded = json.loads(spec.argv[spec.argv.index("--kv-transfer-config") + 1])
    engine_args = parse_args(spec.argv)  # the simulator accepts what the launcher forwards
    assert engine_args.kv_transfer_config.engine_id == forwarded.get("engine_id")
    if pinned:
        assert len(forwarded["engine_id"]) == 32
    else:
        assert forwarded == cfg
    if mode == "mixed":
        assert fields["disagg_meta"] == {}
    else:
        meta = fields["disagg_meta"]
        assert (meta["protocol"], meta["connector"]) == ("vllm-nixl", NIXL)
        assert meta["params"]["engine_id"] == forwarded["engine_id"]
