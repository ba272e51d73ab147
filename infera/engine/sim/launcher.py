"""The simulated engine's adapter: launched and registered exactly like a real engine.

Like the vLLM launcher, KV events are on by default (``--enable-kv-events``): unless the user gives
a ``--kv-events-config``, one is injected with a publisher and a replay socket on free ports, and the
record advertises ``kv_events_endpoint`` / ``kv_events_replay_endpoint``.

P/D comes from the sim's ``--kv-transfer-config`` exactly as for vLLM (the vLLM adapter's code):
a producer/consumer's missing ``engine_id`` is pinned into the forwarded config, and the record's
``disagg_mode``/``disagg_meta`` say ``vllm-nixl``.
"""
from __future__ import annotations

import argparse
from typing import Any

import aiohttp

from infera.engine.base.anthropic_probe import serves_anthropic_messages
from infera.engine.base.argv import flag_value, flag_values
from infera.engine.base.kv_events import add_kv_events_flag, bind_kv_events, event_fields, with_kv_events
from infera.engine.base.launcher import EngineProcessSpec, default_advertise_host, engine_command
from infera.engine.base.lora_watch import lora_enabled, max_loras, probe_lora_adapters
from infera.engine.base.ports import free_port
from infera.engine.base.prom import VLLM_INFLIGHT, info_labels, sum_samples
from infera.engine.vllm.adapter import disaggregation, parse_kv_transfer_config, with_pinned_engine_id
from infera.engine.vllm.tasks import probe_tasks

PROG = "infera.engine.sim"

SIM_DEFAULT_BLOCK_SIZE = 16


class SimAdapter:
    engine = "sim"
    # In the follower gate through LWS_WORKER_INDEX only, like vLLM: a sim pool rendered as a
    # LeaderWorkerSet must register its leader alone.
    node_rank_flags: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.kv_events: tuple[int, int | None] | None = None  # (publisher, replay) ports, set by prepare

    def add_flags(self, parser: argparse.ArgumentParser) -> None:
        add_kv_events_flag(parser)

    def prepare(self, engine_argv: list[str], args: argparse.Namespace) -> EngineProcessSpec:
        if not flag_value(engine_argv, "--model"):
            raise SystemExit(f"{PROG}: --model is required (a name, or a folder with tokenizer.json)")
        port_s = flag_value(engine_argv, "--port")
        if port_s is None:  # no port given: take a free one rather than colliding on :8000
            port = free_port()
            engine_argv = [*engine_argv, "--port", str(port)]
        else:
            port = int(port_s)
        own_kv_events = flag_value(engine_argv, "--kv-events-config") is None
        engine_argv, self.kv_events = with_kv_events(engine_argv, getattr(args, "enable_kv_events", False), "sim")
        engine_argv, _ = with_pinned_engine_id(engine_argv, PROG)
        bind = flag_value(engine_argv, "--host", default="0.0.0.0")
        reach = default_advertise_host(bind)
        if own_kv_events:  # ours: bound where the router connects, not on every interface
            engine_argv = bind_kv_events(engine_argv, getattr(args, "advertise_host", None) or reach)
        return EngineProcessSpec(cmd=engine_command(args, "infera.engine.sim.server", engine_argv), port=port, host=reach,
                                 argv=engine_argv)

    async def ready(self, session: aiohttp.ClientSession, base_url: str) -> bool:
        async with session.get(base_url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
            return resp.status == 200

    async def describe(self, session: aiohttp.ClientSession, base_url: str, engine_argv: list[str],
                       args: argparse.Namespace) -> dict:
        async with session.get(base_url + "/v1/models") as resp:
            models = (await resp.json())["data"]
        async with session.get(base_url + "/metrics") as resp:
            cache_info = info_labels(await resp.text(), "vllm:cache_config_info") or {}
        block_size = cache_info.get("block_size") or flag_value(engine_argv, "--block-size") or SIM_DEFAULT_BLOCK_SIZE
        served = flag_values(engine_argv, "--served-model-name")
        model_name = served[0] if served else models[0]["id"]
        bind = flag_value(engine_argv, "--host", default="0.0.0.0")
        fields: dict[str, Any] = {"model_name": model_name, "kv_block_size": int(block_size), "bind_host": bind}
        advertise = getattr(args, "advertise_host", None) or default_advertise_host(bind)
        kv_transfer = parse_kv_transfer_config(flag_value(engine_argv, "--kv-transfer-config"), PROG)
        fields["disagg_mode"], fields["disagg_meta"] = disaggregation(kv_transfer, advertise)
        fields.update(event_fields(self.kv_events, advertise))
        fields["tasks"] = await probe_tasks(session, base_url, engine_argv)  # --runner pooling's tasks, as vLLM's
        if not fields["tasks"] or "generate" in fields["tasks"]:  # its own /v1/messages: passed through to it
            fields["anthropic_messages"] = await serves_anthropic_messages(session, base_url, fields["model_name"])
        if lora_enabled(engine_argv):  # its loaded adapters (kept current by base/lora_watch.py)
            fields["lora_adapters"] = await probe_lora_adapters(session, base_url, served or [model_name]) or []
            fields["lora_max"] = max_loras(engine_argv)
        return fields

    def inflight(self, metrics_text: str) -> int | None:
        return sum_samples(metrics_text, VLLM_INFLIGHT)
