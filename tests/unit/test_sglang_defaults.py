"""The engine defaults the SGLang launcher adds (§7.1): fp8 KV cache on GPU hosts, and the decode
radix cache for mooncake decode workers with KV events. One row per rule, each skip logged."""
from __future__ import annotations

import logging

import pytest

from infera.engine.base.kv_dtype import kv_fp8_decision
from infera.engine.sglang import adapter as sglang_adapter
from infera.engine.sglang.adapter import SglangAdapter, speculative_algorithm
from infera.engine.vllm import adapter as vllm_adapter
from infera.engine.vllm.adapter import VllmAdapter
from tests.unit import launcher_helpers

FP8 = ["--kv-cache-dtype", "fp8_e4m3"]
RADIX = "--disaggregation-decode-enable-radix-cache"
DECODE = ["--disaggregation-mode", "decode"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("INFERA_ENABLE_KV_EVENTS", "INFERA_DEFAULT_KV_FP8"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(vllm_adapter, "vllm_entry_module", lambda: "vllm.entrypoints.openai.api_server")


def prepare(monkeypatch, user, *launcher_flags, gpu=False, env=None):
    monkeypatch.setattr(sglang_adapter, "has_gpu", lambda: gpu)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    _, _, spec = launcher_helpers.prepare(SglangAdapter(), ["--model-path", "/m", *user], *launcher_flags)
    return spec.argv[len(user) + 2:]  # what the launcher added


def logged(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


# -- fp8 KV cache ----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "user, gpu, env, added, log_says",
    [
        ([], True, {}, True, "--kv-cache-dtype fp8_e4m3 (GPU host default"),
        ([], True, {"INFERA_DEFAULT_KV_FP8": "1"}, True, "GPU host default"),
        ([], True, {"INFERA_DEFAULT_KV_FP8": ""}, True, "GPU host default"),  # empty: as unset
        ([], False, {}, False, "no GPU found"),  # CPU host
        ([], True, {"INFERA_DEFAULT_KV_FP8": "0"}, False, "INFERA_DEFAULT_KV_FP8=0"),  # env off
        ([], True, {"INFERA_DEFAULT_KV_FP8": "false"}, False, "INFERA_DEFAULT_KV_FP8=false"),
        (["--kv-cache-dtype", "auto"], True, {}, False, "the user's --kv-cache-dtype auto"),  # user override
        (["--kv-cache-dtype=fp8_e5m2"], True, {"INFERA_DEFAULT_KV_FP8": "1"}, False,
         "the user's --kv-cache-dtype fp8_e5m2"),
    ],
)
def test_sglang_fp8_kv_default(monkeypatch, caplog, user, gpu, env, added, log_says):
    caplog.set_level(logging.INFO, logger="infera.launcher.sglang")
    got = prepare(monkeypatch, user, gpu=gpu, env=env)
    assert got.count("--kv-cache-dtype") == (1 if added else 0)
    if added:
        i = got.index("--kv-cache-dtype")
        assert got[i:i + 2] == FP8
    assert log_says in logged(caplog)


def test_bad_default_kv_fp8_env_is_an_error(monkeypatch):
    with pytest.raises(SystemExit, match="INFERA_DEFAULT_KV_FP8 is not a boolean: 'maybe'"):
        prepare(monkeypatch, [], gpu=True, env={"INFERA_DEFAULT_KV_FP8": "maybe"})


@pytest.mark.parametrize("user, gpu, env, why", [
    ([], True, {}, None),
    ([], False, {}, "no GPU found"),
    ([], True, {"INFERA_DEFAULT_KV_FP8": "off"}, "INFERA_DEFAULT_KV_FP8=off"),
    (["--kv-cache-dtype", "auto"], False, {"INFERA_DEFAULT_KV_FP8": "0"}, "the user's --kv-cache-dtype auto"),
])
def test_kv_fp8_decision_is_shared_by_sglang_and_vllm(monkeypatch, user, gpu, env, why):
    got = kv_fp8_decision(user, gpu, env)
    assert (got is None) if why is None else why in got
    monkeypatch.setattr(vllm_adapter, "has_gpu", lambda: gpu)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    _, _, spec = launcher_helpers.prepare(VllmAdapter(), ["--model", "/m", *user])
    added = spec.argv[2 + len(user):]
    assert added[0] == "--enable-prompt-tokens-details"
    assert (added[1:3] == FP8) == (why is None)
    assert added[3:].count("--kv-cache-dtype") == 0 and ("--kv-cache-dtype" in added) == (why is None)


# -- decode radix cache ------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "user, launcher_flags, added, log_says",
    [
        (DECODE, (), True, f"decode worker: {RADIX}"),  # mooncake is SGLang's default backend
        ([*DECODE, "--disaggregation-transfer-backend", "mooncake"], (), True, RADIX),
        ([*DECODE, "--disaggregation-transfer-backend", "nixl"], (), False, "transfer backend 'nixl'"),
        (DECODE, ("--no-enable-kv-events",), False, "KV events are off"),
        ([*DECODE, "--speculative-algorithm", "EAGLE"], (), False, "speculative algorithm 'EAGLE'"),
        ([*DECODE, "--speculative-algorithm=EAGLE3"], (), False, "speculative algorithm 'EAGLE3'"),
        ([*DECODE, "--speculative-algo", "NEXTN"], (), False, "speculative algorithm 'NEXTN'"),  # argparse prefix
        ([*DECODE, RADIX], (), False, "the user passed it"),
        ([*DECODE, "--disable-radix-cache"], (), False, "the user's --disable-radix-cache"),
        (["--disaggregation-mode", "prefill"], (), False, None),  # not a decode worker: nothing to log
        ([], (), False, None),
    ],
)
def test_decode_radix_cache(monkeypatch, caplog, user, launcher_flags, added, log_says):
    caplog.set_level(logging.INFO, logger="infera.launcher.sglang")
    got = prepare(monkeypatch, user, *launcher_flags)
    assert got.count(RADIX) == (1 if added else 0)
    text = logged(caplog)
    if log_says is None:
        assert RADIX not in text
    else:
        assert log_says in text


@pytest.mark.parametrize("argv, expect", [
    (["--speculative-algorithm", "EAGLE"], "EAGLE"),
    (["--speculative-alg=NGRAM"], "NGRAM"),
    (["--speculative-draft-model-path", "/d"], None),  # another speculative flag
    (["--speculative-a", "X"], None),  # ambiguous in SGLang (--speculative-accept-…): not this flag
    ([], None),
])
def test_speculative_algorithm(argv, expect):
    assert speculative_algorithm(argv) == expect
