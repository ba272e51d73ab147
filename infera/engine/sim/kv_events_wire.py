"""The simulated engine's KV events in the simulator's own terms (:class:`StoredEvent`,
:class:`RemovedEvent`, :class:`ClearedEvent`) and on the wire: the msgspec structs of vLLM 0.32,
SGLang 0.5.23 (tagged maps) and ATOM v0.1.5 (tagged arrays), field for field, and
:func:`encode_batch`, which turns one step's events into the msgpack ``[ts, [events], dp_rank]``
payload of the chosen format. Pure encoding: no sockets. ``kv_events.py`` describes the wire.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable

import msgspec

from .lora import first_block_keys, lora_name_of

FORMATS = ("vllm", "sglang", "atom")
MEDIUM = "GPU"
# The medium each engine names its host-memory tier by (see kv_events.py's docstring).
HOST_MEDIUM = {"vllm": "CPU", "sglang": "CPU_PINNED", "atom": "CPU"}


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
    extra_keys: list[list[str] | None]  # per block; a salted prompt's first block: [cache_salt]
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
            extra: list[list[str] | None] = [None] * len(ev.block_hashes)
            if ev.salt is not None and extra:
                # vLLM's to_event_extra_keys: a LoRA adapter's name, then the bare salt, on the first block
                extra[0] = first_block_keys(ev.salt)
            out.append(VllmBlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, None,
                                       ev.medium, lora_name_of(ev.salt), extra, VLLM_GROUP_IDX, VLLM_SPEC_KIND))
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
    salt: str | None = None  # the cache_salt of a salted prompt's first block (the first of block_hashes)


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
