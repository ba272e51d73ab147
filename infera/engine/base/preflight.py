"""PD preflight: refuse, before the (slow) engine start, a prefill/decode worker whose KV would
cross hosts over plain TCP or whose peers could not reach it.

Checks (only for ``prefill``/``decode`` workers):

* the PD protocol is known (a connector the router can drive) — always;
* what the engine itself would refuse after its slow start (``PdSetup.refusals``: SGLang's ``fake``
  transfer backend on a prefill worker, a backend SGLang does not list) — always;
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
#: SGLang's ``--disaggregation-transfer-backend`` choices, each with whether it moves KV over RDMA
#: (sglang 0.5.23 ``srt/arg_groups/choices.py`` DISAGG_TRANSFER_BACKEND_CHOICES). ``mooncake_tcp`` is
#: mooncake with its TCP transport forced (MC_FORCE_TCP=1, ``srt/arg_groups/pd_disaggregation_hook.py``);
#: ``fake`` moves no KV at all (synthetic decode benchmarks; SGLang refuses it on a prefill worker).
SGLANG_TRANSFER_BACKENDS: dict[str, bool] = {
    "mooncake": True, "nixl": True, "ascend": True, "mori": True, "fake": False, "mooncake_tcp": False,
}
SGLANG_RDMA_BACKENDS = tuple(b for b, rdma in SGLANG_TRANSFER_BACKENDS.items() if rdma)


def sglang_transfer_refusals(mode: str, backend: str) -> tuple[str, ...]:
    """What SGLang itself would refuse about ``backend`` for a ``mode`` worker (after loading)."""
    if backend not in SGLANG_TRANSFER_BACKENDS:
        return (f"--disaggregation-transfer-backend {backend!r} is not one SGLang accepts "
                f"({', '.join(SGLANG_TRANSFER_BACKENDS)})",)
    if backend == "fake" and mode == "prefill":
        return ("the 'fake' transfer backend moves no KV and SGLang refuses it on a prefill worker "
                "(it is for synthetic decode benchmarks)",)
    return ()


@dataclass(frozen=True)
class PdSetup:
    """What an adapter reads from the engine argv about its PD role, before the engine starts."""

    mode: str  # "mixed" | "prefill" | "decode"
    protocol: str | None = None  # the router-side protocol id; None: an unknown connector
    transfer: str = ""  # what moves the KV, for messages ("NixlConnector", "mooncake backend", …)
    rdma_capable: bool = True  # False: a transfer that never uses RDMA (a shared folder, TCP-only)
    bind_host: str | None = None  # the engine's --host (the advertise default when no --advertise-host)
    refusals: tuple[str, ...] = ()  # argv problems the engine would refuse anyway (allow-tcp lifts none)


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
    problems.extend(setup.refusals)
    if allow_tcp:
        return problems
    hint = " (or pass --disaggregation-allow-tcp for a single-host test or benchmark)"
    if advertise_host.strip("[]") in NON_ROUTABLE_HOSTS or advertise_host in NON_ROUTABLE_HOSTS:
        problems.append(f"{setup.mode} worker would advertise {advertise_host!r}, which other hosts cannot reach: "
                        f"set --advertise-host to this host's cluster/RDMA-rail address{hint}")
    if not setup.rdma_capable:
        problems.append(f"{setup.transfer} does not move KV over RDMA; use an RDMA transfer for PD{hint}")
    else:
        devices = active_rdma_devices() if rdma_devices is None else rdma_devices
        if not devices:
            problems.append(f"no RDMA device with an ACTIVE port under /sys/class/infiniband: {setup.transfer or 'the KV transfer'} "
                            f"would fall back to TCP, far slower than the GPU it feeds{hint}")
    return problems
