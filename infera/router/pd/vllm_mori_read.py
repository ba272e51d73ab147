"""``vllm-mori-read``: vLLM's MoRIIOConnector in read mode, serial.

The prefill leg runs first and answers with the engine id and block ids holding the prompt's KV
(and its host, ports and DP rank); the decode leg carries that handoff on and the decode engine
reads the blocks from there. The transfer id is minted for the prefill leg and kept in
``pair.state`` for the decode leg.
"""

from __future__ import annotations

from typing import Any

from infera.router.pd import _mori
from infera.router.pd.base import (
    PdError,
    PdPair,
    ProtocolDefaults,
    Topology,
    decode_remaining,
    prefill_single_token,
    reply_kv_transfer_params,
)

TRANSFER_ID_KEY = "mori_transfer_id"


class VllmMoriReadProtocol(ProtocolDefaults):
    name = "vllm-mori-read"
    topology: Topology = "serial"

    def leg_request_id(self, pair: PdPair) -> str | None:
        return _mori.forged_request_id(self.name, pair)

    def prefill_body(self, body: dict[str, Any], pair: PdPair) -> dict[str, Any]:
        transfer_id = pair.state.get(TRANSFER_ID_KEY)
        if not isinstance(transfer_id, str):
            transfer_id = pair.state[TRANSFER_ID_KEY] = _mori.random_transfer_id()
        out = prefill_single_token(body)
        out["kv_transfer_params"] = _mori.prefill_kv_transfer_params(self.name, pair, transfer_id)
        return out

    def decode_body(self, body: dict[str, Any], pair: PdPair, prefill_reply: dict[str, Any] | None) -> dict[str, Any]:
        transfer_id = pair.state.get(TRANSFER_ID_KEY)
        if not isinstance(transfer_id, str):
            # The router's fault (decode built before prefill), never the client's or the engine's.
            raise PdError(500, f"PD protocol {self.name}: decode leg built before the prefill leg", "internal_error")
        handoff = reply_kv_transfer_params(self.name, prefill_reply)
        remote_engine_id = handoff.get("remote_engine_id")
        remote_block_ids = handoff.get("remote_block_ids")
        if remote_engine_id is None or not isinstance(remote_block_ids, list):
            raise PdError(
                502,
                f"PD protocol {self.name}: the prefill reply's kv_transfer_params lack "
                "remote_engine_id or a remote_block_ids list",
                "handoff_missing",
            )
        out = decode_remaining(body)
        out["kv_transfer_params"] = _mori.decode_kv_transfer_params_from_handoff(self.name, pair, transfer_id, handoff)
        return out
