"""KV-cache events for the simulated engine, on the wire exactly as vLLM (or SGLang) sends them.

The simulator's ``KVCache`` calls ``on_stored``/``on_removed``/``on_cleared`` when full blocks first
enter the cache, when a cached block is evicted and when the whole cache is reset. A
``KvEventPublisher`` attached to the cache collects those calls into events, and after every
scheduler step that produced any, publishes them as ONE batch on a ZMQ PUB socket:

* multipart ``[topic, seq (8-byte big-endian), payload]``; ``seq`` starts at 0, +1 per batch;
* payload: msgpack ``[ts, [events...], dp_rank]``; events are maps tagged ``"type"`` in both
  formats, field for field what each engine writes for a plain full-attention model (checked
  against the engines' own msgspec structs, see ``tests/fixtures/kv_events/README.md``):

  - vLLM 0.32 (``vllm/distributed/kv_events.py``): ``{"type": "BlockStored", "block_hashes": [...],
    "parent_block_hash": int|None, "token_ids": [...], "block_size": N, "lora_id": None,
    "medium": "GPU", "lora_name": None, "extra_keys": [None per block; a request's ``cache_salt`` as
    ``[salt]`` on its first block], "group_idx": 0,
    "kv_cache_spec_kind": "full_attention"}``, ``{"type": "BlockRemoved", "block_hashes": [...],
    "medium": "GPU", "group_idx": 0}``, ``{"type": "AllBlocksCleared"}``;
  - SGLang 0.5.23 (``sglang/srt/disaggregation/kv_events.py``): ``{"type": "BlockStored",
    "block_hashes": [...], "parent_block_hash": ..., "token_ids": [...], "block_size": N,
    "lora_id": None, "medium": "GPU"}``, ``{"type": "BlockRemoved", "block_hashes": [...],
    "medium": "GPU"}``, ``{"type": "AllBlocksCleared"}``, with block hashes as signed 64-bit
    integers (SGLang's ``hash_str_to_int64``). SGLang up to 0.5.19 sent tagged arrays instead;
    the simulator speaks the current release.
* ATOM v0.1.5 (``atom/distributed/kv_events.py``, format ``"atom"``) differs on the wire: events
  are tagged **arrays** with every field written (``["BlockStored", hashes, parent, token_ids,
  block_size, None, "GPU", None, None, None, None, None]``, ``["BlockRemoved", hashes, "GPU",
  None]``, ``["AllBlocksCleared", None]``), each message is ``[topic, payload]`` or just
  ``[payload]`` when the topic is empty (no sequence frame), the endpoint is always bound and
  there is no replay socket.
* Replay (``replay_endpoint``): a ROUTER socket. A DEALER sends ``[b"", start_seq (8-byte BE)]``
  and gets ``[b"", topic, seq, payload]`` for each buffered batch (the last ``buffer_steps``) with
  ``seq >= start_seq``, then the end marker ``[b"", b"", (-1 as 8-byte signed BE), b""]``
  (vLLM 0.32 and SGLang 0.5.23 alike).

Engine hashes are NOT the router's hashes. The cache chains XXH3 from parent 0 -- the router's own
hash space -- so announcing those would let a router "work" while trusting engine hashes. Events
instead carry the chain re-rooted at a seed-dependent parent (``xxh3_64(f"sim-{seed}")``), like
vLLM's ``NONE_HASH``: a router has to re-hash ``token_ids``. The cache's own prefix matching is
untouched; the publisher keeps the cache-hash -> engine-hash map of the blocks currently cached.

Host tier (``--kv-offload-blocks``): a block the GPU evicts into it is announced as a
``BlockStored`` with the host medium — vLLM 0.32's offloading connector says ``"CPU"``, SGLang
0.5.23's HiCache ``"CPU_PINNED"``, ATOM v0.1.5 ``"CPU"`` — ahead of the GPU's ``BlockRemoved``, with
the same engine hash; its eviction from the host is a ``BlockRemoved`` with that medium. A block
loaded back is stored on the GPU again (medium ``"GPU"``), its host copy staying.

Everything is ``zmq.asyncio``: a PUB send never blocks (it drops at the high-water mark, which a
subscriber sees as a gap and repairs by replay) and the replay server is a task on the loop.

This module owns the publisher (:class:`KvEventPublisher`: cache hooks, one batch per step, the
PUB and replay sockets); beside it are the configuration (``kv_events_config.py``), the events and
their wire encodings (``kv_events_wire.py``) and the engine's hashes (``kv_events_hashes.py``),
whose names are importable from here too.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any

import zmq
import zmq.asyncio

from infera.runtime import cancel_and_wait
from .cache import KVCache
# The parts' names stay importable from here, where the engine, the stand-ins, the benches and the
# tests find them.
from .kv_events_config import (SGLANG_EVENT_FORMATS, SGLANG_ONLY_FIELDS, KvEventsConfig, binds,
                               parse_kv_events_config)
from .kv_events_hashes import EngineHashes, engine_root_hash
from .kv_events_wire import (FORMATS, HOST_MEDIUM, MEDIUM, VLLM_GROUP_IDX, VLLM_SPEC_KIND, AtomAllBlocksCleared,
                             AtomBlockRemoved, AtomBlockStored, ClearedEvent, EventBatch, RemovedEvent,
                             SglangAllBlocksCleared, SglangBlockRemoved, SglangBlockStored, SimEvent, StoredEvent,
                             VllmAllBlocksCleared, VllmBlockRemoved, VllmBlockStored, encode_batch)

__all__ = ["END_SEQ", "FORMATS", "HOST_MEDIUM", "MEDIUM", "SGLANG_EVENT_FORMATS", "SGLANG_ONLY_FIELDS",
           "VLLM_GROUP_IDX", "VLLM_SPEC_KIND", "AtomAllBlocksCleared", "AtomBlockRemoved", "AtomBlockStored",
           "ClearedEvent", "EngineHashes", "EventBatch", "KvEventPublisher", "KvEventsConfig", "RemovedEvent",
           "SglangAllBlocksCleared", "SglangBlockRemoved", "SglangBlockStored", "SimEvent", "StoredEvent",
           "VllmAllBlocksCleared", "VllmBlockRemoved", "VllmBlockStored", "binds", "encode_batch",
           "engine_root_hash", "parse_kv_events_config"]

log = logging.getLogger("infera.engine.sim.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_U64 = (1 << 64) - 1


# ================================================================================ publisher


class KvEventPublisher:
    """Collects a ``KVCache``'s events and publishes one batch per scheduler step over ZMQ.

    ``attach(cache, scheduler)`` installs the cache hooks and makes every scheduler step end with
    ``flush()``. ``start()`` binds (or connects) the PUB socket and the replay ROUTER inside the
    running loop; ``stop()`` closes them. ``flush()`` works without ``start()`` too (the batch is
    numbered and buffered for replay; nothing is sent).
    """

    def __init__(self, config: KvEventsConfig, *, block_size: int, seed: int = 0, fmt: str = "vllm",
                 dp_rank: int = 0, context: zmq.asyncio.Context | None = None) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown KV-event format {fmt!r} (choose from {', '.join(FORMATS)})")
        self.config = config
        self.block_size = block_size
        self.fmt = fmt
        self.dp_rank = dp_rank
        self.topic = config.topic.encode()
        self.hashes = EngineHashes(seed)
        self.host_medium = HOST_MEDIUM[fmt]
        self.next_seq = 0
        self.batches_sent = 0
        self._pending: list[SimEvent] = []
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = context
        self._own_ctx = context is None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task | None = None
        self.endpoint: str | None = None  # as bound/connected (a wildcard port resolved)
        self.replay_endpoint: str | None = None

    # ------------------------------------------------------------------ cache hooks

    def attach(self, cache: KVCache, scheduler: Any = None) -> None:
        cache.on_stored = self.on_stored
        cache.on_removed = self.on_removed
        cache.on_cleared = self.on_cleared
        cache.on_offloaded = self.on_offloaded
        cache.on_offload_evicted = self.on_offload_evicted
        cache.on_stored_salted = self.on_stored_salted
        cache.on_offloaded_salted = self.on_offloaded_salted
        if scheduler is not None:
            step = scheduler._complete_step

            def complete_step_then_publish(scheduled: list) -> None:
                try:
                    step(scheduled)
                finally:
                    self.flush()  # everything this step produced (schedule + decode) is one batch

            scheduler._complete_step = complete_step_then_publish

    def on_stored(self, block_hashes: list[int], parent_hash: int | None, token_ids: list[int]) -> None:
        if not block_hashes:
            return
        eng, eng_parent = self.hashes.stored(block_hashes, parent_hash, token_ids, self.block_size)
        last = self._pending[-1] if self._pending else None
        if (isinstance(last, StoredEvent) and parent_hash is not None and last.last_cache_hash == parent_hash
                and last.medium == MEDIUM):
            # The next block of the chain the previous event ended with: one event, like vLLM.
            last.block_hashes.extend(eng)
            last.token_ids.extend(token_ids)
            last.last_cache_hash = block_hashes[-1]
            return
        self._pending.append(StoredEvent(eng, eng_parent, list(token_ids), self.block_size, block_hashes[-1]))

    def on_stored_salted(self, block_hashes: list[int], salt: str, token_ids: list[int]) -> None:
        """A salted prompt's first block: an event of its own, naming the salt (vLLM's extra keys)."""
        eng, _ = self.hashes.stored(block_hashes, None, token_ids, self.block_size, salt)
        self._pending.append(StoredEvent(eng, None, list(token_ids), self.block_size, block_hashes[-1], salt=salt))

    def on_offloaded_salted(self, block_hash: int, salt: str, token_ids: list[int]) -> None:
        eng, _ = self.hashes.offloaded(block_hash, None, token_ids, salt)
        self._pending.append(StoredEvent([eng], None, list(token_ids), self.block_size, block_hash,
                                         self.host_medium, salt=salt))

    def on_removed(self, block_hashes: list[int]) -> None:
        for ch in block_hashes:  # one event per evicted block, like vLLM
            eng = self.hashes.removed(ch)
            if eng is not None:
                self._pending.append(RemovedEvent([eng]))

    def on_offloaded(self, block_hash: int, parent_hash: int | None, token_ids: list[int]) -> None:
        eng, eng_parent = self.hashes.offloaded(block_hash, parent_hash, token_ids)
        self._pending.append(StoredEvent([eng], eng_parent, list(token_ids), self.block_size, block_hash,
                                         self.host_medium))

    def on_offload_evicted(self, block_hashes: list[int]) -> None:
        for ch in block_hashes:
            eng = self.hashes.offload_evicted(ch)
            if eng is not None:
                self._pending.append(RemovedEvent([eng], self.host_medium))

    def on_cleared(self) -> None:
        self.hashes.clear()
        self._pending.append(ClearedEvent())

    # ------------------------------------------------------------------ batches

    @property
    def pending(self) -> list[SimEvent]:
        return list(self._pending)

    def buffered(self) -> list[tuple[int, bytes]]:
        """The replay buffer: (seq, payload) of the last ``buffer_steps`` batches."""
        return list(self._buffer)

    def flush(self) -> int | None:
        """Publish what is pending as one batch; returns its seq (None when nothing was pending)."""
        if not self._pending:
            return None
        events, self._pending = self._pending, []
        payload = encode_batch(events, self.fmt, dp_rank=self.dp_rank)
        seq = self.next_seq
        self.next_seq += 1
        self._buffer.append((seq, payload))
        pub = self._pub
        if pub is not None and not pub.closed:
            if self.fmt == "atom":  # no sequence frame, and no topic frame for an empty topic
                frames = [self.topic, payload] if self.topic else [payload]
            else:
                frames = [self.topic, seq.to_bytes(8, "big"), payload]
            fut = pub.send_multipart(frames, copy=False)
            fut.add_done_callback(self._sent)
        return seq

    def _sent(self, fut: "asyncio.Future") -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            log.warning("KV-event batch not published: %s", exc)
        else:
            self.batches_sent += 1

    # ------------------------------------------------------------------ sockets

    async def start(self) -> None:
        if self._pub is not None:
            return
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        try:
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            self._pub = pub
            self.endpoint = _open(pub, self.config.endpoint,
                                  bind=binds(self.config.endpoint, self.fmt, self.config.bind))
            if self.config.replay_endpoint and self.fmt != "atom":  # ATOM has no replay socket
                rep = self._ctx.socket(zmq.ROUTER)
                rep.setsockopt(zmq.LINGER, 0)
                rep.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full pipe waits instead of dropping replies
                rep.setsockopt(zmq.SNDHWM, self.config.hwm)
                self._replay = rep
                self.replay_endpoint = _open(rep, self.config.replay_endpoint, bind=True)  # always bound, as vLLM does
                self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay(),
                                                                           name="sim-kv-replay")
        except zmq.ZMQError as exc:
            await self.stop()
            raise OSError(exc.errno, f"KV events: cannot open {self.config.endpoint!r} / "
                                     f"{self.config.replay_endpoint!r}: {exc}") from None
        log.info("publishing KV events (%s) on %s%s", self.fmt, self.endpoint,
                 f", replay on {self.replay_endpoint}" if self.replay_endpoint else "")

    async def stop(self) -> None:
        task, self._replay_task = self._replay_task, None
        await cancel_and_wait(task)
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._own_ctx and self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def _serve_replay(self) -> None:
        rep = self._replay
        assert rep is not None
        while True:
            frames = await rep.recv_multipart()
            # [identity, b"", start_seq] from a DEALER (tolerate a request without the delimiter).
            if len(frames) < 2 or len(frames[-1]) != 8:
                log.warning("ignoring malformed KV-event replay request (%d frames)", len(frames))
                continue
            envelope = frames[:-1]
            start = int.from_bytes(frames[-1], "big")
            try:
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        await rep.send_multipart([*envelope, self.topic, seq.to_bytes(8, "big"), payload],
                                                 copy=False)
                await rep.send_multipart([*envelope, b"", END_SEQ, b""])
            except zmq.ZMQError as exc:  # the requester went away (EHOSTUNREACH)
                log.info("KV-event replay from %d abandoned: %s", start, exc)


def _open(sock: zmq.asyncio.Socket, endpoint: str, bind: bool) -> str:
    if bind:
        sock.bind(endpoint)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.connect(endpoint)
    return endpoint
