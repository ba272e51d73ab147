"""vLLM's NixlConnector P/D in the simulated engine (pull mode, :class:`NixlDisaggregation`): a
prefill pins a finished prompt's KV and names itself in the reply's ``kv_transfer_params``; a
decode pulls those blocks from it (``POST /sim/kv/pull``), takes the modelled transfer time and
recomputes locally or fails when the pull fails, as ``kv_load_failure_policy`` says. ``pd.py``
describes the protocol.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Callable

import aiohttp
import msgspec
from aiohttp import web

from .cache import KVCache
from .pd_base import (Disaggregation, LegError, LegPlan, PdFields, _held_kv_body, _HeldKvReply, _http_base,
                      _json_encode, _json_error)
from .pd_config import KV_PULL_PATH, KvLink, KvTransferConfig
from .scheduler import ImportedKv, Sequence

log = logging.getLogger("infera.engine.sim.pd")  # the name the P/D roles have always logged under


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
            plan.kv_import = await self._pull(params, prompt_ids, request_id, getattr(fields, "cache_salt", None))
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

    async def _pull(self, params: dict[str, Any], prompt_ids: list[int], request_id: str,
                    salt: str | None = None) -> ImportedKv | None:
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
            return await self._import(token_ids, url, salt)  # vLLM's decode hashes them under the salt
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
