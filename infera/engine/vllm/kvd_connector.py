"""``InferaKvdConnector``: vLLM's KV connector for the per-host kvd daemon (spec §8.6).

Load it with ``--kv-transfer-config '{"kv_connector":"InferaKvdConnector","kv_role":"kv_both",
"kv_connector_module_path":"infera.engine.vllm.kvd_connector","kv_load_failure_policy":"recompute"}'``
(``python -m infera.engine.vllm --kvd-socket PATH`` writes that, merged with the user's own), alone
or as a ``MultiConnector`` child. The daemon's socket comes from ``INFERA_KVD_SOCKET``.

* Scheduler side: for a request the engine has not fully cached, one ``exists`` round trip over
  the chunk keys after the local hit says how many tokens kvd can supply (a synchronous load:
  the worker loads them before the step's forward). It also plans which computed chunks to save.
* Worker side: loads copy each chunk straight from the daemon's shared arena (one copy, seqlock
  checked afterwards) into the paged KV tensors; a chunk that is gone, torn or malformed turns its
  blocks into "invalid blocks", which vLLM recomputes (``kv_load_failure_policy: recompute``);
  the worker tells the scheduler (worker metadata), which saves the recomputed chunks again.
  Saves gather the chunk's pages into one blob after the forward (the step's only cost) and a
  background thread writes it into an arena slot and commits it; the step never waits on the
  daemon, and a full save queue drops the save.
* An unreachable daemon at start fails the constructor (the engine does not start). One that dies
  later is logged once; until it answers again (retried every few seconds) lookups report 0 tokens
  and saves are dropped: recompute, never a wrong answer.

Supported (``kv_layouts``): one KV-cache group, dense or MLA, in any of vLLM's six stride orders, as
the CPU, FlashAttention, FlashInfer, Triton and ROCm backends pack it, bf16/fp16/fp32 or fp8 with
per-tensor scales. The layout's tag joins the compat key; the fp8 scales join the chunk header.
Anything else (packed or scale-carrying content, hybrid models) is refused at start, naming it.
On an accelerator the copies run on a side stream through pinned staging (``kv_staging``).
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from infera.engine.vllm import kv_layouts, kvd_format as fmt
from infera.engine.vllm.kv_pages import PagedLayer, gather_layer, payload_nbytes, payload_view, scatter_layer
from infera.engine.vllm.kv_staging import BufferPool, KvDevice, device_for
from infera.kvd import protocol as kvp
from infera.kvd.arena import SLOT_HEADER, SLOT_HEADER_BYTES
from infera.kvd.client import default_socket_path
from infera.kvd.resilient import KvdUnavailable, ResilientKvdClient

if TYPE_CHECKING:
    from infera.kvd.client import SyncKvdClient
    from vllm.config import VllmConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

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


# --- scheduler side -------------------------------------------------------------------------------

@dataclass
class _Lookup:
    start_page: int
    end_page: int
    chain: list[fmt.ChunkRef]


class _SchedulerSide:
    def __init__(self, settings: _Settings):
        self.s = settings
        self.compat_key = settings.compat_key(0, 0)
        self.daemon = _daemon(settings, f"vllm-{settings.model}-scheduler-{os.getpid()}", arena=False,
                              timeout=SCHEDULER_TIMEOUT_S)
        self.requests: dict[str, "Request"] = {}
        self.lookups: dict[str, _Lookup] = {}
        self.pending_loads: dict[str, _Lookup] = {}
        self.cursors: dict[str, fmt.SaveCursor] = {}

    def _exists(self, refs: list[fmt.ChunkRef]) -> list[bool] | None:
        keys = [r.key for r in refs]
        try:
            return self.daemon.call(lambda c: c.exists(keys, model=self.s.model, compat_key=self.compat_key))
        except KvdUnavailable:
            return None

    def matched_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        self.lookups.pop(request.request_id, None)
        if not self.s.usable or (request.kv_transfer_params or {}).get("do_remote_prefill"):
            return 0  # a P/D decode leg gets its KV from the prefill engine
        bs, n = self.s.block_size, self.s.pages_per_chunk
        loadable = (request.num_tokens - 1) // bs  # the last token is always computed (logits)
        start = num_computed_tokens // bs
        hashes = request.block_hashes
        if loadable <= start or len(hashes) <= start:
            return 0
        full, tails = fmt.lookup_candidates(hashes, start, n, self.s.group_id)
        present = self._exists(full + tails)
        if present is None:
            return 0
        chain, missed_at = fmt.matched_chain(full, present[:len(full)], tails, present[len(full):])
        if missed_at is not None:  # a full chunk is missing: a shorter tail may have been saved there
            more = fmt.tail_candidates(hashes, missed_at, min(n - 1, len(hashes) - missed_at), self.s.group_id)
            chain = fmt.extend_with_tail(chain, missed_at, more, (self._exists(more) or []) if more else [])
        end = min(chain[-1].end_page if chain else 0, loadable)
        if end <= start:
            return 0
        self.lookups[request.request_id] = _Lookup(start, end, chain)
        return (end - start) * bs

    def after_alloc(self, request: "Request", num_external_tokens: int) -> None:
        lookup = self.lookups.pop(request.request_id, None)
        if num_external_tokens > 0 and lookup is not None:
            lookup.end_page = lookup.start_page + num_external_tokens // self.s.block_size
            self.pending_loads[request.request_id] = lookup

    def build_meta(self, out: "SchedulerOutput", block_ids_of) -> KvdConnectorMetadata:
        meta = KvdConnectorMetadata()
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        bs, n = self.s.block_size, self.s.pages_per_chunk
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or not self.s.usable:
                continue
            blocks: list[int] | None = None
            lookup = self.pending_loads.pop(req_id, None)
            if lookup is not None:
                blocks = block_ids_of(req_id)
                meta.loads.append(RequestLoad(req_id, [
                    ChunkLoad(ref.key, ref.first_page, ref.num_pages, lo, hi, blocks[lo:hi])
                    for ref in lookup.chain
                    if (lo := max(ref.first_page, lookup.start_page)) < (hi := min(ref.end_page, lookup.end_page))]))
            before = computed.get(req_id, request.num_computed_tokens)
            cursor = self.cursors.get(req_id)
            if cursor is None:
                retention, problem = fmt.request_retention(request.kv_transfer_params, self.s.default_retention)
                if problem:
                    log.warning("request %s: %s", req_id, problem)
                cursor = self.cursors[req_id] = fmt.SaveCursor(retention, held_pages=before // bs)
            after = before + num_tokens
            refs = fmt.chunks_to_save(cursor, request.block_hashes, after // bs, after >= request.num_prompt_tokens,
                                      n, self.s.group_id)
            if refs:
                blocks = blocks if blocks is not None else block_ids_of(req_id)
                meta.saves.extend(ChunkSave(req_id, r.key, blocks[r.first_page:r.end_page], cursor.retention)
                                  for r in refs)
        for req_id in list(self.pending_loads):  # allocated but not scheduled: vLLM will ask again
            if req_id not in out.num_scheduled_tokens:
                del self.pending_loads[req_id]
        return meta

    def loads_failed(self, failed_from_page: dict[str, int]) -> None:
        """Chunks from these pages on were recomputed: save them again as they are recomputed."""
        for req_id, page in failed_from_page.items():
            cursor = self.cursors.get(req_id)
            if cursor is not None:
                cursor.held_pages = min(cursor.held_pages, page)
                cursor.next_page = min(cursor.next_page, page // self.s.pages_per_chunk * self.s.pages_per_chunk)
                cursor.tail_done = False

    def finished(self, req_id: str) -> None:
        for table in (self.requests, self.lookups, self.pending_loads, self.cursors):
            table.pop(req_id, None)

    def clear(self) -> bool:
        def clear_all(client: "SyncKvdClient") -> None:
            for tp in range(1 if self.s.collapse_tp else self.s.tp_size):
                for pp in range(self.s.pp_size):
                    client.clear(model=self.s.model, compat_key=self.s.compat_key(tp, pp))
        try:
            self.daemon.call(clear_all)
            return True
        except KvdUnavailable:
            return False


# --- worker side ----------------------------------------------------------------------------------

@dataclass
class _SaveJob:
    key: bytes
    blob: torch.Tensor  # uint8 host buffer (pinned on an accelerator): header + payload
    retention: str
    ready: Any = None  # device event: the payload's device-to-host copy is done
    release: Any = None  # hands the staging buffers back to their pools once written


class _Saver:
    """The background writer: a bounded (by bytes) queue and one thread with its own client."""

    def __init__(self, settings: _Settings, compat_key: str, client_id: str, max_bytes: int):
        self.s = settings
        self.compat_key = compat_key
        self.daemon = _daemon(settings, client_id, arena=True, timeout=WORKER_TIMEOUT_S)
        self.max_bytes = max_bytes
        self._jobs: deque[_SaveJob | None] = deque()
        self._bytes = 0
        self._busy = False
        self._cond = threading.Condition()
        self.saved = self.dropped = self.rejected = 0
        self.device: KvDevice | None = None  # set when the worker registers its caches
        self._thread = threading.Thread(target=self._run, name="infera-kvd-save", daemon=True)
        self._thread.start()

    def submit(self, job: _SaveJob) -> bool:
        size = job.blob.numel()
        with self._cond:
            if self._bytes + size > self.max_bytes:
                self.dropped += 1
                return False
            self._jobs.append(job)
            self._bytes += size
            self._cond.notify()
        return True

    def idle(self, timeout: float) -> bool:
        """Wait until every submitted save is written (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                job = self._jobs.popleft()
                if job is None:
                    return
                self._busy = True
            try:
                self._write(job)
            finally:
                if job.release is not None:
                    job.release()
                with self._cond:
                    self._bytes -= job.blob.numel()
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, job: _SaveJob) -> None:
        if job.ready is not None and self.device is not None:
            self.device.host_waits(job.ready)  # this thread, not the step, waits for the copy
        value = memoryview(job.blob.numpy())
        try:
            result = self.daemon.call(lambda c: c.put_zero_copy(job.key, value, retention=job.retention,
                                                                model=self.s.model, compat_key=self.compat_key))
        except KvdUnavailable:
            self.dropped += 1
            return
        if result.accepted:
            self.saved += 1
        else:
            self.rejected += 1
            log.debug("kvd refused chunk %s: %s", job.key.hex(), result.reason)

    def close(self) -> None:
        with self._cond:
            self._jobs.append(None)
            self._cond.notify()
        self._thread.join(10)
        self.daemon.close()


class _WorkerSide:
    def __init__(self, settings: _Settings, vllm_config: "VllmConfig"):
        self.s = settings
        self.vllm_config = vllm_config
        self.tp_rank, self.pp_rank = _worker_ranks(vllm_config)
        self.compat_key = settings.compat_key(self.tp_rank, self.pp_rank)
        self.cache_dtype = str(vllm_config.cache_config.cache_dtype or "auto")
        ident = f"vllm-{settings.model}-rank{self.tp_rank}"
        self.loader = _daemon(settings, f"{ident}-load", arena=True, timeout=WORKER_TIMEOUT_S)
        self.max_bytes = int(os.environ.get(SAVE_QUEUE_MIB_ENV, DEFAULT_SAVE_QUEUE_MIB)) << 20
        self.saver = _Saver(settings, self.compat_key, f"{ident}-save", self.max_bytes)
        self.layers: list[PagedLayer] = []
        self.geometry: kv_layouts.KvGeometry | None = settings.geometry
        self.device: KvDevice | None = None
        self.host_pool: BufferPool | None = None  # save blobs and load staging (pinned on an accelerator)
        self.device_pool: BufferPool | None = None  # device staging of saves and loads
        self.layer_ready: dict[str, Any] = {}  # layer -> event: this step's loads into it are written
        self._in_flight_loads: list[tuple[Any, Any]] = []  # (event, release) of loads still copying
        self.invalid: set[int] = set()
        self.failed_from_page: dict[str, int] = {}
        self._headers: dict[tuple[int, str], bytes] = {}
        self.loaded_chunks = self.loaded_tokens = self.failed_chunks = 0

    def register(self, kv_caches: dict[str, Any]) -> None:
        first = kv_caches[self.s.layer_names[0]]
        if self.geometry is None:  # hand-built settings (tests): vLLM's CPU layout
            if not isinstance(first, torch.Tensor) or first.dim() != 4 or first.shape[3] % 2:
                raise kv_layouts.UnsupportedKvLayout(f"InferaKvdConnector: layer {self.s.layer_names[0]} has KV "
                                                     f"shape {tuple(getattr(first, 'shape', ()))}")
            self.geometry = kv_layouts.KvGeometry(
                platform="cpu", packing="kv_rows", layout="LBHNC", heads=first.shape[1], content=first.shape[3],
                storage=str(first.dtype).removeprefix("torch."),
                dtype=kv_layouts.header_dtype(str(first.dtype).removeprefix("torch."), self.cache_dtype),
                quant="NONE", channels=2, hidden=first.shape[1] * first.shape[3] // 2, block_size=self.s.block_size)
        g = self.geometry
        num_blocks = self.s.num_blocks or first.shape[0] // max(1, g.block_size // first.shape[2])
        layers = []
        for name in self.s.layer_names:
            kv = kv_caches[name]
            if not isinstance(kv, torch.Tensor):
                raise kv_layouts.UnsupportedKvLayout(f"InferaKvdConnector: layer {name}'s KV is a "
                                                     f"{type(kv).__name__}, not one paged tensor")
            layers.append(PagedLayer(name, kv, g, num_blocks))
        if len({(l.page_shape, l.dtype, l.device) for l in layers}) != 1:
            raise kv_layouts.UnsupportedKvLayout("InferaKvdConnector: layers of one KV-cache group differ in shape, "
                                                 "dtype or device")
        self.layers = layers
        self.use_device(device_for(first))
        log.info("InferaKvdConnector: %d layers, layout %s, %s, compat key %s", len(layers), g.tag(),
                 type(self.device).__name__, self.compat_key)

    def use_device(self, device: KvDevice) -> None:
        """The copies' device and staging pools (``register`` picks the cache's own device)."""
        self.device = self.saver.device = device
        self.host_pool = BufferPool(device.host_empty, self.max_bytes)
        self.device_pool = BufferPool(device.empty, self.max_bytes)

    # header / payload geometry
    def _dtype_name(self) -> str:
        """The header's dtype; fp8 adds a digest of the layers' scales: a chunk written under other
        scales fails the header check and is recomputed."""
        assert self.geometry is not None
        name = self.geometry.dtype
        if not name.startswith("fp8"):
            return name
        ctx = getattr(getattr(self.vllm_config, "compilation_config", None), "static_forward_context", None) or {}
        scales = [(getattr(ctx.get(n), "_k_scale_float", 1.0), getattr(ctx.get(n), "_v_scale_float", 1.0))
                  for n in self.s.layer_names]
        return f"{name}/s{hashlib.sha256(repr(scales).encode()).hexdigest()[:12]}"

    def _header(self, pages: int, dtype_name: str) -> fmt.ChunkHeader:
        g = self.geometry
        assert g is not None
        return fmt.ChunkHeader(v=fmt.BLOB_VERSION, chunk_tokens=pages * self.s.block_size,
                               block_size=self.s.block_size, num_layers=len(self.layers),
                               layer_names=list(self.s.layer_names), hidden_dim=g.hidden,
                               dtype=dtype_name, cache_group_id=self.s.group_id,
                               num_kv_channels=g.channels, payload_byte_offset=0)

    def _prefix(self, pages: int, dtype_name: str) -> bytes:
        prefix = self._headers.get((pages, dtype_name))
        if prefix is None:
            prefix = self._headers[(pages, dtype_name)] = fmt.encode_header(self._header(pages, dtype_name))
        return prefix

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long).to(self.layers[0].device, non_blocking=True)

    # --- saving ---
    def save(self, saves: list[ChunkSave]) -> None:
        if not self.layers:
            return
        assert self.device is not None and self.host_pool is not None and self.device_pool is not None
        dtype_name = self._dtype_name()
        for job in saves:
            pages = len(job.block_ids)
            prefix = self._prefix(pages, dtype_name)
            size = payload_nbytes(self.layers, pages)
            host = self.host_pool.take(len(prefix) + size)
            if host is None:
                self.saver.dropped += 1  # the staging budget is spent by saves not yet written
                continue
            host[:len(prefix)] = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
            host_pool, device_pool = self.host_pool, self.device_pool
            if self.device.direct:
                payload = payload_view(host, len(prefix), self.layers, pages)  # (C, L, P, R, N, H, D)
                ids = self._ids(job.block_ids)
                for i, layer in enumerate(self.layers):
                    gather_layer(layer, ids, payload[:, i])
                ready, release = None, (lambda h=host: host_pool.give(h))
            else:
                staging = device_pool.take(size)
                if staging is None:
                    host_pool.give(host)
                    self.saver.dropped += 1
                    continue
                with self.device.side():
                    self.device.after_compute()  # the step's KV writes come first
                    ids = self._ids(job.block_ids)
                    payload = payload_view(staging, 0, self.layers, pages)
                    for i, layer in enumerate(self.layers):
                        gather_layer(layer, ids, payload[:, i])
                    gathered = self.device.record()
                    host[len(prefix):].copy_(staging, non_blocking=True)
                    ready = self.device.record()
                self.device.compute_waits(gathered)  # a later step may reuse these blocks: after the gather
                release = (lambda h=host, d=staging: (host_pool.give(h), device_pool.give(d)))
            if not self.saver.submit(_SaveJob(job.key, host, job.retention, ready, release)):
                if ready is not None:
                    self.device.host_waits(ready)  # rare: a full queue; the buffers must be idle to reuse
                release()

    # --- loading ---
    def load(self, loads: list[RequestLoad]) -> None:
        self._finish_loads()
        self.layer_ready.clear()
        dtype_name = self._dtype_name() if self.layers else ""
        for req in loads:
            for i, chunk in enumerate(req.chunks):
                problem = self._load_chunk(chunk, dtype_name) if self.layers else "connector has no KV layers"
                if problem is None:
                    self.loaded_chunks += 1
                    self.loaded_tokens += (chunk.write_to - chunk.write_from) * self.s.block_size
                    continue
                self.failed_chunks += 1
                failed = [b for c in req.chunks[i:] for b in c.block_ids]
                self.invalid.update(failed)
                self.failed_from_page[req.req_id] = chunk.first_page
                log.warning("kvd: chunk %s of request %s not loaded (%s): vLLM recomputes its %d blocks",
                            chunk.key.hex(), req.req_id, problem, len(failed))
                break

    def wait_for_layer(self, layer_name: str) -> None:
        event = self.layer_ready.pop(layer_name, None)
        if event is not None and self.device is not None:
            self.device.compute_waits(event)

    def _finish_loads(self) -> None:
        """Every load's copies are done (the previous step's forward waited on them): staging back."""
        for name, event in self.layer_ready.items():  # layers the forward never asked for
            self.device.compute_waits(event)
        for event, release in self._in_flight_loads:
            self.device.host_waits(event)
            release()
        self._in_flight_loads.clear()

    def _load_chunk(self, chunk: ChunkLoad, dtype_name: str) -> str | None:
        """None when the chunk's pages were written (or queued to be, on an accelerator); else why not."""
        get = kvp.Get(key=chunk.key, model=self.s.model, compat_key=self.compat_key)
        try:
            resp = self.loader.call(lambda c: c.request(get))
        except KvdUnavailable:
            return "kvd unreachable"
        client = self.loader.client
        if isinstance(resp, kvp.GetSharedResponse) and client is not None and client.arena is not None:
            mm = client.arena.mm
            start = resp.slot_offset + SLOT_HEADER_BYTES
            if resp.slot_offset < 0 or start + resp.length > len(mm):
                return "arena answer out of range"
            if SLOT_HEADER.unpack_from(mm, resp.slot_offset)[0] != resp.version:
                return "arena slot rewritten"
            whole = memoryview(mm)
            try:
                buf = torch.frombuffer(whole, dtype=torch.uint8, count=resp.length, offset=start)
                if self.device is not None and not self.device.direct:
                    # Copy out of the arena into pinned memory first: the seqlock covers that copy,
                    # and the device reads the pinned copy asynchronously.
                    staged = self.host_pool.take(resp.length) if self.host_pool is not None else None
                    if staged is None:
                        return "load staging budget spent"
                    staged.copy_(buf)
                    del buf
                    if SLOT_HEADER.unpack_from(mm, resp.slot_offset)[0] != resp.version:
                        self.host_pool.give(staged)
                        return "arena slot rewritten during the copy"
                    return self._write_pages(staged, chunk, dtype_name, host_buffer=staged)
                problem = self._write_pages(buf, chunk, dtype_name)
                del buf
            finally:
                whole.release()
            # The seqlock: the copy is good only if nobody rewrote the slot meanwhile.
            if problem is None and SLOT_HEADER.unpack_from(mm, resp.slot_offset)[0] != resp.version:
                problem = "arena slot rewritten during the copy"
            return problem
        if isinstance(resp, kvp.GetResponse):
            if resp.value is None:
                return "evicted from kvd"
            with warnings.catch_warnings():  # read-only bytes: we only read from it
                warnings.simplefilter("ignore", UserWarning)
                buf = torch.frombuffer(resp.value, dtype=torch.uint8)
            if self.device is not None and not self.device.direct and self.host_pool is not None:
                staged = self.host_pool.take(len(buf))
                if staged is None:
                    return "load staging budget spent"
                staged.copy_(buf)
                return self._write_pages(staged, chunk, dtype_name, host_buffer=staged)
            return self._write_pages(buf, chunk, dtype_name)
        if isinstance(resp, kvp.Error):
            return f"kvd error {resp.code}: {resp.message}"
        return f"unexpected answer {type(resp).__name__}"

    def _write_pages(self, buf: torch.Tensor, chunk: ChunkLoad, dtype_name: str,
                     host_buffer: torch.Tensor | None = None) -> str | None:
        problem = self._check_header(buf, chunk, dtype_name)
        if problem is not None or host_buffer is None:
            if problem is None:  # direct: scatter from the bytes as they are
                payload = self._payload_of(buf, chunk)
                ids = self._ids(chunk.block_ids)
                a, b = chunk.write_from - chunk.first_page, chunk.write_to - chunk.first_page
                for i, layer in enumerate(self.layers):
                    scatter_layer(layer, ids, payload[:, i, a:b])
            elif host_buffer is not None:
                self.host_pool.give(host_buffer)
            return problem
        # staged: host-to-device per layer on the side stream, then the scatter; one event per layer
        host_payload = self._payload_of(buf, chunk)
        size = payload_nbytes(self.layers, chunk.num_pages)
        staging = self.device_pool.take(size)
        if staging is None:
            self.host_pool.give(host_buffer)
            return "load staging budget spent"
        device_payload = payload_view(staging, 0, self.layers, chunk.num_pages)
        a, b = chunk.write_from - chunk.first_page, chunk.write_to - chunk.first_page
        with self.device.side():
            self.device.after_compute()
            ids = self._ids(chunk.block_ids)
            for i, layer in enumerate(self.layers):
                device_payload[:, i].copy_(host_payload[:, i], non_blocking=True)
                scatter_layer(layer, ids, device_payload[:, i, a:b])
                self.layer_ready[layer.name] = self.device.record()
            done = self.device.record()
        host_pool, device_pool = self.host_pool, self.device_pool
        self._in_flight_loads.append((done, lambda: (host_pool.give(host_buffer), device_pool.give(staging))))
        return None

    def _check_header(self, buf: torch.Tensor, chunk: ChunkLoad, dtype_name: str) -> str | None:
        if len(buf) < 4:
            return "blob shorter than its header length"
        header_end = 4 + int.from_bytes(bytes(buf[:4].numpy()), "little")
        try:
            header = fmt.decode_header(bytes(buf[:min(len(buf), header_end)].numpy()))
        except ValueError as e:
            return str(e)
        expect = self._header(chunk.num_pages, dtype_name)
        expect.payload_byte_offset = header.payload_byte_offset
        if header != expect:
            return f"chunk header {header} does not match this engine's {expect}"
        if header.payload_byte_offset + payload_nbytes(self.layers, chunk.num_pages) > len(buf):
            return "chunk shorter than its header says"
        self._payload_offset = header.payload_byte_offset
        return None

    def _payload_of(self, buf: torch.Tensor, chunk: ChunkLoad) -> torch.Tensor:
        return payload_view(buf, self._payload_offset, self.layers, chunk.num_pages)

    def take_invalid(self) -> set[int]:
        out, self.invalid = self.invalid, set()
        return out

    def take_worker_meta(self) -> KvdWorkerMetadata | None:
        if not self.failed_from_page:
            return None
        out, self.failed_from_page = KvdWorkerMetadata(self.failed_from_page), {}
        return out

    def close(self) -> None:
        if self.device is not None:
            self._finish_loads()
        self.saver.idle(10)
        self.saver.close()
        self.loader.close()


# --- the connector --------------------------------------------------------------------------------

class InferaKvdConnector(KVConnectorBase_V1):
    """KV connector backed by kvd (see the module docstring)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._settings = _settings(vllm_config, kv_cache_config)
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(self._settings)
        else:
            self._worker = _WorkerSide(self._settings, vllm_config)
        log.info("InferaKvdConnector (%s): kvd %s, model %r, %d pages (%d tokens) per chunk, default retention %s",
                 role.name.lower(), self._settings.socket, self._settings.model, self._settings.pages_per_chunk,
                 self._settings.pages_per_chunk * self._settings.block_size, self._settings.default_retention)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss, never a wrong answer

    # --- worker side ---
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, KvdConnectorMetadata) and meta.loads:
            self._worker.load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # The CPU loads in start_load_kv; an accelerator's copies run on a side stream, and the
        # forward waits (on the device) for each layer's just before that layer's attention.
        if self._worker is not None:
            self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # saved after the forward, in wait_for_save, from the registered caches

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self._worker is not None and isinstance(meta, KvdConnectorMetadata) and meta.saves:
            self._worker.save(meta.saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_invalid() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.take_worker_meta() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.daemon.close()

    # --- scheduler side ---
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens), False

    def on_new_request(self, request: "Request") -> None:
        if self._scheduler is not None:
            self._scheduler.requests[request.request_id] = request

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.requests.setdefault(request.request_id, request)
        self._scheduler.after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._scheduler is not None
        manager = self._kv_cache_manager
        gid = self._settings.group_id

        def block_ids_of(req_id: str) -> list[int]:
            assert manager is not None, "vLLM did not bind the KV-cache manager"
            return list(manager.get_block_ids(req_id)[gid])

        return self._scheduler.build_meta(scheduler_output, block_ids_of)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        meta = connector_output.kv_connector_worker_meta
        if self._scheduler is not None and isinstance(meta, KvdWorkerMetadata):
            self._scheduler.loads_failed(meta.failed_from_page)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._scheduler.finished(request.request_id)
        return False, None  # saves copy their pages during the step: the blocks are free to go

    def reset_cache(self) -> bool | None:
        """``POST /reset_prefix_cache?reset_external=true``: drop this engine's chunks from kvd."""
        return self._scheduler.clear() if self._scheduler is not None else None


__all__ = ["InferaKvdConnector", "KvdConnectorMetadata", "KvdWorkerMetadata"]
