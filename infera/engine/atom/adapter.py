"""ATOM: argv translation, readiness and the worker record for ``python -m infera.engine.atom``.

Every flag the user gives goes to ``python -m atom.entrypoints.openai_server`` verbatim and in
order; Infera only appends ``--port <free port>`` when absent (ATOM uses ``--port`` as the internal
torch MASTER_PORT; it serves HTTP on ``--server-port``).

Differences from the other engines (AMD Infera's behaviour):

* etcd discovery and HTTP request transport only.
* No drain: ATOM exposes no in-flight metric, so on SIGTERM the launcher deregisters and stops the
  engine straight away (``drains = False``); the engine gets 15 s between SIGTERM and SIGKILL
  unless ``--engine-stop-timeout``/``INFERA_ENGINE_STOP_TIMEOUT`` says otherwise.
* KV events are off by default and cannot be turned on: ATOM has no KV-events flag (AMD Infera
  publishes them from an in-process hook inside ATOM, which this re-implementation does not ship),
  so ``--enable-kv-events`` fails with a clear error instead of silently publishing nothing.

The record: ``model_name`` = ``--served-model-name`` or ``--model``; ``kv_block_size`` =
``--block-size`` (16); the PD role from ``--kv-transfer-config``'s ``kv_role`` with the
``atom-mooncake`` protocol and the params the router's serial-pull dispatch needs.
"""
from __future__ import annotations

import argparse
import os
from typing import Any

import aiohttp

from infera.engine.base.engine_config import http_ready, parse_json_flag
from infera.engine.base.argv import flag_value, flag_values, has_flag
from infera.engine.base.launcher import EngineProcessSpec, default_advertise_host, engine_command
from infera.engine.base.preflight import PdSetup
from infera.engine.sglang.adapter import add_kv_events_flag, int_flag, kv_events_enabled
from infera.engine.base.kv_events import free_port

PROG = "infera.engine.atom"
ATOM_MODULE = "atom.entrypoints.openai_server"

# ATOM's own defaults for the flags the record is built from.
ATOM_DEFAULT_HOST = "0.0.0.0"
ATOM_DEFAULT_SERVER_PORT = 8000
ATOM_DEFAULT_BLOCK_SIZE = 16
ATOM_DEFAULT_HANDSHAKE_PORT = 6301
ATOM_ENGINE_STOP_TIMEOUT = 15.0

TP_FLAGS = ("-tp", "--tensor-parallel-size")
ROLE_MODES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "mixed"}
# ATOM's kv_connector names (lowercase; "mooncake" is its default) → Infera PD protocol id.
CONNECTOR_PROTOCOLS = {"mooncake": "atom-mooncake"}



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

    def add_flags(self, parser: argparse.ArgumentParser) -> None:
        add_kv_events_flag(parser, False, "not supported for ATOM (it has no KV-events flag); "
                                          "--enable-kv-events is refused")
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
        if kv_events_enabled(args, PROG):
            raise SystemExit(f"{PROG}: --enable-kv-events is not supported for ATOM: ATOM has no KV-events "
                             "flag to inject, so no events would be published. Run with --no-enable-kv-events "
                             "(the default) and unset INFERA_ENABLE_KV_EVENTS")
        if not flag_value(argv, "--model"):
            raise SystemExit(f"{PROG}: --model is required (a model folder or a hub id)")
        server_port = int_flag(argv, ["--server-port"], ATOM_DEFAULT_SERVER_PORT, PROG)
        tp_size = int_flag(argv, TP_FLAGS, 1, PROG)
        int_flag(argv, ["--block-size"], ATOM_DEFAULT_BLOCK_SIZE, PROG)
        # Validate the PD config before the (slow) engine start, not after it.
        disaggregation(parse_kv_transfer_config(flag_value(argv, "--kv-transfer-config")), "-", server_port, tp_size)
        if not has_flag(argv, "--port"):
            argv += ["--port", str(free_port())]  # ATOM's torch MASTER_PORT; a fixed one collides
        bind = flag_value(argv, "--host", default=ATOM_DEFAULT_HOST)
        reach = default_advertise_host(bind)
        return EngineProcessSpec(cmd=engine_command(args, ATOM_MODULE, argv), port=server_port, host=reach, argv=argv)

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
        return fields

    def inflight(self, metrics_text: str) -> int | None:
        return None  # ATOM has no in-flight metric (and drains = False: the launcher never asks)
