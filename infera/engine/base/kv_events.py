"""vLLM-style ``--kv-events-config`` handling shared by the launchers that speak it (vLLM, sim).

Unless the user gave one, a config is injected publishing on a free port with a replay socket on
another; a user's own config is honoured and its ports read back, so the record can advertise
``kv_events_endpoint`` / ``kv_events_replay_endpoint``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket

from infera.config import add_flag
from infera.engine.base.argv import flag_value
from infera.engine.base.engine_config import parse_json_flag

Ports = tuple[int, "int | None"]  # (publisher, replay)


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


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_port_block(n: int = 1, host: str = "", attempts: int = 256) -> int:
    """First of ``n`` consecutive TCP ports free now, chosen BELOW the kernel's ephemeral range and
    outside Kubernetes' NodePort range: a port handed to an engine is bound seconds later (vLLM
    binds its KV-event publisher after loading the model), and a port from the ephemeral range
    can be taken meanwhile by any outgoing connection on the host (it happened in CI)."""
    eph_lo, _ = _ephemeral_range()
    nodeports = _nodeport_range()
    lo, hi = 10000, eph_lo - n
    for _ in range(attempts):
        base = random.randint(lo, hi) if hi > lo else 0
        if base == 0:
            break
        if nodeports and base + n - 1 >= nodeports[0] and base <= nodeports[1]:
            continue
        if all(_bindable(base + i, host) for i in range(n)):
            return base
    # No room below the ephemeral range (unusual sysctl): let the kernel pick.
    for _ in range(attempts):
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + n - 1 <= 65535 and all(_bindable(base + i, host) for i in range(1, n)):
            return base
    raise OSError(f"no {n} consecutive free TCP ports found")


def free_port(host: str = "") -> int:
    return free_port_block(1, host)


def add_kv_events_flag(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--enable-kv-events", env="INFERA_ENABLE_KV_EVENTS", default=True,
             action=argparse.BooleanOptionalAction,
             help="publish KV events: inject a --kv-events-config on free ports unless one is given")


def with_kv_events(argv: list[str], enabled: bool, engine: str) -> tuple[list[str], Ports | None]:
    """(argv with a config injected if needed, the ports to advertise or None)."""
    if not enabled:
        return argv, None
    user_cfg = flag_value(argv, "--kv-events-config")
    if user_cfg is not None:
        return argv, event_ports(user_cfg, engine)
    pub, replay = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "kv-events"}
    return [*argv, "--kv-events-config", json.dumps(config, separators=(",", ":"))], (pub, replay)


def event_ports(raw: str, engine: str) -> Ports | None:
    """Publisher and replay ports of a user's ``--kv-events-config`` (None: nothing to subscribe to)."""
    cfg = parse_json_flag(raw, "--kv-events-config", f"infera.engine.{engine}") or {}
    if not cfg.get("enable_kv_cache_events", False) or (cfg.get("publisher") or "zmq") != "zmq":
        return None

    def port(endpoint: str | None) -> int | None:
        if not endpoint or not endpoint.startswith("tcp://") or ":" not in endpoint[len("tcp://"):]:
            return None
        try:
            return int(endpoint.rsplit(":", 1)[1])
        except ValueError:
            return None

    pub = port(cfg.get("endpoint", "tcp://*:5557"))
    return (pub, port(cfg.get("replay_endpoint"))) if pub else None


def event_fields(ports: Ports | None, advertise_host: str) -> dict[str, str]:
    """The record fields for the published endpoints."""
    if not ports:
        return {}
    pub, replay = ports
    fields = {"kv_events_endpoint": f"tcp://{advertise_host}:{pub}"}
    if replay:
        fields["kv_events_replay_endpoint"] = f"tcp://{advertise_host}:{replay}"
    return fields
