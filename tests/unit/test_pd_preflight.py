"""PD preflight: which PD workers are refused before their engine starts, and why."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from infera.engine.atom.adapter import AtomAdapter
from infera.engine.base.launcher import build_launcher_parser, pd_preflight_problems
from infera.engine.base.preflight import PdSetup, active_rdma_devices, pd_preflight
from infera.engine.sglang.adapter import SglangAdapter
from infera.engine.vllm.adapter import VllmAdapter

NIXL = PdSetup("prefill", "vllm-nixl", "NixlConnector")


@pytest.mark.parametrize(
    "setup, host, allow_tcp, devices, expect",
    [
        (None, "127.0.0.1", False, [], []),
        (PdSetup("mixed"), "127.0.0.1", False, [], []),
        (NIXL, "10.0.0.5", False, ["mlx5_0"], []),
        (NIXL, "10.0.0.5", False, [], ["no RDMA device"]),
        (NIXL, "127.0.0.1", False, ["mlx5_0"], ["cannot reach"]),
        (NIXL, "0.0.0.0", False, [], ["cannot reach", "no RDMA device"]),
        (NIXL, "::1", False, ["mlx5_0"], ["cannot reach"]),
        (NIXL, "127.0.0.1", True, [], []),  # single-host test: allowed on purpose
        (PdSetup("decode", "vllm-example", "ExampleConnector", rdma_capable=False), "10.0.0.5", False, ["mlx5_0"],
         ["not move KV over RDMA"]),
        (PdSetup("decode", "vllm-example", "ExampleConnector", rdma_capable=False), "10.0.0.5", True, [], []),
        # An unknown connector is refused even with --disaggregation-allow-tcp: the router could not drive it.
        (PdSetup("prefill", None, "LMCacheConnectorV1"), "10.0.0.5", True, [], ["no PD protocol"]),
        # What the engine would refuse after its slow start is refused first, allow-tcp or not.
        (PdSetup("prefill", "sglang-bootstrap", "x", refusals=("engine says no",)), "10.0.0.5", True, [],
         ["engine says no"]),
    ],
)
def test_pd_preflight(setup, host, allow_tcp, devices, expect):
    problems = pd_preflight(setup, host, allow_tcp=allow_tcp, rdma_devices=devices)
    assert len(problems) == len(expect)
    for problem, fragment in zip(problems, expect):
        assert fragment in problem
        if not allow_tcp and "protocol" not in fragment and "engine" not in fragment:
            assert "--disaggregation-allow-tcp" in problem  # the message says how to proceed


def test_active_rdma_devices_reads_port_states(tmp_path):
    for dev, states in {"mlx5_0": ["4: ACTIVE"], "mlx5_1": ["1: DOWN", "1: DOWN"], "irdma0": ["1: DOWN", "4: ACTIVE"]}.items():
        for i, state in enumerate(states, 1):
            port = tmp_path / dev / "ports" / str(i)
            port.mkdir(parents=True)
            (port / "state").write_text(state + "\n")
    assert active_rdma_devices(str(tmp_path)) == ["irdma0", "mlx5_0"]
    assert active_rdma_devices(str(tmp_path / "missing")) == []


def kvt(role: str, connector: str = "NixlConnector") -> str:
    return json.dumps({"kv_connector": connector, "kv_role": role})


@pytest.mark.parametrize(
    "adapter, argv, launcher_flags, expect",
    [
        (VllmAdapter(), ["--model", "m"], [], 0),
        (VllmAdapter(), ["--model", "m", "--kv-transfer-config", kvt("kv_producer")], [], 2),
        (VllmAdapter(), ["--model", "m", "--kv-transfer-config", kvt("kv_producer")], ["--disaggregation-allow-tcp"], 0),
        (VllmAdapter(), ["--model", "m", "--kv-transfer-config", kvt("kv_both")], [], 0),
        (VllmAdapter(), ["--model", "m", "--kv-transfer-config", kvt("kv_consumer", "Foo")],
         ["--disaggregation-allow-tcp"], 1),
        (SglangAdapter(), ["--model-path", "m", "--disaggregation-mode", "decode"], [], 2),
        (SglangAdapter(), ["--model-path", "m", "--disaggregation-mode", "decode", "--host", "10.1.2.3"], [], 1),
        (SglangAdapter(), ["--model-path", "m", "--disaggregation-mode", "prefill", "--host", "10.1.2.3",
                           "--disaggregation-transfer-backend", "fake"], [], 2),
        (SglangAdapter(), ["--model-path", "m", "--disaggregation-mode", "prefill"], ["--advertise-host", "10.1.2.3"], 1),
        (AtomAdapter(), ["--model", "m", "--kv-transfer-config", kvt("kv_producer", "mooncake")], [], 2),
    ],
)
def test_adapters_feed_the_preflight(adapter, argv, launcher_flags, expect):
    parser = build_launcher_parser(adapter, "t", environ={})
    args, engine_argv = parser.parse_known_args(["--etcd-endpoint", "e", *launcher_flags, *argv])
    assert len(pd_preflight_problems(adapter, args, engine_argv, rdma_devices=[])) == expect


def test_allow_tcp_from_the_environment():
    adapter = VllmAdapter()
    parser = build_launcher_parser(adapter, "t", environ={"INFERA_DISAGGREGATION_ALLOW_TCP": "1"})
    args, engine_argv = parser.parse_known_args(["--etcd-endpoint", "e", "--model", "m",
                                                 "--kv-transfer-config", kvt("kv_producer")])
    assert pd_preflight_problems(adapter, args, engine_argv, rdma_devices=[]) == []


def test_refused_launcher_exits_2_before_starting_anything():
    proc = subprocess.run([sys.executable, "-m", "infera.engine.vllm", "--etcd-endpoint", "127.0.0.1:1",
                           "--model", "m", "--kv-transfer-config", kvt("kv_producer")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "PD preflight refused" in proc.stderr and "--disaggregation-allow-tcp" in proc.stderr


def sglang_problems(mode: str, backend: str | None, launcher_flags=(), devices=("mlx5_0",)) -> list[str]:
    adapter = SglangAdapter()
    parser = build_launcher_parser(adapter, "t", environ={})
    argv = ["--model-path", "m", "--disaggregation-mode", mode, "--host", "10.1.2.3"]
    if backend is not None:
        argv += ["--disaggregation-transfer-backend", backend]
    args, engine_argv = parser.parse_known_args(["--etcd-endpoint", "e", *launcher_flags, *argv])
    return pd_preflight_problems(adapter, args, engine_argv, rdma_devices=list(devices))


ALLOW_TCP = ["--disaggregation-allow-tcp"]


@pytest.mark.parametrize(
    "mode, backend, launcher_flags, expect",
    [
        # SGLang 0.5.23's choices: every RDMA backend passes on a host with an active RDMA port
        *[(m, b, [], []) for m in ("prefill", "decode") for b in ("mooncake", "nixl", "ascend", "mori")],
        ("prefill", None, [], []),  # the default is mooncake
        # mooncake_tcp is mooncake over TCP (MC_FORCE_TCP=1): RDMA hardware does not help it
        ("prefill", "mooncake_tcp", [], ["does not move KV over RDMA"]),
        ("decode", "mooncake_tcp", [], ["does not move KV over RDMA"]),
        ("decode", "mooncake_tcp", ALLOW_TCP, []),
        # fake moves no KV: a decode worker may use it for a synthetic benchmark, a prefill never
        ("decode", "fake", [], ["does not move KV over RDMA"]),
        ("decode", "fake", ALLOW_TCP, []),
        ("prefill", "fake", ALLOW_TCP, ["refuses it on a prefill worker"]),
        ("prefill", "fake", [], ["refuses it on a prefill worker", "does not move KV over RDMA"]),
        ("decode", "tcp", ALLOW_TCP, ["is not one SGLang accepts"]),
    ],
)
def test_sglang_transfer_backends(mode, backend, launcher_flags, expect):
    problems = sglang_problems(mode, backend, launcher_flags)
    assert len(problems) == len(expect), problems
    for problem, fragment in zip(problems, expect):
        assert fragment in problem


def test_sglang_backend_table_matches_the_stand_in():
    """The preflight's table and the SGLang stand-in's --disaggregation-transfer-backend choices are
    both SGLang 0.5.23's list."""
    from infera.engine.base.preflight import SGLANG_RDMA_BACKENDS, SGLANG_TRANSFER_BACKENDS
    from infera.engine.sim.pd import SGLANG_TRANSFER_BACKENDS as STANDIN_CHOICES
    assert set(SGLANG_TRANSFER_BACKENDS) == set(STANDIN_CHOICES)
    assert set(SGLANG_RDMA_BACKENDS) == {"mooncake", "nixl", "ascend", "mori"}
