"""Simulated vLLM engine: vLLM's OpenAI-compatible HTTP API over a timing-model "GPU".

Run ``python -m infera.engine.sim.server --model NAME [--port 8000 --speedup 10 ...]``.

In-process use (tests, launchers)::

    args = parse_args(["--model", "m", "--port", "0", "--speedup", "100"])
    async with SimServer(args) as server:      # or: await server.start() / await server.stop()
        ...  # server.url == "http://127.0.0.1:<port>"

``--kv-events-config`` (vLLM's JSON schema) publishes the cache's real KV events over ZMQ in vLLM's
wire format, with vLLM's replay socket (see ``kv_events.py``).

``--kv-transfer-config`` (vLLM's JSON, ``NixlConnector``) makes the engine a prefill
(``kv_producer``), decode (``kv_consumer``) or either (``kv_both``) of vLLM's NIXL P/D protocol,
with a modelled transfer (``--kv-transfer-bandwidth``, ``--kv-bytes-per-token``); see ``pd.py``.

``build_app(args)`` returns the bare ``aiohttp`` application if you want to host it yourself;
run it with ``web.AppRunner(app, handler_cancellation=True)`` so a client disconnect cancels the
handler (which aborts the sequence and frees its KV blocks).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
import uuid
from typing import Any, Awaitable, Callable, Iterable

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from . import tool_calls
from .cache import KVCache
from .kv_events import KvEventPublisher, parse_kv_events_config
from .pd import (DEFAULT_KV_BYTES_PER_TOKEN, DEFAULT_KV_TRANSFER_BANDWIDTH_GBPS, VLLM_KV_HOLD_TIMEOUT_S,
                 VLLM_KV_TRANSFER_TIMEOUT_S, Disaggregation, LegError, LegPlan, NixlDisaggregation,
                 SglangDisaggregation, build_disaggregation, parse_kv_transfer_config)
from .scheduler import FINISH_REASONS, FINISH_STOP, PROMPT_TOKEN_SOURCES, Scheduler, Sequence, default_load_ms_per_block
from .schemas import (ENGINE_KEY, SSE_HEADERS, ApiError, ChatCompletionRequest, CompletionRequest, StartProfileRequest,
                      TokenizeRequest, _check_sampling, _completion_prompt_ids, _decode_body, _request_id,
                      _resolve_max_tokens, _SamplingRequest, _stop_strings, _usage)
from infera.config import non_negative_float, positive_float
from infera.runtime import install_event_loop, wait_for_shutdown_signal
from infera.kv.tokenizer import ChatTemplateError, SimTokenizer, load_tokenizer

log = logging.getLogger("infera.engine.sim.server")

SIM_VERSION = "0.0.0+infera.sim"
# Requests bigger than this (bytes) are tokenized in a worker thread to keep the loop responsive.
OFFLOAD_TOKENIZE_BYTES = 16 * 1024

_json_encode = msgspec.json.Encoder().encode


# ============================================================================ CLI


def _int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def conv(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from None
        if n < lo or (hi is not None and n > hi):
            bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"must be {bound}: {value!r}")
        return n

    conv.__name__ = "int"
    return conv


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m infera.engine.sim.server",
        description="Simulated vLLM engine: vLLM's OpenAI-compatible API with a modelled GPU.",
    )
    p.add_argument("--model", required=True,
                   help="model name, or a directory with tokenizer.json [+ tokenizer_config.json]")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names the API accepts; the first is reported (default: --model)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=_int_in(0, 65535), default=8000, help="0 picks a free port")
    p.add_argument("--block-size", type=_int_in(1), default=16, help="tokens per KV block")
    p.add_argument("--num-gpu-blocks", type=_int_in(1), default=4096, help="KV blocks in the cache")
    p.add_argument("--max-num-seqs", type=_int_in(1), default=256, help="max running sequences")
    p.add_argument("--max-num-batched-tokens", type=_int_in(1), default=8192,
                   help="uncached prompt tokens prefilled per step")
    p.add_argument("--max-model-len", type=_int_in(1), default=8192, help="prompt + output token limit")
    p.add_argument("--speedup", type=positive_float, default=1.0, help="simulated time is divided by this")
    p.add_argument("--seed", type=int, default=0, help="seed of the deterministic output")
    p.add_argument("--kv-events-config", type=parse_kv_events_config, default=None,
                   help="vLLM's KV-events config (JSON): enable_kv_cache_events, publisher (zmq), endpoint, "
                        "replay_endpoint, buffer_steps, topic")
    p.add_argument("--kv-transfer-config", type=parse_kv_transfer_config, default=None,
                   help="vLLM's KV-transfer config (JSON) for P/D: kv_connector (NixlConnector), kv_role "
                        "(kv_producer | kv_consumer | kv_both), engine_id, kv_connector_extra_config, "
                        "kv_load_failure_policy (recompute | fail)")
    p.add_argument("--kv-transfer-bandwidth", type=positive_float, default=DEFAULT_KV_TRANSFER_BANDWIDTH_GBPS,
                   help="GB/s of the simulated KV transfer between P and D")
    p.add_argument("--kv-bytes-per-token", type=_int_in(1), default=DEFAULT_KV_BYTES_PER_TOKEN,
                   help="KV bytes per token moved by a transfer (default: an 8B Llama in bf16)")
    p.add_argument("--kv-hold-timeout", type=positive_float, default=VLLM_KV_HOLD_TIMEOUT_S,
                   help="seconds a prefill holds a prompt's KV for its decode (VLLM_NIXL_ABORT_REQUEST_TIMEOUT)")
    p.add_argument("--kv-transfer-timeout", type=positive_float, default=VLLM_KV_TRANSFER_TIMEOUT_S,
                   help="seconds a decode waits for the prefill's KV before giving up")
    # -- a host KV tier (vLLM CPU offloading, SGLang HiCache, kvd behind a connector; cache.py) --
    p.add_argument("--kv-offload-blocks", type=_int_in(0), default=0,
                   help="blocks of a host-memory KV tier that keeps what the GPU cache evicts (published as KV "
                        "events with medium CPU; CPU_PINNED as SGLang); a prompt that goes on there after its GPU "
                        "hit loads those blocks instead of computing them. 0: no host tier")
    p.add_argument("--kv-offload-load-ms-per-block", type=non_negative_float, default=None,
                   help="milliseconds to load one block back from the host tier, divided by --speedup like all "
                        "modelled time (default: 5%% of prefilling a block's tokens)")
    return p


def parse_args(argv: Iterable[str] | None = None) -> argparse.Namespace:
    """Parse and validate flags; exits 2 with a message on unknown/invalid flags (like vLLM)."""
    parser = build_arg_parser()
    args = parser.parse_args(None if argv is None else list(argv))
    capacity = args.num_gpu_blocks * args.block_size
    if args.max_model_len > capacity:
        parser.error(
            f"--max-model-len ({args.max_model_len}) is larger than the maximum number of tokens that "
            f"can be stored in KV cache ({capacity} = --num-gpu-blocks x --block-size)")
    return args


# ========================================================================= engine


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
        if model is not None and model not in self.served_model_names:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", param="model")

    async def run_tokenizer(self, size_hint: int, fn: Callable[..., Any], *args: Any) -> Any:
        """Tokenize inline when small; in a thread when big, so one huge prompt can't stall streams."""
        if size_hint < OFFLOAD_TOKENIZE_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


class _LiveMetrics:
    """Base of the collectors that read live engine state at scrape time, labelled by model."""

    def __init__(self, engine: SimEngine) -> None:
        self._engine = engine

    def describe(self) -> list:
        return []  # don't let registration trigger a collect

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self._engine.model_name], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self._engine.model_name], value)
        return c


class _EngineMetrics(_LiveMetrics):
    """vLLM's metric names."""

    def collect(self):
        e = self._engine
        stats = e.scheduler.stats
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    e.scheduler.num_running)
        # Like vLLM, a decode waiting for remote KV is a waiting request.
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    e.scheduler.num_waiting + (e.disagg.num_in_flight if e.disagg is not None else 0))
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.cache.usage)
        yield self._counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.", e.cache.prefix_cache_queries)
        yield self._counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.", e.cache.prefix_cache_hits)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      stats.num_preemptions)
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.", stats.generation_tokens)
        by_source = CounterMetricFamily("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                        labels=["model_name", "source"])
        for source in PROMPT_TOKEN_SOURCES:
            by_source.add_metric([e.model_name, source], stats.prompt_tokens_by_source.get(source, 0))
        yield by_source
        yield self._counter("vllm:external_prefix_cache_queries",
                            "External prefix cache queries from KV connector cross-instance cache sharing, "
                            "in terms of number of queried tokens.", stats.external_prefix_cache_queries)
        yield self._counter("vllm:external_prefix_cache_hits",
                            "External prefix cache hits from KV connector cross-instance cache sharing, "
                            "in terms of number of cached tokens.", stats.external_prefix_cache_hits)
        if isinstance(e.disagg, NixlDisaggregation):
            yield self._counter("vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers.",
                                e.disagg.num_failed_transfers)
            # vLLM's is a histogram per transfer; its _sum and _count are what dashboards read.
            moved = HistogramMetricFamily("vllm:nixl_bytes_transferred", "Number of bytes transferred per NIXL "
                                          "KV Cache transfers.", labels=["model_name"])
            moved.add_metric([e.model_name], [("+Inf", e.disagg.num_transfers)], sum_value=e.disagg.bytes_transferred)
            yield moved
            yield self._counter("vllm:nixl_num_kv_expired_reqs",
                                "Number of requests that had their KV expire before a decode pulled it.",
                                e.disagg.holds.num_expired)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=["model_name", "finished_reason"])
        for reason in FINISH_REASONS:
            success.add_metric([e.model_name, reason], stats.request_success.get(reason, 0))
        yield success
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"])
        info.add_metric([str(e.cache.block_size), str(e.cache.num_blocks), "True"], 1)
        yield info


class _SglangMetrics(_LiveMetrics):
    """The same live state under SGLang's metric names (``--enable-metrics``), PD queues at 0."""

    def collect(self):
        e = self._engine
        stats = e.scheduler.stats
        queries = e.cache.prefix_cache_queries
        yield self._gauge("sglang:num_running_reqs", "The number of running requests.", e.scheduler.num_running)
        yield self._gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", e.scheduler.num_waiting)
        yield self._gauge("sglang:token_usage", "The token usage.", e.cache.usage)
        yield self._gauge("sglang:cache_hit_rate", "The prefix cache hit rate.",
                    e.cache.prefix_cache_hits / queries if queries else 0.0)
        pd = e.disagg if isinstance(e.disagg, SglangDisaggregation) else None
        # The simulated prefill never waits for a bootstrap handshake; its KV waits to be fetched.
        queues = {"sglang:num_prefill_bootstrap_queue_reqs": 0,
                  "sglang:num_prefill_inflight_queue_reqs": len(pd.holds) if pd else 0,
                  "sglang:num_decode_prealloc_queue_reqs": pd.num_waiting_for_kv if pd else 0,
                  "sglang:num_decode_transfer_queue_reqs": pd.num_transferring if pd else 0}
        for name, value in queues.items():
            yield self._gauge(name, "Requests in a PD queue.", value)
        yield self._counter("sglang:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
        # SGLang counts a request's prompt tokens found in its radix cache here (the KV self-check's
        # engine side, infera/server/engine_scrape.py)
        # SGLang counts HiCache host hits as cached (its radix tree spans both tiers)
        yield self._counter("sglang:cached_tokens", "Number of cached prompt tokens.",
                            e.cache.prefix_cache_hits + e.cache.host_loaded_tokens)
        yield self._counter("sglang:generation_tokens", "Number of generation tokens processed.", stats.generation_tokens)
        yield self._counter("sglang:num_requests", "Number of requests processed.", sum(stats.request_success.values()))


METRICS_FLAVORS: dict[str, Callable[[SimEngine], Any]] = {"vllm": _EngineMetrics, "sglang": _SglangMetrics}


# ==================================================================== stop strings


class StopStringMatcher:
    """Builds output text token by token, cutting at the first stop string (which is not returned).

    When streaming with stop strings, the last ``max(len(stop)) - 1`` characters are held back
    until they can no longer start a stop string -- vLLM's detokenizer does the same.
    """

    def __init__(self, stop: list[str], hold_back: bool) -> None:
        self.stop = stop
        self._max_stop_len = max((len(s) for s in stop), default=0)
        self._hold = max(self._max_stop_len - 1, 0) if hold_back else 0
        self.text = ""
        self._released = 0
        self.matched: str | None = None

    def add(self, piece: str) -> str:
        """Append a token's text; return the newly releasable text. Sets ``matched`` on a stop hit."""
        start = max(len(self.text) - self._max_stop_len + 1, 0)
        self.text += piece
        if self.stop:
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                idx, self.matched = min(hits)
                self.text = self.text[:idx]
                return self.flush()
        end = len(self.text) - self._hold
        if end <= self._released:
            return ""
        delta = self.text[self._released:end]
        self._released = end
        return delta

    def flush(self) -> str:
        delta = self.text[self._released:]
        self._released = len(self.text)
        return delta


# ======================================================================= handlers


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": SIM_VERSION})


async def _models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    data = [
        {
            "id": name,
            "object": "model",
            "created": engine.created,
            "owned_by": "vllm",
            "root": engine.model_path,
            "parent": None,
            "max_model_len": engine.max_model_len,
            "permission": [{
                "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": engine.created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False,
            }],
        }
        for name in engine.served_model_names
    ]
    return web.Response(body=_json_encode({"object": "list", "data": data}), content_type="application/json")


async def _metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.Response(body=generate_latest(engine.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _reset_prefix_cache(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not engine.cache.reset_prefix_cache():
        return ApiError(500, "Failed to reset prefix cache: blocks are in use.", "InternalServerError").response()
    if engine.kv_events is not None:
        engine.kv_events.flush()  # AllBlocksCleared now (vLLM sends it with the next step's batch)
    return web.Response(status=200)


async def _tokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    req = await _decode_body(request, TokenizeRequest)
    engine.check_model(req.model)
    tok = engine.tokenizer
    try:
        if req.messages is not None:
            tokens = await engine.run_tokenizer(request.content_length or 0, tok.encode_chat, req.messages)
        elif isinstance(req.prompt, str):
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            tokens = await engine.run_tokenizer(len(req.prompt), tok.encode, req.prompt, add_special)
        else:
            raise ApiError(400, "Either `prompt` (a string) or `messages` is required.")
    except ChatTemplateError as e:
        raise ApiError(400, str(e)) from None
    return web.Response(
        body=_json_encode({"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens,
                           "token_strs": None}),
        content_type="application/json")


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    req = await _decode_body(request, ChatCompletionRequest)
    engine.check_model(req.model)
    _check_sampling(req)
    try:
        prompt_ids = await engine.run_tokenizer(request.content_length or 0, engine.tokenizer.encode_chat,
                                                req.messages)
    except ChatTemplateError as e:
        raise ApiError(400, str(e)) from None
    # vLLM: max_completion_tokens wins over the deprecated max_tokens.
    requested, param = ((req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens is not None
                        else (req.max_tokens, "max_tokens"))
    max_tokens = _resolve_max_tokens(engine, len(prompt_ids), requested, param)
    return await _generate(request, engine, req, prompt_ids, max_tokens, chat=True,
                           request_id=f"chatcmpl-{_request_id(request)}")


async def _completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    req = await _decode_body(request, CompletionRequest)
    engine.check_model(req.model)
    _check_sampling(req)
    text, prompt_ids = _completion_prompt_ids(req.prompt)
    if prompt_ids is None:
        prompt_ids = await engine.run_tokenizer(len(text), engine.tokenizer.encode, text, True)
    if not prompt_ids:
        raise ApiError(400, "The decoder prompt cannot be empty")
    max_tokens = _resolve_max_tokens(engine, len(prompt_ids), req.max_tokens, "max_tokens")
    return await _generate(request, engine, req, prompt_ids, max_tokens, chat=False,
                           request_id=f"cmpl-{_request_id(request)}")


def _local_addr(request: web.Request) -> tuple[str, int] | None:
    """The (host, port) this request reached us at: a concrete address even on a wildcard bind."""
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    if isinstance(sockname, tuple) and len(sockname) >= 2:
        return sockname[0], sockname[1]
    return None


async def _generate(request: web.Request, engine: SimEngine, req: _SamplingRequest, prompt_ids: list[int],
                    max_tokens: int, *, chat: bool, request_id: str) -> web.StreamResponse:
    plan = LegPlan()
    if engine.disagg is not None:
        try:
            plan = await engine.disagg.admit(req, prompt_ids, request_id)
        except LegError as e:
            raise ApiError(e.status, e.message, e.err_type) from None
        if plan.max_tokens is not None:
            max_tokens = plan.max_tokens
    try:
        seq = engine.scheduler.submit(prompt_ids, max_tokens, ignore_eos=bool(req.ignore_eos), request_id=request_id,
                                      kv_hold=plan.kv_hold, kv_import=plan.kv_import)
    except ValueError as e:
        if engine.disagg is not None:
            engine.disagg.discard(plan)
        raise ApiError(400, str(e)) from None
    try:
        if req.stream:
            return await _stream_response(request, engine, req, seq, chat=chat, request_id=request_id)
        return await _full_response(engine, req, seq, chat=chat, request_id=request_id, plan=plan,
                                    local_addr=_local_addr(request))
    finally:
        # Normal end: no-op. Client gone (handler cancelled / write failed): free the slot now.
        engine.scheduler.abort(seq)


async def _full_response(engine: SimEngine, req: _SamplingRequest, seq: Sequence, *, chat: bool,
                         request_id: str, plan: LegPlan, local_addr: tuple[str, int] | None) -> web.Response:
    text = StopStringMatcher(_stop_strings(req.stop), hold_back=False)
    finish_reason: str | None = None
    async for token_id, finish_reason in seq.stream():
        if token_id is not None:
            text.add(engine.tokenizer.output_text(token_id))
            if text.matched is not None:
                engine.scheduler.finish(seq, FINISH_STOP)
                finish_reason = FINISH_STOP
                break
    created = int(time.time())
    kv_transfer_params = (engine.disagg.reply_kv_transfer_params(plan, local_addr)
                          if engine.disagg is not None else None)
    if chat:
        body = {
            "id": request_id, "object": "chat.completion", "created": created, "model": engine.model_name,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text.text, "refusal": None, "tool_calls": [],
                            "reasoning_content": None},
                "logprobs": None, "finish_reason": finish_reason, "stop_reason": text.matched,
                "token_ids": list(seq.output_token_ids) if req.return_token_ids else None,
            }],
            "usage": _usage(seq), "prompt_logprobs": None,
            "prompt_token_ids": list(seq.prompt_token_ids) if req.return_token_ids else None,
            "kv_transfer_params": kv_transfer_params,
        }
    else:
        body = {
            "id": request_id, "object": "text_completion", "created": created, "model": engine.model_name,
            "choices": [{
                "index": 0, "text": text.text, "logprobs": None, "finish_reason": finish_reason,
                "stop_reason": text.matched, "prompt_logprobs": None,
                "prompt_token_ids": list(seq.prompt_token_ids) if req.return_token_ids else None,
                "token_ids": list(seq.output_token_ids) if req.return_token_ids else None,
            }],
            "usage": _usage(seq), "kv_transfer_params": kv_transfer_params,
        }
    return web.Response(body=_json_encode(body), content_type="application/json")


async def _stream_response(request: web.Request, engine: SimEngine, req: _SamplingRequest, seq: Sequence, *,
                           chat: bool, request_id: str) -> web.StreamResponse:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous_usage = include_usage and bool(req.stream_options.continuous_usage_stats)
    created = int(time.time())
    model = engine.model_name
    obj = "chat.completion.chunk" if chat else "text_completion"
    text = StopStringMatcher(_stop_strings(req.stop), hold_back=True)

    def frame(choices: list[dict], usage: dict | None = None, extra: dict | None = None) -> bytes:
        chunk: dict[str, Any] = {"id": request_id, "object": obj, "created": created, "model": model,
                                 "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        if extra:
            chunk.update(extra)
        return b"data: " + _json_encode(chunk) + b"\n\n"

    # vLLM's return_token_ids placement: chat puts the prompt's ids on the role chunk (top level),
    # completions in the first chunk's choice; every content choice carries its tokens' ids.
    ids = bool(req.return_token_ids)
    first_choice = True

    def choice(delta: str, finish_reason: str | None, stop_reason: str | None, token_ids: list[int]) -> dict:
        nonlocal first_choice
        if chat:
            c: dict[str, Any] = {"index": 0, "delta": {"content": delta}, "logprobs": None,
                                 "finish_reason": finish_reason}
            if finish_reason is not None:
                c["stop_reason"] = stop_reason
        else:
            c = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason,
                 "stop_reason": stop_reason}
            if ids:
                c["prompt_token_ids"] = list(seq.prompt_token_ids) if first_choice else None
        if ids:
            c["token_ids"] = token_ids
        first_choice = False
        return c

    resp: web.StreamResponse | None = None
    try:
        async for token_id, finish_reason in seq.stream():
            delta = ""
            token_ids = [token_id] if token_id is not None else []
            if token_id is not None:
                delta = text.add(engine.tokenizer.output_text(token_id))
                if text.matched is not None:
                    engine.scheduler.finish(seq, FINISH_STOP)
                    finish_reason = FINISH_STOP
            if finish_reason is not None:
                delta += text.flush()
            if resp is None:
                # Like vLLM, headers and the role chunk go out with the first token.
                resp = web.StreamResponse(headers=SSE_HEADERS)
                await resp.prepare(request)
                if chat:
                    role = frame([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}],
                                 _usage(seq) if continuous_usage else None,
                                 {"prompt_token_ids": list(seq.prompt_token_ids), "prompt_text": None} if ids else None)
                    await resp.write(role)
            if delta or finish_reason is not None or (ids and token_ids):
                await resp.write(frame([choice(delta, finish_reason, text.matched, token_ids)],
                                       _usage(seq) if continuous_usage else None))
            if finish_reason is not None:
                break
        if include_usage:
            await resp.write(frame([], _usage(seq)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        log.debug("client of %s disconnected mid-stream", request_id)
    return resp


async def _start_profile(request: web.Request) -> web.Response:
    """vLLM's (and SGLang's) ``POST /start_profile``: recorded, answered 200 with no body."""
    raw = await request.read()
    options: dict[str, Any] = {}
    if raw.strip():
        try:
            msgspec.json.decode(raw, type=StartProfileRequest)
            options = msgspec.json.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise ApiError(400, f"Invalid profile request: {e}") from None
    request.app[ENGINE_KEY].profile_calls.append(("start", options))
    return web.Response(status=200)


async def _stop_profile(request: web.Request) -> web.Response:
    request.app[ENGINE_KEY].profile_calls.append(("stop", {}))
    return web.Response(status=200)


@web.middleware
async def _errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status in (404, 405):
            # Unknown route / wrong method: FastAPI's (hence vLLM's) body is {"detail": reason}.
            return web.Response(status=e.status, body=_json_encode({"detail": e.reason}),
                                content_type="application/json", headers={k: v for k, v in e.headers.items()
                                                                          if k == "Allow"})
        raise


def build_app(args: argparse.Namespace, engine: SimEngine | None = None) -> web.Application:
    """The aiohttp app; the scheduler starts on app startup and stops (aborting leftovers) on shutdown."""
    engine = engine if engine is not None else SimEngine(args)
    # vLLM accepts large prompts; aiohttp's 1 MiB default would reject long contexts.
    app = web.Application(middlewares=[_errors_middleware], client_max_size=64 * 1024 * 1024)
    app[ENGINE_KEY] = engine

    async def start_engine(_app: web.Application) -> None:
        if engine.kv_events is not None:
            await engine.kv_events.start()  # bound before the first request can store a block
        if engine.disagg is not None:
            await engine.disagg.start()
        engine.scheduler.start()

    async def stop_engine(_app: web.Application) -> None:
        # Ends in-flight generations (finish_reason "abort") so handlers return promptly.
        await engine.scheduler.stop()
        if engine.disagg is not None:
            await engine.disagg.stop()
        if engine.kv_events is not None:
            await engine.kv_events.stop()

    app.on_startup.append(start_engine)
    app.on_shutdown.append(stop_engine)
    app.router.add_get("/health", _health)
    app.router.add_get("/ping", _health)
    app.router.add_post("/ping", _health)
    app.router.add_get("/version", _version)
    app.router.add_get("/v1/models", _models)
    if engine.metrics_flavor is not None:
        app.router.add_get("/metrics", _metrics)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/reset_prefix_cache", _reset_prefix_cache)
    app.router.add_post("/start_profile", _start_profile)
    app.router.add_post("/stop_profile", _stop_profile)
    if engine.disagg is not None:
        engine.disagg.add_routes(app)
    tool_calls.install(app)  # a forced tool_choice is answered with a tool call, as engines do
    return app


# ======================================================================== hosting


class SimServer:
    """Host the app on ``args.host:args.port`` (port 0 picks a free one); ``url`` once started."""

    def __init__(self, args: argparse.Namespace, engine: SimEngine | None = None) -> None:
        self.args = args
        self.app = build_app(args, engine)
        self.engine = self.app[ENGINE_KEY]
        self.host: str = args.host
        self.port: int = args.port
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        # handler_cancellation: a client disconnect cancels its handler -> sequence aborted.
        runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = runner.addresses[0][1]

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> "SimServer":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def serve(args: argparse.Namespace) -> None:
    """Run until SIGTERM/SIGINT, then shut down gracefully."""
    server = SimServer(args)
    await server.start()
    log.info("sim engine for %s serving %s on %s:%d (speedup %g)", args.model, server.engine.model_name,
             args.host, server.port, args.speedup)
    try:
        await wait_for_shutdown_signal()
        log.info("shutting down")
    finally:
        await server.stop()


def run_until_signalled(main: Callable[[], Awaitable[None]]) -> int:
    """A simulated engine's process: serve until SIGTERM/SIGINT; 1 if it cannot bind."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    log.info("started server process [%d]", os.getpid())
    install_event_loop()
    try:
        asyncio.run(main())
    except OSError as exc:  # e.g. port in use
        log.error("cannot serve: %s", exc)
        return 1
    return 0


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    return run_until_signalled(lambda: serve(args))


if __name__ == "__main__":
    # Run as ``python -m infera.engine.sim.server`` (the launcher does) this file is ``__main__``, a
    # second copy beside the ``infera.engine.sim.server`` that other modules import (the stand-ins):
    # its classes would not be theirs. Serve from the one module everything else imports.
    from infera.engine.sim.server import main as _main

    sys.exit(_main())
