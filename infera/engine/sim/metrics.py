"""The simulated engine's ``/metrics``: Prometheus collectors that read the engine's live state
(scheduler queues, KV cache, P/D transfers) at scrape time, labelled by model, under vLLM's metric
names (:class:`_EngineMetrics`) or SGLang's (:class:`_SglangMetrics`). ``METRICS_FLAVORS`` maps a
flavor name to its collector; :class:`~infera.engine.sim.engine.SimEngine` registers the one it was
asked for.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from .pd import NixlDisaggregation, SglangDisaggregation
from .scheduler import FINISH_REASONS, PROMPT_TOKEN_SOURCES

if TYPE_CHECKING:
    from .engine import SimEngine


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
