"""``infera-preflight``: a node's GPUs, RDMA devices and GIDs, and storage, from a fake host root;
the console script is installed and runs on this host."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from infera import preflight
from tests.unit.test_rocm_env import fake_host


def test_report_and_table_from_a_fake_node(tmp_path, capsys):
    root = tmp_path / "root"
    fake_host(root, devices=(("mlx5_0", "ACTIVE", "10.1.0.5"), ("mlx5_1", "DOWN", "10.2.0.5")), gpus=2)
    (root / "sys/class/kfd/kfd/topology/nodes/1/name").write_text("gfx942\n")
    gpu = root / "proc/driver/nvidia/gpus/0000:17:00.0"
    gpu.mkdir(parents=True)
    gpu.joinpath("information").write_text("Model: \t NVIDIA H200\nIRQ: 1\n")
    assert preflight.main(["--root", str(root), "--path", str(tmp_path), "--path", str(tmp_path / "nope")]) == 0
    out = capsys.readouterr().out.splitlines()
    rep = json.loads(out[-1])
    assert [g["name"] for g in rep["gpus"]] == ["NVIDIA H200", "gfx942", "?"] and rep["rocm"] is True
    assert [(d["name"], d["active"], d["ipv4"]) for d in rep["rdma"]] == [("mlx5_0", True, "10.1.0.5"),
                                                                          ("mlx5_1", False, "10.2.0.5")]
    assert set(rep["rdma"][0]["gids"]) == {"0", "1"}
    free, missing = rep["storage"]
    assert free["path"] == str(tmp_path) and 0 < free["free_bytes"] <= free["total_bytes"]
    assert missing["error"]
    table = "\n".join(out[:-1])
    assert "GPUs: 3 (ROCm /dev/kfd)" in table and "mlx5_0     ACTIVE 10.1.0.5" in table and "GiB free of" in table


def test_json_only_and_an_empty_node(tmp_path, capsys):
    assert preflight.main(["--json", "--root", str(tmp_path), "--path", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1
    rep = json.loads(out[0])
    assert rep["gpus"] == [] and rep["rdma"] == [] and rep["rocm"] is False and rep["gid_index"] == 1


def test_console_script_runs_here():
    script = shutil.which("infera-preflight", path=str(Path(sys.executable).parent))
    assert script, "infera-preflight is not installed (pip install -e .)"
    done = subprocess.run([script, "--json"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "storage" in json.loads(done.stdout)
