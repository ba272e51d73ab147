"""The kvd connector's shared pieces: the scheduler-to-worker metadata, the settings both sides
derive from vLLM's config (the KV-cache group, its layout and compat key), ranks and the daemon
connection. See ``kvd_connector`` for the whole."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
except ImportError:  # bench/gpu_kvd_check.py drives the worker side on GPU hosts without vLLM
    KVConnectorMetadata = KVConnectorWorkerMetadata = object  # type: ignore[misc,assignment]

from infera.engine.vllm import kv_layouts, kvd_format as fmt
from infera.kvd.client import default_socket_path
from infera.kvd.resilient import ResilientKvdClient

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# A child of "vllm": the engine process configures that logger's handlers and level.
log = logging.getLogger("vllm.infera.kvd_connector")

SAVE_QUEUE_MIB_ENV = "INFERA_KVD_SAVE_QUEUE_MIB"
DEFAULT_SAVE_QUEUE_MIB = 1024
SCHEDULER_TIMEOUT_S = 2.0  # the scheduler's exists() must not hang a step on a wedged daemon
WORKER_TIMEOUT_S = 30.0


# --- metadata (scheduler -> worker, pickled with the scheduler output) ----------------------------

@dataclass
class ChunkLoad:
    key: bytes
    first_page: int  # request page where the chunk starts
    num_pages: int  # pages the chunk holds
    write_from: int  # request pages [write_from, write_to) are written...
    write_to: int
    block_ids: list[int]  # ...into these blocks (one per written page)


@dataclass
class RequestLoad:
    req_id: str
    chunks: list[ChunkLoad]


@dataclass
class ChunkSave:
    req_id: str
    key: bytes
    block_ids: list[int]  # the chunk's pages, in order
    retention: str


@dataclass
class KvdConnectorMetadata(KVConnectorMetadata):
    loads: list[RequestLoad] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)


@dataclass
class KvdWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: per request, the first page of a chunk that failed to load. vLLM
    recomputes from there; the scheduler then saves those chunks again (replacing a bad one)."""

    failed_from_page: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = dict(self.failed_from_page)
        for req_id, page in getattr(other, "failed_from_page", {}).items():
            merged[req_id] = min(page, merged.get(req_id, page))
        return KvdWorkerMetadata(merged)


# --- shared settings ------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Settings:
    socket: str
    model: str
    block_size: int
    pages_per_chunk: int
    group_id: int
    layer_names: tuple[str, ...]
    usable: bool  # False: an unsupported KV layout; the connector loads and saves nothing
    tp_size: int
    pp_size: int
    collapse_tp: bool  # MLA: the latent KV is the same on every TP rank
    fingerprint: str | None
    default_retention: str
    # The group's page geometry (its tag joins the compat key); None only where a test builds the
    # settings by hand: the worker then takes vLLM's CPU layout from the tensors it is given.
    geometry: kv_layouts.KvGeometry | None = None
    num_blocks: int | None = None  # engine blocks (kv_cache_config.num_blocks); None: the tensors' first dim

    def compat_key(self, tp_rank: int, pp_rank: int) -> str:
        key = fmt.compat_key(0 if self.collapse_tp else tp_rank, self.tp_size, pp_rank, self.pp_size,
                             self.fingerprint)
        return key + kv_layouts.compat_suffix(self.geometry) if self.geometry is not None else key


def _platform() -> str:
    from vllm.platforms import current_platform
    if current_platform.is_cpu():
        return "cpu"
    return "rocm" if current_platform.is_rocm() else str(current_platform.device_type)


def _settings(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> _Settings:
    model_config = vllm_config.model_config
    served = model_config.served_model_name
    model = (served[0] if isinstance(served, (list, tuple)) else served) or model_config.model
    block_size = vllm_config.cache_config.block_size
    if kv_cache_config is None:
        raise kv_layouts.UnsupportedKvLayout("InferaKvdConnector: vLLM gave no KV-cache config")
    groups = list(kv_cache_config.kv_cache_groups)
    try:
        group_id = kv_layouts.select_group(groups, getattr(kv_cache_config, "transfer_group_ids", None))
        spec = groups[group_id].kv_cache_spec
        layout = (getattr(kv_cache_config, "kv_cache_layout", None)
                  or getattr(vllm_config.cache_config, "kv_cache_layout", None) or kv_layouts.DEFAULT_LAYOUT)
        geometry = kv_layouts.classify(kv_layouts.spec_facts(spec), layout=str(layout),
                                       cache_dtype=str(vllm_config.cache_config.cache_dtype or "auto"),
                                       platform=_platform())
        if geometry.block_size != block_size:
            raise kv_layouts.UnsupportedKvLayout(f"group block size {geometry.block_size} is not the engine's "
                                                 f"{block_size}")
    except kv_layouts.UnsupportedKvLayout as e:
        raise kv_layouts.UnsupportedKvLayout(f"InferaKvdConnector refuses this engine's KV cache: {e}") from None
    layer_names = tuple(groups[group_id].layer_names)
    bytes_per_token = spec.page_size_bytes * len(layer_names) // block_size
    chunk_tokens = fmt.resolve_chunk_tokens(os.environ.get(fmt.CHUNK_TOKENS_ENV), block_size, bytes_per_token,
                                            model_config.max_model_len,
                                            int(os.environ.get(fmt.CHUNK_TARGET_MIB_ENV,
                                                               fmt.DEFAULT_CHUNK_TARGET_MIB)))
    parallel = vllm_config.parallel_config
    return _Settings(socket=default_socket_path(), model=model, block_size=block_size,
                     pages_per_chunk=chunk_tokens // block_size, group_id=group_id, layer_names=layer_names,
                     usable=True, tp_size=parallel.tensor_parallel_size, pp_size=parallel.pipeline_parallel_size,
                     collapse_tp=bool(model_config.use_mla) and parallel.tensor_parallel_size > 1,
                     fingerprint=fmt.model_fingerprint(model_config.model),
                     default_retention=fmt.default_retention(), geometry=geometry,
                     num_blocks=getattr(kv_cache_config, "num_blocks", None))


def _worker_ranks(vllm_config: "VllmConfig") -> tuple[int, int]:
    """(tp rank, pp rank): the live distributed groups, else the config, else ``RANK``, else 0."""
    try:
        from vllm.distributed import parallel_state as ps
        if ps.model_parallel_is_initialized():
            return ps.get_tp_group().rank_in_group, ps.get_pp_group().rank_in_group
    except (ImportError, AssertionError, AttributeError):
        pass
    parallel = vllm_config.parallel_config
    rank = getattr(parallel, "rank", None)
    if rank is None:
        rank = int(os.environ.get("RANK", "0") or 0)
    tp = max(parallel.tensor_parallel_size, 1)
    return rank % tp, (rank // tp) % max(parallel.pipeline_parallel_size, 1)


def _daemon(settings: _Settings, client_id: str, *, arena: bool, timeout: float) -> ResilientKvdClient:
    # Fail fast: an unreachable daemon at start is a configuration error, so the engine stops.
    try:
        return ResilientKvdClient(settings.socket, client_id, arena=arena, timeout=timeout,
                                  outage="recomputing instead of loading and dropping saves",
                                  resumed="loading and saving resume")
    except OSError as e:
        raise OSError(e.errno, f"InferaKvdConnector: kvd at {settings.socket} does not answer ({e}); start "
                               f"`python -m infera.kvd --socket {settings.socket}` or set INFERA_KVD_SOCKET") from e
