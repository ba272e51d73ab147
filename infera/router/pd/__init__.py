"""PD (prefill/decode disaggregation) protocols: one module per connector wire contract.

``protocol_registry()`` builds the protocols the router speaks; ``resolve_protocol`` picks the one a
prefill/decode pair shares (§6.4: same protocol id, same engine, or the pair cannot work).
"""

from __future__ import annotations

from infera.discovery.record import WorkerRecord
from infera.router.pd.atom_mooncake import AtomMooncakeProtocol
from infera.router.pd.base import PdError, PdPair, PdProtocol
from infera.router.pd.sglang_bootstrap import SglangBootstrapProtocol
from infera.router.pd.vllm_example import VllmExampleProtocol
from infera.router.pd.vllm_mooncake import VllmMooncakeProtocol
from infera.router.pd.vllm_mori_read import VllmMoriReadProtocol
from infera.router.pd.vllm_mori_write import VllmMoriWriteProtocol
from infera.router.pd.vllm_nixl import VllmNixlProtocol

__all__ = ["PdError", "PdPair", "PdProtocol", "protocol_registry", "resolve_protocol"]


def protocol_registry() -> dict[str, PdProtocol]:
    """Every protocol by its ``disagg_meta.protocol`` id; fresh instances per call."""
    protocols: list[PdProtocol] = [
        SglangBootstrapProtocol(),
        VllmNixlProtocol(),
        VllmExampleProtocol(),
        VllmMooncakeProtocol(),
        VllmMoriWriteProtocol(),
        VllmMoriReadProtocol(),
        AtomMooncakeProtocol(),
    ]
    return {protocol.name: protocol for protocol in protocols}


def resolve_protocol(prefill: WorkerRecord, decode: WorkerRecord, registry: dict[str, PdProtocol]) -> PdProtocol:
    """The protocol both workers advertise; ``PdError(500, "pd_protocol_mismatch")`` when they
    disagree on it or on the engine, or when the router does not speak it."""
    prefill_protocol = (prefill.disagg_meta or {}).get("protocol")
    decode_protocol = (decode.disagg_meta or {}).get("protocol")
    pair = (
        f"prefill {prefill.worker_id} ({prefill.engine}, protocol {prefill_protocol!r}) and "
        f"decode {decode.worker_id} ({decode.engine}, protocol {decode_protocol!r})"
    )
    if prefill_protocol != decode_protocol:
        problem = "advertise different PD protocols"
    elif prefill.engine != decode.engine:
        problem = "run different engines"
    elif not isinstance(prefill_protocol, str) or prefill_protocol not in registry:
        problem = f"advertise a PD protocol this router does not speak (known: {', '.join(sorted(registry))})"
    else:
        return registry[prefill_protocol]
    raise PdError(500, f"PD pair {pair} {problem}", "pd_protocol_mismatch")
