"""Prefill/decode disaggregation for the simulated engine, speaking two real engines' wire contracts.

No tensors move: "KV" is the token ids of the prompt's full blocks, from which the decode rebuilds
(and caches, with KV events) the very blocks a local prefill would have made. The transfer of N
tokens takes ``N x --kv-bytes-per-token / (--kv-transfer-bandwidth x 1e9)`` seconds, divided by
``--speedup`` like all simulated time. Timeouts (``--kv-hold-timeout``, ``--kv-transfer-timeout``)
are wall-clock protections, not modelled work, so ``--speedup`` leaves them alone.

**vLLM NixlConnector** (``--kv-transfer-config``, :class:`NixlDisaggregation`):

* prefill (``kv_producer``/``kv_both``): a non-streaming request whose ``kv_transfer_params`` has
  ``do_remote_decode: true`` runs normally; its prompt's full blocks are then pinned under a new
  ``remote_request_id`` until a decode pulls them or ``--kv-hold-timeout`` passes, and the reply
  carries vLLM's ``kv_transfer_params`` naming this server's own HTTP address as the side channel.
* decode (``kv_consumer``/``kv_both``): ``do_remote_prefill: true`` first pulls from
  ``remote_host:remote_port`` (``POST /sim/kv/pull``), waits the transfer time for the blocks it
  does not already cache, inserts them, then runs the request, whose prefill finds them cached.
  A failed pull recomputes locally (``kv_load_failure_policy`` "recompute", vLLM's default) or
  fails the request ("fail").

**SGLang bootstrap** (the stand-in's ``--disaggregation-mode``, :class:`SglangDisaggregation`):
requests must carry ``bootstrap_host``/``bootstrap_port``/``bootstrap_room``. The prefill computes
the prompt (1 output token), offers the room's KV on its bootstrap server
(``--disaggregation-bootstrap-port``; held until fetched or the hold timeout) and answers. The
decode long-polls ``POST /sim/kv/fetch`` on that server until the room is offered (at most
``--kv-transfer-timeout``, else 500 "KV transfer failed"), waits the transfer time, inserts the
blocks and decodes. The legs may arrive in either order.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Protocol

import aiohttp
import msgspec
from aiohttp import web

from infera.config import json_config

from .cache import KVCache
from .scheduler import ImportedKv, Sequence

log = logging.getLogger("infera.engine.sim.pd")

NIXL_CONNECTORS = ("NixlConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
LOAD_FAILURE_POLICIES = ("recompute", "fail")
# vLLM's KVTransferConfig fields: accepted (most ignored by the simulator); anything else is a typo.
KV_TRANSFER_CONFIG_FIELDS = frozenset({
    "kv_connector", "engine_id", "kv_buffer_device", "kv_buffer_size", "kv_role", "kv_rank",
    "kv_parallel_size", "kv_ip", "kv_port", "kv_connector_extra_config", "kv_connector_module_path",
    "enable_permute_local_kv", "kv_load_failure_policy",
})
SGLANG_DISAGGREGATION_MODES = ("null", "prefill", "decode")
# SGLang 0.5.23's DISAGG_TRANSFER_BACKEND_CHOICES (sglang/srt/arg_groups/choices.py).
SGLANG_TRANSFER_BACKENDS = ("mooncake", "nixl", "ascend", "fake", "mori", "mooncake_tcp")

KV_PULL_PATH = "/sim/kv/pull"
KV_FETCH_PATH = "/sim/kv/fetch"

DEFAULT_KV_TRANSFER_BANDWIDTH_GBPS = 25.0
DEFAULT_KV_BYTES_PER_TOKEN = 131072  # Llama-3-8B, bf16: 32 layers x 8 KV heads x 128 dims x 2 (K,V) x 2 bytes
# vLLM 0.32's NIXL prefill keeps blocks under a 30 s lease (kv_lease_duration) that the decode's
# heartbeats renew; the simulator has no heartbeats, so it holds them a fixed time: the 480 s of
# the older VLLM_NIXL_ABORT_REQUEST_TIMEOUT (and of 0.32's decoder_kv_blocks_ttl).
VLLM_KV_HOLD_TIMEOUT_S = 480.0
VLLM_KV_TRANSFER_TIMEOUT_S = 30.0
SGLANG_KV_HOLD_TIMEOUT_S = 300.0  # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT
SGLANG_KV_TRANSFER_TIMEOUT_S = 300.0  # SGLANG_DISAGGREGATION_WAITING_TIMEOUT

_json_encode = msgspec.json.Encoder().encode


# ================================================================================ config


@dataclass(frozen=True)
class KvTransferConfig:
    """The part of vLLM's ``--kv-transfer-config`` the simulator acts on."""

    kv_connector: str
    kv_role: str
    engine_id: str | None = None
    kv_connector_extra_config: dict = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_dict(cls, obj: Any) -> "KvTransferConfig":
        """Validate a parsed JSON config; ValueError naming what is wrong (and what is supported)."""
        if not isinstance(obj, dict):
            raise ValueError("must be a JSON object")
        unknown = sorted(set(obj) - KV_TRANSFER_CONFIG_FIELDS)
        if unknown:
            raise ValueError(f"unknown field(s): {', '.join(unknown)}")
        connector = obj.get("kv_connector")
        if connector not in NIXL_CONNECTORS:
            raise ValueError(f"kv_connector {connector!r} is not supported by the simulated engine; "
                             f"supported: {', '.join(NIXL_CONNECTORS)}")
        role = obj.get("kv_role")
        if role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {role!r}")
        engine_id = obj.get("engine_id")
        if engine_id is not None and (not isinstance(engine_id, str) or not engine_id):
            raise ValueError("engine_id must be a non-empty string")
        extra = obj.get("kv_connector_extra_config")
        extra = {} if extra is None else extra
        if not isinstance(extra, dict):
            raise ValueError("kv_connector_extra_config must be a JSON object")
        policy = obj.get("kv_load_failure_policy") or "recompute"
        if policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {', '.join(LOAD_FAILURE_POLICIES)}, "
                             f"got {policy!r}")
        return cls(kv_connector=connector, kv_role=role, engine_id=engine_id, kv_connector_extra_config=extra,
                   kv_load_failure_policy=policy)


# argparse ``type`` for the sim's ``--kv-transfer-config`` (vLLM's JSON).
parse_kv_transfer_config = json_config(KvTransferConfig.from_dict)


@dataclass(frozen=True)
class SglangDisaggregationConfig:
    """The SGLang stand-in's PD flags."""

    mode: str  # "prefill" | "decode" ("null" builds no disaggregation at all)
    bootstrap_port: int
    transfer_backend: str = "mooncake"  # accepted for fidelity; the simulated transfer ignores it


@dataclass(frozen=True)
class KvLink:
    """The modelled KV transfer and its protections."""

    bandwidth_gbps: float = DEFAULT_KV_TRANSFER_BANDWIDTH_GBPS
    bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    speedup: float = 1.0
    hold_timeout_s: float = VLLM_KV_HOLD_TIMEOUT_S
    transfer_timeout_s: float = VLLM_KV_TRANSFER_TIMEOUT_S

    def transfer_seconds(self, num_tokens: int) -> float:
        return transfer_seconds(num_tokens, self.bytes_per_token, self.bandwidth_gbps, self.speedup)


def transfer_seconds(num_tokens: int, bytes_per_token: int, bandwidth_gbps: float, speedup: float = 1.0) -> float:
    """Simulated wall time to move ``num_tokens`` tokens of KV (0 for none)."""
    if num_tokens <= 0:
        return 0.0
    return num_tokens * bytes_per_token / (bandwidth_gbps * 1e9) / speedup


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

    async def _import(self, token_ids: list[int], origin: str) -> ImportedKv:
        """Move the blocks of ``token_ids`` this cache lacks (taking the transfer time) and hold
        them for the request; ValueError when the cache has no room for them."""
        num_full_tokens = len(token_ids) // self.cache.block_size * self.cache.block_size
        num_moved = num_full_tokens - self.cache.match_full_blocks(token_ids)
        await asyncio.sleep(self.link.transfer_seconds(num_moved))
        self._import_ids += 1
        hold_id = ("kv-import", self._import_ids)
        block_ids = self.cache.import_blocks(hold_id, token_ids)
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


# ======================================================================== vLLM NIXL


class _PullRequest(msgspec.Struct):
    remote_request_id: str
    remote_engine_id: str | None = None


class NixlDisaggregation(Disaggregation):
    """vLLM's NixlConnector (pull mode): see the module docstring."""

    def __init__(self, config: KvTransferConfig, cache: KVCache, link: KvLink,
                 flush_kv_events: Callable[[], Any] | None = None) -> None:
        super().__init__(cache, link, flush_kv_events)
        self.config = config
        # vLLM picks a random engine id when none is configured (the launcher pins one).
        self.engine_id = config.engine_id or str(uuid.uuid4())

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(KV_PULL_PATH, self._serve_pull)

    async def admit(self, fields: PdFields, prompt_ids: list[int], request_id: str) -> LegPlan:
        plan = LegPlan()
        params = fields.kv_transfer_params
        if not isinstance(params, dict):
            return plan
        if params.get("do_remote_prefill") and self.config.is_consumer:
            plan.kv_import = await self._pull(params, prompt_ids, request_id)
        elif params.get("do_remote_decode") and self.config.is_producer and not fields.stream:
            # Streaming replies never carry kv_transfer_params, so no decode could ask for a hold.
            key = f"{request_id}-{uuid.uuid4().hex[:8]}"

            def hold(seq: Sequence) -> None:
                plan.held = self.holds.pin(key, seq)

            plan.kv_hold = hold
        return plan

    def reply_kv_transfer_params(self, plan: LegPlan, local_addr: tuple[str, int] | None) -> dict | None:
        held = plan.held
        if held is None:
            return None
        host, port = local_addr if local_addr is not None else (None, None)
        # Field for field what vLLM 0.32's NixlConnector returns (real-engine-cpu.md §8b).
        return {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [list(held.block_ids)],
            "remote_engine_id": self.engine_id, "remote_request_id": held.key, "remote_host": host,
            "remote_port": port, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": held.prompt_len,
            "remote_blocks_expiry_time": None, "transfer_mode": "pull",
            "remote_prefill_cached_tokens": held.num_cached_tokens,
        }

    async def _serve_pull(self, request: web.Request) -> web.Response:
        try:
            pull = msgspec.json.decode(await request.read(), type=_PullRequest)
        except msgspec.DecodeError as exc:  # ValidationError included
            return _json_error(400, f"Invalid KV pull: {exc}", "BadRequestError")
        if pull.remote_engine_id is not None and pull.remote_engine_id != self.engine_id:
            return _json_error(404, f"engine {pull.remote_engine_id!r} is not this one ({self.engine_id!r})",
                               "NotFoundError")
        held = self.holds.take(pull.remote_request_id)
        if held is None:
            return _json_error(404, f"no KV held for request {pull.remote_request_id!r} "
                                    "(unknown, already pulled or expired)", "NotFoundError")
        return web.Response(body=_json_encode(_held_kv_body(held, self.cache.block_size)),
                            content_type="application/json")

    async def _pull(self, params: dict[str, Any], prompt_ids: list[int], request_id: str) -> ImportedKv | None:
        host, port, remote_id = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
        self.num_transferring += 1
        try:
            if not isinstance(host, str) or not isinstance(port, int) or not isinstance(remote_id, str):
                raise ValueError("kv_transfer_params lacks remote_host, remote_port or remote_request_id")
            url = _http_base(host, port) + KV_PULL_PATH
            body = {"remote_request_id": remote_id, "remote_engine_id": params.get("remote_engine_id")}
            timeout = aiohttp.ClientTimeout(total=self.link.transfer_timeout_s)
            async with self.session.post(url, json=body, timeout=timeout) as resp:
                payload = await resp.read()
                if resp.status != 200:
                    raise ValueError(f"{url} answered {resp.status}: {payload[:300].decode(errors='replace')}")
            token_ids = msgspec.json.decode(payload, type=_HeldKvReply).token_ids
            if token_ids != prompt_ids[: len(token_ids)]:
                log.warning("%s: KV pulled from %s is for another prompt (a router bug?)", request_id, url)
            return await self._import(token_ids, url)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, msgspec.DecodeError) as exc:
            self.num_failed_transfers += 1
            reason = str(exc) or type(exc).__name__
            if self.config.kv_load_failure_policy == "fail":
                log.warning("%s: KV transfer failed (%s); failing the request", request_id, reason)
                raise LegError(500, f"KV transfer failed: {reason}", "InternalServerError") from None
            log.warning("%s: KV transfer failed (%s); recomputing the prompt locally", request_id, reason)
            return None
        finally:
            self.num_transferring -= 1


# ==================================================================== SGLang bootstrap


class _FetchRequest(msgspec.Struct):
    bootstrap_room: int
    wait_s: float = 0.0


class SglangDisaggregation(Disaggregation):
    """SGLang's bootstrap-room PD: see the module docstring."""

    def __init__(self, config: SglangDisaggregationConfig, cache: KVCache, link: KvLink, bind_host: str,
                 flush_kv_events: Callable[[], Any] | None = None) -> None:
        super().__init__(cache, link, flush_kv_events)
        self.config = config
        self.bind_host = bind_host
        self.bootstrap_port: int | None = None  # bound port once started (prefill only)
        self._runner: web.AppRunner | None = None
        self._room_offered: dict[int, asyncio.Event] = {}  # rooms a decode is waiting for

    @property
    def is_prefill(self) -> bool:
        return self.config.mode == "prefill"

    async def start(self) -> None:
        await super().start()
        if self.is_prefill and self._runner is None:
            app = web.Application()
            app.router.add_get("/health", _bootstrap_health)
            app.router.add_post(KV_FETCH_PATH, self._serve_fetch)
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
            await runner.setup()
            try:
                await web.TCPSite(runner, self.bind_host, self.config.bootstrap_port).start()
            except BaseException:
                await runner.cleanup()
                raise
            self._runner = runner
            self.bootstrap_port = runner.addresses[0][1]
            log.info("bootstrap server on %s:%d (transfer backend %s, simulated)", self.bind_host,
                     self.bootstrap_port, self.config.transfer_backend)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        await super().stop()

    async def admit(self, fields: PdFields, prompt_ids: list[int], request_id: str) -> LegPlan:
        host, port, room = fields.bootstrap_host, fields.bootstrap_port, fields.bootstrap_room
        missing = [name for name, v in (("bootstrap_host", host), ("bootstrap_port", port),
                                        ("bootstrap_room", room)) if v is None]
        if missing:
            raise LegError(400, f"A {self.config.mode} server needs {', '.join(missing)} in the request "
                                "(PD requests come through a PD router).", "BadRequestError")
        if self.is_prefill:
            plan = LegPlan(max_tokens=1)  # SGLang's prefill server answers with the first token only

            def offer(seq: Sequence) -> None:
                plan.held = self.holds.pin(room, seq)
                waiting = self._room_offered.get(room)
                if waiting is not None:
                    waiting.set()

            plan.kv_hold = offer
            return plan
        return LegPlan(kv_import=await self._fetch(host, port, room, request_id))

    async def _serve_fetch(self, request: web.Request) -> web.Response:
        """Long-poll: the room's KV once offered (and released here), or 404 after ``wait_s``."""
        try:
            fetch = msgspec.json.decode(await request.read(), type=_FetchRequest)
        except msgspec.DecodeError as exc:
            return _json_error(400, f"Invalid KV fetch: {exc}", "BadRequestError")
        room = fetch.bootstrap_room
        held = self.holds.take(room)
        if held is None:  # the decode came first: wait for the prefill to offer the room
            offered = self._room_offered.setdefault(room, asyncio.Event())
            try:
                await asyncio.wait_for(offered.wait(), max(fetch.wait_s, 0.0))
            except asyncio.TimeoutError:
                pass
            finally:
                if self._room_offered.get(room) is offered:
                    del self._room_offered[room]
            held = self.holds.take(room)
        if held is None:
            return _json_error(404, f"no KV offered for bootstrap room {room} within {fetch.wait_s:g}s",
                               "NotFoundError")
        return web.Response(body=_json_encode(_held_kv_body(held, self.cache.block_size)),
                            content_type="application/json")

    async def _fetch(self, host: str, port: int, room: int, request_id: str) -> ImportedKv:
        url = _http_base(host, port) + KV_FETCH_PATH
        try:
            self.num_waiting_for_kv += 1
            try:
                token_ids = await self._fetch_room(url, room)
            finally:
                self.num_waiting_for_kv -= 1
            self.num_transferring += 1
            try:
                return await self._import(token_ids, url)
            finally:
                self.num_transferring -= 1
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, msgspec.DecodeError) as exc:
            self.num_failed_transfers += 1
            reason = str(exc) or type(exc).__name__
            log.warning("%s: KV transfer for bootstrap room %d failed: %s", request_id, room, reason)
            raise LegError(500, f"KV transfer failed: {reason}", "InternalServerError") from None

    async def _fetch_room(self, url: str, room: int) -> list[int]:
        wait_s = self.link.transfer_timeout_s
        # The client allows a little more than the server waits, so a room never offered is a clean 404.
        timeout = aiohttp.ClientTimeout(total=wait_s + 1.0)
        async with self.session.post(url, json={"bootstrap_room": room, "wait_s": wait_s}, timeout=timeout) as resp:
            payload = await resp.read()
            if resp.status != 200:
                raise ValueError(f"{url} answered {resp.status}: {payload[:300].decode(errors='replace')}")
        return msgspec.json.decode(payload, type=_HeldKvReply).token_ids


# ============================================================================= factory


def build_disaggregation(args: argparse.Namespace, cache: KVCache,
                         flush_kv_events: Callable[[], Any] | None = None) -> Disaggregation | None:
    """The engine's PD role from its flags: ``--kv-transfer-config`` (vLLM flavour) or the SGLang
    stand-in's ``sglang_disaggregation``; None for a mixed engine."""
    link = KvLink(bandwidth_gbps=args.kv_transfer_bandwidth, bytes_per_token=args.kv_bytes_per_token,
                  speedup=args.speedup, hold_timeout_s=args.kv_hold_timeout,
                  transfer_timeout_s=args.kv_transfer_timeout)
    sglang_cfg: SglangDisaggregationConfig | None = getattr(args, "sglang_disaggregation", None)
    if sglang_cfg is not None and sglang_cfg.mode != "null":
        return SglangDisaggregation(sglang_cfg, cache, link, args.host, flush_kv_events)
    kv_cfg: KvTransferConfig | None = getattr(args, "kv_transfer_config", None)
    if kv_cfg is not None:
        return NixlDisaggregation(kv_cfg, cache, link, flush_kv_events)
    return None
