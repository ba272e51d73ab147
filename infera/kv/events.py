"""Decoders for engine KV-cache event payloads (no engine imports; msgspec only).

One ZMQ message from an engine's PUB socket is ``[topic, seq, payload]`` (vLLM, SGLang),
``[topic, payload]`` or ``[payload]`` (ATOM: no sequence frame; no topic frame when its topic is
empty); the payload is always the **last** frame and is what these decoders take. Every payload is
a msgpack batch array ``[ts: float, events: [...], dp_rank?]``.

Events come in two encodings of the same three tagged types (checked against each engine's own
msgspec structs; versions and files in ``tests/fixtures/kv_events/README.md``):

* **map form** (vLLM >= 0.10, SGLang >= 0.5.22, the simulator): ``{"type": "BlockStored",
  "block_hashes": [...], "parent_block_hash": ..., "token_ids": [...], "block_size": n,
  "lora_id": ..., "medium": ..., ...}``, ``{"type": "BlockRemoved", "block_hashes": [...], ...}``,
  ``{"type": "AllBlocksCleared"}``;
* **array form** (msgspec ``array_like`` tagged structs; SGLang <= 0.5.19, ATOM, the first vLLM):
  ``["BlockStored", block_hashes, parent, token_ids, block_size, lora_id?, medium?, ...]``,
  ``["BlockRemoved", hashes, medium?, ...]``, ``["AllBlocksCleared", medium?]`` (ATOM scopes a
  clear to one medium). Items after ``medium`` differ between engines (SGLang 0.5.19's
  ``BlockStoredWithMetadata`` appends a metadata struct, ATOM a ``lora_name``...) and are
  ignored; array-form events carry no ``kv_cache_spec_kind`` (``spec_kind`` is None).

Default-valued keys may be omitted (map form; msgspec's ``omit_defaults``) and trailing items may
be missing (array form: msgspec itself writes every field of an ``array_like`` struct, but older
and hand-written publishers may not); unknown map keys and extra trailing array items are ignored. SGLang's EAGLE/MTP bigram tokens (``[t_i, t_i+1]`` pairs,
in either form) are flattened to their first element. ``medium`` (the tier: vLLM "GPU"/"CPU",
SGLang "GPU"/"CPU_PINNED"/..., ATOM "GPU"/"CPU"/"DISK"/"REMOTE") is kept as sent, None when the
engine left it out. Events whose type tag is unknown (a newer engine, ATOM's
``BlockTransferred``) are skipped; anything else that does not fit raises
:class:`KvEventDecodeError`.

The output is normalized: :class:`EventBatch` holding :class:`Stored`, :class:`Removed` and
:class:`Cleared` (always exactly these classes). Engine block hashes stay opaque hashable keys: an
``int`` (vLLM's default 64-bit ints, SGLang, ATOM) or ``bytes`` (vLLM full digests with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).

Fast path: the common map-form payload is decoded by one typed msgspec decoder straight into the
public structs (no per-event conversion). The other forms are tried only when that fails.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import msgspec

from infera.kv.hashing import ROUTER_SEED, chain_root, event_salt

__all__ = [
    "BlockHash", "Stored", "Removed", "Cleared", "KvEvent", "EventBatch", "KvEventDecodeError",
    "ENGINES", "decoder_for", "decode_map_form", "decode_array_form", "decode_sglang", "encode_batch",
]

BlockHash = Union[int, bytes]


class KvEventDecodeError(ValueError):
    """A KV-event payload that is not a valid event batch for the chosen engine schema."""


# --- public normalized types (also the map-form wire schema: decoded into directly) ------------

class Stored(msgspec.Struct, tag_field="type", tag="BlockStored", omit_defaults=True, gc=False):
    """Full blocks stored by the engine. ``token_ids`` are all tokens of those blocks, in order.
    ``extra_keys`` (vLLM, map form): per block, what else its hash folded in; the first block of a
    request with a ``cache_salt`` names the salt there (``infera.kv.hashing.event_salt``). Decoded
    only when that first entry is set (else None, with ``lora_name``: nothing else reads them), and
    never for SGLang or ATOM, whose caches the router treats as unsalted."""
    block_hashes: list[BlockHash]
    parent: Optional[BlockHash] = msgspec.field(name="parent_block_hash")
    token_ids: list[int]
    block_size: int
    spec_kind: Optional[str] = msgspec.field(default=None, name="kv_cache_spec_kind")
    medium: Optional[str] = None  # the tier the blocks entered; None: not said (GPU by convention)
    extra_keys: Optional[list[Any]] = None
    lora_name: Optional[str] = None

    def root(self) -> int:
        """The router-space parent of a first block (``parent`` None): ``ROUTER_SEED``, or the root
        of the salt its extra keys name (vLLM's cache isolation) under its LoRA adapter, if any."""
        keys = self.extra_keys
        if not keys or keys[0] is None:
            return ROUTER_SEED
        return chain_root(event_salt(keys, self.lora_name), self.lora_name)


class Removed(msgspec.Struct, tag_field="type", tag="BlockRemoved", omit_defaults=True, gc=False):
    """Blocks evicted by the engine (engine hashes)."""
    block_hashes: list[BlockHash]
    medium: Optional[str] = None  # the tier they left; None: not said


class Cleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", omit_defaults=True, gc=False):
    """The engine dropped its whole prefix cache (``medium`` set: only that tier's, as ATOM can say)."""
    medium: Optional[str] = None


KvEvent = Union[Stored, Removed, Cleared]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published batch: ``[ts, events, dp_rank?]``."""
    ts: float
    events: list[KvEvent]
    dp_rank: Optional[int] = None


# --- map form with bigram tokens (SGLang >= 0.5.22 under EAGLE/MTP; private) ------------------

class _StoredBigramM(msgspec.Struct, tag_field="type", tag="BlockStored", gc=False):
    block_hashes: list[BlockHash]
    parent: Optional[BlockHash] = msgspec.field(name="parent_block_hash")
    token_ids: list[Union[int, tuple[int, int]]]
    block_size: int
    spec_kind: Optional[str] = msgspec.field(default=None, name="kv_cache_spec_kind")
    medium: Optional[str] = None


class _BatchBigramM(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[_StoredBigramM, Removed, Cleared]]
    dp_rank: Optional[int] = None


# --- array-form wire schema (private; converted to the public types) --------------------------

class _StoredA(msgspec.Struct, tag="BlockStored", array_like=True, gc=False):
    # Positions 0-5 are common to SGLang, ATOM and array-form vLLM; anything after ``medium``
    # differs between them (SGLang 0.5.19's ``BlockStoredWithMetadata`` appends a struct, ATOM
    # ``lora_name``, ``extra_keys``...) and is ignored.
    block_hashes: list[BlockHash]
    parent: Optional[BlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Any = None
    medium: Optional[str] = None


class _StoredBigramA(_StoredA, tag="BlockStored"):
    token_ids: list[Union[int, tuple[int, int]]]  # type: ignore[assignment]


class _RemovedA(msgspec.Struct, tag="BlockRemoved", array_like=True, gc=False):
    block_hashes: list[BlockHash]
    medium: Optional[str] = None


class _ClearedA(msgspec.Struct, tag="AllBlocksCleared", array_like=True, gc=False):
    medium: Optional[str] = None  # ATOM's medium-scoped clear; SGLang and vLLM send none


class _BatchA(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[_StoredA, _RemovedA, _ClearedA]]
    dp_rank: Optional[int] = None


class _BatchBigramA(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[_StoredBigramA, _RemovedA, _ClearedA]]
    dp_rank: Optional[int] = None


class _BatchRaw(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    dp_rank: Optional[int] = None


_KNOWN_TAGS = frozenset(("BlockStored", "BlockRemoved", "AllBlocksCleared"))
_map_batch = msgspec.msgpack.Decoder(EventBatch).decode
_map_bigram_batch = msgspec.msgpack.Decoder(_BatchBigramM).decode
_array_batch = msgspec.msgpack.Decoder(_BatchA).decode
_bigram_batch = msgspec.msgpack.Decoder(_BatchBigramA).decode
_raw_batch = msgspec.msgpack.Decoder(_BatchRaw).decode
_map_event = msgspec.msgpack.Decoder(KvEvent).decode
_map_bigram_event = msgspec.msgpack.Decoder(Union[_StoredBigramM, Removed, Cleared]).decode
_array_event = msgspec.msgpack.Decoder(Union[_StoredA, _RemovedA, _ClearedA]).decode
_bigram_event = msgspec.msgpack.Decoder(Union[_StoredBigramA, _RemovedA, _ClearedA]).decode
_any = msgspec.msgpack.Decoder().decode
# RecursionError: msgspec refuses a value nested past Python's recursion limit with it (a
# payload of ``[[[[...]]]]`` from the wire, a few KiB deep), not with a DecodeError; it is a
# malformed payload like any other, never an exception that escapes the decoders.
_DecodeErrors = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)


def _flatten(tokens: list) -> list[int]:
    return [t if type(t) is int else t[0] for t in tokens]


def _from_array(ev: Any) -> KvEvent:
    if type(ev) is _RemovedA:
        return Removed(ev.block_hashes, ev.medium)
    if type(ev) is _ClearedA:
        return Cleared(ev.medium)
    if type(ev) in (Stored, Removed, Cleared):
        return ev
    if type(ev) is _StoredBigramM:
        return Stored(ev.block_hashes, ev.parent, _flatten(ev.token_ids), ev.block_size, ev.spec_kind, ev.medium)
    tokens = ev.token_ids if type(ev) is _StoredA else _flatten(ev.token_ids)
    return Stored(ev.block_hashes, ev.parent, tokens, ev.block_size, None, ev.medium)


def _unknown_tag(raw: msgspec.Raw) -> bool:
    """True for a well-formed event of a type this decoder does not know (skipped, not an error)."""
    try:
        obj = _any(raw)
    except _DecodeErrors:
        return False
    if isinstance(obj, dict):
        tag = obj.get("type")
    elif isinstance(obj, list) and obj:
        tag = obj[0]
    else:
        return False
    return isinstance(tag, str) and tag not in _KNOWN_TAGS


def _per_event(payload: bytes, forms: tuple[Callable[[Any], Any], ...]) -> EventBatch:
    """Slow path: decode event by event (mixed forms, unknown event types skipped)."""
    try:
        raw = _raw_batch(payload)
    except _DecodeErrors as exc:
        raise KvEventDecodeError(f"not a KV-event batch: {exc}") from None
    events: list[KvEvent] = []
    for i, item in enumerate(raw.events):
        why: Exception | None = None
        for form in forms:
            try:
                ev = form(item)
            except _DecodeErrors as exc:
                why = why or exc  # the engine's own form first: its error is the useful one
                continue
            events.append(_from_array(ev))
            break
        else:
            if not _unknown_tag(item):
                raise KvEventDecodeError(f"event {i}: {why}") from None
    return EventBatch(raw.ts, events, raw.dp_rank)


def _converted(decode: Callable[[bytes], Any], payload: bytes) -> EventBatch:
    b = decode(payload)
    return EventBatch(b.ts, [_from_array(e) for e in b.events], b.dp_rank)


def _first_keys_only(batch: EventBatch) -> EventBatch:
    """``extra_keys``/``lora_name`` kept only on a store whose first block has extra keys."""
    for ev in batch.events:
        if type(ev) is Stored and (ev.extra_keys is not None or ev.lora_name is not None):
            keys = ev.extra_keys
            if not keys or keys[0] is None:
                ev.extra_keys = ev.lora_name = None
    return batch


def _no_keys(batch: EventBatch) -> EventBatch:
    for ev in batch.events:
        if type(ev) is Stored and (ev.extra_keys is not None or ev.lora_name is not None):
            ev.extra_keys = ev.lora_name = None
    return batch


def decode_map_form(payload: bytes) -> EventBatch:
    """vLLM / simulator payload: map-form events first (array-form and bigram events also accepted)."""
    try:
        return _first_keys_only(_map_batch(payload))
    except _DecodeErrors:
        pass
    try:
        return _converted(_array_batch, payload)
    except _DecodeErrors:
        pass
    return _first_keys_only(_per_event(payload, (_map_event, _array_event, _map_bigram_event, _bigram_event)))


def decode_array_form(payload: bytes) -> EventBatch:
    """SGLang / ATOM payload, whichever form the release writes: SGLang <= 0.5.19 and ATOM send
    array-form events, SGLang >= 0.5.22 map-form ones; either may carry bigram token pairs
    (flattened)."""
    try:
        return _converted(_array_batch, payload)
    except _DecodeErrors:
        pass
    try:
        return _no_keys(_map_batch(payload))
    except _DecodeErrors:
        pass
    for decode in (_map_bigram_batch, _bigram_batch):
        try:
            return _converted(decode, payload)
        except _DecodeErrors:
            pass
    return _no_keys(_per_event(payload, (_array_event, _map_event, _map_bigram_event, _bigram_event)))


decode_sglang = decode_array_form

ENGINES: dict[str, Callable[[bytes], EventBatch]] = {
    "vllm": decode_map_form,
    "atom": decode_array_form,
    "sim": decode_map_form,
    "sglang": decode_array_form,
}


def decoder_for(engine: str) -> Callable[[bytes], EventBatch]:
    """The payload decoder for a registered engine name (``vllm``, ``atom``, ``sim``, ``sglang``)."""
    try:
        return ENGINES[engine]
    except KeyError:
        raise ValueError(f"no KV-event decoder for engine {engine!r} (known: {sorted(ENGINES)})") from None


_encoder = msgspec.msgpack.Encoder()


def encode_batch(batch: EventBatch) -> bytes:
    """Map-form payload of ``batch`` (vLLM wire layout; used by the simulator and tests)."""
    return _encoder.encode(batch)
