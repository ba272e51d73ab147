"""Launch robustness of the vLLM launcher: NIXL side-channel ports, VLLM_HOST_IP, per-DP-rank KV-event
ports (as vLLM 0.32.0 offsets them), and the tokenizer a worker record names."""
from __future__ import annotations

import hashlib
import json
import socket

import pytest

from infera.discovery.record import BUILTIN_TOKENIZER
from infera.engine.base.launcher import Launcher
from infera.engine.base.ports import free_port_blocks
from infera.engine.base.tokenizer_source import tokenizer_fields, tokenizer_source
from infera.engine.vllm import adapter as vllm_adapter
from infera.engine.vllm.adapter import DpLayout, VllmAdapter, dp_layout, uses_nixl, vllm_host_ip
from tests.unit import launcher_helpers

NIXL_P = {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
NIXL_D = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
VLLM_ENV = ("VLLM_HOST_IP", "VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_HOST", "PYTHONHASHSEED")


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    monkeypatch.setattr(vllm_adapter, "has_gpu", lambda: False)
    monkeypatch.setattr(vllm_adapter, "vllm_entry_module", lambda: "vllm.entrypoints.openai.api_server")
    for name in VLLM_ENV:
        monkeypatch.delenv(name, raising=False)


def prepare(argv, *launcher_flags):
    return launcher_helpers.prepare(VllmAdapter(), ["--model", "/m", *argv], *launcher_flags)


def transfer(cfg: dict) -> list[str]:
    return ["--kv-transfer-config", json.dumps(cfg)]


def events_config(spec) -> dict:
    return json.loads(spec.argv[spec.argv.index("--kv-events-config") + 1])


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


# -- 1. NIXL side channel -------------------------------------------------------------------------------

def test_two_nixl_workers_on_one_host_get_distinct_free_side_channel_ports():
    _, _, prefill = prepare(transfer(NIXL_P))
    _, _, decode = prepare(transfer(NIXL_D))
    ports = [int(s.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) for s in (prefill, decode)]
    assert ports[0] != ports[1] and 5600 not in ports
    assert all(bindable(p) for p in ports)
    ev = events_config(prefill)
    assert ports[0] not in (port_of(ev["endpoint"]), port_of(ev["replay_endpoint"]), prefill.port)


def test_side_channel_port_is_logged(caplog):
    with caplog.at_level("INFO", logger="infera.launcher.vllm"):
        _, _, spec = prepare(transfer(NIXL_P))
    assert f"VLLM_NIXL_SIDE_CHANNEL_PORT={spec.env['VLLM_NIXL_SIDE_CHANNEL_PORT']}" in caplog.text


@pytest.mark.parametrize("cfg, nixl", [
    (NIXL_P, True),
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, True),  # mixed, still a NIXL listener
    ({"kv_connector": "NixlPullConnector", "kv_role": "kv_consumer"}, True),
    ({"kv_connector": "MultiConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "LMCacheConnectorV1"}, {"kv_connector": "NixlConnector"}]}}, True),
    ({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"}, False),
    (None, False),
])
def test_only_nixl_connectors_get_a_side_channel(cfg, nixl):
    assert uses_nixl(cfg) is nixl
    _, _, spec = prepare(transfer(cfg) if cfg else [])
    assert ("VLLM_NIXL_SIDE_CHANNEL_PORT" in spec.env) is nixl


def test_users_side_channel_port_and_host_win(monkeypatch):
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "5700")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.9.9.9")
    _, _, spec = prepare(transfer(NIXL_P))
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in spec.env and "VLLM_NIXL_SIDE_CHANNEL_HOST" not in spec.env


@pytest.mark.parametrize("argv, start, local", [
    (["--data-parallel-size", "4", "--data-parallel-rank", "2"], 2, 1),  # external LB: only rank 2 here
    (["--data-parallel-size", "4"], 0, 4),  # internal DP: ranks 0..3 on this host
])
def test_side_channel_ports_of_every_local_dp_rank_are_free(argv, start, local):
    _, _, spec = prepare([*argv, *transfer(NIXL_P)])
    base = int(spec.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
    # vLLM binds base + data_parallel_index (nixl/base_scheduler.py): exactly the free block.
    assert all(bindable(base + r) for r in range(start, start + local))


def test_side_channel_host_follows_vllm_host_ip(monkeypatch):
    _, _, spec = prepare(["--host", "0.0.0.0", *transfer(NIXL_P)], "--advertise-host", "10.1.2.3")
    assert spec.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.1.2.3" == spec.env["VLLM_HOST_IP"]
    monkeypatch.setenv("VLLM_HOST_IP", "10.7.7.7")
    _, _, spec = prepare(["--host", "0.0.0.0", *transfer(NIXL_P)], "--advertise-host", "10.1.2.3")
    assert spec.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.7.7.7" and "VLLM_HOST_IP" not in spec.env


def test_free_port_blocks_are_disjoint_and_avoid():
    first = free_port_blocks([4])[0]
    blocks = free_port_blocks([4, 4, 1], avoid=[range(first, first + 4)])
    ranges = [range(first, first + 4)] + [range(b, b + n) for b, n in zip(blocks, (4, 4, 1))]
    ports = [p for r in ranges for p in r]
    assert len(ports) == len(set(ports))


# -- 2. VLLM_HOST_IP follows the advertise host ----------------------------------------------------------

@pytest.mark.parametrize("host, advertise, expected", [
    (None, None, "127.0.0.1"),  # wildcard bind, single host: loopback as before
    ("0.0.0.0", None, "127.0.0.1"),
    ("127.0.0.1", None, "127.0.0.1"),
    (None, "10.1.2.3", "10.1.2.3"),  # wildcard bind + advertise host: multi-host PD works
    ("0.0.0.0", "10.1.2.3", "10.1.2.3"),
    ("10.0.0.7", None, "10.0.0.7"),  # a specific bind is the advertise host
    ("::", "fd00::5", "fd00::5"),
    (None, "[fd00::5]", "fd00::5"),
    (None, "worker-0.infer.svc", None),  # a name: vLLM finds the node's IP itself
])
def test_vllm_host_ip_follows_the_advertise_host(host, advertise, expected):
    argv = ["--host", host] if host else []
    flags = ["--advertise-host", advertise] if advertise else []
    _, _, spec = prepare(argv, *flags)
    assert spec.env.get("VLLM_HOST_IP") == expected


def test_pod_ip_is_the_advertise_host():
    _, _, spec = launcher_helpers.prepare(VllmAdapter(), ["--model", "/m"], environ={"POD_IP": "10.4.0.9"})
    assert spec.env["VLLM_HOST_IP"] == "10.4.0.9"


def test_users_vllm_host_ip_wins(monkeypatch):
    monkeypatch.setenv("VLLM_HOST_IP", "192.168.1.1")
    _, _, spec = prepare([], "--advertise-host", "10.1.2.3")
    assert "VLLM_HOST_IP" not in spec.env
    assert vllm_host_ip("10.1.2.3", {"VLLM_HOST_IP": "x"}) is None


# -- 3. KV-event ports per DP rank (vLLM offsets by data_parallel_index) -----------------------------------

@pytest.mark.parametrize("argv, layout", [
    ([], DpLayout()),
    (["--data-parallel-size", "1", "--data-parallel-rank", "0"], DpLayout()),
    (["--data-parallel-size", "4", "--data-parallel-rank", "2"], DpLayout(4, 2, 2, 1)),
    (["-dp", "4", "-dpn", "3", "--data-parallel-external-lb"], DpLayout(4, 3, 3, 1)),
    (["--data-parallel-size", "4"], DpLayout(4, None, 0, 4)),
    # -dpr is vLLM's --data-parallel-start-rank (a secondary node), not the rank
    (["-dp", "4", "-dpl", "2", "-dpr", "2"], DpLayout(4, None, 2, 2)),
])
def test_dp_layout(argv, layout):
    assert dp_layout(argv) == layout


def test_bad_dp_flag_is_a_clear_error():
    with pytest.raises(SystemExit, match="--data-parallel-rank must be an integer"):
        dp_layout(["--data-parallel-size", "2", "--data-parallel-rank", "x"])


def test_external_lb_rank_registers_the_port_vllm_binds_for_its_rank():
    a, _, spec = prepare(["--data-parallel-size", "4", "--data-parallel-rank", "2"])
    cfg = events_config(spec)
    pub, replay = a.kv_events
    # vLLM binds endpoint + rank; the record advertises exactly that, and it was free.
    assert (port_of(cfg["endpoint"]) + 2, port_of(cfg["replay_endpoint"]) + 2) == (pub, replay)
    assert bindable(pub) and bindable(replay)


def test_external_lb_rank_with_users_config_registers_base_plus_rank():
    user = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:6000",
                       "replay_endpoint": "tcp://*:6100"})
    a, _, spec = prepare(["--data-parallel-size", "4", "--data-parallel-rank", "3", "--kv-events-config", user])
    assert a.kv_events == (6003, 6103)
    assert events_config(spec)["endpoint"] == "tcp://*:6000"  # the user's config is forwarded untouched


async def test_external_lb_record_advertises_the_ranks_port():
    a, spec, record = await launcher_helpers.record(
        VllmAdapter(), ["--model", "/m", "--data-parallel-size", "2", "--data-parallel-rank", "1", "--kv-events-config",
                        '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:7000"}'],
        session=_MetricsSession())
    assert (record.dp_rank, record.dp_size) == (1, 2)
    assert record.kv_events_endpoint == "tcp://127.0.0.1:7001"


def test_internal_dp_gets_a_free_port_per_rank():
    a, _, spec = prepare(["--data-parallel-size", "4"])
    cfg = events_config(spec)
    pub, replay = port_of(cfg["endpoint"]), port_of(cfg["replay_endpoint"])
    assert a.kv_events == (pub, replay)  # the base: the server subscribes base + rank
    ports = [p + r for p in (pub, replay) for r in range(4)]
    assert len(set(ports)) == 8 and all(bindable(p) for p in ports)


class _MetricsSession:
    """Just enough of an aiohttp session for ``describe`` (the engine's /metrics)."""

    def get(self, url, **kw):
        return _Reply()

    def post(self, url, **kw):  # the Messages API probe: answered as by an engine without the route
        return _Reply(status=404)


class _Reply:
    def __init__(self, status: int = 200) -> None:
        self.status = status

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False

    async def text(self):
        return 'vllm:cache_config_info{block_size="16"} 1.0\n'


# -- 4. the tokenizer a record names ----------------------------------------------------------------------

@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "tokenizer.json").write_text('{"version": "1.0"}')
    return d


@pytest.mark.parametrize("argv, sim, expected", [
    (["--model", "{dir}"], False, "{dir}"),
    (["--model", "org/hub-model"], False, "org/hub-model"),
    (["--model", "org/hub-model", "--tokenizer", "{dir}"], False, "{dir}"),  # vLLM/ATOM --tokenizer wins
    (["--model-path", "org/x", "--tokenizer-path", "org/tok"], False, "org/tok"),  # SGLang
    (["--model", "sim-model"], True, BUILTIN_TOKENIZER),  # the sim's built-in tokenizer serves any name
    (["--model", "{dir}"], True, "{dir}"),
    (["--model", "{empty}"], True, BUILTIN_TOKENIZER),  # a folder without tokenizer.json: built-in too
    (["--port", "1"], False, None),
])
def test_tokenizer_source(argv, sim, expected, model_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    fill = lambda s: s.format(dir=model_dir, empty=tmp_path / "empty") if s else s  # noqa: E731
    assert tokenizer_source([fill(a) for a in argv], sim=sim) == fill(expected)


def test_relative_model_path_is_made_absolute(model_dir, monkeypatch):
    monkeypatch.chdir(model_dir.parent)
    assert tokenizer_source(["--model", "model"], sim=False) == str(model_dir)


def test_tokenizer_fields_carry_the_fingerprint(model_dir):
    fields = tokenizer_fields("vllm", ["--model", str(model_dir)])
    assert fields == {"tokenizer": str(model_dir),
                      "tokenizer_sha256": hashlib.sha256((model_dir / "tokenizer.json").read_bytes()).hexdigest()}
    assert tokenizer_fields("vllm", ["--model", "org/not-cached-anywhere"]) == {
        "tokenizer": "org/not-cached-anywhere", "tokenizer_sha256": None}
    # A sim stand-in for another engine tokenizes as the sim does.
    assert tokenizer_fields("sglang", ["--model-path", "m"], "python -m infera.engine.sim.sglang_standin")[
        "tokenizer"] == BUILTIN_TOKENIZER


async def test_launcher_puts_the_tokenizer_in_the_record(model_dir):
    adapter, args, spec = launcher_helpers.prepare(VllmAdapter(), ["--model", str(model_dir)])
    launcher = Launcher(adapter, args, ["--model", str(model_dir)])
    launcher.spec = spec
    fields = await launcher.tokenizer_fields()
    record = launcher._make_record({"model_name": "m", "bind_host": None, **fields})
    assert record.tokenizer == str(model_dir) and len(record.tokenizer_sha256) == 64
