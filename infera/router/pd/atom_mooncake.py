"""``atom-mooncake``: ATOM's Mooncake connector, serial, ``/v1/completions`` and ``/v1/chat/completions``.

The prefill leg is told where the decode engine listens (its host, HTTP and handshake ports and its
parallelism); its reply carries the handoff (with the ``transfer_id``) that the decode leg gets back
verbatim, plus the prefill's parallelism and the DP rank that served it. The decode engine
produces every output token, so its body keeps the client's limits.

Checked against ATOM v0.1.5 (``atom/kv_transfer/disaggregation/mooncake/mooncake_connector.py``
``request_finished``, ``types.py`` ``ConnectorMetadata._build_req_meta``): the prefill reply's
``kv_transfer_params`` carry ``remote_host``, ``remote_handshake_port``, ``tp_size`` (the
prefill's) and the prefill's ``dp_rank`` *inside* them; the decode engine reads ``tp_size`` (else
``remote_tp_size``) as the prefill's TP degree and ``remote_dp_rank`` (default 0) to pick the
prefill rank's handshake port. Chat takes the same legs: ATOM v0.1.5's ``/v1/chat/completions``
(``atom/entrypoints/openai/api_server.py`` ``chat_completions``) hands the request's
``kv_transfer_params`` to the engine exactly as ``/v1/completions`` does, and its reply carries the
prefill's handoff at the top level (``serving_chat.py`` ``build_chat_response``; the last stream
chunk when streamed), like a completion's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from infera.discovery.record import WorkerRecord
from infera.router.pd.base import (
    OPENAI_ROUTES,
    PdError,
    PdPair,
    Topology,
    as_port,
    is_int,
    misconfigured,
    params,
    prefill_single_token,
    reply_kv_transfer_params,
    require_route,
)


@dataclass(frozen=True, slots=True)
class AtomWorkerParams:
    """The ``disagg_meta.params`` an ATOM worker advertises (see ``engine.atom.adapter``)."""

    host: str
    http_port: int
    handshake_port: int
    tp_size: int
    dp_size: int

    @classmethod
    def of(cls, protocol: str, worker: WorkerRecord) -> AtomWorkerParams:
        raw = params(worker)
        host = raw.get("host")
        if not isinstance(host, str) or not host:
            raise misconfigured(protocol, worker, f"advertises host {host!r}")
        checked: dict[str, int] = {}
        for key in ("http_port", "handshake_port"):
            port = as_port(raw.get(key))
            if port is None:
                raise misconfigured(protocol, worker, f"advertises {key} {raw.get(key)!r}; expected a port")
            checked[key] = port
        for key in ("tp_size", "dp_size"):
            size = raw.get(key)
            if not is_int(size) or size < 1:
                raise misconfigured(protocol, worker, f"advertises {key} {size!r}; expected an integer ≥ 1")
            checked[key] = size
        return cls(
            host=host,
            http_port=checked["http_port"],
            handshake_port=checked["handshake_port"],
            tp_size=checked["tp_size"],
            dp_size=checked["dp_size"],
        )


class AtomMooncakeProtocol:
    name = "atom-mooncake"
    topology: Topology = "serial"

    def check_route(self, route: str) -> None:
        require_route(self.name, route, OPENAI_ROUTES)

    def leg_request_id(self, pair: PdPair) -> str | None:
        return None

    def prefill_body(self, body: dict[str, Any], pair: PdPair) -> dict[str, Any]:
        decode = AtomWorkerParams.of(self.name, pair.decode)
        out = prefill_single_token(body)
        out["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": decode.host,
            "remote_port": decode.http_port,
            "remote_handshake_port": decode.handshake_port,
            "remote_dp_size": decode.dp_size,
            "remote_tp_size": decode.tp_size,
        }
        return out

    def decode_body(self, body: dict[str, Any], pair: PdPair, prefill_reply: dict[str, Any] | None) -> dict[str, Any]:
        prefill = AtomWorkerParams.of(self.name, pair.prefill)
        AtomWorkerParams.of(self.name, pair.decode)  # a decode record that cannot drive ATOM is refused here too
        handoff = reply_kv_transfer_params(self.name, prefill_reply)
        if handoff.get("transfer_id") is None:
            raise PdError(
                502,
                f"PD protocol {self.name}: the prefill reply's kv_transfer_params carry no transfer_id",
                "handoff_missing",
            )
        handoff["remote_dp_size"] = prefill.dp_size
        handoff["remote_tp_size"] = prefill.tp_size
        if handoff.get("tp_size") is None:  # read before remote_tp_size: the prefill's, never the decode's
            handoff["tp_size"] = prefill.tp_size
        if not is_int(handoff.get("remote_dp_rank")):
            # ATOM puts the serving rank inside kv_transfer_params; the reference's layout had it
            # at the reply's top level.
            dp_rank = handoff.get("dp_rank")
            if not is_int(dp_rank) and isinstance(prefill_reply, dict):
                dp_rank = prefill_reply.get("dp_rank")
            if is_int(dp_rank):
                handoff["remote_dp_rank"] = dp_rank
        out = copy.deepcopy(body)
        out["kv_transfer_params"] = handoff
        return out
