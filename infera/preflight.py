"""``infera-preflight``: what this node has for serving, as a short table and one JSON object.

GPUs (NVIDIA from ``/proc/driver/nvidia/gpus``, AMD from the KFD topology), RDMA devices with
their port state and non-zero GIDs (the IPv4 one, if any, at ``MC_GID_INDEX``, default 1), and the
storage paths kvd or the engines would use with their free space. Reads sysfs and procfs only: no
torch, no driver calls, so it runs on any node (``--root`` reads a copy of those trees instead).
Exit status 0 always: it reports, it does not judge (the launchers' PD preflight refuses).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from infera.engine.base.rocm_env import read_rdma_devices

DEFAULT_PATHS = ("/", "/tmp", "/dev/shm")
_ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


def nvidia_gpus(root: Path) -> list[dict]:
    out = []
    for info in sorted((root / "proc/driver/nvidia/gpus").glob("*/information")):
        fields = {}
        for line in info.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
        out.append({"vendor": "nvidia", "bus": info.parent.name, "name": fields.get("Model", "?")})
    return out


def amd_gpus(root: Path) -> list[dict]:
    out = []
    nodes = root / "sys/class/kfd/kfd/topology/nodes"
    for node in sorted(nodes.glob("*"), key=lambda p: int(p.name) if p.name.isdigit() else 0) if nodes.is_dir() else []:
        try:
            gpu_id = int((node / "gpu_id").read_text().strip() or 0)
        except (OSError, ValueError):
            continue
        if gpu_id:
            name = (node / "name").read_text().strip() if (node / "name").exists() else "?"
            out.append({"vendor": "amd", "node": int(node.name), "gpu_id": gpu_id, "name": name})
    return out


def rdma_devices(root: Path, gid_index: int) -> list[dict]:
    return [{"name": d.name, "active": d.active, "ipv4": d.ipv4(gid_index),
             "gids": {str(i): g for i, g in sorted(d.gids.items()) if g != _ZERO_GID}}
            for d in read_rdma_devices(root / "sys/class/infiniband")]


def storage(paths: list[str]) -> list[dict]:
    out = []
    for path in paths:
        try:
            st = os.statvfs(path)
        except OSError as e:
            out.append({"path": path, "error": e.strerror or str(e)})
            continue
        out.append({"path": path, "free_bytes": st.f_bavail * st.f_frsize, "total_bytes": st.f_blocks * st.f_frsize})
    return out


def report(root: str = "/", paths: list[str] | None = None, environ=None) -> dict:
    environ = os.environ if environ is None else environ
    r = Path(root)
    try:
        gid_index = int(environ.get("MC_GID_INDEX") or 1)
    except ValueError:
        gid_index = 1
    return {"gpus": nvidia_gpus(r) + amd_gpus(r), "rocm": (r / "dev/kfd").exists(), "gid_index": gid_index,
            "rdma": rdma_devices(r, gid_index), "storage": storage(list(paths or DEFAULT_PATHS))}


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def table(rep: dict) -> str:
    lines = [f"GPUs: {len(rep['gpus'])}" + (" (ROCm /dev/kfd)" if rep["rocm"] else "")]
    lines += [f"  {g['vendor']:<6} {g['name']}" for g in rep["gpus"]]
    lines.append(f"RDMA devices: {len(rep['rdma'])} (IPv4 at GID index {rep['gid_index']})")
    lines += [f"  {d['name']:<10} {'ACTIVE' if d['active'] else 'down':<6} {d['ipv4'] or '-':<15} "
              f"{len(d['gids'])} GIDs" for d in rep["rdma"]]
    lines.append("Storage:")
    lines += [f"  {s['path']:<20} " + (f"error: {s['error']}" if "error" in s else
                                        f"{_gib(s['free_bytes'])} free of {_gib(s['total_bytes'])}")
              for s in rep["storage"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="infera-preflight", description=__doc__.splitlines()[0])
    parser.add_argument("--path", action="append", default=None,
                        help=f"a storage path to report (repeatable; default {', '.join(DEFAULT_PATHS)})")
    parser.add_argument("--json", action="store_true", help="the JSON object only, no table")
    parser.add_argument("--root", default="/", help="read sysfs/procfs/dev under this folder (tests, copies)")
    args = parser.parse_args(argv)
    rep = report(args.root, args.path)
    try:
        if not args.json:
            print(table(rep))
        print(json.dumps(rep, sort_keys=True))
        sys.stdout.flush()
    except BrokenPipeError:  # piped into head: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
