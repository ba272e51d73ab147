"""ATOM's Mooncake prefill/decode connector for the simulated engine (the ATOM stand-in's
``--kv-transfer-config '{"kv_connector": "mooncake", ...}'``).

What ATOM v0.1.5 does, read in ``atom/kv_transfer/disaggregation/mooncake/mooncake_connector.py``
(ROCm/ATOM tag ``v0.1.5``): the config is a plain dict read with defaults, ``kv_role`` (default
``kv_producer``; any other value is a consumer) and ``handshake_port`` (default 6301). The
producer's rank ``(dp, tp)`` listens on ``handshake_port + dp * tp_size + tp``
(``_port_offset``). ``request_finished`` returns, in the reply's ``kv_transfer_params``,
``do_remote_prefill``, ``remote_block_ids``, ``remote_engine_id`` (``"None"``: never set),
``remote_host``, ``remote_port``, ``remote_handshake_port`` (the base), ``tp_size``, ``dp_rank``,
``transfer_id`` (the sequence id), ``first_token_id``, ``draft_token_ids`` and
``local_slot_index``. The consumer dials ``remote_handshake_port + _port_offset(remote_dp_rank,
tp_rank, tp_size)`` (``tp_size`` if the params have it, else ``remote_tp_size``; rank default 0)
with the ``transfer_id``, and the producer writes the KV into the consumer's memory. Both
``/v1/completions`` and ``/v1/chat/completions`` hand ``kv_transfer_params`` to the engine
(``atom/entrypoints/openai/api_server.py``), so both routes take part.

Simulated: the prefill (``kv_producer``) holds a request's prompt blocks under its
``transfer_id`` (requests with ``do_remote_decode``, not streamed: only a full reply carries the
handoff) until a decode asks or ``--kv-hold-timeout`` passes, and serves them on a handshake
server at ``handshake_port`` (rank 0's; 0 picks a free port). The decode asks that address for
the ``transfer_id`` — the peer, port and order ATOM's push takes, with the bytes flowing back
instead of being written — waits the transfer time for the blocks it lacks, inserts them and
decodes. A failed transfer fails the request (500). A leg on the wrong role is a 400 (ATOM
asserts).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp
import msgspec
from aiohttp import web

from .cache import KVCache
from .pd import (Disaggregation, KvLink, LegError, LegPlan, PdFields, _bootstrap_health, _held_kv_body,
                 _http_base, _json_error, _HeldKvReply)
from .scheduler import ImportedKv, Sequence

log = logging.getLogger("infera.engine.sim.atom_pd")

ATOM_CONNECTORS = ("mooncake",)
ATOM_DEFAULT_HANDSHAKE_PORT = 6301
ATOM_ENGINE_ID = "None"  # MooncakeConnectorScheduler.engine_id: the string "None", never replaced
KV_PUSH_PATH = "/sim/kv/atom-push"


@dataclass(frozen=True)
class AtomKvTransferConfig:
    """The part of ATOM's ``--kv-transfer-config`` the simulator acts on (ATOM ignores unknown keys)."""

    kv_connector: str
    is_producer: bool
    handshake_port: int = ATOM_DEFAULT_HANDSHAKE_PORT

    @classmethod
    def from_dict(cls, obj: Any) -> "AtomKvTransferConfig":
        if not isinstance(obj, dict):
            raise ValueError("must be a JSON object")
        connector = obj.get("kv_connector", "moriio")  # ATOM's factory default
        if connector not in ATOM_CONNECTORS:
            raise ValueError(f"kv_connector {connector!r} is not simulated; supported: {', '.join(ATOM_CONNECTORS)}")
        port = obj.get("handshake_port", ATOM_DEFAULT_HANDSHAKE_PORT)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"handshake_port must be a port number, got {port!r}")
        return cls(kv_connector=connector, is_producer=obj.get("kv_role", "kv_producer") == "kv_producer",
                   handshake_port=port)


@dataclass(eq=False)
class _AtomLegPlan(LegPlan):
    transfer_id: int | None = None
    first_token_id: int | None = None


class _PushRequest(msgspec.Struct):
    transfer_id: int


class AtomMooncakeDisaggregation(Disaggregation):
    """One ATOM engine's Mooncake role: see the module docstring."""

    def __init__(self, config: AtomKvTransferConfig, cache: KVCache, link: KvLink, bind_host: str,
                 tp_size: int = 1, flush_kv_events: Callable[[], Any] | None = None) -> None:
        super().__init__(cache, link, flush_kv_events)
        self.config = config
        self.bind_host = bind_host
        self.tp_size = tp_size
        self.handshake_port: int | None = None  # bound port once started (producer only)
        self._runner: web.AppRunner | None = None
        self._transfer_ids = itertools.count(1)

    async def start(self) -> None:
        await super().start()
        if self.config.is_producer and self._runner is None:
            app = web.Application()
            app.router.add_get("/health", _bootstrap_health)
            app.router.add_post(KV_PUSH_PATH, self._serve_push)
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
            await runner.setup()
            try:
                await web.TCPSite(runner, self.bind_host, self.config.handshake_port).start()
            except BaseException:
                await runner.cleanup()
                raise
            self._runner = runner
            self.handshake_port = runner.addresses[0][1]
            log.info("mooncake handshake server on %s:%d (simulated)", self.bind_host, self.handshake_port)

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        await super().stop()

    async def admit(self, fields: PdFields, prompt_ids: list[int], request_id: str) -> LegPlan:
        params = fields.kv_transfer_params
        if not isinstance(params, dict):
            return LegPlan()
        if params.get("do_remote_prefill"):
            if self.config.is_producer:
                raise LegError(400, "do_remote_prefill on a kv_producer: only the decode (consumer) side "
                                    "takes it", "BadRequestError")
            return LegPlan(kv_import=await self._receive(params, request_id))
        if params.get("do_remote_decode"):
            if not self.config.is_producer:
                raise LegError(400, "do_remote_decode on a consumer: only the prefill (kv_producer) side "
                                    "takes it", "BadRequestError")
            if fields.stream:
                return LegPlan()  # the simulator's streams carry no handoff: nothing a decode could ask for
            plan = _AtomLegPlan(transfer_id=next(self._transfer_ids))

            def hold(seq: Sequence) -> None:
                plan.held = self.holds.pin(plan.transfer_id, seq)
                plan.first_token_id = seq.output_token_ids[0] if seq.output_token_ids else None

            plan.kv_hold = hold
            return plan
        return LegPlan()

    def reply_kv_transfer_params(self, plan: LegPlan, local_addr: tuple[str, int] | None) -> dict | None:
        held = plan.held
        if held is None or not isinstance(plan, _AtomLegPlan):
            return None
        host = local_addr[0] if local_addr is not None else self.bind_host
        return {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": list(held.block_ids),
            "remote_engine_id": ATOM_ENGINE_ID, "remote_host": host, "remote_port": self.handshake_port,
            "remote_handshake_port": self.handshake_port, "tp_size": self.tp_size, "dp_rank": 0,
            "transfer_id": plan.transfer_id, "first_token_id": plan.first_token_id, "draft_token_ids": [],
            "local_slot_index": -1,
        }

    async def _serve_push(self, request: web.Request) -> web.Response:
        try:
            push = msgspec.json.decode(await request.read(), type=_PushRequest)
        except msgspec.DecodeError as exc:
            return _json_error(400, f"Invalid KV request: {exc}", "BadRequestError")
        held = self.holds.take(push.transfer_id)
        if held is None:
            return _json_error(404, f"no KV held for transfer_id {push.transfer_id} "
                                    "(unknown, already sent or expired)", "NotFoundError")
        return web.Response(body=msgspec.json.encode(_held_kv_body(held, self.cache.block_size)),
                            content_type="application/json")

    async def _receive(self, params: dict[str, Any], request_id: str) -> ImportedKv:
        self.num_transferring += 1
        try:
            host, base, transfer_id = params.get("remote_host"), params.get("remote_handshake_port"), \
                params.get("transfer_id")
            tp = params["tp_size"] if "tp_size" in params else params.get("remote_tp_size", 1)
            rank = params.get("remote_dp_rank", 0)
            if not isinstance(host, str) or not _is_int(base) or not _is_int(transfer_id) \
                    or not _is_int(tp) or not _is_int(rank):
                raise ValueError("kv_transfer_params lacks remote_host, remote_handshake_port or transfer_id "
                                 "(or a size or rank is not an integer)")
            url = _http_base(host, base + rank * tp) + KV_PUSH_PATH  # _port_offset for TP rank 0
            timeout = aiohttp.ClientTimeout(total=self.link.transfer_timeout_s)
            async with self.session.post(url, json={"transfer_id": transfer_id}, timeout=timeout) as resp:
                payload = await resp.read()
                if resp.status != 200:
                    raise ValueError(f"{url} answered {resp.status}: {payload[:300].decode(errors='replace')}")
            token_ids = msgspec.json.decode(payload, type=_HeldKvReply).token_ids
            return await self._import(token_ids, url)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, msgspec.DecodeError) as exc:
            self.num_failed_transfers += 1
            reason = str(exc) or type(exc).__name__
            log.warning("%s: KV transfer failed: %s", request_id, reason)
            raise LegError(500, f"KV transfer failed: {reason}", "InternalServerError") from None
        finally:
            self.num_transferring -= 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
