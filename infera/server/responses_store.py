"""The router's store of Responses API conversations: per stored response, its (expanded) input
items and the response object, so a follow-up naming ``previous_response_id`` can be sent to any
worker as one self-contained request, and ``GET``/``DELETE /v1/responses/{id}`` are answered here.

``ResponsesStore`` keeps entries as encoded bytes in memory: bounded in bytes
(``--responses-store-max-bytes``; the least recently used go first past it, an entry bigger
than the bound is not kept, and 0 keeps none), each for ``--responses-store-ttl`` seconds from when it was stored.
Its methods are coroutines so that a store shared between replicas can take its place: over NATS KV
(``responses_store_nats.py``), or among the processes of a ``--workers N`` server without NATS,
``SiblingResponsesStore``: each stored response and each delete is sent to the siblings over the
replica-sync channel's side channel (best effort: a process started later has only what it stored
or heard since).
"""

from __future__ import annotations

import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_TTL_S = 3600.0
_ENTRY_OVERHEAD = 96  # bytes counted per entry on top of its id and value (the dict slot, the tuple)


class ResponsesStoreLike(Protocol):
    """What the Responses handlers use of a store (this module's, or the NATS-shared one)."""

    @property
    def max_bytes(self) -> int: ...

    async def put(self, response_id: str, value: bytes) -> bool: ...

    async def get(self, response_id: str) -> bytes | None: ...

    async def delete(self, response_id: str) -> bool: ...


def encode_entry(input_items: list[Any], response: dict[str, Any]) -> bytes:
    return msgspec.json.encode({"input": input_items, "response": response})


def decode_entry(value: bytes) -> tuple[list[Any], dict[str, Any]] | None:
    """(input items, response object), or None for a value that is not an entry."""
    try:
        doc = msgspec.json.decode(value)
    except (msgspec.DecodeError, RecursionError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("input"), list) or not isinstance(doc.get("response"), dict):
        return None
    return doc["input"], doc["response"]


class ResponsesStore:
    """Stored responses in memory: LRU bounded in bytes, each kept ``ttl_s`` seconds."""

    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes < 0 or ttl_s <= 0:
            raise ValueError("the responses store needs max_bytes >= 0 and ttl_s > 0")
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # id -> (expires at, value)
        self.bytes = 0
        self._next_sweep = clock() + ttl_s / 4

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _size(response_id: str, value: bytes) -> int:
        return len(response_id) + len(value) + _ENTRY_OVERHEAD

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= self._size(response_id, entry[1])
        return True

    def _sweep(self, now: float) -> None:
        """Expired entries out, whatever their place in the LRU order (at most every ttl/4)."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.ttl_s / 4
        for response_id in [k for k, (expires, _) in self._entries.items() if expires <= now]:
            self._drop(response_id)

    async def put(self, response_id: str, value: bytes) -> bool:
        """Keep ``value`` under ``response_id`` (False: bigger than the whole bound, not kept)."""
        return self.put_now(response_id, value)

    def put_now(self, response_id: str, value: bytes) -> bool:
        size = self._size(response_id, value)
        self._drop(response_id)
        if size > self.max_bytes:
            return False
        now = self._clock()
        self._sweep(now)
        while self.bytes + size > self.max_bytes and self._entries:
            self._drop(next(iter(self._entries)))  # the least recently used
        self._entries[response_id] = (now + self.ttl_s, value)
        self.bytes += size
        return True

    async def get(self, response_id: str) -> bytes | None:
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if entry[0] <= self._clock():
            self._drop(response_id)
            return None
        self._entries.move_to_end(response_id)
        return entry[1]

    async def delete(self, response_id: str) -> bool:
        """Forget ``response_id``; False if it was not (or no longer) stored."""
        return self.delete_now(response_id)

    def delete_now(self, response_id: str) -> bool:
        entry = self._entries.get(response_id)
        if entry is None:
            return False
        self._drop(response_id)
        return entry[0] > self._clock()


SIDE_CHANNEL = "responses"
MAX_SHARED_VALUE_BYTES = 8 * 1024 * 1024  # larger entries stay with the process that stored them
_ID_LEN = struct.Struct("<H")


def encode_side(op: bytes, response_id: str, value: bytes = b"") -> bytes:
    raw = response_id.encode("utf-8", "surrogateescape")
    return op + _ID_LEN.pack(len(raw)) + raw + value


def decode_side(data: bytes) -> tuple[bytes, str, bytes] | None:
    """(op, id, value) of a side-channel message, or None for garbage."""
    if len(data) < 3 or data[:1] not in (b"P", b"D"):
        return None
    (n,) = _ID_LEN.unpack_from(data, 1)
    if len(data) < 3 + n:
        return None
    return data[:1], data[3 : 3 + n].decode("utf-8", "surrogateescape"), data[3 + n :]


class SiblingResponsesStore:
    """``ResponsesStore``'s interface, each put and delete also sent to the sibling processes over
    ``sync`` (a ``ReplicaSync``: ``add_side_channel`` / ``publish_side``), whose messages it applies."""

    def __init__(self, local: ResponsesStore, sync: Any) -> None:
        self.local = local
        self.sync = sync
        self._subject = sync.add_side_channel(SIDE_CHANNEL, self._receive)

    @property
    def max_bytes(self) -> int:
        return self.local.max_bytes

    def _receive(self, data: bytes) -> None:
        message = decode_side(data)
        if message is None:
            return
        op, response_id, value = message
        if op == b"P":
            self.local.put_now(response_id, value)  # (our own: the same value again)
        else:
            self.local.delete_now(response_id)

    async def put(self, response_id: str, value: bytes) -> bool:
        kept = self.local.put_now(response_id, value)
        if kept and len(value) <= MAX_SHARED_VALUE_BYTES:
            await self.sync.publish_side(self._subject, encode_side(b"P", response_id, value))
        return kept

    async def get(self, response_id: str) -> bytes | None:
        return await self.local.get(response_id)

    async def delete(self, response_id: str) -> bool:
        existed = self.local.delete_now(response_id)
        await self.sync.publish_side(self._subject, encode_side(b"D", response_id))
        return existed
