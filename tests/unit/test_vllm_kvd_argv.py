"""``python -m infera.engine.vllm --kvd-socket``: the kvd connector joins --kv-transfer-config,
merged with (never replacing) the user's own connector."""
import json
import subprocess
import sys
import time

import pytest

from infera.engine.vllm import adapter as vllm_adapter
from infera.engine.vllm.adapter import VllmAdapter, disaggregation, with_kvd_transfer_config
from tests.unit import launcher_helpers

KVD = {"kv_connector": "InferaKvdConnector", "kv_role": "kv_both",
       "kv_connector_module_path": "infera.engine.vllm.kvd_connector"}
REAL_PROBE = vllm_adapter.probe_kvd
NIXL_P = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu"}


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    monkeypatch.setattr(vllm_adapter, "has_gpu", lambda: False)
    monkeypatch.setattr(vllm_adapter, "vllm_entry_module", lambda: "vllm.entrypoints.openai.api_server")
    monkeypatch.setattr(vllm_adapter, "probe_kvd", lambda path: None)
    for name in ("PYTHONHASHSEED", "VLLM_HOST_IP", "INFERA_KVD_SOCKET"):
        monkeypatch.delenv(name, raising=False)


CASES = [
    ("no user config", None,
     {**KVD, "kv_load_failure_policy": "recompute"}),
    ("NIXL producer is wrapped, NIXL first", {**NIXL_P, "engine_id": "e1"},
     {"kv_connector": "MultiConnector", "kv_role": "kv_producer", "engine_id": "e1",
      "kv_connector_extra_config": {"connectors": [NIXL_P, KVD]}, "kv_load_failure_policy": "recompute"}),
    ("the user's failure policy is kept (hoisted)", {**NIXL_P, "kv_load_failure_policy": "fail"},
     {"kv_connector": "MultiConnector", "kv_role": "kv_producer", "kv_load_failure_policy": "fail",
      "kv_connector_extra_config": {"connectors": [NIXL_P, KVD]}}),
    ("a user MultiConnector gets kvd appended",
     {"kv_connector": "MultiConnector", "kv_role": "kv_consumer",
      "kv_connector_extra_config": {"connectors": [NIXL_P]}},
     {"kv_connector": "MultiConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"connectors": [NIXL_P, KVD]}}),
    ("kvd alone already: untouched", {**KVD, "kv_connector_extra_config": {"x": 1}},
     {**KVD, "kv_connector_extra_config": {"x": 1}}),
    ("kvd inside a MultiConnector already: untouched",
     {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [KVD]}},
     {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [KVD]}}),
]


@pytest.mark.parametrize("name,user,expected", CASES, ids=[c[0] for c in CASES])
def test_merge_table(name, user, expected):
    before = json.dumps(user)
    assert with_kvd_transfer_config(user) == expected
    assert json.dumps(user) == before  # the user's dict is not mutated


@pytest.mark.parametrize("form", ["separate", "equals"])
def test_argv_user_config_merged_in_place(form):
    user_cfg = json.dumps(NIXL_P)
    flag = ["--kv-transfer-config", user_cfg] if form == "separate" else [f"--kv-transfer-config={user_cfg}"]
    argv = ["--model", "/m", *flag, "--block-size", "32"]
    _, _, spec = launcher_helpers.prepare(VllmAdapter(), argv, "--kvd-socket", "/tmp/k.sock")
    raw = vllm_adapter.flag_value(spec.argv, "--kv-transfer-config")
    cfg = json.loads(raw)
    assert cfg["kv_connector"] == "MultiConnector" and cfg["kv_connector_extra_config"]["connectors"][1] == KVD
    assert cfg["engine_id"]  # a P/D role: the launcher pins the id at the top level, where the record reads it
    assert sum(a.startswith("--kv-transfer-config") for a in spec.argv) == 1
    assert spec.argv[spec.argv.index("--block-size") + 1] == "32"
    assert spec.env["INFERA_KVD_SOCKET"] == "/tmp/k.sock"
    assert disaggregation(cfg, "h")[0] == "prefill"
    assert disaggregation(cfg, "h")[1]["protocol"] == "vllm-nixl"


def test_argv_without_user_config_appends_one():
    _, _, spec = launcher_helpers.prepare(VllmAdapter(), ["--model", "/m"], "--kvd-socket", "/tmp/k.sock")
    i = spec.argv.index("--kv-transfer-config")
    assert json.loads(spec.argv[i + 1]) == {**KVD, "kv_load_failure_policy": "recompute"}
    assert disaggregation(json.loads(spec.argv[i + 1]), "h") == ("mixed", {})


def test_env_gives_the_socket_and_no_flag_means_no_connector(monkeypatch):
    _, _, spec = launcher_helpers.prepare(VllmAdapter(), ["--model", "/m"])
    assert "--kv-transfer-config" not in spec.argv and "INFERA_KVD_SOCKET" not in spec.env
    monkeypatch.setenv("INFERA_KVD_SOCKET", "/tmp/env.sock")
    _, args, spec = launcher_helpers.prepare(VllmAdapter(), ["--model", "/m"])
    assert args.kvd_socket == "/tmp/env.sock" and spec.env["INFERA_KVD_SOCKET"] == "/tmp/env.sock"
    _, args, spec = launcher_helpers.prepare(VllmAdapter(), ["--model", "/m"], "--kvd-socket", "/tmp/flag.sock")
    assert spec.env["INFERA_KVD_SOCKET"] == "/tmp/flag.sock"  # flag > env


def test_child_params_are_advertised_for_a_wrapped_connector():
    mori = {"kv_connector": "MoRIIOConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"host_ip": "10.0.0.1", "tp_size": 2}}
    mode, meta = disaggregation(with_kvd_transfer_config(mori), "h")
    assert mode == "prefill" and meta["connector"] == "MoRIIOConnector"
    assert meta["params"]["kv_connector_extra_config"] == {"host_ip": "10.0.0.1", "tp_size": 2}


def test_unreachable_daemon_fails_the_launch(tmp_path):
    with pytest.raises(SystemExit, match="does not answer"):
        REAL_PROBE(str(tmp_path / "nobody.sock"))


def test_probe_passes_against_a_real_daemon(tmp_path):
    sock = tmp_path / "kvd.sock"
    proc = subprocess.Popen([sys.executable, "-m", "infera.kvd", "--socket", str(sock), "--max-bytes", "16M"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:  # the probe passes once the daemon listens
            try:
                REAL_PROBE(str(sock))
                break
            except SystemExit:
                assert proc.poll() is None and time.monotonic() < deadline, "kvd did not come up"
                time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("cfg, socket_arg, env, expected", [
    (None, None, {}, None),  # no connector: no kvd in the record
    ({"kv_connector": "InferaKvdConnector", "kv_role": "kv_both"}, "/tmp/k.sock", {}, "/tmp/k.sock"),
    ({"kv_connector": "InferaKvdConnector", "kv_role": "kv_both"}, None, {"INFERA_KVD_SOCKET": "/run/k"}, "/run/k"),
    ({"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
        {"kv_connector": "InferaKvdConnector", "kv_role": "kv_both"}]}}, "/tmp/k.sock", {}, "/tmp/k.sock"),
])
async def test_the_record_names_the_kvd_socket_of_an_engine_running_the_connector(cfg, socket_arg, env, expected,
                                                                                 monkeypatch):
    """The router tells only engines with kvd their requests' retention (engine_hints): the record says so."""
    import argparse
    import json

    from aiohttp import web

    from infera.engine.vllm.adapter import VllmAdapter

    monkeypatch.delenv("INFERA_KVD_SOCKET", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    async def metrics(_):
        return web.Response(text='vllm:cache_config_info{block_size="16"} 1.0\n')

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    argv = ["--model", "m"] + (["--kv-transfer-config", json.dumps(cfg)] if cfg else [])
    adapter = VllmAdapter()
    adapter.kv_events = None
    try:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            fields = await adapter.describe(session, f"http://127.0.0.1:{port}", argv,
                                            argparse.Namespace(advertise_host="127.0.0.1", kvd_socket=socket_arg))
    finally:
        await runner.cleanup()
    assert fields.get("kvd_socket") == expected
