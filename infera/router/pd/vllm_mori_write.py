"""``vllm-mori-write``: vLLM's MoRIIOConnector in write mode, both legs sent at once.

The prefill engine writes the KV into the decode engine's blocks as it computes them; the legs meet
through the forged request id and a transfer id derived from the room. The prefill emits the first
token, so the decode leg's limits are one lower.
"""

from __future__ import annotations

from typing import Any

from infera.router.pd import _mori
from infera.router.pd.base import PdPair, ProtocolDefaults, Topology, decode_remaining, prefill_single_token


class VllmMoriWriteProtocol(ProtocolDefaults):
    name = "vllm-mori-write"
    topology: Topology = "concurrent"

    def leg_request_id(self, pair: PdPair) -> str | None:
        return _mori.forged_request_id(self.name, pair)

    def prefill_body(self, body: dict[str, Any], pair: PdPair) -> dict[str, Any]:
        out = prefill_single_token(body)
        out["kv_transfer_params"] = _mori.prefill_kv_transfer_params(self.name, pair, _mori.room_transfer_id(pair.room))
        return out

    def decode_body(self, body: dict[str, Any], pair: PdPair, prefill_reply: dict[str, Any] | None) -> dict[str, Any]:
        out = decode_remaining(body)
        out["kv_transfer_params"] = _mori.decode_kv_transfer_params(self.name, pair, _mori.room_transfer_id(pair.room))
        return out
