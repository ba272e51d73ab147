"""The simulated engine itself, one per served model: :class:`SimEngine` puts together the
tokenizer, the KV cache (``cache.py``), the continuous-batching scheduler whose task is the engine
loop (``scheduler.py``), the KV-event publisher (``kv_events.py``), the P/D role (``pd.py``) and the
Prometheus registry (``metrics.py``), and answers what every handler asks of it: which model names
it serves and how to tokenize without stalling the event loop. It knows nothing of HTTP routes
(``handlers.py``) or hosting (``server.py``).
"""
from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any, Callable

from prometheus_client import CollectorRegistry

from .cache import KVCache
from .kv_events import KvEventPublisher
from .metrics import METRICS_FLAVORS
from .lora import LoraAdapters
from .pd import Disaggregation, build_disaggregation
from .scheduler import Scheduler, default_load_ms_per_block
from .schemas import ApiError
from infera.kv.tokenizer import SimTokenizer, load_tokenizer

# Requests bigger than this (bytes) are tokenized in a worker thread to keep the loop responsive.
OFFLOAD_TOKENIZE_BYTES = 16 * 1024


class SimEngine:
    """Tokenizer + KV cache + scheduler + metrics for one served model."""

    def __init__(self, args: argparse.Namespace, tokenizer: SimTokenizer | None = None, *,
                 metrics_flavor: str | None = "vllm", kv_events_format: str = "vllm") -> None:
        if metrics_flavor is not None and metrics_flavor not in METRICS_FLAVORS:
            raise ValueError(f"unknown metrics flavor {metrics_flavor!r} (choose from {', '.join(METRICS_FLAVORS)})")
        self.args = args
        # Whose metric names /metrics speaks ("vllm", "sglang"); None: no /metrics at all.
        self.metrics_flavor = metrics_flavor
        self.model_path: str = args.model
        self.served_model_names: list[str] = list(args.served_model_name or [args.model])
        # LoRA adapters (--enable-lora, --lora-modules, runtime loads): served as models of their own.
        self.lora = LoraAdapters(args, self.served_model_names)
        self.max_model_len: int = args.max_model_len
        self.created = int(time.time())
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(args.model)
        host_blocks = getattr(args, "kv_offload_blocks", 0) or 0
        load_ms = getattr(args, "kv_offload_load_ms_per_block", None)
        self.cache = KVCache(args.block_size, args.num_gpu_blocks, host_blocks=host_blocks)
        self.scheduler = Scheduler(
            self.cache,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            speedup=args.speedup,
            seed=args.seed,
            output_vocab=self.tokenizer.output_token_ids,
            # a host tier is a KV connector to vLLM (its OffloadingConnector)
            kv_connector=getattr(args, "kv_transfer_config", None) is not None or host_blocks > 0,
            load_ms_per_block=default_load_ms_per_block(args.block_size) if load_ms is None else load_ms,
        )
        # KV events, one batch per scheduler step: "type"-tagged maps as vLLM 0.32 and SGLang 0.5.22+
        # send them ("vllm", "sglang"), or ATOM v0.1.5's tagged arrays ("atom").
        self.kv_events: KvEventPublisher | None = None
        # A request's cache_salt salts its prefix cache as vLLM does; the SGLang and ATOM stand-ins
        # ignore it, as engines without the salt (the router routes such tenants cache-blind there).
        self.salts_cache = kv_events_format == "vllm"
        kv_cfg = getattr(args, "kv_events_config", None)
        if kv_cfg is not None and kv_cfg.enabled:
            self.kv_events = KvEventPublisher(kv_cfg, block_size=args.block_size, seed=args.seed,
                                              fmt=kv_events_format)
            self.kv_events.attach(self.cache, self.scheduler)
        # P/D role (None: a mixed engine). Blocks a transfer brings are announced right away.
        self.disagg: Disaggregation | None = build_disaggregation(
            args, self.cache, self.kv_events.flush if self.kv_events is not None else None)
        self.registry = CollectorRegistry()
        if metrics_flavor is not None:
            self.registry.register(METRICS_FLAVORS[metrics_flavor](self))
        # POST /start_profile, /stop_profile as they arrived: (action, the options sent); no profiler runs.
        self.profile_calls: list[tuple[str, dict[str, Any]]] = []

    @property
    def model_name(self) -> str:
        """The name reported in responses (vLLM: the first served name)."""
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        # vLLM: an omitted model means the default one; otherwise it must be a served name.
        if model is not None and model not in self.served_model_names and not self.lora.holds(model):
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", param="model")

    async def run_tokenizer(self, size_hint: int, fn: Callable[..., Any], *args: Any) -> Any:
        """Tokenize inline when small; in a thread when big, so one huge prompt can't stall streams."""
        if size_hint < OFFLOAD_TOKENIZE_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
