"""An InferaDeployment's status, computed from what the operator saw: pure functions, no I/O.

* :func:`workload_readiness` reads one owned Deployment / StatefulSet / LeaderWorkerSet: how many
  replicas it wants and how many are ready, and whether its controller has caught up with its spec.
* :func:`next_state` is the state machine (§10): ``initializing`` until the first apply succeeds,
  then ``pending`` until every workload is ready, ``ready``; ``degraded`` when a workload drops
  below its wanted count after the CR was ready (without a spec change since); ``failed`` on a bad
  spec or an apply the API server refuses.
* :func:`compute_status` builds the whole ``status`` block, keeping each condition's
  ``lastTransitionTime`` unless its ``status`` flips, so an unchanged world gives an equal dict and
  the operator writes nothing.
* :func:`status_merge_patch` is the JSON merge patch (RFC 7386) from the old status to the new one:
  keys that disappeared (a removed pool) are set to ``null``, so a merge patch removes them.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

# Labels shared with the renderer (docs/kubernetes.md "Names and labels").
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "infera-operator"
DEPLOYMENT_LABEL = "infera.amd.com/deployment"
SERVICE_LABEL = "infera.amd.com/service"
COMPONENT_LABEL = "infera.amd.com/component"

# The kinds whose readiness makes a CR Ready (a DaemonSet's count depends on the nodes, not the spec).
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "LeaderWorkerSet")

INITIALIZING, PENDING, READY, DEGRADED, FAILED = "initializing", "pending", "ready", "degraded", "failed"
STATES = (INITIALIZING, PENDING, READY, DEGRADED, FAILED)

CONDITION_TYPES = ("Ready", "Progressing", "Degraded")


@dataclass(frozen=True)
class WorkloadReadiness:
    """One owned workload as the status reports it."""
    name: str          # the service label (a pool), else the component label (nats, etcd)
    kind: str
    replicas: int      # wanted (spec.replicas; LeaderWorkerSet: groups)
    ready_replicas: int
    up_to_date: bool   # its controller has observed its latest spec
    pool: bool = True  # one of spec.services (reported in status.services); False: the plane

    @property
    def ready(self) -> bool:
        return self.up_to_date and self.ready_replicas >= self.replicas

    def describe(self) -> str:
        text = f"{self.name} {self.ready_replicas}/{self.replicas} ready"
        return text if self.up_to_date else f"{text} (rollout not observed yet)"


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def workload_readiness(obj: Mapping[str, Any]) -> WorkloadReadiness:
    """Wanted and ready replicas of a Deployment, StatefulSet or LeaderWorkerSet.

    ``up_to_date`` is false while ``status.observedGeneration`` is behind ``metadata.generation``
    (a spec change not seen by its controller yet: the old Pods' readiness says nothing about the new
    spec) or while fewer replicas than wanted run the new spec (``updatedReplicas``). Either field
    missing counts as caught up, since not every controller writes them.
    """
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    replicas = _int(spec.get("replicas"), 1)
    ready = _int(status.get("readyReplicas"))
    up_to_date = True
    generation = meta.get("generation")
    observed = status.get("observedGeneration")
    if isinstance(generation, int) and isinstance(observed, int) and observed < generation:
        up_to_date = False
    updated = status.get("updatedReplicas")
    if isinstance(updated, int) and updated < replicas:
        up_to_date = False
    service = labels.get(SERVICE_LABEL)
    name = service or labels.get(COMPONENT_LABEL) or meta.get("name", "")
    return WorkloadReadiness(name=name, kind=obj.get("kind", ""), replicas=replicas,
                             ready_replicas=ready, up_to_date=up_to_date, pool=bool(service))


def services_status(workloads: Iterable[WorkloadReadiness]) -> dict[str, dict[str, Any]]:
    """``status.services``: the pools of ``spec.services`` (the plane's readiness shows in the
    conditions' messages only, so a pool named like a plane component cannot collide)."""
    return {w.name: {"kind": w.kind, "replicas": w.replicas, "readyReplicas": w.ready_replicas}
            for w in sorted(workloads, key=lambda w: w.name) if w.pool}


def next_state(previous: str | None, *, spec_error: bool, applied: bool, all_ready: bool,
               spec_changed: bool) -> str:
    """The CR's state after a reconcile (see the module docstring for the table)."""
    if spec_error:
        return FAILED
    if not applied:
        # A transient failure to apply keeps a running fleet's state; a new or failed CR waits.
        return previous if previous in (PENDING, READY, DEGRADED) else INITIALIZING
    if all_ready:
        return READY
    if previous in (READY, DEGRADED) and not spec_changed:
        return DEGRADED
    return PENDING


@dataclass(frozen=True)
class Outcome:
    """What one reconcile found, the input of :func:`compute_status`."""
    generation: int | None
    workloads: tuple[WorkloadReadiness, ...] = ()
    applied: bool = False
    spec_error: str | None = None       # SpecError's message: the spec is invalid
    apply_error: str | None = None      # the API server refused an object (terminal until the spec changes)
    transient_error: str | None = None  # the API could not be reached / answered 5xx (retried)
    gaie: dict[str, Any] | None = None  # status.gaie (gaie.enabled), from gaie_status; None: not enabled


def _conditions_for(state: str, outcome: Outcome) -> list[tuple[str, str, str, str]]:
    """(type, status, reason, message) of each condition for ``state``."""
    not_ready = [w.describe() for w in outcome.workloads if not w.ready]
    waiting = "waiting for " + ", ".join(not_ready) if not_ready else ""
    count = len(outcome.workloads)
    if state == FAILED:
        reason = "InvalidSpec" if outcome.spec_error is not None else "ApplyFailed"
        message = outcome.spec_error if outcome.spec_error is not None else (outcome.apply_error or "")
        return [("Ready", "False", reason, message), ("Progressing", "False", reason, message),
                ("Degraded", "True", reason, message)]
    if state == INITIALIZING:
        message = outcome.transient_error or "applying the rendered objects"
        return [("Ready", "False", "Initializing", message), ("Progressing", "True", "Initializing", message),
                ("Degraded", "False", "Initializing", "")]
    if state == READY:
        message = f"all {count} workloads ready"
        return [("Ready", "True", "AllReady", message), ("Progressing", "False", "Complete", message),
                ("Degraded", "False", "AllReady", "")]
    if state == DEGRADED:
        return [("Ready", "False", "ReplicasUnavailable", waiting),
                ("Progressing", "False", "ReplicasUnavailable", waiting),
                ("Degraded", "True", "ReplicasUnavailable", waiting)]
    # PENDING
    return [("Ready", "False", "Pending", waiting), ("Progressing", "True", "RollingOut", waiting),
            ("Degraded", "False", "Pending", "")]


def merge_conditions(previous: Iterable[Mapping[str, Any]] | None,
                     wanted: Iterable[tuple[str, str, str, str]], now: str,
                     generation: int | None = None) -> list[dict[str, Any]]:
    """The new conditions list: ``lastTransitionTime`` is kept from ``previous`` unless the
    condition's ``status`` changed (reason and message may change without a transition)."""
    old = {c.get("type"): c for c in (previous or []) if isinstance(c, Mapping)}
    merged = []
    for ctype, status, reason, message in wanted:
        before = old.get(ctype)
        if before is not None and before.get("status") == status and before.get("lastTransitionTime"):
            since = before["lastTransitionTime"]
        else:
            since = now
        condition: dict[str, Any] = {"type": ctype, "status": status, "reason": reason, "message": message,
                                     "lastTransitionTime": since}
        if generation is not None:
            condition["observedGeneration"] = generation
        merged.append(condition)
    return merged


def now_rfc3339(clock: datetime.datetime | None = None) -> str:
    moment = clock or datetime.datetime.now(datetime.timezone.utc)
    return moment.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def compute_status(previous: Mapping[str, Any] | None, outcome: Outcome, now: str) -> dict[str, Any]:
    """The CR's new ``status`` from its previous one and this reconcile's outcome."""
    previous = previous or {}
    prev_state = previous.get("state")
    spec_changed = outcome.generation != previous.get("observedGeneration")
    if outcome.spec_error is not None or outcome.apply_error is not None:
        state = FAILED
    else:
        state = next_state(prev_state, spec_error=False, applied=outcome.applied,
                           all_ready=all(w.ready for w in outcome.workloads), spec_changed=spec_changed)
    if not outcome.applied and state != INITIALIZING and outcome.spec_error is None and outcome.apply_error is None:
        # A transient failure on a running fleet: keep what was reported, only note nothing else.
        return dict(previous)
    status: dict[str, Any] = {}
    if outcome.generation is not None:
        status["observedGeneration"] = outcome.generation
    status["state"] = state
    wanted = _conditions_for(state, outcome)
    status["message"] = next(message for ctype, _, _, message in wanted if ctype == "Ready")
    status["conditions"] = merge_conditions(previous.get("conditions"), wanted, now, outcome.generation)
    status["services"] = services_status(outcome.workloads) if outcome.applied else {}
    if outcome.applied and outcome.gaie is not None:
        status["gaie"] = outcome.gaie
    # Fields other writers own pass through untouched; gaie is ours (dropped once it is turned off).
    for key, value in previous.items():
        if key not in ("observedGeneration", "state", "message", "conditions", "services", "gaie"):
            status.setdefault(key, value)
        elif key == "gaie" and not outcome.applied:
            status.setdefault(key, value)
    return status


def _accepted(obj: Mapping[str, Any] | None) -> bool:
    """A Gateway API object accepted by some parent: a gateway controller wrote ``Accepted=True``
    into one of its ``status.parents``."""
    for parent in ((obj or {}).get("status") or {}).get("parents") or []:
        for condition in parent.get("conditions") or []:
            if condition.get("type") == "Accepted" and condition.get("status") == "True":
                return True
    return False


def gaie_status(epp: WorkloadReadiness | None, pool: Mapping[str, Any] | None,
                route: Mapping[str, Any] | None) -> dict[str, Any]:
    """``status.gaie``: the endpoint picker's replicas, and whether the gateway controller accepted
    the InferencePool and the HTTPRoute. Only a gateway controller writes that acceptance, so
    ``ready`` is reported but does not hold the CR's own state (a fleet serves through its Service
    either way)."""
    status: dict[str, Any] = {"eppReplicas": epp.replicas if epp else 0,
                              "eppReadyReplicas": epp.ready_replicas if epp else 0}
    if pool is not None:
        status["inferencePoolName"] = (pool.get("metadata") or {}).get("name", "")
        status["inferencePoolReady"] = _accepted(pool)
    if route is not None:
        status["httpRouteName"] = (route.get("metadata") or {}).get("name", "")
        status["httpRouteAccepted"] = _accepted(route)
    status["ready"] = bool(epp is not None and epp.ready and status.get("inferencePoolReady")
                           and status.get("httpRouteAccepted"))
    return status


def status_merge_patch(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """RFC 7386 merge patch turning ``old`` into ``new`` (lists are replaced whole; keys only in
    ``old`` become ``null``). Empty when they are equal."""
    old = old or {}
    patch: dict[str, Any] = {}
    for key in old:
        if key not in new:
            patch[key] = None
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            sub = status_merge_patch(before, value)
            if sub:
                patch[key] = sub
        elif key not in old or before != value:
            patch[key] = value
    return patch
