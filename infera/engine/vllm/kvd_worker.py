"""The kvd connector's worker side: registers the paged KV tensors (``kv_pages``), gathers saves
into blobs a background thread writes to kvd, and scatters loads from the shared arena, through
side-stream staging on an accelerator (``kv_staging``). See ``kvd_connector`` for the whole."""
from __future__ import annotations

import hashlib
import os
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from infera.engine.vllm import kv_layouts, kvd_format as fmt
from infera.engine.vllm.kv_pages import PagedLayer, gather_layer, payload_nbytes, payload_view, scatter_layer
from infera.engine.vllm.kv_staging import BufferPool, KvDevice, device_for
from infera.engine.vllm.kvd_meta import (DEFAULT_SAVE_QUEUE_MIB, SAVE_QUEUE_MIB_ENV, WORKER_TIMEOUT_S, ChunkLoad,
                                         ChunkSave, KvdWorkerMetadata, RequestLoad, _daemon, _Settings, _worker_ranks,
                                         log)
from infera.kvd import protocol as kvp
from infera.kvd.arena import SLOT_HEADER, SLOT_HEADER_BYTES
from infera.kvd.resilient import KvdUnavailable

if TYPE_CHECKING:
    from vllm.config import VllmConfig

DEVICE_STAGING_CHUNKS = 2  # device staging buffers, in chunks: a save's gather and a load's copy in flight


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
        # Device staging sits outside vLLM's KV budget: at most a few chunks of it.
        chunk = payload_nbytes(self.layers, self.s.pages_per_chunk) if self.layers else self.max_bytes
        self.device_pool = BufferPool(device.empty, min(self.max_bytes, DEVICE_STAGING_CHUNKS * chunk))

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
                for c in range(device_payload.shape[0]):  # contiguous pieces: a truly async copy from pinned
                    device_payload[c, i].copy_(host_payload[c, i], non_blocking=True)
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
