"""``sglang-bootstrap``: SGLang's PD, both legs sent at once and matched by a bootstrap room.

The decode engine pulls the KV from the prefill engine's bootstrap server; both legs carry the
same body annotated with that server's address and the room id. With a DP prefill, SGLang picks the
prefill rank from ``room % dp_size`` (the router aligns the room) and the decode engine is told the
rank outright through ``disagg_prefill_dp_rank``.
"""

from __future__ import annotations

import copy
import ipaddress
from typing import Any

from infera.router.pd.base import PdPair, ProtocolDefaults, Topology, as_port, misconfigured, params


def parse_bootstrap_addr(addr: Any) -> tuple[str, int] | None:
    """``"host:port"`` or ``"[v6]:port"`` → (host, port), the host without brackets (SGLang adds
    them itself); None when malformed. An unbracketed IPv6 literal is refused: ``"::1:8998"`` is
    itself a valid address, so which part is the port cannot be known."""
    if not isinstance(addr, str):
        return None
    if addr.startswith("["):
        host, closed, rest = addr[1:].partition("]")
        if not closed or not rest.startswith(":"):
            return None
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return None
        port_text = rest[1:]
    else:
        host, sep, port_text = addr.rpartition(":")
        if not sep or ":" in host:
            return None
    port = as_port(port_text)
    if not host or port is None:
        return None
    return host, port


class SglangBootstrapProtocol(ProtocolDefaults):
    name = "sglang-bootstrap"
    topology: Topology = "concurrent"

    def _annotated(self, body: dict[str, Any], pair: PdPair) -> dict[str, Any]:
        addr = params(pair.prefill).get("bootstrap_addr")
        parsed = parse_bootstrap_addr(addr)
        if parsed is None:
            raise misconfigured(
                self.name, pair.prefill, f'advertises bootstrap_addr {addr!r}; expected "host:port" or "[v6]:port"'
            )
        out = copy.deepcopy(body)
        out["bootstrap_host"], out["bootstrap_port"] = parsed
        out["bootstrap_room"] = pair.room
        return out

    def prefill_body(self, body: dict[str, Any], pair: PdPair) -> dict[str, Any]:
        return self._annotated(body, pair)

    def decode_body(self, body: dict[str, Any], pair: PdPair, prefill_reply: dict[str, Any] | None) -> dict[str, Any]:
        out = self._annotated(body, pair)
        if pair.prefill_rank is not None:
            out["disagg_prefill_dp_rank"] = pair.prefill_rank
        return out
