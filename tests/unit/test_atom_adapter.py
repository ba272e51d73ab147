import asyncio
import json
import logging
from typing import Optional, Union

import msgspec
import pytest
import zmq
import zmq.asyncio

from infera.engine.atom.adapter import AtomAdapter
from infera.engine.base.launcher import Launcher
from infera.kv.events import Cleared, Removed, Stored, decoder_for
from infera.transport.kv_events_zmq import ZmqKvEventSubscriber
from tests.unit import launcher_helpers

ATOM_KV_ENV = ("ATOM_KV_EVENTS_ENABLE", "ATOM_KV_EVENTS_PUBLISHER", "ATOM_KV_EVENTS_ENDPOINT", "ATOM_KV_EVENTS_TOPIC")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("INFERA_ENABLE_KV_EVENTS", "INFERA_ENGINE_STOP_TIMEOUT", "INFERA_ATOM_READY_TIMEOUT",
                 "INFERA_ENGINE_READY_TIMEOUT", *ATOM_KV_ENV):
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
        (["--model", "/m", "-tp", "two"], (), "-tp must be an integer"),
        (["--model", "/m", "--kv-transfer-config", "{nope"], (), "--kv-transfer-config is not valid JSON"),
        (["--model", "/m", *kv("kv_producer", "MooncakeConnector")], (), "kv_connector 'MooncakeConnector'"),
        (["--model", "/m", *kv("kv_sender")], (), "unknown kv_role 'kv_sender'"),
    ],
)
def test_errors(argv, launcher_flags, message):
    with pytest.raises(SystemExit, match=message):
        prepare(argv, *launcher_flags)


# -- KV events: ATOM's own publisher, configured through its environment ------------------------------

async def test_kv_events_turn_on_atom_s_publisher():
    user = ["--model", "/m", "--block-size", "32"]
    a, spec, rec = await launcher_helpers.record(AtomAdapter(), user, "--enable-kv-events")
    assert spec.argv[:len(user)] == user and spec.argv[len(user)] == "--port" and len(spec.argv) == len(user) + 2
    host, port = a.kv_events
    assert host == "127.0.0.1" and port > 0  # bound on the advertise address, not every interface
    assert spec.env == {"ATOM_KV_EVENTS_ENABLE": "1", "ATOM_KV_EVENTS_PUBLISHER": "zmq",
                        "ATOM_KV_EVENTS_TOPIC": "kv-events", "ATOM_KV_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{port}"}
    assert rec.kv_events_endpoint == f"tcp://127.0.0.1:{port}"


async def test_kv_events_default_off_env_on_flag_wins(monkeypatch):
    a, spec, rec = await launcher_helpers.record(AtomAdapter(), ["--model", "/m"])
    assert (a.kv_events, spec.env, rec.kv_events_endpoint) == (None, {}, None)  # AMD Infera's default: off
    monkeypatch.setenv("INFERA_ENABLE_KV_EVENTS", "1")
    a, spec, rec = await launcher_helpers.record(AtomAdapter(), ["--model", "/m"])
    assert spec.env["ATOM_KV_EVENTS_ENABLE"] == "1" and rec.kv_events_endpoint is not None
    a, spec, rec = await launcher_helpers.record(AtomAdapter(), ["--model", "/m"], "--no-enable-kv-events")
    assert (a.kv_events, spec.env, rec.kv_events_endpoint) == (None, {}, None)


@pytest.mark.parametrize("endpoint, launcher_flags, advertised", [
    ("tcp://*:6100", ("--advertise-host", "10.1.2.3"), "tcp://10.1.2.3:6100"),
    ("tcp://0.0.0.0:6100", (), "tcp://127.0.0.1:6100"),
    ("tcp://10.9.9.9:6101", (), "tcp://10.9.9.9:6101"),
])
async def test_a_users_own_endpoint_is_kept_and_advertised(monkeypatch, endpoint, launcher_flags, advertised):
    monkeypatch.setenv("ATOM_KV_EVENTS_ENDPOINT", endpoint)
    monkeypatch.setenv("ATOM_KV_EVENTS_TOPIC", "kv-events")  # the router's own topic is fine
    _, spec, rec = await launcher_helpers.record(AtomAdapter(), ["--model", "/m"], "--enable-kv-events", *launcher_flags)
    assert "ATOM_KV_EVENTS_ENDPOINT" not in spec.env  # inherited from the launcher's environment as set
    assert rec.kv_events_endpoint == advertised


@pytest.mark.parametrize("argv, env, message", [
    (["-dp", "2"], {}, "with -dp 2 every rank's engine core binds the same ATOM_KV_EVENTS_ENDPOINT"),
    (["--data-parallel-size=4"], {}, "with -dp 4"),
    (["-dp", "two"], {}, "-dp must be an integer"),
    ([], {"ATOM_KV_EVENTS_PUBLISHER": "null"}, "needs ATOM's zmq publisher"),
    ([], {"ATOM_KV_EVENTS_TOPIC": "mine"}, "the router subscribes to topic 'kv-events'"),
    ([], {"ATOM_KV_EVENTS_ENDPOINT": "ipc:///tmp/atom-kv"}, "is not tcp://host:port"),
])
def test_kv_event_settings_the_router_cannot_use_are_refused(monkeypatch, argv, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit, match=message):
        prepare(["--model", "/m", *argv], "--enable-kv-events")


def test_dp_without_kv_events_is_fine():
    _, _, spec = prepare(["--model", "/m", "-dp", "2"])
    assert spec.env == {}


def test_atom_publishing_unadvertised_is_warned(monkeypatch, caplog):
    monkeypatch.setenv("ATOM_KV_EVENTS_ENABLE", "1")
    a, _, spec = prepare(["--model", "/m"])
    assert a.kv_events is None and spec.env == {}
    assert any("ATOM_KV_EVENTS_ENABLE=1" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


# ATOM's event schema, written from atom/distributed/kv_events.py (ROCm/ATOM v0.1.5, de2d85de): msgspec
# array_like tagged structs with omit_defaults, batch [ts, events, data_parallel_rank?], and an
# ATOM-only BlockTransferred the router must skip.
class _AtomStored(msgspec.Struct, array_like=True, omit_defaults=True, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = "GPU"
    lora_name: Optional[str] = None
    extra_keys: Optional[list] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class _AtomRemoved(msgspec.Struct, array_like=True, omit_defaults=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = "GPU"
    group_idx: Optional[int] = None


class _AtomCleared(msgspec.Struct, array_like=True, omit_defaults=True, tag="AllBlocksCleared"):
    medium: Optional[str] = None


class _AtomTransferred(msgspec.Struct, array_like=True, omit_defaults=True, tag="BlockTransferred"):
    block_hashes: list[int]
    from_medium: str
    to_medium: str
    group_idx: Optional[int] = None


class _AtomBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Union[_AtomStored, _AtomRemoved, _AtomCleared, _AtomTransferred]]
    data_parallel_rank: Optional[int] = None


async def test_atom_s_wire_reaches_the_router_from_the_launcher_s_endpoint():
    """ATOM's publisher as it behaves (binds ATOM_KV_EVENTS_ENDPOINT, sends [topic, payload]) over real
    ZMQ, read by the router's subscriber at the advertised endpoint and decoded as an ATOM worker's."""
    _, spec, rec = await launcher_helpers.record(AtomAdapter(), ["--model", "/m"], "--enable-kv-events")
    payload = msgspec.msgpack.encode(_AtomBatch(1.5, [
        _AtomStored([11, 12], None, list(range(32)), 16),
        _AtomStored([13], 12, list(range(32, 48)), 16, medium="REMOTE"),  # lora_id written: medium is not last
        _AtomTransferred([11], "GPU", "CPU"),
        _AtomRemoved([11]),
        _AtomCleared(),
    ], 0))
    got: list[bytes] = []
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(spec.env["ATOM_KV_EVENTS_ENDPOINT"])
    sub = ZmqKvEventSubscriber(lambda key, seq, data: got.append(data), lambda key: None, context=ctx)
    sub.add("atom-worker", rec.kv_events_endpoint)
    await sub.start()
    try:
        deadline = asyncio.get_running_loop().time() + 10
        while not got:  # PUB/SUB's slow joiner: publish until the subscription has reached the socket
            assert asyncio.get_running_loop().time() < deadline, "no ATOM batch reached the subscriber"
            await pub.send_multipart([spec.env["ATOM_KV_EVENTS_TOPIC"].encode(), payload])
            await asyncio.sleep(0.05)
    finally:
        await sub.stop()
        pub.close(linger=0)
        ctx.destroy(linger=0)
    batch = decoder_for(rec.engine)(got[0])
    assert batch.dp_rank == 0

    def essence(ev):  # what routing uses (the decoder may carry more, e.g. the medium)
        if isinstance(ev, Stored):
            return ("stored", ev.block_hashes, ev.parent, ev.token_ids, ev.block_size)
        return ("removed", ev.block_hashes) if isinstance(ev, Removed) else ("cleared",) if isinstance(ev, Cleared) else ev

    assert [essence(e) for e in batch.events] == [("stored", [11, 12], None, list(range(32)), 16),
                                                   ("stored", [13], 12, list(range(32, 48)), 16),
                                                   ("removed", [11]), ("cleared",)]


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
