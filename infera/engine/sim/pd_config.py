"""The simulated P/D's configuration: the wire contracts' constants (connector names, KV roles, the
pull and fetch paths, vLLM's and SGLang's default timeouts), vLLM's ``--kv-transfer-config``
(:class:`KvTransferConfig`, validated, with the argparse type ``parse_kv_transfer_config``), the
SGLang stand-in's PD flags (:class:`SglangDisaggregationConfig`) and the modelled KV link
(:class:`KvLink`, ``transfer_seconds``: how long N tokens of KV take to move). Pure data and
arithmetic: no I/O. ``pd.py`` describes the protocols these configure.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infera.config import json_config

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
