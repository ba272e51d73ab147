"""``InferaKvdBackend``: kvd as SGLang's HiCache storage backend (L3 under the GPU and host tiers).

SGLang loads it through its ``dynamic`` backend (``--hicache-storage-backend dynamic`` with
``--hicache-storage-backend-extra-config {"module_path": "infera.engine.sglang.kvd_adapter",
"class_name": "InferaKvdBackend", ...}``; ``python -m infera.engine.sglang --infera-kvd-socket``
appends both). Checked against SGLang 0.5.23 (``sglang/srt/mem_cache/storage/backend_factory.py``,
``hicache_storage.py``, ``managers/cache_controller.py``,
``mem_cache/hybrid_cache/hybrid_cache_controller.py``):

* construction: ``InferaKvdBackend(storage_config, kwargs)``: a ``HiCacheStorageConfig`` and a
  dict; then ``register_mem_pool_host(host_pool)`` and ``on_host_pools_registered()``;
* without ``interface_v1`` in the extra config SGLang drives the generic page path on its cache
  threads: ``batch_exists(keys, extra_info) -> int`` (pages present from the start),
  ``batch_get(keys, target_locations) -> [page | None]`` (a target is a flat, contiguous CPU page
  from ``get_dummy_flat_data_page()``, filled in place and returned) and
  ``batch_set(keys, values) -> bool`` (values from ``get_data_page(i)``). ``clear()``,
  ``get_stats()`` and ``close()`` are called too.

Keys: SGLang's page keys are sha256 hex strings chaining the whole prefix (``get_hash_str``);
the kvd key is their 32 raw bytes (``bytes.fromhex``), so a router prewarm naming the same hex
hashes reaches the same entries. Any other string key is stored as its UTF-8 bytes (sha256 of
them past kvd's 64-byte limit). kvd namespaces keys by ``(model, compat_key)``: ``model`` is
SGLang's storage model name and the compat key names what makes one rank's page bytes readable by
another: ``sglang_<layout>_p<page size>_<dtype>_tp{r}of{T}_pp{p}of{P}`` (plus ``_cp``/``_dcp``/
``_dp`` parts when those are in use; an MLA model's KV is the same on every TP rank, so its TP part
is ``tp0of1``). Retention: ``INFERA_KVD_RETENTION_DEFAULT`` (``short`` unless set; ``none`` saves
nothing).

Failure policy: a daemon that does not answer at construction fails the engine's start-up
(configuration error). One that dies later turns every call into a miss (``get`` -> None,
``exists`` -> False, ``set`` -> False), logged once per outage, and is reconnected to at most every
``RECONNECT_EVERY_S`` (``infera.kvd.resilient``, shared with vLLM's connector); no exception
reaches SGLang's cache threads.

Host layouts: a flat page's byte order is the layout's (``get_data_page``/``set_from_flat_data_page``
in SGLang's ``pool_host/mha.py`` and ``mla.py``), so the layout is part of the compat key. The
generic path serves MHA ``layer_first``, ``page_first``, ``page_first_direct`` (direct I/O) and
``page_head``, and MLA ``layer_first``, ``page_first``, ``page_first_direct``: each round-trips
bit-identically under ``tests/integration/test_sglang_hicache_layouts.py``, which runs the wheel's
own layout methods. ``page_unified`` and Ascend's ``page_first_kv_split`` have no flat data page
(SGLang raises for them), so they never reach this backend's generic calls.

Not supported: hybrid models' sidecar pools (Mamba/SWA states, SGLang's ``*_v2`` calls): the
attach fails with a clear error rather than caching half a model's state.
"""
from __future__ import annotations

import hashlib
import logging
import os
import sys
from typing import Any, Callable, List, Optional, Sequence

from infera.engine.vllm.kvd_format import RETENTION_ENV, compat_key as rank_compat_key, default_retention
from infera.kvd.client import default_socket_path
from infera.kvd.protocol import MAX_KEY_BYTES
from infera.kvd.resilient import DAEMON_ERRORS, KvdUnavailable, ResilientKvdClient

log = logging.getLogger("infera.engine.sglang.kvd_adapter")

CALL_TIMEOUT_S = 30.0


def _hicache_storage_base() -> type:
    """SGLang's ``HiCacheStorage`` when SGLang is installed (its factory checks the subclass);
    ``object`` otherwise, so this module imports (and is tested) without SGLang."""
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    except Exception:  # not installed, or a build whose import needs a GPU runtime
        return object
    return HiCacheStorage


def kvd_key(page_key: str) -> bytes:
    """The kvd key of one SGLang page key (see the module docstring)."""
    if len(page_key) == 64:
        try:
            return bytes.fromhex(page_key)
        except ValueError:
            pass
    raw = page_key.encode("utf-8")
    return raw if 0 < len(raw) <= MAX_KEY_BYTES else hashlib.sha256(raw).digest()


def storage_compat_key(config: Any, layout: str = "", page_size: int = 0, dtype: str = "") -> str:
    """The compat key of one SGLang rank's pages from its ``HiCacheStorageConfig`` and host pool."""
    replicated = bool(getattr(config, "is_mla_model", False))
    tp_rank, tp_size = (0, 1) if replicated else (config.tp_rank, config.tp_size)
    parts = ["sglang"]
    if layout:
        parts.append(layout)
    if page_size:
        parts.append(f"p{page_size}")
    if dtype:
        parts.append(dtype)
    parts.append(rank_compat_key(tp_rank, tp_size, config.pp_rank, config.pp_size))
    cp_size = getattr(config, "attn_cp_size", 1) or 1
    if cp_size > 1:  # each context-parallel rank holds a disjoint slice of every page
        parts.append(f"cp{config.attn_cp_rank}of{cp_size}")
    dcp_size = getattr(config, "dcp_size", 1) or 1
    if dcp_size > 1:
        parts.append(f"dcp{config.dcp_rank}of{dcp_size}")
    return "_".join(parts)


def _torch_tensor_type() -> type | None:
    torch = sys.modules.get("torch")  # only SGLang brings torch; never imported here
    return getattr(torch, "Tensor", None)


def byte_view(obj: Any, *, writable: bool = False) -> memoryview:
    """A flat byte view of a page: a CPU torch tensor (viewed as uint8, no copy when contiguous) or
    any object with the buffer protocol. ``writable``: the view must alias ``obj`` (a GET target)."""
    tensor_type = _torch_tensor_type()
    if tensor_type is not None and isinstance(obj, tensor_type):
        torch = sys.modules["torch"]
        if obj.device.type != "cpu":
            raise ValueError(f"page on {obj.device}, not in host memory")
        if not obj.is_contiguous():
            if writable:
                raise ValueError("GET target is not contiguous")
            obj = obj.contiguous()
        return memoryview(obj.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")
    view = memoryview(obj)
    if writable and view.readonly:
        raise ValueError("GET target is read-only")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _dtype_name(dtype: Any) -> str:
    return str(dtype).rpartition(".")[2] if dtype is not None else ""


def _connect(socket_path: str, client_id: str) -> ResilientKvdClient:
    try:
        return ResilientKvdClient(socket_path, client_id, arena=True, timeout=CALL_TIMEOUT_S,
                                  outage="HiCache storage misses and drops writes", resumed="HiCache storage resumes")
    except DAEMON_ERRORS as e:
        raise RuntimeError(f"InferaKvdBackend: kvd at {socket_path} does not answer ({e or type(e).__name__}); "
                           f"start `python -m infera.kvd --socket {socket_path}` or set INFERA_KVD_SOCKET") from e


class InferaKvdBackend(_hicache_storage_base()):  # type: ignore[misc]
    """SGLang HiCache storage over the host's kvd daemon (socket: ``INFERA_KVD_SOCKET``, or
    ``socket`` in the extra config)."""

    def __init__(self, storage_config: Any, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.retention = default_retention()  # ValueError on a bad INFERA_KVD_RETENTION_DEFAULT: fails the attach
        self.model = getattr(storage_config, "model_name", None) or ""
        self.compat_key = storage_compat_key(storage_config)
        rank = f"tp{storage_config.tp_rank}pp{storage_config.pp_rank}"
        dp_rank = getattr(storage_config, "dp_rank", 0) or 0
        if dp_rank:
            rank += f"dp{dp_rank}"
        self.socket_path = str(extra.get("socket") or default_socket_path())
        self.daemon = _connect(self.socket_path, f"sglang-hicache-{rank}-{os.getpid()}")
        if self.retention == "none":
            log.warning("%s=none: InferaKvdBackend saves nothing (reads still hit what others saved)", RETENTION_ENV)
        log.info("InferaKvdBackend: kvd at %s, model %r, compat key %s, retention %s", self.socket_path, self.model,
                 self.compat_key, self.retention)

    # -- SGLang's set-up calls ---------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        # The page bytes depend on the host pool's layout, page size and dtype: part of the namespace.
        self.compat_key = storage_compat_key(self.storage_config, str(getattr(mem_pool_host, "layout", "") or ""),
                                             int(getattr(mem_pool_host, "page_size", 0) or 0),
                                             _dtype_name(getattr(mem_pool_host, "dtype", None)))
        log.info("InferaKvdBackend: compat key %s", self.compat_key)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if not hasattr(self, "registered_pools"):
            self.registered_pools = {}
        self.registered_pools[host_pool_name] = host_pool

    def on_host_pools_registered(self) -> None:
        extra = sorted(str(name) for name in getattr(self, "registered_pools", {}) if str(name) != "kv")
        if extra:
            raise RuntimeError(f"InferaKvdBackend stores the KV pool only; this model also has {', '.join(extra)} "
                               f"host pools (hybrid models are not supported): drop --infera-kvd-socket")

    # -- single pages ------------------------------------------------------------------------------

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> Any:
        """The page copied into ``target_location`` (returned), or None on a miss. Without a target
        the value comes back as bytes."""
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- batches: what SGLang's generic page path calls --------------------------------------------

    def batch_exists(self, keys: List[str], extra_info: Optional[Any] = None) -> int:
        """How many of ``keys`` are present from the start (SGLang loads a prefix)."""
        if not keys:
            return 0
        try:
            present = self.daemon.call(lambda c: c.exists([kvd_key(k) for k in keys], model=self.model,
                                                          compat_key=self.compat_key))
        except KvdUnavailable:
            return 0
        return next((i for i, hit in enumerate(present) if not hit), len(keys))

    def batch_get(self, keys: List[str], target_locations: Optional[Sequence[Any]] = None,
                  target_sizes: Optional[Any] = None) -> List[Any]:
        """Each page read into its target (returned) or None; after the first miss the rest are
        None unread (SGLang keeps only the leading run)."""
        out: List[Any] = [None] * len(keys)
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        try:
            for i, (key, target) in enumerate(zip(keys, targets)):
                page = self._read_page(kvd_key(key), target)
                if page is None:
                    break
                out[i] = page
        except KvdUnavailable:
            pass
        return out

    def _read_page(self, key: bytes, target: Any) -> Any:
        if target is None:
            return self.daemon.call(lambda c: c.get(key, model=self.model, compat_key=self.compat_key))
        try:
            view = byte_view(target, writable=True)
        except (TypeError, ValueError) as e:
            log.error("InferaKvdBackend: cannot read into %s: %s", type(target).__name__, e)
            return None
        try:
            n = self.daemon.call(lambda c: c.get_into(key, view, model=self.model, compat_key=self.compat_key))
        except ValueError:  # a stored value larger than the page: another layout, never loaded
            log.warning("InferaKvdBackend: kvd value of %s does not fit a %d-byte page; treated as a miss",
                        key.hex(), len(view))
            return None
        if n is None:
            return None
        if n != len(view):
            log.warning("InferaKvdBackend: kvd value of %s has %d bytes, a page %d; treated as a miss",
                        key.hex(), n, len(view))
            return None
        return target

    def batch_set(self, keys: List[str], values: Optional[Sequence[Any]] = None,
                  target_locations: Optional[Any] = None, target_sizes: Optional[Any] = None) -> bool:
        """True when every page was stored; stops at the first that was not (SGLang counts only
        the leading run as backed up)."""
        if self.retention == "none" or values is None:
            return False
        try:
            for key, value in zip(keys, values):
                view = byte_view(value)
                k = kvd_key(key)
                result = self.daemon.call(lambda c: c.put_zero_copy(k, view, retention=self.retention,
                                                                    model=self.model, compat_key=self.compat_key))
                if not result.accepted:
                    log.debug("InferaKvdBackend: kvd refused page %s: %s", key, result.reason)
                    return False
        except KvdUnavailable:
            return False
        except (TypeError, ValueError) as e:
            log.error("InferaKvdBackend: cannot store a page: %s", e)
            return False
        return len(keys) == len(values)

    # -- housekeeping ------------------------------------------------------------------------------

    def clear(self) -> bool:
        """Drop this rank's pages (SGLang's ``/clear_hicache_storage_backend``)."""
        try:
            n = self.daemon.call(lambda c: c.clear(model=self.model, compat_key=self.compat_key))
        except KvdUnavailable:
            return False
        log.info("InferaKvdBackend: cleared %d kvd entries of %s", n, self.compat_key)
        return True

    def get_stats(self) -> None:
        return None  # SGLang then records empty storage metrics; the daemon exports its own

    def close(self) -> None:
        self.daemon.close()
