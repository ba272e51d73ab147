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
    "medium": "GPU", "lora_name": None, "extra_keys": [None per block], "group_idx": 0,
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
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Iterable, Sequence

import msgspec
import xxhash
import zmq
import zmq.asyncio

from infera.config import json_config
from infera.runtime import cancel_and_wait
from .cache import KVCache, hash_chunk

log = logging.getLogger("infera.engine.sim.kv_events")

FORMATS = ("vllm", "sglang", "atom")
MEDIUM = "GPU"
# The medium each engine names its host-memory tier by (see the module docstring).
HOST_MEDIUM = {"vllm": "CPU", "sglang": "CPU_PINNED", "atom": "CPU"}
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_U64 = (1 << 64) - 1


# ================================================================================ config


# SGLang 0.5.23's KVEventsConfig adds these two to vLLM's fields (and has no enable_kv_cache_events).
SGLANG_ONLY_FIELDS = frozenset({"bind", "format"})
SGLANG_EVENT_FORMATS = ("default", "dynamo")


@dataclass(frozen=True)
class KvEventsConfig:
    """vLLM 0.32's ``KVEventsConfig``; SGLang 0.5.23's has the same fields minus
    ``enable_kv_cache_events``, plus ``bind`` (true/false forces bind/connect, null infers it from
    the endpoint) and ``format`` ("dynamo" namespaces hashes by LoRA/salt, which the simulator
    never has, so both formats are the same bytes here)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10000
    hwm: int = 100000
    max_queue_size: int = 100000
    topic: str = ""
    bind: bool | None = None
    format: str = "default"

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_dict(cls, obj: dict[str, Any], *, sglang: bool = False) -> "KvEventsConfig":
        """Validate a parsed JSON config. vLLM: events need ``enable_kv_cache_events`` and the
        publisher defaults to "zmq" when enabled. SGLang: a "zmq" publisher alone enables them."""
        if not isinstance(obj, dict):
            raise ValueError("must be a JSON object")
        known = {f.name for f in fields(cls)} - (set() if sglang else SGLANG_ONLY_FIELDS)
        unknown = sorted(set(obj) - known)
        if unknown:
            raise ValueError(f"unknown field(s): {', '.join(unknown)}")
        kw = dict(obj)
        if sglang:
            kw.pop("enable_kv_cache_events", None)
            kw["enable_kv_cache_events"] = (kw.get("publisher") or "null") == "zmq"
        elif kw.get("publisher") is None:
            kw["publisher"] = "zmq" if kw.get("enable_kv_cache_events") else "null"
        cfg = cls(**kw)
        if not isinstance(cfg.enable_kv_cache_events, bool):
            raise ValueError("enable_kv_cache_events must be a boolean")
        if cfg.publisher not in ("null", "zmq"):
            raise ValueError(f"publisher must be 'zmq' or 'null', got {cfg.publisher!r}")
        if not isinstance(cfg.endpoint, str) or not cfg.endpoint:
            raise ValueError("endpoint must be a non-empty string")
        if cfg.replay_endpoint is not None and not isinstance(cfg.replay_endpoint, str):
            raise ValueError("replay_endpoint must be a string or null")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(cfg, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1")
        if not isinstance(cfg.topic, str):
            raise ValueError("topic must be a string")
        if cfg.bind is not None and not isinstance(cfg.bind, bool):
            raise ValueError("bind must be a boolean or null")
        if cfg.format not in SGLANG_EVENT_FORMATS:
            raise ValueError(f"format must be one of {', '.join(SGLANG_EVENT_FORMATS)}, got {cfg.format!r}")
        return cfg


# argparse ``type`` for the sim's ``--kv-events-config`` (vLLM schema).
parse_kv_events_config = json_config(KvEventsConfig.from_dict)


def binds(endpoint: str, fmt: str = "vllm", bind: bool | None = None) -> bool:
    """The engine's rule for the PUB socket: wildcard, IPv6-any, ipc:// and inproc:// endpoints are
    bound, others connected; SGLang 0.5.23 also binds ``0.0.0.0`` and lets ``bind`` decide
    outright. ``tcp://*:0;<ip>:<port>`` (libzmq's source;address form) passes the rule and binds
    ``<ip>:<port>`` only: the launchers inject that to keep events off other interfaces."""
    if fmt == "atom":
        return True  # ATOM's ZmqEventPublisher always binds
    if fmt == "sglang":
        if bind is not None:
            return bind
        if "0.0.0.0" in endpoint:
            return True
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


# ================================================================================ wire structs


class VllmBlockStored(msgspec.Struct, tag_field="type", tag="BlockStored"):
    # vLLM 0.32 BlockStored: lora_id, medium and lora_name have no default (always written); the
    # rest is what it writes for a full-attention model's only KV-cache group.
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str
    lora_name: str | None
    extra_keys: list[None]
    group_idx: int
    kv_cache_spec_kind: str


class VllmBlockRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str
    group_idx: int


class VllmAllBlocksCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class SglangBlockStored(msgspec.Struct, tag_field="type", tag="BlockStored"):
    # SGLang 0.5.23 BlockStored (omit_defaults): lora_id has no default (written as None); medium
    # is set; cache_salt, session_id and lora_name are None for plain requests, so omitted.
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str


class SglangBlockRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str


class SglangAllBlocksCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared"):
    pass


class AtomBlockStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    # ATOM v0.1.5 BlockStored: array_like, so its defaulted fields are written too
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM
    lora_name: str | None = None
    extra_keys: list | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class AtomBlockRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = MEDIUM
    group_idx: int | None = None


class AtomAllBlocksCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    medium: str | None = None  # None: every medium


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int  # SGLang calls it attn_dp_rank; the same third slot


VLLM_GROUP_IDX = 0
VLLM_SPEC_KIND = "full_attention"
_encode = msgspec.msgpack.Encoder().encode


def _signed64(h: int) -> int:
    """SGLang publishes block hashes as signed 64-bit integers."""
    return h - (1 << 64) if h >= (1 << 63) else h


def _vllm_events(events: Iterable["SimEvent"]) -> list[Any]:
    out: list[Any] = []
    for ev in events:
        if isinstance(ev, StoredEvent):
            out.append(VllmBlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, None,
                                       ev.medium, None, [None] * len(ev.block_hashes), VLLM_GROUP_IDX, VLLM_SPEC_KIND))
        elif isinstance(ev, RemovedEvent):
            out.append(VllmBlockRemoved(ev.block_hashes, ev.medium, VLLM_GROUP_IDX))
        elif isinstance(ev, ClearedEvent):
            out.append(VllmAllBlocksCleared())
        else:
            raise TypeError(f"not a KV event: {ev!r}")
    return out


def _sglang_events(events: Iterable["SimEvent"]) -> list[Any]:
    out: list[Any] = []
    for ev in events:
        if isinstance(ev, StoredEvent):
            parent = None if ev.parent_block_hash is None else _signed64(ev.parent_block_hash)
            out.append(SglangBlockStored([_signed64(h) for h in ev.block_hashes], parent, ev.token_ids,
                                         ev.block_size, None, ev.medium))
        elif isinstance(ev, RemovedEvent):
            out.append(SglangBlockRemoved([_signed64(h) for h in ev.block_hashes], ev.medium))
        elif isinstance(ev, ClearedEvent):
            out.append(SglangAllBlocksCleared())
        else:
            raise TypeError(f"not a KV event: {ev!r}")
    return out


def _atom_events(events: Iterable["SimEvent"]) -> list[Any]:
    out: list[Any] = []
    for ev in events:
        if isinstance(ev, StoredEvent):
            out.append(AtomBlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size,
                                       medium=ev.medium))
        elif isinstance(ev, RemovedEvent):
            out.append(AtomBlockRemoved(ev.block_hashes, ev.medium))
        elif isinstance(ev, ClearedEvent):
            out.append(AtomAllBlocksCleared())
        else:
            raise TypeError(f"not a KV event: {ev!r}")
    return out


_FORMATS = {"vllm": _vllm_events, "sglang": _sglang_events, "atom": _atom_events}


@dataclass
class StoredEvent:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    last_cache_hash: int = 0  # the cache-side hash of the last block (to coalesce a chain)
    medium: str = MEDIUM


@dataclass
class RemovedEvent:
    block_hashes: list[int]
    medium: str = MEDIUM


@dataclass
class ClearedEvent:
    pass


SimEvent = StoredEvent | RemovedEvent | ClearedEvent


def encode_batch(events: Iterable[SimEvent], fmt: str = "vllm", *, ts: float | None = None,
                 dp_rank: int = 0) -> bytes:
    """msgpack ``[ts, [events], dp_rank]`` with vLLM 0.32 / SGLang 0.5.23 events (tagged maps) or
    ATOM v0.1.5 ones (tagged arrays)."""
    try:
        to_wire = _FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown KV-event format {fmt!r} (choose from {', '.join(FORMATS)})") from None
    return _encode(EventBatch(time.time() if ts is None else ts, to_wire(events), dp_rank))


# ================================================================================ engine hashes


def engine_root_hash(seed: int) -> int:
    """The simulated engine's parent of the first block (vLLM's ``NONE_HASH`` analogue)."""
    return xxhash.xxh3_64_intdigest(f"sim-{seed}".encode())


class EngineHashes:
    """Maps the cache's block hashes (router hash space) to the engine's announced hashes.

    ``engine(block) = hash_chunk(engine(parent), tokens)`` with ``engine_root_hash(seed)`` as the
    parent of the first block: the same chain, re-rooted. Entries live while the block is cached.
    """

    def __init__(self, seed: int) -> None:
        self.root = engine_root_hash(seed)
        self._map: dict[int, int] = {}
        self._host: dict[int, int] = {}  # the same, for blocks in the host tier

    def __len__(self) -> int:
        return len(self._map)

    def get(self, cache_hash: int) -> int | None:
        return self._map.get(cache_hash)

    def parent(self, cache_parent: int | None) -> int | None:
        """The engine hash to announce as parent (None for a first block)."""
        if cache_parent is None:
            return None
        h = self._map.get(cache_parent)
        if h is None:
            h = self._host.get(cache_parent)
        if h is None:
            # The parent's content lives on only in a private (never registered) copy, and its
            # registered twin was evicted: derive a stable stand-in so the chain stays unique.
            h = xxhash.xxh3_64_intdigest(self.root.to_bytes(8, "little") + cache_parent.to_bytes(8, "little"))
        return h

    def stored(self, cache_hashes: Sequence[int], cache_parent: int | None, token_ids: Sequence[int],
               block_size: int) -> tuple[list[int], int | None]:
        """Register newly cached blocks; returns (their engine hashes, engine parent)."""
        eng_parent = self.parent(cache_parent)
        prev = self.root if eng_parent is None else eng_parent
        out: list[int] = []
        for i, ch in enumerate(cache_hashes):
            prev = hash_chunk(prev, token_ids[i * block_size:(i + 1) * block_size])
            self._map[ch] = prev
            out.append(prev)
        return out, eng_parent

    def removed(self, cache_hash: int) -> int | None:
        return self._map.pop(cache_hash, None)

    def offloaded(self, cache_hash: int, cache_parent: int | None, token_ids: Sequence[int]) -> tuple[int, int | None]:
        """A block copied to the host tier: (its engine hash, the same it had on the GPU; its engine
        parent)."""
        eng_parent = self.parent(cache_parent)
        eng = self._map.get(cache_hash)
        if eng is None:
            eng = hash_chunk(self.root if eng_parent is None else eng_parent, token_ids)
        self._host[cache_hash] = eng
        return eng, eng_parent

    def offload_evicted(self, cache_hash: int) -> int | None:
        return self._host.pop(cache_hash, None)

    def clear(self) -> None:
        self._map.clear()
        self._host.clear()


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
