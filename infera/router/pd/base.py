"""The PD protocol interface: how one client request becomes a prefill leg and a decode leg.

A protocol knows one connector's wire contract — what each engine must receive so that the decode
engine ends up with the prefill engine's KV cache. It never does I/O: the router
(``infera.router.disagg``) picks the pair, sends the legs and relays the decode leg's output.

Topologies:

* ``concurrent``: both legs are sent at once; the engines meet through ids in the bodies
  (SGLang bootstrap room, Mooncake/MoRI transfer ids). ``decode_body`` gets ``prefill_reply=None``.
* ``serial``: the prefill leg runs first (one token, not streamed); its JSON reply carries the
  handoff (``kv_transfer_params``) that ``decode_body`` puts into the decode leg.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeGuard

from infera.discovery.record import WorkerRecord

log = logging.getLogger(__name__)

Topology = Literal["concurrent", "serial"]

CHAT_ROUTE = "/v1/chat/completions"
COMPLETIONS_ROUTE = "/v1/completions"


class PdError(Exception):
    """A leg cannot be built: status + OpenAI error ``code`` for the client (400 bad route for the
    pair, 500 misconfigured workers, 502 a prefill reply without a usable handoff)."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


@dataclass(slots=True)
class PdPair:
    """One request's prefill/decode pair and the ids both legs share."""

    prefill: WorkerRecord
    decode: WorkerRecord
    room: int  # random u63; the router aligns it so room % prefill.dp_size == prefill_rank
    prefill_rank: int | None = None  # DP rank pinned on the prefill leg (X-Data-Parallel-Rank)
    decode_rank: int | None = None
    state: dict[str, Any] = field(default_factory=dict)  # protocol scratch shared by both legs


class PdProtocol(Protocol):
    name: str  # the id workers advertise in disagg_meta.protocol
    topology: Topology

    def check_route(self, route: str) -> None:
        """Raise ``PdError(400, …)`` if this protocol cannot serve ``route``."""
        ...

    def leg_request_id(self, pair: PdPair) -> str | None:
        """An ``X-Request-Id`` both legs must carry (MoRI forges one); None: the router's own id."""
        ...

    def prefill_body(self, body: dict[str, Any], pair: PdPair) -> dict[str, Any]:
        """The prefill leg's JSON body. ``body`` is the client's (parsed); never mutate it."""
        ...

    def decode_body(self, body: dict[str, Any], pair: PdPair, prefill_reply: dict[str, Any] | None) -> dict[str, Any]:
        """The decode leg's JSON body. Serial protocols get the prefill leg's parsed JSON reply and
        raise ``PdError(502, …, "handoff_missing")`` when it carries no usable handoff."""
        ...


# -- helpers shared by the protocols ------------------------------------------------------------


def prefill_single_token(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg computes the prompt and one token, unstreamed: ``max_tokens=1``,
    ``stream=false``, no ``stream_options``, ``max_completion_tokens=1`` if present, and no
    ``min_tokens`` (an engine rejects min_tokens > max_tokens)."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_remaining(body: dict[str, Any]) -> dict[str, Any]:
    """The decode leg of a protocol whose prefill already emitted the first token: integer
    ``max_tokens``/``max_completion_tokens`` decremented by one (never below 1), and ``min_tokens``
    too (never below 0) — else a client's ``min_tokens == max_tokens`` would reach the decode
    engine as min > max, which it rejects."""
    out = copy.deepcopy(body)
    for key in ("max_tokens", "max_completion_tokens"):
        value = out.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            out[key] = max(1, value - 1)
    min_tokens = out.get("min_tokens")
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool):
        out["min_tokens"] = max(0, min_tokens - 1)
    return out


def params(worker: WorkerRecord) -> dict[str, Any]:
    """``disagg_meta.params`` of a worker (empty when absent)."""
    p = (worker.disagg_meta or {}).get("params")
    return p if isinstance(p, dict) else {}


OPENAI_ROUTES = (CHAT_ROUTE, COMPLETIONS_ROUTE)


def require_route(protocol: str, route: str, allowed: tuple[str, ...] = OPENAI_ROUTES) -> None:
    """``PdError(400, "unsupported_route")`` unless ``route`` is one this protocol serves."""
    if route not in allowed:
        raise PdError(400, f"PD protocol {protocol} serves only {', '.join(allowed)}, not {route}", "unsupported_route")


def misconfigured(protocol: str, worker: WorkerRecord, problem: str) -> PdError:
    """A worker record that cannot drive this protocol: the operator's fault, not the client's.
    The worker and what is wrong (its id, hosts, ports) go to the log; the client is told no address."""
    log.error("PD protocol %s: %s worker %s %s", protocol, worker.disagg_mode, worker.worker_id, problem)
    return PdError(
        500,
        f"PD protocol {protocol}: a {worker.disagg_mode} worker's record cannot drive it (see the server log)",
        "pd_misconfigured",
    )


def as_port(value: Any) -> int | None:
    """A TCP port from an int or a decimal string (engine configs carry both); None if invalid."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and value.isdecimal():
        value = int(value)
    if isinstance(value, int) and 0 < value < 65536:
        return value
    return None


def is_int(value: Any) -> TypeGuard[int]:
    """A JSON integer (``bool`` is an ``int`` subclass in Python, not in JSON)."""
    return isinstance(value, int) and not isinstance(value, bool)


def reply_kv_transfer_params(protocol: str, prefill_reply: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of the prefill reply's top-level ``kv_transfer_params``, or 502 ``handoff_missing``."""
    handoff = prefill_reply.get("kv_transfer_params") if isinstance(prefill_reply, dict) else None
    if not isinstance(handoff, dict):
        raise PdError(
            502, f"PD protocol {protocol}: the prefill reply carries no kv_transfer_params object", "handoff_missing"
        )
    return copy.deepcopy(handoff)


class ProtocolDefaults:
    """What most protocols share: both OpenAI routes, and the router's own request id on both legs."""

    name: str

    def check_route(self, route: str) -> None:
        require_route(self.name, route)

    def leg_request_id(self, pair: PdPair) -> str | None:
        return None
