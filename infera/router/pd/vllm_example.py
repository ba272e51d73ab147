"""``vllm-example``: vLLM's ExampleConnector (formerly SharedStorageConnector), serial.

A debug connector: the prefill engine writes the prompt's KV into a shared folder keyed by the
prompt's tokens and the decode engine finds it there by the same prompt. No handoff travels through
the router, so the decode leg is the client's body as sent.
"""

from __future__ import annotations

import copy
from typing import Any

from infera.router.pd.base import PdPair, ProtocolDefaults, Topology, prefill_single_token


class VllmExampleProtocol(ProtocolDefaults):
    name = "vllm-example"
    topology: Topology = "serial"

    def prefill_body(self, body: dict[str, Any], pair: PdPair) -> dict[str, Any]:
        return prefill_single_token(body)

    def decode_body(self, body: dict[str, Any], pair: PdPair, prefill_reply: dict[str, Any] | None) -> dict[str, Any]:
        return copy.deepcopy(body)
