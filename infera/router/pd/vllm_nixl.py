"""``vllm-nixl``: vLLM's NixlConnector, serial (the decode engine pulls the prompt's KV blocks).

The prefill leg asks for a remote decode; vLLM answers with ``kv_transfer_params`` naming its
engine, blocks and side channel, which the decode leg passes back verbatim. The decode engine
computes every output token itself, so its body keeps the client's limits (checked against real
vLLM on CPU: decode output equals the prefill engine's own).
"""

from __future__ import annotations

import copy
from typing import Any

from infera.router.pd.base import PdPair, ProtocolDefaults, Topology, prefill_single_token, reply_kv_transfer_params


class VllmNixlProtocol(ProtocolDefaults):
    name = "vllm-nixl"
    topology: Topology = "serial"

    def prefill_body(self, body: dict[str, Any], pair: PdPair) -> dict[str, Any]:
        out = prefill_single_token(body)
        # Every key spelled out: the remote_* keys as null are how vLLM's proxy asks for a
        # producer-side request, and NixlConnector reads them without defaults.
        out["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        return out

    def decode_body(self, body: dict[str, Any], pair: PdPair, prefill_reply: dict[str, Any] | None) -> dict[str, Any]:
        handoff = reply_kv_transfer_params(self.name, prefill_reply)
        out = copy.deepcopy(body)
        out["kv_transfer_params"] = handoff
        return out
