"""``vllm-mooncake``: vLLM's MooncakeConnector, both legs sent at once and matched by a transfer id.

The prefill engine computes the prompt and first token and holds the KV under ``transfer_id``; the
decode engine fetches it through the prefill engine's bootstrap server and generates the rest, so
its token limits are one lower.
"""

from __future__ import annotations

from typing import Any

from infera.discovery.record import WorkerRecord
from infera.router.pd.base import (
    PdPair,
    ProtocolDefaults,
    Topology,
    decode_remaining,
    misconfigured,
    params,
    prefill_single_token,
)


def transfer_id(room: int) -> str:
    return f"xfer-{room:032x}"


class VllmMooncakeProtocol(ProtocolDefaults):
    name = "vllm-mooncake"
    topology: Topology = "concurrent"

    def prefill_body(self, body: dict[str, Any], pair: PdPair) -> dict[str, Any]:
        out = prefill_single_token(body)
        out["kv_transfer_params"] = {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": transfer_id(pair.room),
        }
        return out

    def decode_body(self, body: dict[str, Any], pair: PdPair, prefill_reply: dict[str, Any] | None) -> dict[str, Any]:
        prefill_params = params(pair.prefill)
        engine_id = prefill_params.get("engine_id")
        bootstrap_addr = prefill_params.get("bootstrap_addr")
        if not isinstance(engine_id, str) or not engine_id:
            raise misconfigured(self.name, pair.prefill, "advertises no engine_id")
        if not isinstance(bootstrap_addr, str) or not bootstrap_addr:
            raise misconfigured(self.name, pair.prefill, "advertises no bootstrap_addr")
        out = decode_remaining(body)
        out["kv_transfer_params"] = {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_bootstrap_addr": bootstrap_addr,
            "remote_engine_id": engine_id + _dp_suffix(pair.prefill, pair.room),
            "transfer_id": transfer_id(pair.room),
        }
        return out


def _dp_suffix(prefill: WorkerRecord, room: int) -> str:
    """vLLM names each DP rank's engine ``<engine_id>_dp<rank>``. A rank-multiplexed prefill serves
    the request on rank ``room % dp_size`` (the router aligns the room to the rank it pins); a
    rank-pinned record (vLLM external LB: one record per rank) is that rank whatever the room."""
    dp_size = prefill.dp_size or 1
    if dp_size <= 1:
        return ""
    rank = prefill.dp_rank if prefill.dp_rank is not None else room % dp_size
    return f"_dp{rank}"
