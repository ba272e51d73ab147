"""What a Pod means to the fleet, for :mod:`infera.discovery.kubernetes` (which re-exports these
names): the annotation a worker's record lives in (``ANNOTATION``), and :func:`pod_state`, the pure
decision of what a (not deleted) Pod contributes: nothing (no annotation, not running, an
undecodable or wrongly signed record), its record as ``draining`` (terminating), or its record.
Also the lightkube client internals the discovery needs (``_generic``), checked once.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import msgspec
from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod

from infera.discovery.kubernetes_api import KubernetesError
from infera.discovery.record import FleetKey, RecordSignatureError, WorkerRecord, decode_record

ANNOTATION = "infera.amd.com/worker-info"


# --------------------------------------------------------------------------------------------
# Pod → record (pure)
# --------------------------------------------------------------------------------------------
class PodState(NamedTuple):
    record: WorkerRecord | None  # what the fleet should hold for this Pod (None: nothing)
    reason: str  # "active" | "draining" | "no-annotation" | "not-running" | "bad-annotation" | "bad-signature"
    detail: str = ""


def pod_state(pod: Pod, fleet_key: FleetKey | None = None) -> PodState:
    """Decide what a (not deleted) Pod contributes to the fleet; with ``fleet_key``, only a record
    signed with it counts."""
    meta = pod.metadata
    raw = (meta.annotations or {}).get(ANNOTATION) if meta is not None else None
    if not raw:
        return PodState(None, "no-annotation")
    phase = pod.status.phase if pod.status is not None else None
    if phase != "Running":
        return PodState(None, "not-running", phase or "unknown")
    try:
        record = decode_record(raw, fleet_key)
    except RecordSignatureError as exc:
        return PodState(None, "bad-signature", str(exc))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return PodState(None, "bad-annotation", str(exc))
    if meta.deletionTimestamp is not None:
        # Terminating: stop routing now, before the kubelet's SIGTERM reaches the worker.
        return PodState(msgspec.structs.replace(record, status="draining"), "draining")
    return PodState(record, "active")


def _pod_name(pod: Pod) -> str:
    return (pod.metadata.name if pod.metadata is not None else None) or ""


def _generic(client: AsyncClient) -> Any:
    generic = getattr(client, "_client", None)
    if generic is None or not hasattr(generic, "prepare_request"):
        raise KubernetesError("unsupported lightkube version: AsyncClient._client.prepare_request is missing")
    return generic
