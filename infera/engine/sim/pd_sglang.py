"""SGLang's bootstrap-room P/D in the simulated engine (:class:`SglangDisaggregation`): a prefill
computes the first token, offers the room's KV on its own bootstrap server
(``--disaggregation-bootstrap-port``) until fetched or the hold times out; a decode long-polls
that server (``POST /sim/kv/fetch``) for the room, takes the modelled transfer time and decodes.
The two legs may arrive in either order. ``pd.py`` describes the protocol.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import aiohttp
import msgspec
from aiohttp import web

from infera.runtime import wait_for

from .cache import KVCache
from .pd_base import (Disaggregation, LegError, LegPlan, PdFields, _bootstrap_health, _held_kv_body, _HeldKvReply,
                      _http_base, _json_encode, _json_error)
from .pd_config import KV_FETCH_PATH, KvLink, SglangDisaggregationConfig
from .scheduler import ImportedKv, Sequence

log = logging.getLogger("infera.engine.sim.pd")  # the name the P/D roles have always logged under


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
                await wait_for(offered.wait(), max(fetch.wait_s, 0.0))
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
