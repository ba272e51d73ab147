import json

import pytest

from infera.engine.atom.adapter import AtomAdapter
from infera.engine.base.launcher import Launcher
from tests.unit import launcher_helpers


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("INFERA_ENABLE_KV_EVENTS", "INFERA_ENGINE_STOP_TIMEOUT", "INFERA_ATOM_READY_TIMEOUT",
                 "INFERA_ENGINE_READY_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)


def parse(argv, *launcher_flags, environ=None):
    a = AtomAdapter()
    return (a, *launcher_helpers.parse(a, argv, *launcher_flags, environ=environ))


def prepare(argv, *launcher_flags):
    return launcher_helpers.prepare(AtomAdapter(), argv, *launcher_flags)


async def record(argv, *launcher_flags):
    return (await launcher_helpers.record(AtomAdapter(), argv, *launcher_flags))[2]


def kv(role=None, connector=None, **extra):
    cfg = {**({"kv_role": role} if role else {}), **({"kv_connector": connector} if connector else {}), **extra}
    return ["--kv-transfer-config", json.dumps(cfg)]


# -- argv translation --------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "user",
    [
        ["--model", "/m"],
        ["--model", "/m", "--server-port", "8100", "-tp", "8", "--block-size", "32", "--kv_cache_dtype", "fp8"],
        ["--model", "/m", "--host", "10.0.0.7", *kv("kv_producer"), "--enforce-eager"],
    ],
)
def test_free_master_port_is_appended_when_absent(user):
    _, _, spec = prepare(user)
    assert spec.argv[: len(user)] == user
    assert spec.argv[len(user)] == "--port" and int(spec.argv[len(user) + 1]) > 0
    assert len(spec.argv) == len(user) + 2
    assert spec.cmd[1:3] == ["-m", "atom.entrypoints.openai_server"] and spec.cmd[3:] == spec.argv


@pytest.mark.parametrize("user", [["--model", "/m", "--port", "29500"], ["--port=29500", "--model", "/m"]])
def test_user_master_port_is_kept_and_nothing_added(user):
    _, _, spec = prepare(user)
    assert spec.argv == user


def test_server_port_and_host():
    _, _, spec = prepare(["--model", "/m"])
    assert (spec.port, spec.host) == (8000, "127.0.0.1")  # ATOM binds 0.0.0.0 by default
    _, _, spec = prepare(["--model", "/m", "--server-port", "8100", "--host", "10.0.0.7"])
    assert (spec.port, spec.host) == (8100, "10.0.0.7")


def test_entrypoint_override():
    _, _, spec = prepare(["--model", "/m"], "--engine-entrypoint", "python -m infera.engine.sim.atom_standin")
    assert spec.cmd[1:3] == ["-m", "infera.engine.sim.atom_standin"] and spec.cmd[3:] == spec.argv


@pytest.mark.parametrize(
    "argv, launcher_flags, message",
    [
        (["--server-port", "1"], (), "--model is required"),
        (["--model", "/m"], ("--enable-kv-events",), "--enable-kv-events is not supported for ATOM"),
        (["--model", "/m", "-tp", "two"], (), "-tp must be an integer"),
        (["--model", "/m", "--kv-transfer-config", "{nope"], (), "--kv-transfer-config is not valid JSON"),
        (["--model", "/m", *kv("kv_producer", "MooncakeConnector")], (), "kv_connector 'MooncakeConnector'"),
        (["--model", "/m", *kv("kv_sender")], (), "unknown kv_role 'kv_sender'"),
    ],
)
def test_errors(argv, launcher_flags, message):
    with pytest.raises(SystemExit, match=message):
        prepare(argv, *launcher_flags)


def test_kv_events_from_env_is_refused_too(monkeypatch):
    monkeypatch.setenv("INFERA_ENABLE_KV_EVENTS", "1")
    with pytest.raises(SystemExit, match="not supported for ATOM"):
        prepare(["--model", "/m"])
    _, args, spec = prepare(["--model", "/m"], "--no-enable-kv-events")  # explicit off beats the env
    assert "--kv-events-config" not in spec.argv


def test_every_plane_is_the_launcher_s_not_the_engine_s():
    # Upstream's ATOM launcher knew only etcd + HTTP. Ours registers and serves NATS in the shared
    # launcher, which proxies to ATOM's HTTP API like any engine's: inside a Pod (production plane
    # by default) an ATOM worker starts without extra flags.
    a, args, engine_argv = parse(["--model", "/m"])
    args.request_transport, args.discovery_backend = "nats", "kubernetes"
    spec = a.prepare(engine_argv, args)
    assert spec.argv[:2] == ["--model", "/m"]


def test_engine_stop_grace_is_15s_unless_set(monkeypatch):
    assert parse(["--model", "/m"])[1].engine_stop_timeout == 15.0
    assert parse(["--model", "/m"], "--engine-stop-timeout", "3")[1].engine_stop_timeout == 3.0
    args = parse(["--model", "/m"], environ={"INFERA_ENGINE_STOP_TIMEOUT": "7"})[1]
    assert args.engine_stop_timeout == 7.0


def test_atom_ready_timeout_env(monkeypatch):
    monkeypatch.setenv("INFERA_ATOM_READY_TIMEOUT", "600")
    assert parse(["--model", "/m"])[1].ready_timeout == 600.0
    assert parse(["--model", "/m"], environ={"INFERA_ENGINE_READY_TIMEOUT": "5"})[1].ready_timeout == 5.0


# -- the record ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "argv, launcher_flags, expect",
    [
        (["--model", "org/model"], (),
         {"engine": "atom", "worker_id": "127.0.0.1:8000", "url": "http://127.0.0.1:8000", "model_name": "org/model",
          "kv_block_size": 16, "disagg_mode": "mixed", "disagg_meta": {}, "kv_events_endpoint": None,
          "dp_size": None, "dp_rank": None}),
        (["--model", "/m", "--served-model-name", "tiny", "--block-size", "32"], (),
         {"model_name": "tiny", "kv_block_size": 32}),
        (["--model", "/m", *kv("kv_both", "mooncake")], (), {"disagg_mode": "mixed", "disagg_meta": {}}),
        (["--model", "/m", *kv(connector="mooncake")], (), {"disagg_mode": "mixed", "disagg_meta": {}}),
        (["--model", "/m", "--host", "10.0.0.7", "--server-port", "8100", "-tp", "8",
          *kv("kv_producer", "mooncake")], (),
         {"worker_id": "10.0.0.7:8100", "disagg_mode": "prefill",
          "disagg_meta": {"protocol": "atom-mooncake",
                          "params": {"host": "10.0.0.7", "http_port": 8100, "handshake_port": 6301, "tp_size": 8,
                                     "dp_size": 1}}}),
        (["--model", "/m", "--tensor-parallel-size", "4", *kv("kv_consumer", handshake_port=7000, dp_size=2)],
         ("--advertise-host", "10.1.2.3"),
         {"worker_id": "10.1.2.3:8000", "disagg_mode": "decode",
          "disagg_meta": {"protocol": "atom-mooncake",
                          "params": {"host": "10.1.2.3", "http_port": 8000, "handshake_port": 7000, "tp_size": 4,
                                     "dp_size": 2}}}),
    ],
)
async def test_record_fields(argv, launcher_flags, expect):
    rec = await record(argv, *launcher_flags)
    assert {k: getattr(rec, k) for k in expect} == expect


# -- no drain ----------------------------------------------------------------------------------------------

def test_no_inflight_metric():
    assert AtomAdapter.drains is False
    assert AtomAdapter().inflight("vllm:num_requests_running 3.0\n") is None


async def test_launcher_skips_the_drain_quietly(caplog):
    a, args, engine_argv = parse(["--model", "/m"])
    launcher = Launcher(a, args, engine_argv)
    assert args.drain_timeout > 0
    await launcher.drain(session=None)  # would fail on the session if it tried to read /metrics
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
