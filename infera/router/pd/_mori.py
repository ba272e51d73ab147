"""What ``vllm-mori-write`` and ``vllm-mori-read`` share: vLLM's MoRIIOConnector wire contract.

MoRI finds its peers through the request id: both legs carry one forged id that names each
engine's host and its handshake/notify ports (from ``kv_connector_extra_config``). The two modes
differ only in who moves the KV (prefill writes into decode, or decode reads from prefill) and
so in where the transfer id and block ids come from.
"""
from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit
from uuid import uuid4

from infera.discovery.record import WorkerRecord
from infera.router.pd.base import PdPair, as_port, is_int, misconfigured, params

REQUEST_ID_KEY = "mori_request_id"  # pair.state: the forged id, so every caller gets the same one


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
    host = urlsplit(worker.url).hostname
    if not host:
        raise misconfigured(protocol, worker, f"has no host in its url {worker.url!r}")
    extra = _extra_config(worker)
    ports = {}
    for key in ("handshake_port", "notify_port"):
        ports[key] = as_port(extra.get(key))
        if ports[key] is None:
            raise misconfigured(protocol, worker,
                                f"advertises kv_connector_extra_config.{key} {extra.get(key)!r}; MoRI needs a port")
    return f"host:{host},handshake:{ports['handshake_port']},notify:{ports['notify_port']}"


def forged_request_id(protocol: str, pair: PdPair) -> str:
    """``___prefill_addr_<P>___decode_addr_<D>_<uuid4 hex>``: MoRI parses its peers out of it."""
    cached = pair.state.get(REQUEST_ID_KEY)
    if isinstance(cached, str):
        return cached
    forged = (f"___prefill_addr_{_peer_address(protocol, pair.prefill)}"
              f"___decode_addr_{_peer_address(protocol, pair.decode)}_{uuid4().hex}")
    pair.state[REQUEST_ID_KEY] = forged
    return forged


def room_transfer_id(room: int) -> str:
    """Write mode: both legs are built at once, so the id is derived from the shared room."""
    return "tx-%032x" % room


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


def decode_kv_transfer_params(protocol: str, pair: PdPair, transfer_id: str,
                              remote_engine_id: Any = None, remote_block_ids: Any = None) -> dict[str, Any]:
    """The decode leg's side, told the prefill engine's parallelism."""
    prefill_tp = tp_size(protocol, pair.prefill)
    return {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": remote_engine_id,
        "remote_block_ids": remote_block_ids,
        "transfer_id": transfer_id,
        "remote_dp_size": dp_size(pair.prefill),
        "tp_size": prefill_tp,
        "remote_tp_size": prefill_tp,
    }
