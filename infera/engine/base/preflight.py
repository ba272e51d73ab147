"""PD preflight: refuse, before the (slow) engine start, a prefill/decode worker whose KV would
cross hosts over plain TCP or whose peers could not reach it.

Checks (only for ``prefill``/``decode`` workers):

* the PD protocol is known (a connector the router can drive) — always;
* the advertise host is routable from other hosts (not loopback or a wildcard);
* the KV transfer can use RDMA: the engine's transfer backend/connector is an RDMA one, and this host
  has an RDMA device with an ACTIVE port under ``/sys/class/infiniband`` (upstream only documents
  this probe; here it runs).

``--disaggregation-allow-tcp`` skips the last two: single-host tests and benchmarks, where KV moves
over loopback TCP (or a shared folder) on purpose.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass

NON_ROUTABLE_HOSTS = frozenset({"", "0.0.0.0", "127.0.0.1", "localhost", "::", "::1", "[::]", "[::1]", "*"})
SGLANG_RDMA_BACKENDS = ("mooncake", "mori", "nixl", "ascend")


@dataclass(frozen=True)
class PdSetup:
    """What an adapter reads from the engine argv about its PD role, before the engine starts."""

    mode: str  # "mixed" | "prefill" | "decode"
    protocol: str | None = None  # the router-side protocol id; None: an unknown connector
    transfer: str = ""  # what moves the KV, for messages ("NixlConnector", "mooncake backend", …)
    rdma_capable: bool = True  # False: a transfer that never uses RDMA (a shared folder, TCP-only)
    bind_host: str | None = None  # the engine's --host (the advertise default when no --advertise-host)


def active_rdma_devices(root: str = "/sys/class/infiniband") -> list[str]:
    """RDMA devices with at least one port in state ACTIVE."""
    devices = []
    for dev in sorted(glob.glob(os.path.join(root, "*"))):
        for state_file in glob.glob(os.path.join(dev, "ports", "*", "state")):
            try:
                with open(state_file) as f:
                    if "ACTIVE" in f.read():
                        devices.append(os.path.basename(dev))
                        break
            except OSError:
                continue
    return devices


def pd_preflight(setup: PdSetup | None, advertise_host: str, *, allow_tcp: bool,
                 rdma_devices: list[str] | None = None) -> list[str]:
    """Problems that must stop this worker (empty: go). ``rdma_devices`` None probes this host."""
    if setup is None or setup.mode == "mixed":
        return []
    problems = []
    if not setup.protocol:
        problems.append(f"{setup.transfer or 'this KV connector'} has no PD protocol the Infera router can drive; "
                        "use one of NixlConnector, MooncakeConnector, MoRIIOConnector (vLLM), a "
                        "--disaggregation-mode with a supported backend (SGLang) or mooncake (ATOM)")
    if allow_tcp:
        return problems
    hint = " (or pass --disaggregation-allow-tcp for a single-host test or benchmark)"
    if advertise_host.strip("[]") in NON_ROUTABLE_HOSTS or advertise_host in NON_ROUTABLE_HOSTS:
        problems.append(f"{setup.mode} worker would advertise {advertise_host!r}, which other hosts cannot reach: "
                        f"set --advertise-host to this host's cluster/RDMA-rail address{hint}")
    if not setup.rdma_capable:
        problems.append(f"{setup.transfer} moves KV without RDMA; use an RDMA transfer for PD{hint}")
    else:
        devices = active_rdma_devices() if rdma_devices is None else rdma_devices
        if not devices:
            problems.append(f"no RDMA device with an ACTIVE port under /sys/class/infiniband: {setup.transfer or 'the KV transfer'} "
                            f"would fall back to TCP, far slower than the GPU it feeds{hint}")
    return problems
