"""What ``vllm-mori-write`` and ``vllm-mori-read`` share: vLLM's MoRIIOConnector wire contract.

MoRI finds its peers through the request id: both legs carry one forged id that names each
engine's host and its handshake/notify ports (from ``kv_connector_extra_config``). The two modes
differ only in who moves the KV (prefill writes into decode, or decode reads from prefill) and
so in where the transfer id and block ids come from.

Checked against vLLM 0.32.0's ``kv_connector/v1/moriio`` (``moriio_common.py``:
``_PREFILL_ZMQ_RE``/``_DECODE_ZMQ_RE``, ``parse_moriio_zmq_address``, ``MoRIIOConnectorMetadata
.add_new_req``; ``moriio_connector.py``: ``_set_port_defaults``, ``update_state_after_alloc``,
``request_finished``):

* a missing or empty ``handshake_port``/``notify_port`` is 6301/61005 in the engine, so here too;
  the engine advertises ``kv_connector_extra_config.host_ip`` when set, so the id names it;
* ``add_new_req`` indexes ``transfer_id``, ``remote_engine_id`` and ``remote_block_ids`` without
  defaults: every leg carries the three keys (null where the engine fills them in);
* a decode leg names the prefill DP rank in ``remote_dp_rank`` (write mode: the rank whose notify
  port it signals; read mode: the rank whose memory it reads; default 0);
* read mode: the prefill's ``request_finished`` returns the whole handoff (engine id, blocks,
  host and ports, its own DP rank with ``remote_dp_rank_override``, DP sizes, TP size), which
  the decode leg carries on verbatim.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit
from uuid import uuid4

from infera.discovery.record import WorkerRecord
from infera.router.pd.base import PdPair, as_port, is_int, misconfigured, params

REQUEST_ID_KEY = "mori_request_id"  # pair.state: the forged id, so every caller gets the same one
# MoRIIOConstants.DEFAULT_HANDSHAKE_PORT / DEFAULT_NOTIFY_PORT: what the engine uses when unset.
DEFAULT_PORTS = {"handshake_port": 6301, "notify_port": 61005}


def _extra_config(worker: WorkerRecord) -> dict[str, Any]:
    extra = params(worker).get("kv_connector_extra_config")
    return extra if isinstance(extra, dict) else {}


def tp_size(protocol: str, worker: WorkerRecord) -> int:
    """The worker's ``kv_connector_extra_config.tp_size``; 1 when absent."""
    value = _extra_config(worker).get("tp_size")
    if value is None:
        return 1
    if not is_int(value) or value < 1:
        raise misconfigured(protocol, worker, f"advertises kv_connector_extra_config.tp_size {value!r}")
    return value


def dp_size(worker: WorkerRecord) -> int:
    return worker.dp_size or 1


def _peer_address(protocol: str, worker: WorkerRecord) -> str:
    extra = _extra_config(worker)
    host_ip = extra.get("host_ip")  # what the engine advertises when set (its resolve_host_ip)
    if host_ip is not None and host_ip != "" and not isinstance(host_ip, str):
        raise misconfigured(protocol, worker, f"advertises kv_connector_extra_config.host_ip {host_ip!r}")
    host = host_ip or urlsplit(worker.url).hostname
    if not host:
        raise misconfigured(protocol, worker, f"has no host in its url {worker.url!r}")
    ports = {}
    for key, default in DEFAULT_PORTS.items():
        raw = extra.get(key)
        ports[key] = default if raw is None or raw == "" or raw == 0 else as_port(raw)
        if ports[key] is None:
            raise misconfigured(
                protocol, worker, f"advertises kv_connector_extra_config.{key} {raw!r}; MoRI needs a port"
            )
    return f"host:{host},handshake:{ports['handshake_port']},notify:{ports['notify_port']}"


def prefill_dp_rank(pair: PdPair) -> int | None:
    """The prefill's global DP rank: the one the router pinned, else a rank-pinned record's."""
    return pair.prefill_rank if pair.prefill_rank is not None else pair.prefill.dp_rank


def forged_request_id(protocol: str, pair: PdPair) -> str:
    """``___prefill_addr_<P>___decode_addr_<D>_<uuid4 hex>``: MoRI parses its peers out of it."""
    cached = pair.state.get(REQUEST_ID_KEY)
    if isinstance(cached, str):
        return cached
    forged = (
        f"___prefill_addr_{_peer_address(protocol, pair.prefill)}"
        f"___decode_addr_{_peer_address(protocol, pair.decode)}_{uuid4().hex}"
    )
    pair.state[REQUEST_ID_KEY] = forged
    return forged


def room_transfer_id(room: int) -> str:
    """Write mode: both legs are built at once, so the id is derived from the shared room."""
    return f"tx-{room:032x}"


def random_transfer_id() -> str:
    """Read mode: the prefill leg runs first, so the id only has to be fresh."""
    return f"tx-{uuid4().hex}"


def prefill_kv_transfer_params(protocol: str, pair: PdPair, transfer_id: str) -> dict[str, Any]:
    """The prefill leg's side: it sends to (or is read by) the decode engine, so it is told the
    decode engine's parallelism."""
    decode_tp = tp_size(protocol, pair.decode)
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "transfer_id": transfer_id,
        "remote_dp_size": dp_size(pair.decode),
        "tp_size": decode_tp,
        "remote_tp_size": decode_tp,
    }


def decode_kv_transfer_params(protocol: str, pair: PdPair, transfer_id: str) -> dict[str, Any]:
    """Write mode's decode leg, told the prefill engine's parallelism and the DP rank it runs the
    request on (the notify goes to that rank's port; the engine assumes 0 when not told)."""
    prefill_tp = tp_size(protocol, pair.prefill)
    out: dict[str, Any] = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "transfer_id": transfer_id,
        "remote_dp_size": dp_size(pair.prefill),
        "tp_size": prefill_tp,
        "remote_tp_size": prefill_tp,
    }
    rank = prefill_dp_rank(pair)
    if rank is not None:
        out["remote_dp_rank"] = rank
    return out


def _positive_int(value: Any) -> int | None:
    return value if is_int(value) and value >= 1 else None


def decode_kv_transfer_params_from_handoff(
    protocol: str, pair: PdPair, transfer_id: str, handoff: dict[str, Any]
) -> dict[str, Any]:
    """Read mode's decode leg: the prefill reply's ``kv_transfer_params`` as the engine returned
    them (host, ports, its DP rank and sizes included), turned into a decode request; what the
    reply lacks comes from the prefill's record."""
    out = dict(handoff)
    out["do_remote_decode"] = False
    out["do_remote_prefill"] = True
    out["transfer_id"] = transfer_id
    out.setdefault("remote_dp_size", dp_size(pair.prefill))
    # The engine reads remote_tp_size first, then tp_size, as the prefill's TP degree.
    prefill_tp = (
        _positive_int(handoff.get("remote_tp_size"))
        or _positive_int(handoff.get("tp_size"))
        or tp_size(protocol, pair.prefill)
    )
    out.setdefault("tp_size", prefill_tp)
    out["remote_tp_size"] = prefill_tp
    rank = prefill_dp_rank(pair)
    if rank is not None:
        out.setdefault("remote_dp_rank", rank)
    return out
