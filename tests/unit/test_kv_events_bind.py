"""KV-event sockets bind the advertise address, not every interface (issue 11, item 2).

KV events carry users' prompt token ids and the replay socket hands out the history, so the
launchers' injected ``--kv-events-config`` binds ``tcp://*:0;<ip>:<port>``: the engines' "bind
when the endpoint holds *" rule still binds it, and libzmq binds ``<ip>`` only.
"""
from __future__ import annotations

import json

import pytest
import zmq
import zmq.asyncio

from infera.engine.base.kv_events import bind_endpoint, bind_kv_events, kv_events_bind_ip
from infera.engine.sglang.adapter import SglangAdapter
from infera.engine.sim.kv_events import KvEventPublisher, KvEventsConfig, binds
from infera.engine.vllm import adapter as vllm_adapter
from infera.engine.vllm.adapter import VllmAdapter
from tests.conftest import free_port
from tests.unit import launcher_helpers
from tests.unit.sim_launcher_fakes import FakeSimSession, prepare as sim_prepare

CFG = '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}'


def listening_hosts(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp)."""
    hosts = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                hosts.add(".".join(str(b) for b in reversed(bytes.fromhex(addr))))
    return hosts


@pytest.mark.parametrize("advertise, expected", [
    ("127.0.0.1", "127.0.0.1"),
    ("localhost", "127.0.0.1"),  # a name is resolved once, at launch
    ("192.0.2.7", None),  # TEST-NET: not this machine's (e.g. NATed to it): binding it would fail
    ("::1", None),  # IPv6: the engines bind v4 only unless told otherwise
    ("0.0.0.0", None),
    ("no-such-host.invalid", None),
])
def test_bind_ip_of_the_advertise_host(advertise, expected):
    assert kv_events_bind_ip(advertise) == expected


def test_injected_wildcards_are_bound_to_the_advertise_address():
    argv = bind_kv_events(["--model", "m", "--kv-events-config", CFG], "127.0.0.1")
    cfg = json.loads(argv[-1])
    assert cfg["endpoint"] == "tcp://*:0;127.0.0.1:5557" and cfg["replay_endpoint"] == "tcp://*:0;127.0.0.1:5558"
    assert argv[:3] == ["--model", "m", "--kv-events-config"]
    # the engines' rule (vLLM, SGLang, the sim): bind when the endpoint holds "*"; the port stays last,
    # so their per-DP-rank offset (rfind(":")) still lands on it
    assert binds(cfg["endpoint"]) and cfg["endpoint"].rsplit(":", 1)[1] == "5557"
    # left as they were: no local address to bind (the engine still starts), or not our wildcard form
    assert bind_kv_events(["--kv-events-config", CFG], "192.0.2.7")[-1] == CFG
    user = '{"enable_kv_cache_events":true,"endpoint":"tcp://10.1.1.1:6000"}'
    assert bind_kv_events(["--kv-events-config", user], "127.0.0.1")[-1] == user
    assert bind_kv_events(["--model", "m"], "127.0.0.1") == ["--model", "m"]


async def test_publisher_listens_on_the_advertise_address_only():
    pub, replay = free_port(), free_port()
    cfg = KvEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=bind_endpoint("127.0.0.1", pub),
                         replay_endpoint=bind_endpoint("127.0.0.1", replay), topic="kv-events")
    publisher = KvEventPublisher(cfg, block_size=4)
    await publisher.start()
    try:
        assert listening_hosts(pub) == {"127.0.0.1"} and listening_hosts(replay) == {"127.0.0.1"}
        assert publisher.endpoint == f"tcp://127.0.0.1:{pub}"
        # and the router, subscribing to the advertised tcp://127.0.0.1:<port>, still gets events
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{pub}")
        try:
            got = None
            for _ in range(100):  # a SUB joins asynchronously: publish until one arrives (bounded)
                publisher.on_cleared()
                publisher.flush()
                if await sub.poll(50):
                    got = await sub.recv_multipart()
                    break
            assert got is not None and got[0] == b"kv-events"
        finally:
            sub.close(linger=0)
            ctx.destroy(linger=0)
    finally:
        await publisher.stop()
    # before: "tcp://*:<port>" listened on 0.0.0.0
    wild = free_port()
    old = KvEventPublisher(KvEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{wild}"),
                           block_size=4)
    await old.start()
    try:
        assert listening_hosts(wild) == {"0.0.0.0"}
    finally:
        await old.stop()


async def test_sim_launcher_binds_the_advertise_host():
    a, args, spec = sim_prepare(["--model", "m", "--host", "0.0.0.0"], "--advertise-host", "localhost")
    cfg = json.loads(spec.argv[spec.argv.index("--kv-events-config") + 1])
    pub, replay = a.kv_events
    assert (cfg["endpoint"], cfg["replay_endpoint"]) == (bind_endpoint("127.0.0.1", pub),
                                                         bind_endpoint("127.0.0.1", replay))
    fields = await a.describe(FakeSimSession(), "http://x", spec.argv, args)
    assert fields["kv_events_endpoint"] == f"tcp://localhost:{pub}"  # advertised as given


def test_vllm_and_sglang_launchers_bind_the_advertise_host(monkeypatch):
    monkeypatch.setattr(vllm_adapter, "has_gpu", lambda: False)
    monkeypatch.setattr(vllm_adapter, "vllm_entry_module", lambda: "vllm.entrypoints.openai.api_server")
    monkeypatch.delenv("INFERA_ENABLE_KV_EVENTS", raising=False)
    a, _, spec = launcher_helpers.prepare(VllmAdapter(), ["--model", "/m", "--host", "127.0.0.1"])
    cfg = json.loads(spec.argv[spec.argv.index("--kv-events-config") + 1])
    pub, replay = a.kv_events
    assert (cfg["endpoint"], cfg["replay_endpoint"]) == (bind_endpoint("127.0.0.1", pub),
                                                         bind_endpoint("127.0.0.1", replay))
    a, _, spec = launcher_helpers.prepare(SglangAdapter(), ["--model-path", "/m"])  # SGLang binds 127.0.0.1
    cfg = json.loads(spec.argv[spec.argv.index("--kv-events-config") + 1])
    assert cfg["endpoint"] == bind_endpoint("127.0.0.1", a.kv_events[1])
    # a user's own config is theirs
    user = '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:6000"}'
    _, _, spec = launcher_helpers.prepare(VllmAdapter(), ["--model", "/m", "--kv-events-config", user])
    assert spec.argv[spec.argv.index("--kv-events-config") + 1] == user
