import json

import pytest

from infera.engine.sglang import adapter as sglang_adapter
from infera.engine.sglang.adapter import SglangAdapter
from tests.unit import launcher_helpers


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("INFERA_ENABLE_KV_EVENTS", raising=False)
    monkeypatch.delenv("INFERA_DEFAULT_KV_FP8", raising=False)
    monkeypatch.setattr(sglang_adapter, "has_gpu", lambda: False)  # the GPU-host default: test_sglang_defaults.py


def prepare(argv, *launcher_flags):
    return launcher_helpers.prepare(SglangAdapter(), argv, *launcher_flags)


async def record(argv, *launcher_flags):
    return await launcher_helpers.record(SglangAdapter(), argv, *launcher_flags)


def added_kv_events_config(added):
    assert added[0] == "--kv-events-config"
    return json.loads(added[1])


# -- argv translation --------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "user, launcher_flags, expect_added",
    [
        # nothing given: metrics and a zmq KV-events config are appended after the user's flags
        (["--model-path", "/m"], (), ["--enable-metrics", "KV"]),
        # the alias SGLang accepts; flags keep their order and values
        (["--model", "/m", "--port", "30001", "--page-size", "16", "--tp", "2"], (), ["--enable-metrics", "KV"]),
        # user already asked for metrics: not repeated
        (["--model-path", "/m", "--enable-metrics", "--mem-fraction-static", "0.8"], (), ["KV"]),
        # user's own KV-events config is kept, nothing injected
        (["--model-path", "/m", "--kv-events-config", '{"publisher":"zmq","endpoint":"tcp://*:6000"}'], (),
         ["--enable-metrics"]),
        # KV events off: only metrics
        (["--model-path", "/m", "--trust-remote-code"], ("--no-enable-kv-events",), ["--enable-metrics"]),
        (["--model-path", "/m", "--enable-metrics", "--kv-events-config", "{}"], ("--no-enable-kv-events",), []),
    ],
)
def test_argv_is_verbatim_and_only_missing_flags_are_added(user, launcher_flags, expect_added):
    _, _, spec = prepare(user, *launcher_flags)
    assert spec.argv[: len(user)] == user
    added = spec.argv[len(user):]
    if "KV" in expect_added:
        i = expect_added.index("KV")
        assert added[:i] == expect_added[:i]
        cfg = added_kv_events_config(added[i:])
        assert cfg["publisher"] == "zmq" and cfg["topic"] == "kv-events"
        assert cfg["endpoint"].startswith("tcp://*:") and int(cfg["endpoint"].rsplit(":", 1)[1]) > 0
        assert len(added) == i + 2
    else:
        assert added == expect_added
    assert spec.cmd[1:3] == ["-m", "sglang.launch_server"] and spec.cmd[3:] == spec.argv


def test_port_and_host_defaults_and_reach():
    _, _, spec = prepare(["--model-path", "/m"])
    assert (spec.port, spec.host) == (30000, "127.0.0.1")  # SGLang's defaults
    _, _, spec = prepare(["--model-path", "/m", "--host", "0.0.0.0", "--port", "31000"])
    assert (spec.port, spec.host) == (31000, "127.0.0.1")  # wildcard bind: reached on loopback
    _, _, spec = prepare(["--model-path", "/m", "--host", "10.0.0.7", "--port=31001"])
    assert (spec.port, spec.host) == (31001, "10.0.0.7")


def test_kv_events_env_default(monkeypatch):
    monkeypatch.setenv("INFERA_ENABLE_KV_EVENTS", "0")
    a, _, spec = prepare(["--model-path", "/m"])
    assert "--kv-events-config" not in spec.argv and a.kv_events is None
    a, _, spec = prepare(["--model-path", "/m"], "--enable-kv-events")  # the flag beats the env
    assert "--kv-events-config" in spec.argv and a.kv_events is not None


def test_dp_reserves_a_port_block_for_the_ranks():
    a, _, spec = prepare(["--model-path", "/m", "--dp-size", "3", "--enable-dp-attention"])
    cfg = added_kv_events_config(spec.argv[-2:])
    assert a.kv_events == (None, int(cfg["endpoint"].rsplit(":", 1)[1]))


def test_entrypoint_override():
    _, _, spec = prepare(["--model-path", "/m"], "--engine-entrypoint", "python -m infera.engine.sim.sglang_standin")
    assert spec.cmd[1:3] == ["-m", "infera.engine.sim.sglang_standin"] and spec.cmd[3:] == spec.argv


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--port", "1"], "--model-path \\(or --model\\) is required"),
        (["--model-path", "/m", "--disaggregation-mode", "both"], "--disaggregation-mode must be one of"),
        (["--model-path", "/m", "--page-size", "big"], "--page-size must be an integer"),
        (["--model-path", "/m", "--dp", "x"], "--dp-size must be an integer"),
        (["--model-path", "/m", "--kv-events-config", "{nope"], "--kv-events-config is not valid JSON"),
    ],
)
def test_errors(argv, message):
    with pytest.raises(SystemExit, match=message):
        prepare(argv)


def test_bad_env_boolean(monkeypatch):
    monkeypatch.setenv("INFERA_ENABLE_KV_EVENTS", "maybe")
    with pytest.raises(SystemExit):  # argparse (converted default) or the adapter: either way, a clear exit
        prepare(["--model-path", "/m"])


# -- the record ----------------------------------------------------------------------------------------

async def test_mixed_record_defaults():
    a, spec, rec = await record(["--model-path", "org/model"])
    port = a.kv_events[1]
    assert (rec.worker_id, rec.url) == ("127.0.0.1:30000", "http://127.0.0.1:30000")
    assert (rec.engine, rec.model_name, rec.kv_block_size) == ("sglang", "org/model", 1)
    assert (rec.disagg_mode, rec.disagg_meta, rec.dp_size, rec.dp_rank) == ("mixed", {}, None, None)
    assert rec.kv_events_endpoint == f"tcp://127.0.0.1:{port}"


@pytest.mark.parametrize(
    "argv, launcher_flags, expect",
    [
        (["--model-path", "/m", "--served-model-name", "tiny", "--page-size", "32"], (),
         {"model_name": "tiny", "kv_block_size": 32}),
        (["--model", "/m", "--dp-size", "4", "--enable-dp-attention"], (), {"dp_size": 4, "dp_rank": None}),
        (["--model-path", "/m", "--data-parallel-size", "2"], (), {"dp_size": 2, "dp_rank": None}),
        (["--model-path", "/m", "--dp-size", "1"], (), {"dp_size": None, "dp_rank": None}),
        (["--model-path", "/m", "--host", "10.0.0.7", "--port", "31000", "--disaggregation-mode", "prefill"], (),
         {"worker_id": "10.0.0.7:31000", "disagg_mode": "prefill",
          "disagg_meta": {"protocol": "sglang-bootstrap", "params": {"bootstrap_addr": "10.0.0.7:8998"}}}),
        (["--model-path", "/m", "--host", "0.0.0.0", "--disaggregation-mode", "prefill",
          "--disaggregation-bootstrap-port", "9100", "--tp-size", "8"], ("--advertise-host", "10.1.2.3"),
         {"worker_id": "10.1.2.3:30000", "disagg_mode": "prefill",
          "disagg_meta": {"protocol": "sglang-bootstrap",
                          "params": {"bootstrap_addr": "10.1.2.3:9100", "tp_size": 8}}}),
        (["--model-path", "/m", "--disaggregation-mode", "decode"], (),
         {"disagg_mode": "decode", "disagg_meta": {"protocol": "sglang-bootstrap", "params": {}}}),
        (["--model-path", "/m", "--disaggregation-mode", "decode", "--tp", "2"], (),
         {"disagg_mode": "decode", "disagg_meta": {"protocol": "sglang-bootstrap", "params": {"tp_size": 2}}}),
        (["--model-path", "/m", "--disaggregation-mode", "null", "--tp", "2"], (),
         {"disagg_mode": "mixed", "disagg_meta": {}}),
        (["--model-path", "/m"], ("--no-enable-kv-events",), {"kv_events_endpoint": None}),
        (["--model-path", "/m", "--kv-events-config", '{"publisher":"zmq","endpoint":"tcp://*:6000"}'],
         ("--advertise-host", "10.1.2.3"), {"kv_events_endpoint": "tcp://10.1.2.3:6000"}),
        (["--model-path", "/m", "--kv-events-config", '{"publisher":"zmq"}'], (),
         {"kv_events_endpoint": "tcp://127.0.0.1:5557"}),  # SGLang's default endpoint
        (["--model-path", "/m", "--kv-events-config", '{"publisher":"zmq","endpoint":"tcp://10.9.9.9:6001"}'], (),
         {"kv_events_endpoint": "tcp://10.9.9.9:6001"}),
        (["--model-path", "/m", "--kv-events-config", '{"endpoint":"tcp://*:6000"}'], (),
         {"kv_events_endpoint": None}),  # no zmq publisher: SGLang publishes nothing
    ],
)
async def test_record_fields(argv, launcher_flags, expect):
    _, _, rec = await record(argv, *launcher_flags)
    assert {k: getattr(rec, k) for k in expect} == expect


# -- drain ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "text, expect",
    [
        ('sglang:num_running_reqs{model_name="m"} 2.0\nsglang:num_queue_reqs{model_name="m"} 3.0\n', 5),
        ('sglang:num_running_reqs{tp_rank="0"} 1.0\nsglang:num_running_reqs{tp_rank="1"} 1.0\n', 2),
        ('sglang:num_running_reqs 0.0\nsglang:num_queue_reqs 0.0\n'
         'sglang:num_prefill_bootstrap_queue_reqs 1.0\nsglang:num_prefill_inflight_queue_reqs 2.0\n'
         'sglang:num_decode_prealloc_queue_reqs 3.0\nsglang:num_decode_transfer_queue_reqs 4.0\n', 10),
        ('sglang:num_decode_transfer_queue_reqs 4.0\n', None),  # no running/queue gauge: unreadable
        ('vllm:num_requests_running 1.0\n', None),
        ("# nothing\n", None),
    ],
)
def test_inflight_from_metrics(text, expect):
    assert SglangAdapter().inflight(text) == expect
