"""Free TCP ports for engines: one (``free_port``), a consecutive block (``free_port_block``), and
several blocks for one engine, none overlapping (``free_port_blocks``).

The finders only check that ports are bindable *now*; ports handed to the same engine (its HTTP
port, KV-event publisher and replay, NIXL side channel) are all still unbound when the next one is
chosen, so each choice must avoid the others. A block of ``n`` ports serves ``n`` data-parallel
ranks: vLLM binds each rank's socket at the base port + its DP rank.
"""
from __future__ import annotations

import os
import random
import socket
from typing import Iterable, Sequence

from infera.engine.base.argv import flag_value


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _nodeport_range() -> tuple[int, int] | None:
    """Kubernetes NodePorts (``INFERA_NODEPORT_RANGE="lo-hi"``, ``none``/``off`` to allow them)."""
    raw = os.environ.get("INFERA_NODEPORT_RANGE", "30000-32767").strip().lower()
    if raw in ("none", "off", ""):
        return None
    try:
        lo, hi = (int(x) for x in raw.split("-", 1))
        return lo, hi
    except ValueError:
        return 30000, 32767


def bindable(port: int, host: str) -> bool:
    """Whether ``host:port`` (port 0: any port on ``host``) can be bound now."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


# The OS's generator, not the module-level one: anything in the process may reseed that one
# (test tools do), and two launchers drawing from a reseeded generator pick the same port.
_port_rng = random.SystemRandom()


def free_port_block(n: int = 1, host: str = "", attempts: int = 256) -> int:
    """First of ``n`` consecutive TCP ports free now, chosen BELOW the kernel's ephemeral range and
    outside Kubernetes' NodePort range: a port handed to an engine is bound seconds later (vLLM
    binds its KV-event publisher after loading the model), and a port from the ephemeral range
    can be taken meanwhile by any outgoing connection on the host (it happened in CI)."""
    eph_lo, _ = _ephemeral_range()
    nodeports = _nodeport_range()
    lo, hi = 10000, eph_lo - n
    for _ in range(attempts):
        base = _port_rng.randint(lo, hi) if hi > lo else 0
        if base == 0:
            break
        if nodeports and base + n - 1 >= nodeports[0] and base <= nodeports[1]:
            continue
        if all(bindable(base + i, host) for i in range(n)):
            return base
    # No room below the ephemeral range (unusual sysctl): let the kernel pick.
    for _ in range(attempts):
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + n - 1 <= 65535 and all(bindable(base + i, host) for i in range(1, n)):
            return base
    raise OSError(f"no {n} consecutive free TCP ports found")


def free_port(host: str = "") -> int:
    return free_port_block(1, host)


def free_port_blocks(sizes: Sequence[int], avoid: Iterable[range] = (), attempts: int = 64) -> list[int]:
    """First port of a free block per size in ``sizes``, disjoint from each other and ``avoid``."""
    taken = list(avoid)
    starts: list[int] = []
    for n in sizes:
        for _ in range(attempts):
            start = free_port_block(n)
            block = range(start, start + n)
            if not any(block.start < t.stop and t.start < block.stop for t in taken):
                break
        else:
            raise OSError(f"no block of {n} free TCP ports apart from the ones already chosen")
        taken.append(block)
        starts.append(start)
    return starts


def engine_port_taken(argv: Sequence[str]) -> list[range]:
    """The engine's own ``--port`` as a range to avoid (empty when not given as a number): it is
    as unbound as the ports chosen next to it until the engine starts."""
    port = flag_value(argv, "--port")
    return [range(int(port), int(port) + 1)] if port and port.isdigit() else []
