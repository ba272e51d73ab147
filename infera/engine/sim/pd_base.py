"""What every simulated P/D role shares: the table of prompt KV a prefill pins for its decode
(:class:`KvHoldTable`, each hold ending when taken or at its deadline), one request's leg
(:class:`LegPlan`, :class:`LegError`, the :class:`PdFields` a request carries), the
:class:`Disaggregation` base class (its HTTP client, counters and the decode side's modelled import
of blocks), and the small HTTP helpers the implementations (``pd_nixl.py``, ``pd_sglang.py``,
``atom_pd.py``) answer with. ``pd.py`` describes the protocols and builds the role from flags.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Protocol

import aiohttp
import msgspec
from aiohttp import web

from .cache import KVCache
from .pd_config import KvLink
from .scheduler import ImportedKv, Sequence

log = logging.getLogger("infera.engine.sim.pd")  # the name the P/D roles have always logged under

_json_encode = msgspec.json.Encoder().encode


# ============================================================================= holds


@dataclass(eq=False)
class HeldKv:
    """A finished prefill's prompt KV, pinned in the cache for one decode to take."""

    key: Hashable
    hold_id: object  # the cache owner of the pinned references
    token_ids: list[int]  # the prompt's full blocks' tokens: what the decode rebuilds
    block_ids: list[int]
    prompt_len: int
    num_cached_tokens: int  # the prefill's own prefix-cache hit
    deadline: float
    timer: asyncio.TimerHandle | None = None


class KvHoldTable:
    """Pinned KV by key; each hold ends when taken or at its deadline, whichever comes first."""

    def __init__(self, cache: KVCache, timeout_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.cache = cache
        self.timeout_s = timeout_s
        self._clock = clock
        self._holds: dict[Hashable, HeldKv] = {}
        self.num_expired = 0
        self.num_taken = 0

    def __len__(self) -> int:
        return len(self._holds)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._holds

    def pin(self, key: Hashable, seq: Sequence) -> HeldKv:
        """Pin ``seq``'s full prompt blocks (it must still hold them) under ``key``; an older hold
        under the same key is released first (a reused room or id must not leak blocks)."""
        self.drop(key)
        bs = self.cache.block_size
        num_blocks = seq.prompt_len // bs
        hold_id = ("kv-hold", key)
        block_ids = self.cache.hold_prefix_blocks(hold_id, seq.seq_id, num_blocks)
        held = HeldKv(key=key, hold_id=hold_id, token_ids=seq.prompt_token_ids[: len(block_ids) * bs],
                      block_ids=block_ids, prompt_len=seq.prompt_len,
                      num_cached_tokens=max(seq.num_cached_tokens, 0), deadline=self._clock() + self.timeout_s)
        try:
            held.timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expire, held)
        except RuntimeError:  # no loop (pure use): expiry is still enforced by take()
            pass
        self._holds[key] = held
        return held

    def take(self, key: Hashable) -> HeldKv | None:
        """Release and return the hold (the caller has "read" it); None if unknown or expired."""
        held = self._holds.pop(key, None)
        if held is None:
            return None
        self._release(held)
        if self._clock() >= held.deadline:  # its timer just hasn't fired yet
            self._count_expired(held)
            return None
        self.num_taken += 1
        return held

    def drop(self, key: Hashable) -> None:
        held = self._holds.pop(key, None)
        if held is not None:
            self._release(held)

    def clear(self) -> None:
        for key in list(self._holds):
            self.drop(key)

    def _expire(self, held: HeldKv) -> None:
        if self._holds.get(held.key) is held:
            del self._holds[held.key]
            self._release(held)
            self._count_expired(held)

    def _count_expired(self, held: HeldKv) -> None:
        self.num_expired += 1
        log.warning("KV held for %r expired after %gs without a decode taking it; blocks freed",
                    held.key, self.timeout_s)

    def _release(self, held: HeldKv) -> None:
        if held.timer is not None:
            held.timer.cancel()
        self.cache.free(held.hold_id)


# ========================================================================= per request


class LegError(Exception):
    """A PD leg the engine refuses or cannot serve; the server answers it in the OpenAI error shape."""

    def __init__(self, status: int, message: str, err_type: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type


class PdFields(Protocol):
    """The request body fields PD legs carry (the server's request structs have them all)."""

    stream: bool | None
    kv_transfer_params: dict[str, Any] | None
    bootstrap_host: str | None
    bootstrap_port: int | None
    bootstrap_room: int | None


@dataclass(eq=False)
class LegPlan:
    """What one request's PD leg asks of the scheduler, and what it left for the reply."""

    max_tokens: int | None = None  # overrides the request's (SGLang prefill: 1)
    kv_hold: Callable[[Sequence], None] | None = None
    kv_import: ImportedKv | None = None
    held: HeldKv | None = None  # set by kv_hold at the prefill's finish


class Disaggregation:
    """One engine's PD role. Subclasses: :class:`NixlDisaggregation`, :class:`SglangDisaggregation`."""

    def __init__(self, cache: KVCache, link: KvLink, flush_kv_events: Callable[[], Any] | None = None) -> None:
        self.cache = cache
        self.link = link
        self.holds = KvHoldTable(cache, link.hold_timeout_s)
        self._flush_kv_events = flush_kv_events
        self._session: aiohttp.ClientSession | None = None
        self._import_ids = 0
        self.num_waiting_for_kv = 0  # decodes whose KV the prefill has not offered yet
        self.num_transferring = 0  # decodes fetching / moving KV
        self.num_failed_transfers = 0
        self.num_transfers = 0  # completed ones, with the bytes they moved
        self.bytes_transferred = 0

    @property
    def num_in_flight(self) -> int:
        """Decode requests inside a KV transfer: the engine's queue counts them as waiting."""
        return self.num_waiting_for_kv + self.num_transferring

    def add_routes(self, app: web.Application) -> None:
        """Routes on the engine's own HTTP server (none by default)."""

    async def start(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession()

    async def stop(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()
        self.holds.clear()

    async def admit(self, fields: PdFields, prompt_ids: list[int], request_id: str) -> LegPlan:
        """Prepare a request's leg before it is queued (a decode's transfer happens here)."""
        return LegPlan()

    def reply_kv_transfer_params(self, plan: LegPlan, local_addr: tuple[str, int] | None) -> dict | None:
        """The non-streaming reply's top-level ``kv_transfer_params``."""
        return None

    def discard(self, plan: LegPlan) -> None:
        """The request never reached the scheduler: release what its plan holds."""
        if plan.kv_import is not None:
            self.cache.free(plan.kv_import.hold_id)
            plan.kv_import = None

    # ------------------------------------------------------------------ shared decode side

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the disaggregation is not started")
        return self._session

    async def _import(self, token_ids: list[int], origin: str, salt: str | None = None) -> ImportedKv:
        """Move the blocks of ``token_ids`` this cache lacks (taking the transfer time) and hold
        them for the request (under its ``cache_salt``); ValueError when the cache has no room."""
        num_full_tokens = len(token_ids) // self.cache.block_size * self.cache.block_size
        num_moved = num_full_tokens - self.cache.match_full_blocks(token_ids, salt)
        await asyncio.sleep(self.link.transfer_seconds(num_moved))
        self._import_ids += 1
        hold_id = ("kv-import", self._import_ids)
        block_ids = self.cache.import_blocks(hold_id, token_ids, salt)
        if block_ids is None:
            raise ValueError(f"no free KV blocks for the {num_full_tokens} tokens from {origin}")
        self.num_transfers += 1
        self.bytes_transferred += num_moved * self.link.bytes_per_token
        if self._flush_kv_events is not None:
            self._flush_kv_events()  # the new blocks' BlockStored, as if computed here
        return ImportedKv(hold_id=hold_id, block_ids=frozenset(block_ids))


async def _bootstrap_health(request: web.Request) -> web.Response:
    return web.Response(status=200)


def _http_base(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _json_error(status: int, message: str, err_type: str) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return web.Response(status=status, body=_json_encode(body), content_type="application/json")


def _held_kv_body(held: HeldKv, block_size: int) -> dict[str, Any]:
    return {"block_size": block_size, "block_ids": held.block_ids, "token_ids": held.token_ids,
            "num_tokens": len(held.token_ids), "prompt_len": held.prompt_len}


class _HeldKvReply(msgspec.Struct):
    token_ids: list[int]
