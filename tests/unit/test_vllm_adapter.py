import json

import pytest

from infera.engine.vllm import adapter as vllm_adapter
from infera.engine.vllm.adapter import VllmAdapter, disaggregation
from tests.unit import launcher_helpers


def prepare(argv, *launcher_flags, monkeypatch=None, gpu=False):
    return launcher_helpers.prepare(VllmAdapter(), argv, *launcher_flags)


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    monkeypatch.setattr(vllm_adapter, "has_gpu", lambda: False)
    monkeypatch.setattr(vllm_adapter, "vllm_entry_module", lambda: "vllm.entrypoints.openai.api_server")
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)


def test_user_flags_pass_verbatim_in_order_and_defaults_are_appended():
    user = ["--model", "/m", "--port", "30001", "--block-size", "32", "--enforce-eager", "--max-num-seqs", "4"]
    a, args, spec = prepare(user)
    assert spec.argv[: len(user)] == user
    added = spec.argv[len(user):]
    assert added[0] == "--enable-prompt-tokens-details"
    assert added[1] == "--kv-events-config"
    cfg = json.loads(added[2])
    assert cfg["enable_kv_cache_events"] and cfg["publisher"] == "zmq" and cfg["topic"] == "kv-events"
    assert cfg["endpoint"].startswith("tcp://*:") and cfg["replay_endpoint"].startswith("tcp://*:")
    assert "--kv-cache-dtype" not in spec.argv  # CPU: fp8 default skipped
    assert spec.cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and spec.cmd[3:] == spec.argv
    assert spec.port == 30001 and spec.host == "127.0.0.1"
    assert spec.env == {"PYTHONHASHSEED": "0", "VLLM_HOST_IP": "127.0.0.1"}


def test_user_choices_are_honoured(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    user = ["--model", "/m", "--enable-prompt-tokens-details", "--kv-events-config",
            '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:6000"}']
    a, _, spec = prepare(user)
    assert spec.argv == user and "PYTHONHASHSEED" not in spec.env
    assert a.kv_events == (6000, None)


def test_no_kv_events_and_gpu_fp8(monkeypatch):
    monkeypatch.setattr(vllm_adapter, "has_gpu", lambda: True)
    a, _, spec = prepare(["--model", "/m"], "--no-enable-kv-events")
    assert "--kv-events-config" not in spec.argv and a.kv_events is None
    assert spec.argv[-2:] == ["--kv-cache-dtype", "fp8_e4m3"]
    _, _, spec = prepare(["--model", "/m", "--kv-cache-dtype", "auto"])
    assert spec.argv.count("--kv-cache-dtype") == 1


def test_cli_entry_where_it_works(monkeypatch):
    monkeypatch.setattr(vllm_adapter, "vllm_entry_module", lambda: "vllm.entrypoints.cli.main")
    _, _, spec = prepare(["--model", "/m"])
    assert spec.cmd[1:4] == ["-m", "vllm.entrypoints.cli.main", "serve"]


def test_entrypoint_override():
    _, _, spec = prepare(["--model", "/m"], "--engine-entrypoint", "python -m my.standin --x")
    assert spec.cmd[1:4] == ["-m", "my.standin", "--x"] and spec.cmd[4:] == spec.argv


def test_model_required():
    with pytest.raises(SystemExit, match="--model is required"):
        prepare(["--port", "1"])


def test_engine_id_is_pinned_into_the_forwarded_config():
    cfg = {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    _, _, spec = prepare(["--model", "/m", "--kv-transfer-config", json.dumps(cfg)])
    forwarded = json.loads(spec.argv[spec.argv.index("--kv-transfer-config") + 1])
    assert len(forwarded["engine_id"]) == 32 and forwarded["kv_role"] == "kv_producer"


@pytest.mark.parametrize(
    "cfg, mode, protocol",
    [
        (None, "mixed", None),
        ({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}, "prefill", "vllm-nixl"),
        ({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}, "decode", "vllm-nixl"),
        ({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, "mixed", None),
        ({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"}, "prefill", "vllm-mooncake"),
        ({"kv_connector": "MoRIIOConnector", "kv_role": "kv_consumer"}, "decode", "vllm-mori-write"),
        ({"kv_connector": "ExampleConnector", "kv_role": "kv_producer"}, "prefill", "vllm-example"),
        ({"kv_connector": "MultiConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"connectors": [{"kv_connector": "LMCacheConnectorV1"},
                                                       {"kv_connector": "NixlConnector"}]}}, "prefill", "vllm-nixl"),
    ],
)
def test_disaggregation_roles_and_protocols(cfg, mode, protocol):
    got_mode, meta = disaggregation(cfg, "10.0.0.5")
    assert got_mode == mode
    assert meta.get("protocol") == protocol


def test_mooncake_bootstrap_addr_uses_advertise_host():
    _, meta = disaggregation({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer", "engine_id": "e1"}, "10.0.0.5")
    assert meta["params"]["bootstrap_addr"] == "http://10.0.0.5:8998" and meta["params"]["engine_id"] == "e1"


def test_bad_kv_transfer_config():
    with pytest.raises(SystemExit, match="not valid JSON"):
        prepare(["--model", "/m", "--kv-transfer-config", "{nope"])


async def test_describe_reads_resolved_block_size_dp_and_events(aiohttp_metrics_server):
    a, args, spec = prepare(["--model", "/m", "--served-model-name", "tiny", "alias", "--block-size", "16",
                             "--data-parallel-size", "4", "--data-parallel-rank", "2", "--data-parallel-external-lb",
                             "--host", "0.0.0.0"], "--advertise-host", "10.1.2.3")
    fields = await a.describe(aiohttp_metrics_server.session, aiohttp_metrics_server.url, spec.argv, args)
    assert fields["model_name"] == "tiny"
    assert fields["kv_block_size"] == 32  # resolved by the engine, not the CLI's 16
    assert (fields["dp_rank"], fields["dp_size"]) == (2, 4)
    assert fields["kv_events_endpoint"] == f"tcp://10.1.2.3:{a.kv_events[0]}"
    assert fields["kv_events_replay_endpoint"] == f"tcp://10.1.2.3:{a.kv_events[1]}"
    assert fields["disagg_mode"] == "mixed" and fields["disagg_meta"] == {}


def test_inflight_from_metrics():
    text = 'vllm:num_requests_running{model_name="m"} 2.0\nvllm:num_requests_waiting{model_name="m"} 3.0\n'
    assert VllmAdapter().inflight(text) == 5
    assert VllmAdapter().inflight("# nothing\n") is None


@pytest.fixture
async def aiohttp_metrics_server():
    import aiohttp
    from aiohttp import web

    async def metrics(request):
        return web.Response(text='vllm:cache_config_info{block_size="32",enable_prefix_caching="True"} 1.0\n')

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]

    class S:
        url = f"http://127.0.0.1:{port}"

    async with aiohttp.ClientSession() as S.session:
        yield S
    await runner.cleanup()
