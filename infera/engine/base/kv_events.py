"""vLLM-style ``--kv-events-config`` handling shared by the launchers that speak it (vLLM, sim).

Unless the user gave one, a config is injected publishing on a free port with a replay socket on
another; a user's own config is honoured and its ports read back, so the record can advertise
``kv_events_endpoint`` / ``kv_events_replay_endpoint``.

An injected config's sockets are then bound to the advertise address only (``bind_kv_events``),
not every interface: KV events carry users' prompt token ids, and the replay socket hands the
event history to whoever asks.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import socket

from infera.config import add_flag
from infera.engine.base.argv import flag_value
from infera.engine.base.engine_config import parse_json_flag
from infera.engine.base.ports import bindable, engine_port_taken, free_port_blocks

log = logging.getLogger("infera.launcher.kv_events")

Ports = tuple[int, "int | None"]  # (publisher, replay)


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
    # Disjoint from each other and from the engine's own port: each is only free *now*, none is
    # bound yet, and two independent draws can be the same port (CI lost a sim engine to exactly
    # that: "Address already in use" on a publisher and replay both given 22476).
    pub, replay = free_port_blocks([1, 1], avoid=engine_port_taken(argv))
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


# -- binding the advertise address -------------------------------------------------------------------
# vLLM 0.32 *binds* a PUB endpoint only when it holds "*" or "::" (or is ipc/inproc) and *connects*
# to anything else; SGLang 0.5.23 binds "0.0.0.0" too, and its config's ``bind`` (true/false)
# overrides that guess; ATOM always binds (the simulator mirrors all three). So
# "tcp://10.0.0.5:5557" would make vLLM, and SGLang without ``bind``, dial out. libzmq reads
# "src;dst" as a source address then the address proper, and a bind ignores the source part:
# "tcp://*:0;10.0.0.5:5557" passes the engines' "*" test and binds 10.0.0.5:5557 only (libzmq 4.3
# as shipped by pyzmq; tests/unit/test_kv_events_bind.py checks it). Replay sockets are always
# bound; the same form keeps one rule for both. The port stays last, so the engines' per-DP-rank
# port offset (rfind(":")) still applies.

def bind_endpoint(ip: str, port: int | str) -> str:
    """A ZMQ endpoint the engines bind on ``ip`` only (see above)."""
    return f"tcp://*:0;{ip}:{port}"


def kv_events_bind_ip(advertise_host: str) -> str | None:
    """The IPv4 address of ``advertise_host`` to bind the KV-event sockets on, or None to keep the
    wildcard (logged): an IPv6 or unresolvable host, or one this machine does not own (an address
    NATed to it: binding it would fail)."""
    host = advertise_host.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:  # a name: resolved once at launch, before the engine starts
            ip = ipaddress.ip_address(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
        except (OSError, IndexError, ValueError) as exc:
            log.warning("KV events: advertise host %r does not resolve (%s): publishing on all interfaces", host, exc)
            return None
    if ip.version != 4 or ip.is_unspecified:
        log.warning("KV events: advertise host %s is not one IPv4 address: publishing on all interfaces", host)
        return None
    if not bindable(0, str(ip)):
        log.warning("KV events: advertise host %s (%s) is not an address of this machine: publishing on all "
                    "interfaces (give --advertise-host a local address, or a --kv-events-config of your own)",
                    host, ip)
        return None
    return str(ip)


def bind_kv_events(argv: list[str], advertise_host: str) -> list[str]:
    """``argv`` with the wildcard ``tcp://*:PORT`` endpoints of its ``--kv-events-config`` bound to
    the advertise address. Only for a config the launcher injected: a user's is left as given."""
    raw = flag_value(argv, "--kv-events-config")
    if raw is None:
        return argv
    cfg = json.loads(raw)
    wild = {k: cfg[k] for k in ("endpoint", "replay_endpoint")
            if isinstance(cfg.get(k), str) and cfg[k].startswith("tcp://*:") and cfg[k][len("tcp://*:"):].isdigit()}
    if not wild:
        return argv
    ip = kv_events_bind_ip(advertise_host)
    if ip is None:
        return argv
    for key, endpoint in wild.items():
        cfg[key] = bind_endpoint(ip, endpoint[len("tcp://*:"):])
    value = json.dumps(cfg, separators=(",", ":"))
    out = list(argv)
    for i, tok in enumerate(out):
        if tok == "--kv-events-config" and i + 1 < len(out):
            out[i + 1] = value
        elif tok.startswith("--kv-events-config="):
            out[i] = f"--kv-events-config={value}"
    return out
