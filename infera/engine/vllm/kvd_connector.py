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

Modules: ``kvd_meta`` (metadata, settings), ``kvd_worker`` (the worker side), ``kv_layouts``,
``kv_pages``, ``kv_staging``, ``kvd_format`` (keys, plans, the blob header); this one holds the
scheduler side and the connector vLLM loads.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from infera.engine.vllm import kvd_format as fmt
# Re-exported: the metadata vLLM pickles and the pieces the tests drive.
from infera.engine.vllm.kvd_meta import (SCHEDULER_TIMEOUT_S, ChunkLoad, ChunkSave, KvdConnectorMetadata,  # noqa: F401
                                         KvdWorkerMetadata, RequestLoad, _daemon, _Settings, _settings, log)
from infera.engine.vllm.kvd_worker import _WorkerSide
from infera.kvd.resilient import KvdUnavailable

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
