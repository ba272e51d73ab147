"""RDMA/ROCm environment defaults the launchers give an engine on an AMD host (spec §6.5).

Only where ``/dev/kfd`` exists, and only variables the user left unset:

* ``MC_GID_INDEX=1``, ``MORI_IB_GID_INDEX=1``: RoCE v2 over IPv4 sits at GID index 1.
* ``MC_ENABLE_DEST_DEVICE_AFFINITY=1`` unless ``MC_ENABLE_HCA_PEER_AFFINITY`` is set; an explicit
  ``0``/``false`` there is removed (Mooncake reads the variable's presence) and the default applies.
* ``MOONCAKE_DISABLE_HIP_DMABUF=1`` when a peer-memory module (``ib_peer_mem``, ``amdp2p``) is loaded.
* ``VLLM_HOST_IP`` (vLLM) / ``ATOM_HOST_IP`` (ATOM): the RDMA rail's IPv4, the IPv4-mapped GID at
  ``MC_GID_INDEX`` of the first ACTIVE ``/sys/class/infiniband`` device by name, else the first
  RFC 1918 address of a physical NIC (not 172.17.x, not cni/docker/flannel/veth/... bridges).
* vLLM: ``VLLM_ROCM_USE_AITER=1``; ``MC_CUSTOM_TOPO_JSON`` (a file pinning every GPU to the rail
  NIC) when the ACTIVE RoCE NICs span more than one /24.
* SGLang: ``SGLANG_OPT_USE_TOPK_V2=0``; ``SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK`` =
  ``--chunked-prefill-size`` with ``--moe-a2a-backend mori``.

``HostFacts`` reads the host (paths injectable); ``rocm_env_defaults`` is pure.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, MutableMapping, Sequence

from infera.engine.base.argv import flag_value

log = logging.getLogger(__name__)

PEER_MEMORY_MODULES = ("ib_peer_mem", "amdp2p")
VIRTUAL_NIC_PREFIXES = ("lo", "cni", "docker", "flannel", "veth", "virbr", "br-", "cali", "kube", "tun", "tap",
                        "vxlan", "weave", "cilium", "podman", "genev")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class RdmaDevice:
    name: str
    active: bool
    gids: dict[int, str]  # index -> GID text (port 1)

    def ipv4(self, gid_index: int) -> str | None:
        """The IPv4 of an IPv4-mapped GID (``::ffff:a.b.c.d``) at ``gid_index``."""
        gid = self.gids.get(gid_index, "")
        try:
            addr = ipaddress.IPv6Address(gid)
        except ValueError:
            return None
        return str(addr.ipv4_mapped) if addr.ipv4_mapped and str(addr.ipv4_mapped) != "0.0.0.0" else None


@dataclass(frozen=True)
class Nic:
    name: str
    ipv4: str
    virtual: bool


@dataclass(frozen=True)
class HostFacts:
    kfd: bool
    rdma: tuple[RdmaDevice, ...] = ()
    modules: frozenset[str] = frozenset()
    nics: tuple[Nic, ...] = ()
    gpus: int = 0

    @classmethod
    def read(cls, root: str = "/") -> "HostFacts":
        r = Path(root)
        if not (r / "dev/kfd").exists():
            return cls(kfd=False)  # not an AMD host: nothing else decides anything
        return cls(kfd=True, rdma=tuple(read_rdma_devices(r / "sys/class/infiniband")),
                   modules=read_modules(r / "proc/modules"), nics=tuple(read_nics(r / "sys/class/net")),
                   gpus=count_amd_gpus(r / "sys/class/kfd/kfd/topology/nodes"))


def read_rdma_devices(folder: Path) -> list[RdmaDevice]:
    out = []
    for dev in sorted(folder.glob("*")) if folder.is_dir() else []:
        port = dev / "ports" / "1"
        try:
            active = "ACTIVE" in (port / "state").read_text()
        except OSError:
            active = False
        gids: dict[int, str] = {}
        for gid in (port / "gids").glob("*") if (port / "gids").is_dir() else []:
            try:
                gids[int(gid.name)] = gid.read_text().strip()
            except (OSError, ValueError):
                continue
        out.append(RdmaDevice(dev.name, active, gids))
    return out


def read_modules(path: Path) -> frozenset[str]:
    try:
        return frozenset(line.split()[0] for line in path.read_text().splitlines() if line.strip())
    except OSError:
        return frozenset()


def _ipv4_of(ifname: str) -> str | None:
    import fcntl
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def read_nics(folder: Path) -> list[Nic]:
    out = []
    for nic in sorted(folder.glob("*")) if folder.is_dir() else []:
        ip = _ipv4_of(nic.name)
        if ip:
            out.append(Nic(nic.name, ip, virtual="/virtual/" in str(nic.resolve())))
    return out


def count_amd_gpus(nodes: Path) -> int:
    count = 0
    for node in nodes.glob("*") if nodes.is_dir() else []:
        try:
            count += int((node / "gpu_id").read_text().strip() or 0) != 0
        except (OSError, ValueError):
            continue
    return count


def rail_ipv4(facts: HostFacts, gid_index: int) -> str | None:
    for dev in facts.rdma:
        if dev.active and (ip := dev.ipv4(gid_index)):
            return ip
    for nic in facts.nics:
        ip = ipaddress.IPv4Address(nic.ipv4)
        if (nic.virtual or nic.name.startswith(VIRTUAL_NIC_PREFIXES) or not ip.is_private or ip.is_loopback
                or ip in ipaddress.IPv4Network("172.17.0.0/16") or ip.is_link_local):
            continue
        return nic.ipv4
    return None


def topo_json(facts: HostFacts, gid_index: int) -> dict | None:
    """Mooncake's topology (``device -> [preferred NICs, others]``) pinning every GPU to the first
    ACTIVE RoCE NIC, when the ACTIVE NICs span more than one /24; else None."""
    active = [d for d in facts.rdma if d.active and d.ipv4(gid_index)]
    subnets = {ipaddress.IPv4Network(f"{d.ipv4(gid_index)}/24", strict=False) for d in active}
    if len(subnets) <= 1:
        return None
    rail = active[0].name
    others = [d.name for d in active[1:]]
    topo = {f"cuda:{i}": [[rail], others] for i in range(max(facts.gpus, 1))}
    topo["cpu:0"] = [[rail], others]
    return topo


@dataclass
class RocmEnv:
    set: dict[str, str] = field(default_factory=dict)
    unset: list[str] = field(default_factory=list)
    topo: dict | None = None  # written to a file by apply_rocm_env (MC_CUSTOM_TOPO_JSON)


def rocm_env_defaults(engine: str, argv: Sequence[str], environ: Mapping[str, str], facts: HostFacts) -> RocmEnv:
    """What to set (and remove) for ``engine`` (vllm | sglang | atom); nothing off an AMD host."""
    out = RocmEnv()
    if not facts.kfd:
        return out

    def default(name: str, value: str) -> None:
        if name not in environ and name not in out.set:
            out.set[name] = value

    default("MC_GID_INDEX", "1")
    default("MORI_IB_GID_INDEX", "1")
    peer = environ.get("MC_ENABLE_HCA_PEER_AFFINITY")
    if peer is not None and peer.strip().lower() in _FALSE:
        out.unset.append("MC_ENABLE_HCA_PEER_AFFINITY")
        peer = None
    if peer is None:
        default("MC_ENABLE_DEST_DEVICE_AFFINITY", "1")
    if facts.modules & set(PEER_MEMORY_MODULES):
        default("MOONCAKE_DISABLE_HIP_DMABUF", "1")
    try:
        gid_index = int(environ.get("MC_GID_INDEX") or out.set.get("MC_GID_INDEX") or 1)
    except ValueError:
        gid_index = 1
    host_var = {"vllm": "VLLM_HOST_IP", "atom": "ATOM_HOST_IP"}.get(engine)
    if host_var and (ip := rail_ipv4(facts, gid_index)):
        default(host_var, ip)
    if engine == "vllm":
        default("VLLM_ROCM_USE_AITER", "1")
        if "MC_CUSTOM_TOPO_JSON" not in environ:
            out.topo = topo_json(facts, gid_index)
    if engine == "sglang":
        default("SGLANG_OPT_USE_TOPK_V2", "0")
        chunk = flag_value(list(argv), "--chunked-prefill-size")
        if flag_value(list(argv), "--moe-a2a-backend") == "mori" and chunk:
            default("SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK", chunk)
    return out


def apply_rocm_env(engine: str, argv: Sequence[str], env: dict[str, str],
                   environ: MutableMapping[str, str] | None = None, facts: HostFacts | None = None) -> RocmEnv:
    """Add the defaults to the engine's ``env`` (what the launcher set already counts as set, except
    a host IP, which the rail wins); remove the cleared variables from ``environ`` (the launcher's
    own, which the engine inherits); write the topology file. Logged once per variable."""
    environ = os.environ if environ is None else environ
    facts = HostFacts.read() if facts is None else facts
    decided = rocm_env_defaults(engine, argv, environ, facts)
    for name, value in decided.set.items():
        if name in env and name not in ("VLLM_HOST_IP", "ATOM_HOST_IP"):
            continue
        env[name] = value
        log.info("ROCm host: %s=%s (set it to choose another)", name, value)
    for name in decided.unset:
        environ.pop(name, None)
        env.pop(name, None)
        log.info("ROCm host: %s removed (an explicit false; Mooncake reads its presence)", name)
    if decided.topo is not None:
        fd, path = tempfile.mkstemp(prefix="infera-mc-topo-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(decided.topo, f)
        env["MC_CUSTOM_TOPO_JSON"] = path
        log.info("ROCm host: RoCE NICs span several /24s: MC_CUSTOM_TOPO_JSON=%s pins the GPUs to one NIC", path)
    return decided


__all__ = ["HostFacts", "Nic", "RdmaDevice", "RocmEnv", "apply_rocm_env", "rail_ipv4", "rocm_env_defaults",
           "topo_json"]
