"""What the router knows of the KV tiers below the GPU, and the local kvd (spec §2.2, §8).

* ``GET /v1/kv-stats``: per host (a worker URL's host), the workers there and, from the router's
  KV-event view, the blocks each of their targets holds per tier (``GPU`` from the prefix view,
  the lower tiers — ``CPU``, ``CPU_PINNED``, ``DISK``… — as their engines publish them); plus the
  local kvd's own counters when ``--kvd-socket-path`` is set. Like ``/v1/fleet`` it is open without
  ``--admin-token`` and needs the Bearer token (or the dashboard cookie) with one: it shows what
  each worker caches.
* ``POST /v1/cache/prewarm``: a prefetch hint for the kvd on this host. The body is checked as the
  spec has it (400 in the OpenAI error shape); one ``PrefetchHint`` goes over a short-lived
  connection, 202 ``{"accepted": true, "n_keys": N}``; no socket configured, or the daemon not
  reachable: 503 (its socket path only in the log). An optional ``worker_id`` names the worker whose
  kvd should load the blocks (the ``kvd_socket`` its record names, else ``--kvd-socket-path``): the
  router reaches only the kvd on its own host, so a worker elsewhere is a 400 that says so. With
  ``--admin-token`` it needs the Bearer token (it makes a daemon read its disk tier); at most
  ``MAX_PREWARM_KEYS`` keys (413) of 1..64 bytes and a ``deadline_ms`` of at most a minute (400).
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

import msgspec

from infera.api.errors import ApiError
from infera.discovery.record import WorkerRecord
from infera.kvd.client import KvdClient
from infera.kvd.protocol import MAX_KEY_BYTES
from infera.router.kv_aware import expand_targets
from infera.runtime import wait_for

log = logging.getLogger(__name__)

PREWARM_ROUTE = "/v1/cache/prewarm"
KV_STATS_ROUTE = "/v1/kv-stats"
PREFETCH_CLIENT_ID = "infera-router-prefetch"
KVD_TIMEOUT_S = 2.0  # connect + one request: a wedged daemon must not hold a handler
# One prewarm is one prompt's blocks: 65 536 blocks is a 1M-token prompt at 16 tokens a block (413 past it),
# and a prefetch worth doing lands within a minute (400 past it). Bigger hints only tie up the kvd.
MAX_PREWARM_KEYS = 65_536
MAX_PREWARM_DEADLINE_MS = 60_000
GPU_TIER = "GPU"

_json = msgspec.json.Encoder()
_decode_json = msgspec.json.Decoder()


def worker_host(worker: WorkerRecord) -> str:
    """The host part of a worker's URL (its name when the URL has none: a NATS worker)."""
    try:
        host = urlsplit(worker.url).hostname if worker.url else None
    except ValueError:
        host = None
    return host or worker.worker_id


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine: a loopback address, or its own host name."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    name = host.lower().rstrip(".")
    # (no getfqdn: a DNS lookup would block the event loop)
    return name == "localhost" or name == socket.gethostname().lower()


def kv_stats_view(workers: list[WorkerRecord], index: Any) -> dict[str, Any]:
    """Per host, its workers and their targets' blocks per tier (router's view; ``index`` None:
    the router keeps no KV view, so no block counts)."""
    hosts: dict[str, dict[str, Any]] = {}
    for w in sorted(workers, key=lambda r: r.worker_id):
        host = worker_host(w)
        entry = hosts.setdefault(host, {"workers": [], "tiers": {}})
        targets = []
        for rank, key in expand_targets(w):
            t: dict[str, Any] = {"route_key": key, "dp_rank": rank}
            if index is not None and index.has_target(key):
                tiers = {GPU_TIER: index.block_count(key), **index.tier_block_counts(key)}
                t["tiers"] = tiers
                totals = entry["tiers"]
                for tier, n in tiers.items():
                    totals[tier] = totals.get(tier, 0) + n
            targets.append(t)
        entry["workers"].append({"worker_id": w.worker_id, "url": w.url, "model": w.model_name,
                                 "targets": targets})
    return {"hosts": hosts}


async def kvd_stats(path: str) -> dict[str, Any]:
    """The local kvd's counters, or why they could not be read."""
    try:
        client = await KvdClient.connect(path, client_id=PREFETCH_CLIENT_ID, timeout=KVD_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError) as exc:
        return {"socket_path": path, "reachable": False, "error": f"cannot connect: {exc or type(exc).__name__}"}
    try:
        stats = await wait_for(client.stats(), KVD_TIMEOUT_S)
    except Exception as exc:  # a daemon that answers nonsense is reported, not raised
        return {"socket_path": path, "reachable": False, "error": f"stats failed: {exc or type(exc).__name__}"}
    finally:
        await client.close()
    return {"socket_path": path, "reachable": True, "stats": stats}


async def handle_kv_stats(workers: list[WorkerRecord], index: Any, kvd_socket_path: Optional[str]) -> bytes:
    body = kv_stats_view(workers, index)
    body["kv_view"] = index is not None
    body["kvd"] = await kvd_stats(kvd_socket_path) if kvd_socket_path else None
    return _json.encode(body)


class PrewarmRequest(msgspec.Struct, frozen=True):
    model: str
    keys: list[bytes]
    compat_key: str = ""
    deadline_ms: int = 1000
    worker_id: Optional[str] = None


def _bad(message: str, param: Optional[str] = None) -> ApiError:
    return ApiError(400, message, "invalid_request", param=param)


def parse_prewarm(raw: bytes) -> PrewarmRequest:
    """The prewarm body, checked as spec §2.2 has it; 400 (OpenAI shape) otherwise."""
    try:
        obj = _decode_json.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: msgspec's, for JSON nested too deep
        raise _bad(f"invalid JSON body: {exc}") from None
    if not isinstance(obj, dict):
        raise _bad("the body must be a JSON object")
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required (a non-empty string)", "model")
    hashes = obj.get("block_hashes")
    if not isinstance(hashes, list):
        raise _bad("'block_hashes' is required: a list of hex strings (the kvd keys of the blocks)", "block_hashes")
    if len(hashes) > MAX_PREWARM_KEYS:
        raise ApiError(413, f"'block_hashes' holds {len(hashes)} keys; at most {MAX_PREWARM_KEYS} per prewarm",
                       "too_many_keys", param="block_hashes")
    keys = []
    for i, h in enumerate(hashes):
        try:
            if not isinstance(h, str):
                raise ValueError
            key = bytes.fromhex(h)
            if not 1 <= len(key) <= MAX_KEY_BYTES:
                raise ValueError
            keys.append(key)
        except ValueError:
            raise _bad(f"block_hashes[{i}] is not a hex string of 1 to {MAX_KEY_BYTES} bytes", "block_hashes") from None
    compat_key = obj.get("compat_key", "")
    if not isinstance(compat_key, str):
        raise _bad("'compat_key' must be a string", "compat_key")
    deadline = obj.get("deadline_ms", 1000)
    if isinstance(deadline, bool) or not isinstance(deadline, int) or not 0 < deadline <= MAX_PREWARM_DEADLINE_MS:
        raise _bad(f"'deadline_ms' must be an integer from 1 to {MAX_PREWARM_DEADLINE_MS}", "deadline_ms")
    worker_id = obj.get("worker_id")
    if worker_id is not None and (not isinstance(worker_id, str) or not worker_id):
        raise _bad("'worker_id' must be a non-empty string", "worker_id")
    return PrewarmRequest(model, keys, compat_key, deadline, worker_id)


async def handle_prewarm(raw: bytes, kvd_socket_path: Optional[str],
                         find_worker: Callable[[str], Optional[WorkerRecord]]) -> bytes:
    """Validate, check the target kvd, send one PrefetchHint; the 202 body. ``find_worker``: the
    fleet's record of a ``worker_id`` the body names (None: unknown)."""
    req = parse_prewarm(raw)
    if req.worker_id is not None:
        worker = find_worker(req.worker_id)
        if worker is None:
            raise ApiError(404, "no such worker in the fleet", "worker_not_found", param="worker_id")
        host = worker_host(worker)
        if not is_local_host(host):
            raise _bad("that worker runs on another host: this router reaches only the kvd on its own host "
                       "(--kvd-socket-path); send the prewarm to a router on that host", "worker_id")
        # the kvd behind that worker's engine, as its launcher registered it (same host: same socket space)
        kvd_socket_path = worker.kvd_socket or kvd_socket_path
    if not req.keys:
        return _json.encode({"accepted": True, "n_keys": 0})
    if not kvd_socket_path:
        raise ApiError(503, "prewarm needs a kvd: start the server with --kvd-socket-path (or "
                            "INFERA_KVD_SOCKET_PATH), or name a local 'worker_id' whose launcher runs one "
                            "(--kvd-socket)", "kvd_not_configured")
    try:
        client = await KvdClient.connect(kvd_socket_path, client_id=PREFETCH_CLIENT_ID, timeout=KVD_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError) as exc:
        # (the socket path and the OS error stay in the log: a client learns nothing of the host's layout)
        log.warning("prewarm: kvd at %s is not reachable: %s", kvd_socket_path, exc or type(exc).__name__)
        raise ApiError(503, "the kvd is not reachable", "kvd_unavailable") from None
    try:
        await wait_for(client.prefetch_hint(req.keys, model=req.model, compat_key=req.compat_key,
                                                    deadline_ms=req.deadline_ms), KVD_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError) as exc:
        log.warning("prewarm: kvd at %s did not take the hint: %s", kvd_socket_path, exc or type(exc).__name__)
        raise ApiError(503, "the kvd did not take the hint", "kvd_unavailable") from None
    finally:
        await client.close()
    return _json.encode({"accepted": True, "n_keys": len(req.keys)})


__all__ = ["PREWARM_ROUTE", "KV_STATS_ROUTE", "handle_kv_stats", "handle_prewarm", "kv_stats_view",
           "parse_prewarm", "worker_host", "is_local_host"]
