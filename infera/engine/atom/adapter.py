"""ATOM: argv translation, readiness and the worker record for ``python -m infera.engine.atom``.

Every flag the user gives goes to ``python -m atom.entrypoints.openai_server`` verbatim and in
order; Infera only appends ``--port <free port>`` when absent (ATOM uses ``--port`` as the internal
torch MASTER_PORT; it serves HTTP on ``--server-port``).

Differences from the other engines (AMD Infera's behaviour):

* etcd discovery and HTTP request transport only.
* No drain: ATOM exposes no in-flight metric, so on SIGTERM the launcher deregisters and stops the
  engine straight away (``drains = False``); the engine gets 15 s between SIGTERM and SIGKILL
  unless ``--engine-stop-timeout``/``INFERA_ENGINE_STOP_TIMEOUT`` says otherwise.
* KV events are off by default (as in AMD Infera). ``--enable-kv-events`` turns on ATOM's own
  publisher (``atom/distributed/kv_events.py``, ROCm/ATOM v0.1.5 on: commit de2d85de, PR #869), which
  ATOM configures from its environment only, no flag: the launcher sets ``ATOM_KV_EVENTS_ENABLE=1``,
  ``ATOM_KV_EVENTS_PUBLISHER=zmq``, ``ATOM_KV_EVENTS_TOPIC=kv-events`` and
  ``ATOM_KV_EVENTS_ENDPOINT=tcp://<advertise IP>:<free port>`` (ATOM binds it as given). A user's
  own ``ATOM_KV_EVENTS_ENDPOINT`` is kept (and advertised); a user's publisher or topic that the
  router cannot subscribe to is refused. Frames are ``[topic, payload]`` (no sequence number); the
  payload has vLLM's layout, ``[ts, events, dp_rank]`` with array-form tagged events (plus ATOM's
  own ``BlockTransferred``, which the router's decoder skips). With ``-dp N`` > 1 it is refused: every DP rank's engine core
  binds the same endpoint (no per-rank port offset), so ranks after the first would fail.
  (AMD Infera patched ATOM's ``BlockManager`` from a ``.pth`` hook instead; ATOM now publishes
  natively, so no hook is needed.) An ATOM without that publisher ignores the variables.

The record: ``model_name`` = ``--served-model-name`` or ``--model``; ``kv_block_size`` =
``--block-size`` (16); the PD role from ``--kv-transfer-config``'s ``kv_role`` with the
``atom-mooncake`` protocol and the params the router's serial-pull dispatch needs.
"""
from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Mapping

import aiohttp

from infera.engine.base.argv import flag_value, flag_values, has_flag
from infera.engine.base.engine_config import http_ready, parse_json_flag
from infera.engine.base.kv_events import kv_events_bind_ip
from infera.engine.base.launcher import EngineProcessSpec, default_advertise_host, engine_command
from infera.engine.base.ports import free_port
from infera.engine.base.preflight import PdSetup
from infera.engine.base.rocm_env import apply_rocm_env
from infera.engine.sglang.adapter import add_kv_events_flag, int_flag, kv_events_enabled

log = logging.getLogger("infera.launcher.atom")

PROG = "infera.engine.atom"
ATOM_MODULE = "atom.entrypoints.openai_server"

# ATOM's own defaults for the flags the record is built from.
ATOM_DEFAULT_HOST = "0.0.0.0"
ATOM_DEFAULT_SERVER_PORT = 8000
ATOM_DEFAULT_BLOCK_SIZE = 16
ATOM_DEFAULT_HANDSHAKE_PORT = 6301
ATOM_ENGINE_STOP_TIMEOUT = 15.0

TP_FLAGS = ("-tp", "--tensor-parallel-size")
DP_FLAGS = ("-dp", "--data-parallel-size")

# ATOM's KV-event publisher settings (atom/utils/envs.py): environment only.
ATOM_KV_EVENTS_ENABLE = "ATOM_KV_EVENTS_ENABLE"
ATOM_KV_EVENTS_PUBLISHER = "ATOM_KV_EVENTS_PUBLISHER"
ATOM_KV_EVENTS_ENDPOINT = "ATOM_KV_EVENTS_ENDPOINT"
ATOM_KV_EVENTS_TOPIC = "ATOM_KV_EVENTS_TOPIC"
# The topic the router subscribes to; ATOM's default "" sends single-frame messages a topic filter drops.
KV_EVENTS_TOPIC = "kv-events"
ROLE_MODES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "mixed"}
# ATOM's kv_connector names (lowercase; "mooncake" is its default) → Infera PD protocol id.
CONNECTOR_PROTOCOLS = {"mooncake": "atom-mooncake"}



def atom_kv_events_env(environ: Mapping[str, str], advertise_host: str, dp_size: int
                       ) -> tuple[dict[str, str], tuple[str | None, int]]:
    """(the ATOM_KV_EVENTS_* variables to give the engine, (bind host or None for all, port) of
    its publisher); SystemExit for settings the router could not subscribe to."""
    if dp_size > 1:
        raise SystemExit(f"{PROG}: --enable-kv-events needs one ATOM DP rank per launcher: with -dp {dp_size} every "
                         f"rank's engine core binds the same {ATOM_KV_EVENTS_ENDPOINT} (ATOM applies no per-rank "
                         "port offset), so all ranks but one would fail. Run with --no-enable-kv-events")
    publisher = environ.get(ATOM_KV_EVENTS_PUBLISHER) or "zmq"
    if publisher != "zmq":
        raise SystemExit(f"{PROG}: --enable-kv-events needs ATOM's zmq publisher, but {ATOM_KV_EVENTS_PUBLISHER}="
                         f"{publisher!r}")
    topic = environ.get(ATOM_KV_EVENTS_TOPIC) or KV_EVENTS_TOPIC
    if topic != KV_EVENTS_TOPIC:
        raise SystemExit(f"{PROG}: {ATOM_KV_EVENTS_TOPIC}={topic!r}: the router subscribes to topic "
                         f"{KV_EVENTS_TOPIC!r}; unset it")
    user_endpoint = environ.get(ATOM_KV_EVENTS_ENDPOINT)
    env = {ATOM_KV_EVENTS_ENABLE: "1", ATOM_KV_EVENTS_PUBLISHER: "zmq", ATOM_KV_EVENTS_TOPIC: KV_EVENTS_TOPIC}
    if user_endpoint:
        return env, _tcp_endpoint(user_endpoint)
    try:
        port = free_port()
    except OSError as exc:
        raise SystemExit(f"{PROG}: {exc} for KV events") from None
    ip = kv_events_bind_ip(advertise_host)  # KV events carry prompt token ids: not on every interface
    env[ATOM_KV_EVENTS_ENDPOINT] = f"tcp://{ip or '*'}:{port}"
    return env, (ip, port)


def _tcp_endpoint(endpoint: str) -> tuple[str | None, int]:
    """(host or None for a wildcard, port) of a ``tcp://host:port`` endpoint; SystemExit otherwise."""
    rest = endpoint[len("tcp://"):] if endpoint.startswith("tcp://") else ""
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"{PROG}: {ATOM_KV_EVENTS_ENDPOINT}={endpoint!r} is not tcp://host:port, which the router "
                         "needs to subscribe")
    return (None if host in ("*", "0.0.0.0", "::", "[::]") else host.strip("[]")), int(port)


def parse_kv_transfer_config(raw: str | None) -> dict[str, Any] | None:
    return parse_json_flag(raw, "--kv-transfer-config", PROG)


def disaggregation(cfg: dict[str, Any] | None, advertise_host: str, http_port: int,
                   tp_size: int) -> tuple[str, dict[str, Any]]:
    """(disagg_mode, disagg_meta) from a parsed ``--kv-transfer-config``; SystemExit if unusable."""
    if not cfg:
        return "mixed", {}
    role = cfg.get("kv_role") or "kv_both"
    if role not in ROLE_MODES:
        raise SystemExit(f"{PROG}: unknown kv_role {role!r} in --kv-transfer-config "
                         f"(expected one of {', '.join(ROLE_MODES)})")
    mode = ROLE_MODES[role]
    if mode == "mixed":
        return "mixed", {}
    connector = cfg.get("kv_connector") or "mooncake"
    protocol = CONNECTOR_PROTOCOLS.get(str(connector))
    if protocol is None:
        raise SystemExit(f"{PROG}: kv_connector {connector!r} has no Infera PD protocol; ATOM workers "
                         f"support: {', '.join(CONNECTOR_PROTOCOLS)}")
    params = {
        "host": advertise_host,
        "http_port": http_port,
        "handshake_port": int(cfg.get("handshake_port") or ATOM_DEFAULT_HANDSHAKE_PORT),
        "tp_size": tp_size,
        "dp_size": int(cfg.get("dp_size") or 1),
    }
    return mode, {"protocol": protocol, "params": params}


class AtomAdapter:
    engine = "atom"
    drains = False  # no in-flight metric: the launcher deregisters, then stops the engine

    def __init__(self) -> None:
        self.kv_events: tuple[str | None, int] | None = None  # (bind host, port) of ATOM's publisher

    def add_flags(self, parser: argparse.ArgumentParser) -> None:
        add_kv_events_flag(parser, False, "publish KV events: turn on ATOM's own zmq publisher (ATOM_KV_EVENTS_*) "
                                          "on a free port and advertise it")
        # ATOM's stop grace is 15 s; an env value (a string default until parsed) or the flag wins.
        if not isinstance(parser.get_default("engine_stop_timeout"), str):
            parser.set_defaults(engine_stop_timeout=ATOM_ENGINE_STOP_TIMEOUT)
        # AMD Infera reads ATOM's ready timeout from its own variable; the generic one still wins.
        if "INFERA_ATOM_READY_TIMEOUT" in os.environ and not isinstance(parser.get_default("ready_timeout"), str):
            parser.set_defaults(ready_timeout=os.environ["INFERA_ATOM_READY_TIMEOUT"])  # parsed like a flag

    def pd_setup(self, engine_argv: list[str]) -> PdSetup:
        mode, meta = disaggregation(parse_kv_transfer_config(flag_value(engine_argv, "--kv-transfer-config")), "-",
                                    ATOM_DEFAULT_SERVER_PORT, 1)
        return PdSetup(mode, meta.get("protocol"), "the mooncake connector",
                       bind_host=flag_value(engine_argv, "--host", default=ATOM_DEFAULT_HOST))

    def prepare(self, engine_argv: list[str], args: argparse.Namespace) -> EngineProcessSpec:
        argv = list(engine_argv)
        if not flag_value(argv, "--model"):
            raise SystemExit(f"{PROG}: --model is required (a model folder or a hub id)")
        server_port = int_flag(argv, ["--server-port"], ATOM_DEFAULT_SERVER_PORT, PROG)
        tp_size = int_flag(argv, TP_FLAGS, 1, PROG)
        int_flag(argv, ["--block-size"], ATOM_DEFAULT_BLOCK_SIZE, PROG)
        # Validate the PD config before the (slow) engine start, not after it.
        disaggregation(parse_kv_transfer_config(flag_value(argv, "--kv-transfer-config")), "-", server_port, tp_size)
        if not has_flag(argv, "--port"):
            argv += ["--port", str(free_port())]  # ATOM's torch MASTER_PORT; a fixed one collides
        dp_size = int_flag(argv, DP_FLAGS, 1, PROG)
        bind = flag_value(argv, "--host", default=ATOM_DEFAULT_HOST)
        reach = default_advertise_host(bind)
        env: dict[str, str] = {}
        self.kv_events = None
        if kv_events_enabled(args, PROG):
            env, self.kv_events = atom_kv_events_env(os.environ, args.advertise_host or reach, dp_size)
            log.info("KV events: ATOM publishes on %s (topic %r)",
                     env.get(ATOM_KV_EVENTS_ENDPOINT) or os.environ[ATOM_KV_EVENTS_ENDPOINT], KV_EVENTS_TOPIC)
        elif os.environ.get(ATOM_KV_EVENTS_ENABLE) == "1":
            log.warning("%s=1: ATOM publishes KV events, but the record advertises none (pass --enable-kv-events "
                        "for the router to use them)", ATOM_KV_EVENTS_ENABLE)
        env = dict(env)
        apply_rocm_env("atom", argv, env)  # spec §6.5: an AMD host's RDMA defaults
        return EngineProcessSpec(cmd=engine_command(args, ATOM_MODULE, argv), port=server_port, host=reach, env=env,
                                 argv=argv)

    async def ready(self, session: aiohttp.ClientSession, base_url: str) -> bool:
        return await http_ready(session, base_url)

    async def describe(self, session: aiohttp.ClientSession | None, base_url: str, engine_argv: list[str],
                       args: argparse.Namespace) -> dict[str, Any]:
        argv = engine_argv  # as finally passed (spec.argv): what the engine really runs with
        bind = flag_value(argv, "--host", default=ATOM_DEFAULT_HOST)
        advertise = args.advertise_host or default_advertise_host(bind)  # as the base launcher decides
        served = flag_values(argv, "--served-model-name")
        server_port = int_flag(argv, ["--server-port"], ATOM_DEFAULT_SERVER_PORT, PROG)
        mode, meta = disaggregation(parse_kv_transfer_config(flag_value(argv, "--kv-transfer-config")),
                                    advertise, server_port, int_flag(argv, TP_FLAGS, 1, PROG))
        fields: dict[str, Any] = {
            "model_name": served[0] if served else flag_value(argv, "--model"),
            "kv_block_size": int_flag(argv, ["--block-size"], ATOM_DEFAULT_BLOCK_SIZE, PROG),
            "disagg_mode": mode,
            "disagg_meta": meta,
        }
        if not args.advertise_host:
            # Only without --advertise-host: the base launcher pops bind_host only when it needs it.
            fields["bind_host"] = bind
        if self.kv_events is not None:
            host, port = self.kv_events
            fields["kv_events_endpoint"] = f"tcp://{host or advertise}:{port}"
        return fields

    def inflight(self, metrics_text: str) -> int | None:
        return None  # ATOM has no in-flight metric (and drains = False: the launcher never asks)
