"""The launchers' RDMA/ROCm env defaults (spec §6.5): only on an AMD host (``/dev/kfd``), only
where unset; read from a fake host root (sysfs, /proc/modules, /dev/kfd)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from infera.engine.atom.adapter import AtomAdapter
from infera.engine.base import rocm_env
from infera.engine.base.rocm_env import HostFacts, Nic, RdmaDevice, rail_ipv4, rocm_env_defaults, topo_json
from infera.engine.sglang.adapter import SglangAdapter
from infera.engine.vllm.adapter import VllmAdapter
from tests.unit import launcher_helpers

ROCM_VARS = ("MC_GID_INDEX", "MORI_IB_GID_INDEX", "MC_ENABLE_DEST_DEVICE_AFFINITY", "MC_ENABLE_HCA_PEER_AFFINITY",
             "MOONCAKE_DISABLE_HIP_DMABUF", "VLLM_HOST_IP", "ATOM_HOST_IP", "VLLM_ROCM_USE_AITER",
             "MC_CUSTOM_TOPO_JSON", "SGLANG_OPT_USE_TOPK_V2", "SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK")


def mapped(ip: str) -> str:
    a, b, c, d = (int(x) for x in ip.split("."))
    return f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"


def fake_host(root: Path, *, kfd=True, devices=(("mlx5_0", "ACTIVE", "10.1.0.5"),), modules=("amdp2p",), gpus=2,
              read=HostFacts.read):  # the real reader, bound before a test patches the launchers' one
    if kfd:
        (root / "dev").mkdir(parents=True, exist_ok=True)
        (root / "dev/kfd").write_text("")
    for name, state, ip in devices:
        port = root / "sys/class/infiniband" / name / "ports/1"
        (port / "gids").mkdir(parents=True)
        (port / "state").write_text(f"4: {state}\n")
        (port / "gids/0").write_text("fe80:0000:0000:0000:0000:0000:0000:0001\n")
        (port / "gids/1").write_text(mapped(ip) + "\n")
    (root / "proc").mkdir(parents=True, exist_ok=True)
    (root / "proc/modules").write_text("".join(f"{m} 16384 0 - Live 0x0\n" for m in ("ib_core", *modules)))
    for i in range(gpus + 1):  # node 0 is the CPU (gpu_id 0)
        node = root / "sys/class/kfd/kfd/topology/nodes" / str(i)
        node.mkdir(parents=True)
        (node / "gpu_id").write_text("0" if i == 0 else str(1000 + i))
    return read(str(root))


def test_nothing_without_kfd(tmp_path):
    facts = fake_host(tmp_path, kfd=False)
    assert rocm_env_defaults("vllm", [], {}, facts).set == {}


def test_reads_the_fake_host(tmp_path):
    facts = fake_host(tmp_path, devices=(("mlx5_1", "DOWN", "10.9.0.1"), ("mlx5_0", "ACTIVE", "10.1.0.5")))
    assert facts.kfd and facts.gpus == 2 and "amdp2p" in facts.modules
    assert [d.name for d in facts.rdma] == ["mlx5_0", "mlx5_1"] and facts.rdma[0].ipv4(1) == "10.1.0.5"
    assert facts.rdma[0].ipv4(0) is None  # a link-local GID is not an IPv4 one


@pytest.mark.parametrize("engine,expect", [
    ("vllm", {"VLLM_HOST_IP": "10.1.0.5", "VLLM_ROCM_USE_AITER": "1"}),
    ("atom", {"ATOM_HOST_IP": "10.1.0.5"}),
    ("sglang", {"SGLANG_OPT_USE_TOPK_V2": "0", "SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK": "8192"}),
])
def test_defaults_per_engine(tmp_path, engine, expect):
    facts = fake_host(tmp_path)
    argv = ["--moe-a2a-backend", "mori", "--chunked-prefill-size", "8192"]
    got = rocm_env_defaults(engine, argv, {}, facts)
    common = {"MC_GID_INDEX": "1", "MORI_IB_GID_INDEX": "1", "MC_ENABLE_DEST_DEVICE_AFFINITY": "1",
              "MOONCAKE_DISABLE_HIP_DMABUF": "1"}
    assert got.set == {**common, **expect} and got.unset == [] and got.topo is None


def test_preset_variables_win(tmp_path):
    facts = fake_host(tmp_path)
    environ = {"MC_GID_INDEX": "3", "MORI_IB_GID_INDEX": "0", "VLLM_HOST_IP": "192.168.0.9",
               "VLLM_ROCM_USE_AITER": "0", "MC_ENABLE_HCA_PEER_AFFINITY": "1", "MOONCAKE_DISABLE_HIP_DMABUF": "0"}
    got = rocm_env_defaults("vllm", [], environ, facts)
    assert got.set == {}  # every one preset; the GID index 3 has no IPv4 anyway


@pytest.mark.parametrize("value", ["0", "false", "FALSE"])
def test_explicit_false_peer_affinity_is_removed(tmp_path, value):
    got = rocm_env_defaults("sglang", [], {"MC_ENABLE_HCA_PEER_AFFINITY": value}, fake_host(tmp_path))
    assert got.unset == ["MC_ENABLE_HCA_PEER_AFFINITY"] and got.set["MC_ENABLE_DEST_DEVICE_AFFINITY"] == "1"


def test_no_peer_memory_module_no_dmabuf_switch(tmp_path):
    got = rocm_env_defaults("sglang", [], {}, fake_host(tmp_path, modules=()))
    assert "MOONCAKE_DISABLE_HIP_DMABUF" not in got.set


def test_rail_falls_back_to_a_physical_private_nic():
    nics = (Nic("lo", "127.0.0.1", True), Nic("docker0", "172.17.0.1", True), Nic("cni0", "10.244.0.1", False),
            Nic("veth12", "10.0.0.7", False), Nic("eth9", "172.17.3.3", False), Nic("eth0", "8.8.8.8", False),
            Nic("ens5", "10.20.30.40", False), Nic("ens6", "10.20.30.41", False))
    assert rail_ipv4(HostFacts(kfd=True, nics=nics), 1) == "10.20.30.40"
    assert rail_ipv4(HostFacts(kfd=True, nics=nics[:6]), 1) is None


def test_topology_file_only_when_nics_span_subnets(tmp_path):
    one = HostFacts(kfd=True, gpus=2, rdma=(RdmaDevice("a", True, {1: mapped("10.1.0.5")}),
                                            RdmaDevice("b", True, {1: mapped("10.1.0.6")})))
    assert topo_json(one, 1) is None
    two = HostFacts(kfd=True, gpus=2, rdma=(RdmaDevice("a", True, {1: mapped("10.1.0.5")}),
                                            RdmaDevice("b", True, {1: mapped("10.1.1.6")})))
    assert topo_json(two, 1) == {"cuda:0": [["a"], ["b"]], "cuda:1": [["a"], ["b"]], "cpu:0": [["a"], ["b"]]}


# --- at the launchers -----------------------------------------------------------------------------

@pytest.fixture
def host(monkeypatch, tmp_path):
    for name in ROCM_VARS:
        monkeypatch.delenv(name, raising=False)

    roots = iter(range(100))

    def use(**kw):
        facts = fake_host(tmp_path / f"root{next(roots)}", **kw)
        monkeypatch.setattr(rocm_env.HostFacts, "read", classmethod(lambda cls, root="/": facts))
    return use


@pytest.mark.parametrize("adapter,argv,host_var", [
    (VllmAdapter, ["--model", "m", "--host", "10.0.0.2"], "VLLM_HOST_IP"),
    (SglangAdapter, ["--model-path", "m"], None),
    (AtomAdapter, ["--model", "m"], "ATOM_HOST_IP"),
])
def test_launchers_apply_defaults_only_on_amd_hosts(host, monkeypatch, adapter, argv, host_var):
    host(kfd=False)
    _, _, spec = launcher_helpers.prepare(adapter(), argv, "--advertise-host", "10.0.0.2")
    assert not set(spec.env) & {"MC_GID_INDEX", "MORI_IB_GID_INDEX", "ATOM_HOST_IP"}
    assert spec.env.get("VLLM_HOST_IP") in (None, "10.0.0.2")  # the advertise host, as before
    host(kfd=True, devices=(("mlx5_0", "ACTIVE", "10.1.0.5"), ("mlx5_1", "ACTIVE", "10.1.7.5")))
    _, _, spec = launcher_helpers.prepare(adapter(), argv, "--advertise-host", "10.0.0.2")
    assert spec.env["MC_GID_INDEX"] == "1" and spec.env["MORI_IB_GID_INDEX"] == "1"
    if host_var:
        assert spec.env[host_var] == "10.1.0.5"  # the rail, not the advertise host
    if adapter is VllmAdapter:
        topo = json.loads(Path(spec.env["MC_CUSTOM_TOPO_JSON"]).read_text())
        assert topo["cuda:1"] == [["mlx5_0"], ["mlx5_1"]]
        os.unlink(spec.env["MC_CUSTOM_TOPO_JSON"])
    monkeypatch.setenv("MC_GID_INDEX", "0")
    monkeypatch.setenv("MC_ENABLE_HCA_PEER_AFFINITY", "false")
    _, _, spec = launcher_helpers.prepare(adapter(), argv, "--advertise-host", "10.0.0.2")
    assert "MC_GID_INDEX" not in spec.env  # preset: the engine inherits the user's
    assert "MC_ENABLE_HCA_PEER_AFFINITY" not in os.environ and spec.env["MC_ENABLE_DEST_DEVICE_AFFINITY"] == "1"
    if host_var:  # GID index 0 holds no IPv4: no rail from sysfs, no fallback NIC in the fake host
        assert spec.env.get(host_var) in (None, "10.0.0.2")
