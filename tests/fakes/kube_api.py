"""A fake Kubernetes API server: in-memory, aiohttp, started by tests on a loopback port.

It serves any kind under ``/api/v1`` and ``/apis/<group>/<version>`` — the built-in kinds of
:data:`BUILTIN_TYPES` and whatever CustomResourceDefinitions register — with the semantics that
Infera's discovery, the operator (kopf), the local kubelet and the real ``kubectl`` rely on:

* paths: ``/api/v1/<plural>`` and ``/apis/<g>/<v>/<plural>`` (cluster-scoped kinds, and lists and
  watches across every namespace), ``.../namespaces/<ns>/<plural>[/<name>[/status|/scale]]``;
  verbs ``GET`` (get, list, ``?watch=true``), ``POST`` (create; ``generateName``; 409
  AlreadyExists), ``PUT`` (update), ``PATCH``, ``DELETE``, and ``DELETE`` on a collection
  (deletecollection, by label/field selector); ``dryRun`` computes an answer and stores nothing;
* metadata: ``uid``, ``creationTimestamp``, ``resourceVersion`` (one global, monotonically increasing
  counter, also on list metadata), ``generation`` (bumped only when something outside metadata and
  status changes); a write that changes nothing changes no resourceVersion and emits no event;
* errors are ``Status`` objects worded as kube-apiserver words them: 404 NotFound, 409 AlreadyExists,
  409 Conflict (a stale ``metadata.resourceVersion`` in a PUT or PATCH: optimistic concurrency;
  failed DeleteOptions preconditions), 422 Invalid (with ``details.causes``), 400 BadRequest, 415;
* PATCH: ``application/merge-patch+json`` (RFC 7386: objects merge recursively, ``null`` deletes a key),
  ``application/json-patch+json`` (RFC 6902, the ``jsonpatch`` package),
  ``application/strategic-merge-patch+json`` (built-in kinds only, as on a real server; the
  essentials, see :func:`strategic_merge_patch`) and ``application/apply-patch+yaml`` (server-side
  apply, ``fieldManager`` required; creates an absent object; merges by :func:`apply_merge`, and
  removes what the same field manager applied last time and leaves out now, :func:`drop_unapplied`);
* ``/status`` (kinds with a status subresource): writes through the main resource keep the stored
  ``status``; writes through ``/status`` change only ``status``. ``/scale`` (Deployments,
  StatefulSets, ReplicaSets, and CRDs that declare ``subresources.scale``) reads and writes an
  ``autoscaling/v1`` ``Scale`` (merge, JSON and strategic patches, PUT); ``POST pods/<name>/binding``
  sets an unbound Pod's ``spec.nodeName`` (409 once bound);
* CustomResourceDefinitions (``apiextensions.k8s.io/v1``): creating one registers its served versions
  (plural, singular, shortNames, categories, scope, status/scale subresources) in discovery at once
  (status Established); updating it re-registers; deleting it deletes its custom resources, ends
  the watches of its kind and unregisters it. Custom resources are validated, pruned and defaulted against the version's
  ``openAPIV3Schema`` (:func:`apply_schema`): type errors, ``enum``, ``required``, bounds, ``pattern``
  → 422 Invalid naming the field; unknown fields under ``fieldValidation=Strict`` → 400
  ``strict decoding error: unknown field "spec.x"``; under ``Warn`` (the default) a ``Warning``
  header per field, and pruned; under ``Ignore`` pruned;
* discovery: ``/version``, ``/api``, ``/api/v1``, ``/apis``, ``/apis/<g>``, ``/apis/<g>/<v>``
  (APIResourceLists with verbs, shortNames, categories and the ``<plural>/status`` and
  ``<plural>/scale`` subresources). Aggregated discovery is not served: a client asking for it gets
  the plain documents, which kubectl accepts (it falls back). ``/openapi/v3`` is a minimal document
  (per built-in group/version, each kind's PATCH operation with its ``fieldValidation`` parameter,
  no schemas), enough for kubectl to leave validation to the server (it sends
  ``fieldValidation=Strict``); ``/openapi/v2`` is an empty document;
* deletion: DELETE of a Pod bound to a node (``spec.nodeName``) with a grace period other than 0
  (``gracePeriodSeconds`` in the query or the DeleteOptions body; default the Pod's
  ``terminationGracePeriodSeconds``, else 30) sets ``deletionTimestamp`` and
  ``deletionGracePeriodSeconds`` (MODIFIED); the kubelet's later DELETE with grace 0 removes it
  (DELETED). An object with ``metadata.finalizers`` gets ``deletionTimestamp`` and is removed by the
  update that empties its finalizers. Anything else is removed at once;
* garbage collection: removing an object removes, at once and recursively, every object whose
  ``ownerReferences`` name its uid (same namespace; any namespace for a cluster-scoped owner), each
  deleted as a DELETE would (a bound Pod goes graceful); ``propagationPolicy=Orphan`` (or
  ``orphanDependents``) keeps them and drops the owner reference instead. An object written with
  owner references none of which names a stored object is deleted right after that write (the
  collector finds it dangling). Deleting a Namespace deletes what is in it;
* Services: ``spec.clusterIP`` (and ``clusterIPs``) allocated on create from a loopback range
  (:data:`SERVICE_IP_RANGE`, 127.0.200.0–127.0.254.255, counting up from ``service_ip_start``: by
  default a random address there, so that the Service proxies of tests running side by side on one
  machine do not collide; hosts .0 and .255 are skipped), unless given or ``None`` (headless), and
  kept across updates; ``ports[].protocol`` defaults to TCP and ``targetPort`` to ``port``.
  Deployments/StatefulSets/ReplicaSets default ``spec.replicas`` to 1; a new Pod's status is
  ``phase: Pending``; a new Namespace's is ``phase: Active``;
* ``labelSelector`` on lists, watches and deletecollection of every kind: ``a=b``, ``a==b``, ``a!=b``,
  ``a in (x,y)``, ``a notin (x,y)``, ``a``, ``!a``; a comma is AND;
* ``fieldSelector``: ``=``, ``==``, ``!=`` on ``metadata.name`` and ``metadata.namespace`` for every
  kind, plus the Pod fields in :data:`FIELDS` and a few Event and Secret fields (:data:`KIND_FIELDS`);
  a field's change in or out of the selector is ADDED / DELETED on a watch, as for labels. Any other
  field answers 400 ``field label not supported: <field>``, as a real server does for a field it
  does not index: a selector is never silently ignored;
* watches on every kind: newline-delimited ``{"type", "object"}`` events after the given
  resourceVersion (the history since then is replayed first), none/``0`` = synthetic ADDED for the
  current objects; ``sendInitialEvents=true`` (watch-list) = the current objects then a BOOKMARK
  annotated ``k8s.io/initial-events-end``; a label change in or out of the selector is seen as ADDED /
  DELETED, as the watch cache does; ``allowWatchBookmarks`` (BOOKMARK on :meth:`FakeKubeApi.bookmark`
  and every ``bookmark_interval`` seconds when set); ``timeoutSeconds`` (the server ends the stream
  cleanly); a resourceVersion older than the kept history → an ``ERROR`` event carrying a
  ``Status`` with ``code: 410, reason: Expired`` (what a real server sends once a watch is open);
  a resourceVersion newer than the server's own: it waits ``too_large_wait_s`` for the store to
  get there (a real watch cache waits 3 s), then answers what kube-apiserver's
  ``storage.NewTooLargeResourceVersionError`` builds — a ``Status`` with ``code: 504``,
  ``reason: Timeout``, ``message: "Timeout: Too large resource version: X, current: Y"`` and the
  cause ``{reason: ResourceVersionTooLarge, message: "Too large resource version"}`` — as a watch
  ``ERROR`` event (``too_large_as="event"``, the cacher's errWatcher) or as the HTTP 504 answer
  itself (``too_large_as="http"``, an error returned before the watch opened); every open watch
  ends when the server stops;
* ``Authorization: Bearer <token>`` is required when the fake has a token (401 otherwise);
* every request is logged in :attr:`FakeKubeApi.request_log` as (loop time, kind, query) and in
  :attr:`FakeKubeApi.access_log` as (method, path and query, status).

Test helpers: :meth:`~FakeKubeApi.add_pod`, :meth:`~FakeKubeApi.set_phase`,
:meth:`~FakeKubeApi.set_annotation`, :meth:`~FakeKubeApi.set_labels`,
:meth:`~FakeKubeApi.begin_graceful_delete` (sets ``deletionTimestamp``: MODIFIED) then
:meth:`~FakeKubeApi.finish_delete` (DELETED), like the kubelet during the grace period;
:meth:`~FakeKubeApi.get` / :meth:`~FakeKubeApi.list` (any kind), and the verbs in-process:
:meth:`~FakeKubeApi.create_object`, :meth:`~FakeKubeApi.update_object`,
:meth:`~FakeKubeApi.patch_object`, :meth:`~FakeKubeApi.delete_object` (KubeError on failure);
:meth:`~FakeKubeApi.compact`, :meth:`~FakeKubeApi.close_watches` (clean end or abrupt drop),
:meth:`~FakeKubeApi.fail_next` (answer the next requests with an error status),
:meth:`~FakeKubeApi.stop` / :meth:`~FakeKubeApi.start` (an outage on the same port, state kept;
``start(fresh_watch_cache=True)`` is a restarted API server: its watch cache is rebuilt from
storage, so a watch from any earlier resourceVersion gets 410 Gone);
:meth:`~FakeKubeApi.snapshot` / :meth:`~FakeKubeApi.restore` (etcd restored from a backup: the
objects and the resourceVersion go back, so a client's newer resourceVersion is "too large").

Where it differs from a real API server:

* Built-in kinds are not validated against their schemas (any JSON object with metadata is stored
  as given; labels and annotations must be strings), except that ``fieldValidation=Strict`` (what
  kubectl sends) refuses their unknown fields, found with the 1.37 JSON schemas of the
  ``kubernetes-validate`` package (:class:`BuiltinFieldChecker`); under ``Warn`` only a custom
  resource's unknown fields are reported. No admission, defaulting beyond the few above, or immutability
  checks (e.g. a Deployment's selector may change). Custom-resource validation covers the
  keywords :func:`apply_schema` names: no CEL (``x-kubernetes-validations``), ``format``,
  ``uniqueItems``, list-type/map-keys uniqueness, ratcheting, or conversion webhooks (every served
  version of a CRD shares the same stored objects; only ``apiVersion`` is rewritten).
* No controllers: nothing turns Deployments into Pods or fills workload status (the local kubelet,
  ``tests/fakes/kubelet.py``, does that). Garbage collection runs synchronously inside the delete
  and ``Foreground`` propagation acts as ``Background``; a dangling dependent goes at once, not
  eventually. A Namespace is removed at once with its contents (no Terminating phase), and objects
  may be created in a namespace that does not exist. ``v1`` and ``events.k8s.io/v1`` Events are
  stored apart (a real server serves one store under both). CRDs are Established at once.
* Server-side apply keeps no ``managedFields`` (objects carry none): the fake remembers each field
  manager's last applied configuration instead, and a field that configuration set and the next
  one leaves out is removed even if another writer changed it meanwhile (a real server would leave
  a field it no longer owns alone). There are no field-manager conflicts (409), so ``force``
  changes nothing; lists merge by key when :data:`MERGE_KEYS` names one or every item has a
  ``name``, ignoring a CRD's ``x-kubernetes-list-type``/``-map-keys``. Strategic merge knows the
  merge keys in :data:`MERGE_KEYS` by field name only (no per-type patch metadata); other lists
  are replaced.
* OpenAPI documents without schemas (``kubectl explain`` has nothing to show), no aggregated
  discovery. ``kubectl get`` gets a Table (server-side printing) for gets and lists: Name, a CRD
  version's ``additionalPrinterColumns`` (``jsonPath`` steps ``.a``, ``[0]``, ``[?(@.k=="v")]``), or
  a few of kubectl's columns for Pods, Services, Deployments, StatefulSets, ReplicaSets, Namespaces,
  then Age; other built-in kinds show Name and Age only; ``kubectl get -w`` falls back to
  client-side printing (watches send objects, not Tables).
* JSON and YAML bodies only: a protobuf body answers 415. kubectl's typed commands (``kubectl create
  namespace|deployment|...``, ``kubectl run``) send protobuf and fail; ``apply``, ``get``, ``patch``,
  ``scale``, ``delete``, ``wait``, ``apply --server-side`` use JSON and work.
* kubectl (client-go) sends no bearer token over plain http: give a fake that kubectl talks to
  ``token=None`` (or the client gets 401).
* Lists ignore ``resourceVersion``/``resourceVersionMatch`` and ``limit``/``continue`` (always
  one page, always the latest state). Watches ignore ``resourceVersionMatch``. Field selectors
  cover only :data:`KIND_FIELDS` (a real server has a few more, e.g. ``spec.restartPolicy``;
  those answer 400 here).
* History is kept in full until :meth:`compact` (or past ``history_limit`` events); a real server
  keeps a time/size-bounded watch cache. No periodic bookmarks unless ``bookmark_interval`` is set.
* No HTTP/2, TLS, RBAC, authentication beyond one bearer token, rate limiting (429) or request
  timeouts; tokens are compared as plain strings.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import ipaddress
import json
import random
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

import jsonpatch
import jsonpointer
import yaml
from aiohttp import web

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
PATCH_TYPES = (JSON_PATCH, MERGE_PATCH, STRATEGIC_PATCH, APPLY_PATCH)
_TRUE = ("true", "1", "True")
SERVICE_IP_RANGE = ("127.0.200.0", "127.0.254.255")  # Service cluster IPs (the local kubelet's Pod IPs are below)


# --------------------------------------------------------------------------------------------
# Label selectors
# --------------------------------------------------------------------------------------------
class Requirement(NamedTuple):
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!exists"
    values: tuple[str, ...] = ()


_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_EXISTS = re.compile(rf"^(?P<neg>!)?\s*(?P<key>{_KEY})$")
_EQUALITY = re.compile(rf"^(?P<key>{_KEY})\s*(?P<op>==|=|!=)\s*(?P<value>{_VALUE})$")
_SET = re.compile(rf"^(?P<key>{_KEY})\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)$")
_SET_VALUE = re.compile(rf"^{_VALUE}$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside parentheses (``a in (x,y),b`` is two requirements)."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ')' in selector {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth:
        raise ValueError(f"unbalanced '(' in selector {text!r}")
    parts.append("".join(current))
    return parts


def parse_selector(text: str | None) -> list[Requirement]:
    """Parse a label selector; ``""``/None selects everything. ValueError when malformed."""
    if text is None or not text.strip():
        return []
    requirements = []
    for raw in _split_top_level(text):
        part = raw.strip()
        if not part:
            raise ValueError(f"empty requirement in selector {text!r}")
        if m := _SET.match(part):
            values = tuple(v.strip() for v in m["values"].split(","))
            if not values or any(not _SET_VALUE.match(v) for v in values) or values == ("",):
                raise ValueError(f"bad value list in {part!r}")
            requirements.append(Requirement(m["key"], m["op"], values))
        elif m := _EQUALITY.match(part):
            requirements.append(Requirement(m["key"], "!=" if m["op"] == "!=" else "=", (m["value"],)))
        elif m := _EXISTS.match(part):
            requirements.append(Requirement(m["key"], "!exists" if m["neg"] else "exists"))
        else:
            raise ValueError(f"cannot parse requirement {part!r} of selector {text!r}")
    return requirements


def selector_matches(requirements: Iterable[Requirement], labels: dict[str, str] | None) -> bool:
    labels = labels or {}
    for key, op, values in requirements:
        present = key in labels
        value = labels.get(key)
        if op == "=":
            ok = present and value == values[0]
        elif op == "!=":
            ok = not present or value != values[0]  # Kubernetes: != also matches a missing key
        elif op == "in":
            ok = present and value in values
        elif op == "notin":
            ok = not present or value not in values
        elif op == "exists":
            ok = present
        else:  # "!exists"
            ok = not present
        if not ok:
            return False
    return True


# Pod fields a field selector may name here (a subset of what kube-apiserver indexes for Pods),
# with where each one lives in the object. Anything else: 400, never silently ignored.
FIELDS: dict[str, tuple[str, ...]] = {
    "metadata.name": ("metadata", "name"),
    "metadata.namespace": ("metadata", "namespace"),
    "spec.nodeName": ("spec", "nodeName"),
    "status.phase": ("status", "phase"),
    "status.podIP": ("status", "podIP"),
}
_FIELD_TERM = re.compile(r"^\s*(?P<key>[A-Za-z0-9.]+)\s*(?P<op>==|=|!=)\s*(?P<value>[^,=!]*?)\s*$")


class FieldSelectorError(ValueError):
    """A field selector the fake (or a real server) refuses; ``unsupported`` names the field, if that is why."""

    def __init__(self, message: str, unsupported: str | None = None) -> None:
        super().__init__(message)
        self.unsupported = unsupported


def parse_field_selector(text: str | None, fields: dict[str, tuple[str, ...]] = FIELDS) -> list[Requirement]:
    """Parse a field selector (``=``, ``==``, ``!=``; a comma is AND); ``""``/None selects everything.
    FieldSelectorError on a malformed term or a field not in ``fields`` (default: the Pod's :data:`FIELDS`)."""
    if text is None or not text.strip():
        return []
    requirements = []
    for part in text.split(","):
        m = _FIELD_TERM.match(part)
        if m is None:
            raise FieldSelectorError(f"invalid selector: '{text}'; can't understand '{part}'")
        if m["key"] not in fields:
            raise FieldSelectorError(f"field label not supported: {m['key']}", unsupported=m["key"])
        requirements.append(Requirement(m["key"], "!=" if m["op"] == "!=" else "=", (m["value"],)))
    return requirements


def pod_fields(pod: dict[str, Any], fields: dict[str, tuple[str, ...]] = FIELDS) -> dict[str, str]:
    """The ``fields`` (default: the Pod's :data:`FIELDS`) of an object as a real server indexes them
    (a missing one is ``""``)."""
    out = {}
    for name, path in fields.items():
        value: Any = pod
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        out[name] = "" if value is None else str(value)
    return out


def fields_match(requirements: Iterable[Requirement], pod: dict[str, Any],
                 fields: dict[str, tuple[str, ...]] = FIELDS) -> bool:
    values = pod_fields(pod, fields) if requirements else {}
    for key, op, (value,) in requirements:
        if (values[key] == value) != (op == "="):
            return False
    return True


# --------------------------------------------------------------------------------------------
# JSON merge patch (RFC 7386), strategic merge patch, server-side apply merge
# --------------------------------------------------------------------------------------------
def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# The merge keys of the lists kubectl's client-side apply patches strategically (from the Go
# types' patchMergeKey tags). A list not named here is replaced whole, as an atomic list is.
# ``ports`` is keyed by ``containerPort`` in a container and by ``port`` in a Service.
MERGE_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",), "initContainers": ("name",), "ephemeralContainers": ("name",),
    "env": ("name",), "volumes": ("name",), "volumeMounts": ("mountPath",),
    "ports": ("containerPort", "port"), "imagePullSecrets": ("name",), "conditions": ("type",),
    "ownerReferences": ("uid",), "hostAliases": ("ip",), "topologySpreadConstraints": ("topologyKey",),
    "resourceClaims": ("name",),
}
# Lists of scalars that merge as sets (patchStrategy "merge" on a primitive list).
MERGE_SETS = frozenset({"finalizers"})


def _merge_key(field_name: str, items: list[Any]) -> str | None:
    for key in MERGE_KEYS.get(field_name, ()):
        if any(isinstance(item, dict) and key in item for item in items):
            return key
    return None


def strategic_merge_patch(target: Any, patch: Any, field_name: str = "") -> Any:
    """The essentials of ``application/strategic-merge-patch+json`` (what kubectl apply sends for
    built-in kinds): maps merge like a merge patch; lists named in :data:`MERGE_KEYS` merge item by
    item on their key (an item ``{"$patch": "delete", key: v}`` removes one); ``$patch: replace``
    replaces a map or list; ``$retainKeys`` keeps only the listed keys of a map;
    ``$setElementOrder/<list>`` orders a merged list; ``$deleteFromPrimitiveList/<list>`` removes
    scalars. Other ``$`` directives are dropped."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if not k.startswith("$")}
    if patch.get("$patch") == "delete":
        return None
    result = dict(target) if isinstance(target, dict) else {}
    orders = {k.split("/", 1)[1]: v for k, v in patch.items() if k.startswith("$setElementOrder/")}
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            if isinstance(result.get(name), list):
                result[name] = [v for v in result[name] if v not in value]
            continue
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list):
            result[key] = _strategic_list(result.get(key), value, key)
        else:
            merged = strategic_merge_patch(result.get(key), value, key)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
    for name, order in orders.items():
        if isinstance(result.get(name), list):
            result[name] = _apply_order(result[name], order, name)
    if "$retainKeys" in patch:
        keep = set(patch["$retainKeys"])
        result = {k: v for k, v in result.items() if k in keep}
    return result


def _strategic_list(live: Any, patch: list[Any], field_name: str) -> list[Any]:
    live = live if isinstance(live, list) else []
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [copy.deepcopy(i) for i in patch if not (isinstance(i, dict) and "$patch" in i)]
    if field_name in MERGE_SETS:
        return live + [v for v in patch if v not in live]
    key = _merge_key(field_name, patch + live)
    if key is None:
        return [copy.deepcopy(v) for v in patch]
    result = [copy.deepcopy(i) for i in live]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            continue
        index = next((i for i, cur in enumerate(result) if isinstance(cur, dict) and cur.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is None:
            result.append(strategic_merge_patch({}, item, field_name))
        else:
            result[index] = strategic_merge_patch(result[index], item, field_name)
    return result


def _apply_order(items: list[Any], order: list[Any], field_name: str) -> list[Any]:
    key = _merge_key(field_name, order + items)

    def ident(item: Any) -> Any:
        return item.get(key) if key is not None and isinstance(item, dict) else json.dumps(item, sort_keys=True)

    rank = {ident(o): i for i, o in enumerate(order)}
    return sorted(items, key=lambda item: rank.get(ident(item), len(rank)))


def _apply_list_key(field_name: str, items: list[Any]) -> str | None:
    """How server-side apply matches a list's items here: the :data:`MERGE_KEYS`, else ``name``
    when every item has one; None = an atomic list (replaced whole)."""
    key = _merge_key(field_name, items)
    if key is None and items and all(isinstance(i, dict) and "name" in i for i in items):
        key = "name"
    return key


def apply_merge(live: Any, applied: Any, field_name: str = "") -> Any:
    """Server-side apply's merge: maps merge recursively, lists of keyed items (see
    :func:`_apply_list_key`) merge by key, any other value is replaced. What a field manager applied
    before and leaves out now is removed first by :func:`drop_unapplied`."""
    if isinstance(applied, dict) and isinstance(live, dict):
        result = dict(live)
        for key, value in applied.items():
            result[key] = apply_merge(live.get(key), value, key)
        return result
    if isinstance(applied, list) and isinstance(live, list):
        key = _apply_list_key(field_name, applied + live)
        if key is None:
            return copy.deepcopy(applied)
        result = [copy.deepcopy(i) for i in live]
        for item in applied:
            index = next((i for i, cur in enumerate(result)
                          if isinstance(cur, dict) and isinstance(item, dict) and cur.get(key) == item.get(key)), None)
            if index is None:
                result.append(copy.deepcopy(item))
            else:
                result[index] = apply_merge(result[index], item, field_name)
        return result
    return copy.deepcopy(applied)


def drop_unapplied(live: Any, previous: Any, current: Any, field_name: str = "") -> Any:
    """Remove from ``live`` what a field manager's ``previous`` applied configuration set and its
    ``current`` one leaves out (map keys, keyed list items), as server-side apply does for the
    fields that manager owns. Ownership is approximated by "this manager applied it last time":
    a field another writer changed meanwhile is still removed."""
    if isinstance(previous, dict) and isinstance(live, dict):
        current = current if isinstance(current, dict) else {}
        result = dict(live)
        for key, before in previous.items():
            if key not in current:
                result.pop(key, None)
            elif key in result:
                result[key] = drop_unapplied(result[key], before, current[key], key)
        return result
    if isinstance(previous, list) and isinstance(live, list) and isinstance(current, list):
        key = _apply_list_key(field_name, previous + current + live)
        if key is None:
            return live  # an atomic list: the apply replaces it whole
        now = {item.get(key): item for item in current if isinstance(item, dict)}
        before = {item.get(key): item for item in previous if isinstance(item, dict)}
        result = []
        for item in live:
            ident = item.get(key) if isinstance(item, dict) else None
            if ident in before and ident not in now:
                continue
            result.append(drop_unapplied(item, before[ident], now[ident], field_name) if ident in before else item)
        return result
    return live


# --------------------------------------------------------------------------------------------
# Custom resources: OpenAPI v3 schema validation, pruning and defaulting (structural schemas)
# --------------------------------------------------------------------------------------------
class FieldError(NamedTuple):
    """One validation error, worded as kube-apiserver's ``field.Error`` prints it."""
    field: str
    reason: str  # the StatusCause reason: FieldValueInvalid, FieldValueRequired, FieldValueNotSupported...
    message: str  # the whole "<field>: <detail>" line


_TYPE_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}


def _type_name(value: Any) -> str:
    return "null" if value is None else _TYPE_NAMES.get(type(value), type(value).__name__)


def _quote(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else (json.dumps(value) if value is not None else "null")


def _shown(value: Any) -> str:
    return f'"{_type_name(value)}"' if isinstance(value, (dict, list)) else _quote(value)


def _type_ok(value: Any, typ: str) -> bool:
    if typ == "integer":
        if isinstance(value, float):
            return value.is_integer()
        return isinstance(value, int) and not isinstance(value, bool)
    if typ == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if typ == "boolean":
        return isinstance(value, bool)
    if typ == "string":
        return isinstance(value, str)
    if typ == "array":
        return isinstance(value, list)
    if typ == "object":
        return isinstance(value, dict)
    return True


@dataclass
class SchemaResult:
    """What :func:`apply_schema` found: the pruned and defaulted object, the errors (422) and the
    unknown fields it pruned (400 under ``fieldValidation=Strict``, warnings under Warn)."""
    value: Any
    errors: list[FieldError]
    unknown: list[str]


def apply_schema(obj: dict[str, Any], schema: dict[str, Any]) -> SchemaResult:
    """Validate a custom resource against its version's ``openAPIV3Schema`` the way
    apiextensions-apiserver does the essentials: ``type`` (``nullable``), ``enum``, ``required``,
    ``minimum``/``maximum`` (and exclusive), ``minLength``/``maxLength``, ``pattern``,
    ``minItems``/``maxItems``, ``minProperties``/``maxProperties``, ``allOf``/``anyOf``/``oneOf``/``not``,
    ``additionalProperties``, ``x-kubernetes-int-or-string``, ``x-kubernetes-preserve-unknown-fields``,
    ``x-kubernetes-embedded-resource``; unknown fields are pruned (and reported); ``default``s are
    applied where a field is absent (or null where null is not allowed: such nulls are pruned
    first). ``apiVersion``/``kind``/``metadata`` at the root are not the
    schema's business (the server checks ObjectMeta itself)."""
    errors: list[FieldError] = []
    unknown: list[str] = []
    root = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    checked = _walk(root, schema, "", errors, unknown, root=True)
    out = {k: obj[k] for k in ("apiVersion", "kind", "metadata") if k in obj}
    out.update(checked if isinstance(checked, dict) else {})
    return SchemaResult(out, errors, unknown)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _walk(value: Any, schema: dict[str, Any], path: str, errors: list[FieldError], unknown: list[str],
          root: bool = False) -> Any:
    if value is None:
        if schema.get("nullable"):
            return None
        typ = schema.get("type") or ("integer-or-string" if schema.get("x-kubernetes-int-or-string") else "")
        if typ:
            errors.append(FieldError(path, "FieldValueInvalid",
                                     f'{path}: Invalid value: "null": {path} in body must be of type {typ}: "null"'))
        return value
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            errors.append(FieldError(path, "FieldValueInvalid",
                                     f'{path}: Invalid value: "{_type_name(value)}": {path} in body must be of type '
                                     f'integer-or-string: "{_type_name(value)}"'))
            return value
    else:
        typ = schema.get("type")
        if typ and not _type_ok(value, typ):
            errors.append(FieldError(path, "FieldValueInvalid",
                                     f'{path}: Invalid value: "{_type_name(value)}": {path} in body must be of type '
                                     f'{typ}: "{_type_name(value)}"'))
            return value
    if isinstance(value, dict):
        value = _walk_object(value, schema, path, errors, unknown, root)
    elif isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, dict):
            value = [_walk(v, items, f"{path}[{i}]", errors, unknown) for i, v in enumerate(value)]
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(FieldError(path, "FieldValueInvalid", f"{path}: Invalid value: {len(value)}: {path} in body "
                                                                f"should have at least {schema['minItems']} items"))
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(FieldError(path, "FieldValueTooMany",
                                     f"{path}: Too many: {len(value)}: must have at most {schema['maxItems']} items"))
    _check_value(value, schema, path, errors)
    return value


def _walk_object(value: dict[str, Any], schema: dict[str, Any], path: str, errors: list[FieldError],
                 unknown: list[str], root: bool) -> dict[str, Any]:
    props = schema.get("properties") or {}
    extra = schema.get("additionalProperties")
    preserve = schema.get("x-kubernetes-preserve-unknown-fields") is True
    embedded = schema.get("x-kubernetes-embedded-resource") is True
    out: dict[str, Any] = {}
    for key, item in value.items():
        sub = _join(path, key)
        known = props.get(key, extra if isinstance(extra, dict) else None)
        if item is None and known is not None and not known.get("nullable"):
            continue  # a null where null is not allowed is pruned (then defaulted), as the server does
        if key in props:
            out[key] = _walk(item, props[key], sub, errors, unknown)
        elif isinstance(extra, dict):
            out[key] = _walk(item, extra, sub, errors, unknown)
        elif extra is True or preserve or (embedded and key in ("apiVersion", "kind", "metadata")):
            out[key] = item
        else:
            unknown.append(sub)
    for key, sub_schema in props.items():
        if key not in out and "default" in sub_schema:
            out[key] = _walk(copy.deepcopy(sub_schema["default"]), sub_schema, _join(path, key), errors, unknown)
    for key in schema.get("required") or ():
        if key not in out:
            errors.append(FieldError(_join(path, key), "FieldValueRequired", f"{_join(path, key)}: Required value"))
    if "minProperties" in schema and len(out) < schema["minProperties"]:
        errors.append(FieldError(path, "FieldValueInvalid", f"{path}: Invalid value: {len(out)}: {path} in body should "
                                                            f"have at least {schema['minProperties']} properties"))
    if "maxProperties" in schema and len(out) > schema["maxProperties"]:
        errors.append(FieldError(path, "FieldValueTooMany",
                                 f"{path}: Too many: {len(out)}: must have at most {schema['maxProperties']} items"))
    return out


def _passes(value: Any, schema: dict[str, Any], path: str) -> bool:
    errors: list[FieldError] = []
    _walk(copy.deepcopy(value), schema, path, errors, [])
    return not errors


def _invalid_value(path: str, shown: str, detail: str) -> FieldError:
    """``<path>: Invalid value: <shown>: <path> in body <detail>`` (kube-openapi's wording)."""
    return FieldError(path, "FieldValueInvalid", f"{path}: Invalid value: {shown}: {path} in body {detail}")


def _check_value(value: Any, schema: dict[str, Any], path: str, errors: list[FieldError]) -> None:
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(_quote(v) for v in schema["enum"])
        errors.append(FieldError(path, "FieldValueNotSupported",
                                 f"{path}: Unsupported value: {_quote(value)}: supported values: {supported}"))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is not None and (value <= low if schema.get("exclusiveMinimum") else value < low):
            relation = "greater than" if schema.get("exclusiveMinimum") else "greater than or equal to"
            errors.append(_invalid_value(path, str(value), f"should be {relation} {low}"))
        if high is not None and (value >= high if schema.get("exclusiveMaximum") else value > high):
            relation = "less than" if schema.get("exclusiveMaximum") else "less than or equal to"
            errors.append(_invalid_value(path, str(value), f"should be {relation} {high}"))
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(_invalid_value(path, _quote(value), f"should be at least {schema['minLength']} chars long"))
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(FieldError(path, "FieldValueTooLong",
                                     f"{path}: Too long: may not be more than {schema['maxLength']} bytes"))
        if "pattern" in schema:
            try:
                matched = re.search(schema["pattern"], value) is not None
            except re.error:
                matched = True  # an ECMA pattern Python cannot compile: not checked here
            if not matched:
                errors.append(_invalid_value(path, _quote(value), f"should match '{schema['pattern']}'"))
    for sub in schema.get("allOf") or ():
        _check_value(value, sub, path, errors)
    if schema.get("anyOf") and not any(_passes(value, s, path) for s in schema["anyOf"]):
        errors.append(_invalid_value(path, _shown(value), "must match at least one schema (anyOf)"))
    if schema.get("oneOf") and sum(_passes(value, s, path) for s in schema["oneOf"]) != 1:
        errors.append(_invalid_value(path, _shown(value), "must validate one and only one schema (oneOf)"))
    if isinstance(schema.get("not"), dict) and _passes(value, schema["not"], path):
        errors.append(_invalid_value(path, _shown(value), "should not validate the given schema"))


class BuiltinFieldChecker:
    """Unknown fields of built-in kinds, found with the Kubernetes 1.37 JSON schemas that the
    ``kubernetes-validate`` package ships (its strict schemas forbid additional properties): what
    ``fieldValidation=Strict`` refuses on a real server. Only unknown fields are reported (a real
    server's other checks are not the JSON schema's). Validators are built once per kind."""

    SCHEMA_VERSION = "1.37.0"

    def __init__(self) -> None:
        self._validators: dict[tuple[str, str], Any] = {}

    def _validator(self, api_version: str, kind: str) -> Any:
        key = (api_version, kind)
        if key not in self._validators:
            self._validators[key] = self._build(api_version, kind)
        return self._validators[key]

    def _build(self, api_version: str, kind: str) -> Any:
        try:
            import jsonschema
            from kubernetes_validate.utils import schema_contents
            from referencing import Registry, Resource
        except ImportError:  # the package is a dev dependency; without it nothing is checked
            return None
        group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
        directory = f"kubernetes-json-schema/v{self.SCHEMA_VERSION}-local-strict"
        try:
            schema = schema_contents(f"{directory}/{kind.lower()}-{group_version}.json", self.SCHEMA_VERSION)
            definitions = schema_contents(f"{directory}/_definitions.json", self.SCHEMA_VERSION)
        except (FileNotFoundError, OSError, ValueError):
            return None
        registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
        return jsonschema.validators.Draft202012Validator(schema, registry=registry)

    def unknown_fields(self, obj: dict[str, Any]) -> list[str]:
        """``spec.template.spec.containers[0].imagePullPolicyy``-style paths, sorted."""
        validator = self._validator(obj.get("apiVersion", ""), obj.get("kind", ""))
        if validator is None:
            return []
        found = []
        for error in validator.iter_errors(obj):
            if error.validator != "additionalProperties" or not isinstance(error.instance, dict):
                continue
            base = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
            allowed = set((error.schema or {}).get("properties") or {})
            found.extend(_join(base, name) for name in error.instance if name not in allowed)
        return sorted(found)


# --------------------------------------------------------------------------------------------
# Resource types
# --------------------------------------------------------------------------------------------
VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass(frozen=True)
class ScalePaths:
    """Where a scalable kind keeps its replicas (a CRD's ``subresources.scale``, JSON paths as ``.spec.replicas``)."""
    spec_replicas: str
    status_replicas: str
    label_selector: str | None = None


@dataclass(frozen=True)
class ResourceType:
    """One served resource: ``group`` "" is the core group (``/api/v1``)."""
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    singular: str = ""
    short_names: tuple[str, ...] = ()
    status: bool = False  # a /status subresource: the main resource's writes drop .status
    scale: ScalePaths | None = None
    schema: dict[str, Any] | None = field(default=None, compare=False)  # a CR version's openAPIV3Schema
    crd: str | None = None  # the CustomResourceDefinition that registered it
    categories: tuple[str, ...] = ()
    printer_columns: tuple[dict[str, Any], ...] = field(default=(), compare=False)  # a CRD version's columns

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> tuple[str, str]:
        """Where its objects are stored: every served version of a group/plural shares the objects."""
        return (self.group, self.plural)

    @property
    def qualified(self) -> str:
        """How error messages name it: ``pods``, ``deployments.apps``."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def discovery(self) -> list[dict[str, Any]]:
        """Its entries in an APIResourceList (the resource, then ``/status`` and ``/scale``)."""
        main: dict[str, Any] = {"name": self.plural, "singularName": self.singular or self.kind.lower(),
                                "namespaced": self.namespaced, "kind": self.kind, "verbs": list(VERBS)}
        if self.short_names:
            main["shortNames"] = list(self.short_names)
        if self.categories:
            main["categories"] = list(self.categories)
        out = [main]
        if self.status:
            out.append({"name": f"{self.plural}/status", "singularName": "", "namespaced": self.namespaced,
                        "kind": self.kind, "verbs": ["get", "patch", "update"]})
        if self.scale is not None:
            out.append({"name": f"{self.plural}/scale", "singularName": "", "namespaced": self.namespaced,
                        "group": "autoscaling", "version": "v1", "kind": "Scale", "verbs": ["get", "patch", "update"]})
        return out


_WORKLOAD_SCALE = ScalePaths(".spec.replicas", ".status.replicas", ".spec.selector")


def _builtin(group: str, version: str, plural: str, kind: str, namespaced: bool = True, short: tuple[str, ...] = (),
             status: bool = False, scale: ScalePaths | None = None, categories: tuple[str, ...] = ()) -> ResourceType:
    return ResourceType(group, version, plural, kind, namespaced, kind.lower(), short, status, scale,
                        categories=categories)


BUILTIN_TYPES: tuple[ResourceType, ...] = (
    _builtin("", "v1", "pods", "Pod", short=("po",), status=True, categories=("all",)),
    _builtin("", "v1", "services", "Service", short=("svc",), status=True, categories=("all",)),
    _builtin("", "v1", "endpoints", "Endpoints", short=("ep",)),
    _builtin("", "v1", "configmaps", "ConfigMap", short=("cm",)),
    _builtin("", "v1", "secrets", "Secret"),
    _builtin("", "v1", "serviceaccounts", "ServiceAccount", short=("sa",)),
    _builtin("", "v1", "namespaces", "Namespace", namespaced=False, short=("ns",), status=True),
    _builtin("", "v1", "nodes", "Node", namespaced=False, short=("no",), status=True),
    _builtin("", "v1", "events", "Event", short=("ev",)),
    _builtin("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", short=("pvc",), status=True),
    _builtin("apps", "v1", "deployments", "Deployment", short=("deploy",), status=True, scale=_WORKLOAD_SCALE,
             categories=("all",)),
    _builtin("apps", "v1", "statefulsets", "StatefulSet", short=("sts",), status=True, scale=_WORKLOAD_SCALE,
             categories=("all",)),
    _builtin("apps", "v1", "daemonsets", "DaemonSet", short=("ds",), status=True, categories=("all",)),
    _builtin("apps", "v1", "replicasets", "ReplicaSet", short=("rs",), status=True, scale=_WORKLOAD_SCALE,
             categories=("all",)),
    _builtin("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", short=("pdb",), status=True),
    _builtin("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    _builtin("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    _builtin("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False),
    _builtin("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", namespaced=False),
    _builtin("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition",
             namespaced=False, short=("crd", "crds"), status=True),
    _builtin("coordination.k8s.io", "v1", "leases", "Lease"),
    _builtin("events.k8s.io", "v1", "events", "Event", short=("ev",)),
)

# Field selectors every kind supports, and the extra ones a kind has (a real server indexes a few
# more; anything else answers 400, never silently ignored).
GENERIC_FIELDS: dict[str, tuple[str, ...]] = {
    "metadata.name": ("metadata", "name"),
    "metadata.namespace": ("metadata", "namespace"),
}
KIND_FIELDS: dict[tuple[str, str], dict[str, tuple[str, ...]]] = {
    ("", "pods"): FIELDS,
    ("", "events"): {**GENERIC_FIELDS, "involvedObject.kind": ("involvedObject", "kind"),
                     "involvedObject.name": ("involvedObject", "name"),
                     "involvedObject.namespace": ("involvedObject", "namespace"),
                     "involvedObject.uid": ("involvedObject", "uid"), "reason": ("reason",), "type": ("type",)},
    ("", "secrets"): {**GENERIC_FIELDS, "type": ("type",)},
}


def crd_resource_types(crd: dict[str, Any]) -> list[ResourceType]:
    """The resource types a CustomResourceDefinition serves (one per served version); ValueError
    naming the field when the CRD cannot be served."""
    spec = crd.get("spec")
    if not isinstance(spec, dict):
        raise ValueError("spec: Required value")
    group, names = spec.get("group"), spec.get("names") or {}
    plural, kind = names.get("plural"), names.get("kind")
    if not group:
        raise ValueError("spec.group: Required value")
    if not plural:
        raise ValueError("spec.names.plural: Required value")
    if not kind:
        raise ValueError("spec.names.kind: Required value")
    name = (crd.get("metadata") or {}).get("name")
    if name != f"{plural}.{group}":
        raise ValueError(f'metadata.name: Invalid value: "{name}": must be spec.names.plural+"."+spec.group')
    scope = spec.get("scope")
    if scope not in ("Namespaced", "Cluster"):
        raise ValueError(f'spec.scope: Unsupported value: "{scope}": supported values: "Cluster", "Namespaced"')
    versions = spec.get("versions") or []
    if not versions:
        raise ValueError("spec.versions: Invalid value: null: must have exactly one version marked as storage version")
    if sum(1 for v in versions if v.get("storage")) != 1:
        raise ValueError("spec.versions: Invalid value: must have exactly one version marked as storage version")
    out = []
    for i, version in enumerate(versions):
        if not version.get("name"):
            raise ValueError(f"spec.versions[{i}].name: Required value")
        if not version.get("served"):
            continue
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        if not isinstance(schema, dict):
            raise ValueError(f"spec.versions[{i}].schema.openAPIV3Schema: Required value: schemas are required")
        subresources = version.get("subresources") or {}
        scale = subresources.get("scale")
        out.append(ResourceType(
            group, version["name"], plural, kind, scope == "Namespaced", names.get("singular") or kind.lower(),
            tuple(names.get("shortNames") or ()), "status" in subresources,
            ScalePaths(scale["specReplicasPath"], scale["statusReplicasPath"], scale.get("labelSelectorPath"))
            if isinstance(scale, dict) else None,
            schema, name, tuple(names.get("categories") or ()),
            tuple(c for c in version.get("additionalPrinterColumns") or () if isinstance(c, dict))))
    return out


def _path_get(obj: Any, json_path: str) -> Any:
    for key in json_path.lstrip(".").split("."):
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def _path_set(obj: dict[str, Any], json_path: str, value: Any) -> None:
    keys = json_path.lstrip(".").split(".")
    for key in keys[:-1]:
        obj = obj.setdefault(key, {})
    obj[keys[-1]] = value


def selector_string(selector: Any) -> str:
    """A LabelSelector (``matchLabels``/``matchExpressions``) as the selector string a Scale's status carries."""
    if isinstance(selector, str):
        return selector
    if not isinstance(selector, dict):
        return ""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or ():
        op, key, values = expr.get("operator"), expr.get("key"), ",".join(expr.get("values") or ())
        parts.append({"In": f"{key} in ({values})", "NotIn": f"{key} notin ({values})",
                      "Exists": key, "DoesNotExist": f"!{key}"}.get(op, key))
    return ",".join(parts)
# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------
def status_body(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                            "message": message, "reason": reason, "code": code}
    if details is not None:
        body["details"] = details
    return body


def too_large_status(requested: int, current: int, retry_after_s: int = 1) -> dict[str, Any]:
    """kube-apiserver's ``storage.NewTooLargeResourceVersionError``: ``errors.NewTimeoutError`` (504,
    reason Timeout, message prefixed "Timeout: ") plus the cause client-go's reflector looks for
    (``metav1.StatusCause`` serializes its type as ``reason``)."""
    return status_body(504, "Timeout", f"Timeout: Too large resource version: {requested}, current: {current}",
                       {"causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                        "retryAfterSeconds": retry_after_s})


class KubeError(Exception):
    """An error answer: carries the ``Status`` object a real server would send."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status_body(code, reason, message, details)

    @property
    def code(self) -> int:
        return self.status["code"]


def _details(rtype: ResourceType, name: str) -> dict[str, Any]:
    return {"name": name, "group": rtype.group, "kind": rtype.plural}


def not_found(rtype: ResourceType, name: str) -> KubeError:
    return KubeError(404, "NotFound", f'{rtype.qualified} "{name}" not found', _details(rtype, name))


def conflict(rtype: ResourceType, name: str, why: str = "the object has been modified; please apply your "
                                                        "changes to the latest version and try again") -> KubeError:
    return KubeError(409, "Conflict", f'Operation cannot be fulfilled on {rtype.qualified} "{name}": {why}',
                     _details(rtype, name))


def invalid(rtype: ResourceType, name: str, errors: list[FieldError]) -> KubeError:
    qualified_kind = f"{rtype.kind}.{rtype.group}" if rtype.group else rtype.kind
    text = errors[0].message if len(errors) == 1 else "[" + ", ".join(e.message for e in errors) + "]"
    causes = [{"reason": e.reason, "message": e.message.split(": ", 1)[-1], "field": e.field} for e in errors]
    return KubeError(422, "Invalid", f'{qualified_kind} "{name}" is invalid: {text}',
                     {"name": name, "group": rtype.group, "kind": rtype.kind, "causes": causes})


def _json_response(body: Any, status: int = 200, warnings: Iterable[str] = ()) -> web.Response:
    # Exactly "application/json" (no charset): lightkube turns an error into ApiError only then.
    response = web.Response(status=status, body=json.dumps(body).encode(), headers={"Content-Type": JSON})
    for warning in warnings:
        response.headers.add("Warning", f'299 - {json.dumps(warning)}')
    return response


def _error(code: int, reason: str, message: str) -> web.Response:
    return _json_response(status_body(code, reason, message), code)


def _error_status(body: dict[str, Any]) -> web.Response:
    return _json_response(body, body["code"])


def _now(offset_s: float = 0) -> str:
    moment = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=offset_s)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _version_priority(version: str) -> tuple[int, int, int]:
    """kube-aware version order (v1 > v1beta2 > v1beta1 > v1alpha1 > anything else), as discovery sorts."""
    m = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if m is None:
        return (0, 0, 0)
    stability = {"alpha": 1, "beta": 2, None: 3}[m[2]]
    return (stability, int(m[1]), int(m[3] or 0))


class _Event(NamedTuple):
    rv: int
    type: str  # ADDED | MODIFIED | DELETED
    key: tuple[str, str]  # (group, plural)
    namespace: str
    obj: dict[str, Any]
    prev: dict[str, Any] | None  # the object before a MODIFIED (selector transitions)


_CLOSE = object()  # queue sentinel: end the stream cleanly
_ABORT = object()  # queue sentinel: drop the connection


@dataclass(eq=False)
class _Watcher:
    rtype: ResourceType
    namespace: str | None  # None = all namespaces
    selector: list[Requirement]
    bookmarks: bool
    fields: list[Requirement] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def matches(self, obj: dict[str, Any]) -> bool:
        return (selector_matches(self.selector, obj["metadata"].get("labels"))
                and fields_match(self.fields, obj, KIND_FIELDS.get(self.rtype.key, GENERIC_FIELDS)))

    def translate(self, event: _Event) -> dict[str, Any] | None:
        """The event as this watcher sees it (selector transitions become ADDED / DELETED)."""
        if event.key != self.rtype.key or (self.namespace is not None and event.namespace != self.namespace):
            return None
        now = self.matches(event.obj)
        if event.type == "MODIFIED":
            before = event.prev is not None and self.matches(event.prev)
            kind = "MODIFIED" if before and now else "ADDED" if now else "DELETED" if before else None
        else:
            kind = event.type if now else None
        if kind is None:
            return None
        obj = event.obj
        if obj.get("apiVersion") != self.rtype.api_version:  # another served version of a CRD
            obj = {**obj, "apiVersion": self.rtype.api_version}
        return {"type": kind, "object": obj}


@dataclass
class _Target:
    """What a request's path names."""
    rtype: ResourceType | None = None
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None
    discovery: str | None = None  # "version" / "api" / "apis" / "group" / "resources" / "openapi"
    group: str = ""
    version: str = ""


_TARGET = web.RequestKey("target", object)  # what the middleware resolved the path to
_NO_SUCH_PATH = "the server could not find the requested resource"


class FakeKubeApi:
    """In-memory objects of any kind behind an aiohttp server; see the module docstring for what it honours."""

    def __init__(self, *, namespace: str = "default", token: str | None = "test-token",
                 history_limit: int | None = None, bookmark_interval: float | None = None,
                 too_large_wait_s: float = 0.2, too_large_as: str = "event",
                 service_ip_start: str | None = None) -> None:
        if too_large_as not in ("event", "http"):
            raise ValueError("too_large_as is 'event' (a watch ERROR event) or 'http' (the HTTP 504 itself)")
        self.namespace = namespace  # the helpers' default namespace
        self.token = token
        self.user = f"system:serviceaccount:{namespace}:default"  # who an injected 403 says was refused
        self.history_limit = history_limit
        self.bookmark_interval = bookmark_interval
        self.too_large_wait_s = too_large_wait_s  # a real watch cache waits 3 s for a newer resourceVersion
        self.too_large_as = too_large_as
        low, high = (int(ipaddress.IPv4Address(a)) for a in SERVICE_IP_RANGE)
        start = ipaddress.IPv4Address(service_ip_start) if service_ip_start else \
            ipaddress.IPv4Address(random.Random().randint(low, high))
        if not low <= int(start) <= high:
            raise ValueError(f"service_ip_start {start} is outside {SERVICE_IP_RANGE[0]}-{SERVICE_IP_RANGE[1]}")
        self.service_ip_start = start
        # (group, plural) -> {(namespace or "", name): object}; every served version shares them.
        self.store: dict[tuple[str, str], dict[tuple[str, str], dict[str, Any]]] = {}
        self.types: dict[tuple[str, str, str], ResourceType] = {}  # (group, version, plural)
        for rtype in BUILTIN_TYPES:
            self._register(rtype)
        self.history: list[_Event] = []
        self.rv = 0
        self.compacted_rv = 0  # watches from an older resourceVersion get 410 Gone
        # requests by kind: "list" / "watch" / "get" / "patch" / "create" / "delete" / "update" / "discovery"
        self.requests: dict[str, int] = {}
        self.watch_params: list[dict[str, str]] = []  # query of every watch request, in order
        self.list_params: list[dict[str, str]] = []  # query of every list request, in order
        self.request_log: list[tuple[float, str, dict[str, str]]] = []  # (loop time, kind, query)
        self.access_log: list[tuple[str, str, int]] = []  # (method, path with query, status) of every request
        self.too_large = 0  # watches answered "Too large resource version"
        self.patches: list[tuple[str, dict[str, Any]]] = []  # (pod name, merge patch body) of Pod PATCHes
        self._orphan_on_removal: set[str] = set()  # uids deleted with propagationPolicy=Orphan
        self._uids: set[str] = set()  # every stored object's uid (owner references resolve against it)
        self._applied: dict[str, dict[str, Any]] = {}  # uid -> field manager -> its last applied configuration
        self._builtin_fields = BuiltinFieldChecker()
        self._watchers: set[_Watcher] = set()
        self._failures: list[tuple[int, str | None]] = []  # (status, only this request kind | None)
        self._rv_waiters: list[asyncio.Future] = []  # watches waiting for a newer resourceVersion
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- resource types ----------------------------------------------------------------------
    def _register(self, rtype: ResourceType) -> None:
        self.types[(rtype.group, rtype.version, rtype.plural)] = rtype
        self.store.setdefault(rtype.key, {})

    def _type_for_key(self, key: tuple[str, str]) -> ResourceType | None:
        return next((t for t in self.types.values() if t.key == key), None)

    def resource_type(self, api_version: str, kind: str) -> ResourceType:
        """The served type of ``apiVersion``/``kind`` (KeyError when none)."""
        group, _, version = api_version.rpartition("/")
        for rtype in self.types.values():
            if rtype.group == group and rtype.version == version and rtype.kind == kind:
                return rtype
        raise KeyError(f"no kind {kind!r} is served in {api_version!r}")

    @property
    def pods(self) -> dict[tuple[str, str], dict[str, Any]]:
        return self.store[("", "pods")]

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int | None = None, *, fresh_watch_cache: bool = False) -> "FakeKubeApi":
        """Serve on ``port`` (default: the previous port, else a free one). The stored state survives
        restarts; with ``fresh_watch_cache`` the watch history does not (a restarted kube-apiserver
        rebuilds its watch cache from a list at the current resourceVersion: a watch from any
        earlier one gets 410 Gone, "too old resource version")."""
        if fresh_watch_cache:
            self.compact()
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port if port is None else port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        """Stop serving (open watches are dropped); the stored state stays for a later start()."""
        self.close_watches(abrupt=True)
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    def kubeconfig_dict(self, namespace: str | None = None) -> dict[str, Any]:
        user: dict[str, Any] = {"token": self.token} if self.token else {}
        return {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake-user", "user": user}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake-user",
                                                      "namespace": namespace or self.namespace}}],
        }

    def kubeconfig(self, namespace: str | None = None):
        from lightkube import KubeConfig

        return KubeConfig.from_dict(self.kubeconfig_dict(namespace))

    def write_kubeconfig(self, path, namespace: str | None = None) -> str:
        """Write a kubeconfig file for this server (JSON is valid YAML); returns the path."""
        with open(path, "w") as f:
            json.dump(self.kubeconfig_dict(namespace), f)
        return str(path)

    # -- test helpers: state -------------------------------------------------------------------
    def add_pod(self, name: str, labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
                phase: str = "Running", ip: str | None = None, namespace: str | None = None) -> dict[str, Any]:
        ns = namespace or self.namespace
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": dict(labels or {}),
                         "annotations": dict(annotations or {})},
            "spec": {"containers": [{"name": "worker", "image": "infera:test"}]},
            "status": {"phase": phase, **({"podIP": ip} if ip else {})},
        }
        return self._store_new(ns, pod)

    def get_pod(self, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        pod = self.pods.get((namespace or self.namespace, name))
        return copy.deepcopy(pod) if pod is not None else None

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """A stored object of any kind (a copy), or None."""
        rtype = self.resource_type(api_version, kind)
        obj = self.store[rtype.key].get((self._ns(rtype, namespace), name))
        return self._out(rtype, obj) if obj is not None else None

    def list(self, api_version: str, kind: str, namespace: str | None = None,
             label_selector: str | None = None) -> list[dict[str, Any]]:
        """Stored objects of a kind (copies; ``namespace`` None = every namespace), sorted by namespace and name."""
        rtype = self.resource_type(api_version, kind)
        return self._list(rtype, namespace, parse_selector(label_selector), [])

    def annotations(self, name: str, namespace: str | None = None) -> dict[str, str]:
        pod = self.pods[(namespace or self.namespace, name)]
        return dict(pod["metadata"].get("annotations") or {})

    def set_phase(self, name: str, phase: str, namespace: str | None = None) -> dict[str, Any]:
        return self._modify(namespace, name, {"status": {"phase": phase}})

    def set_annotation(self, name: str, key: str, value: str | None, namespace: str | None = None) -> dict[str, Any]:
        """Set (or, with None, remove) one annotation."""
        return self._modify(namespace, name, {"metadata": {"annotations": {key: value}}})

    def set_labels(self, name: str, labels: dict[str, str | None], namespace: str | None = None) -> dict[str, Any]:
        return self._modify(namespace, name, {"metadata": {"labels": labels}})

    def begin_graceful_delete(self, name: str, grace_s: int = 30, namespace: str | None = None) -> dict[str, Any]:
        """Step one of a graceful delete: ``deletionTimestamp`` is set (MODIFIED); the Pod stays."""
        return self._modify(namespace, name, {"metadata": {"deletionTimestamp": _now(),
                                                           "deletionGracePeriodSeconds": grace_s}})

    def finish_delete(self, name: str, namespace: str | None = None) -> dict[str, Any]:
        """Step two (or a force delete): the Pod is gone (DELETED); its dependents are collected."""
        return self._remove(self._type_for_key(("", "pods")), namespace or self.namespace, name)

    delete_pod = finish_delete

    # -- test helpers: watches and failures ----------------------------------------------------
    def compact(self) -> int:
        """Forget the whole history: a watch from any earlier resourceVersion gets 410 Gone."""
        self.history.clear()
        self.compacted_rv = self.rv
        return self.rv

    def snapshot(self) -> dict[str, Any]:
        """The stored state (every object and the resourceVersion), for :meth:`restore`."""
        return {"store": copy.deepcopy(self.store), "rv": self.rv}

    def restore(self, snapshot: dict[str, Any]) -> None:
        """etcd restored from a backup (do it while stopped): the objects and the resourceVersion go
        back to ``snapshot``, and no watch history survives. A client's resourceVersion from after
        the backup is now "too large"; one from before it, "too old"."""
        self.store = copy.deepcopy(snapshot["store"])
        self.types = {k: t for k, t in self.types.items() if t.crd is None}
        for crd in self.store.get(("apiextensions.k8s.io", "customresourcedefinitions"), {}).values():
            for rtype in crd_resource_types(crd):
                self._register(rtype)
        self.rv = snapshot["rv"]
        self._uids = {obj["metadata"].get("uid") for objects in self.store.values() for obj in objects.values()}
        self.compact()

    def close_watches(self, abrupt: bool = False) -> int:
        """End every open watch: cleanly (stream terminated) or, with ``abrupt``, by dropping the
        connection mid-stream. Returns how many were open."""
        for watcher in self._watchers:
            watcher.queue.put_nowait(_ABORT if abrupt else _CLOSE)
        return len(self._watchers)

    def bookmark(self) -> int:
        """Send a BOOKMARK at the current resourceVersion to every watch that allows them."""
        count = 0
        for watcher in self._watchers:
            if watcher.bookmarks:
                watcher.queue.put_nowait(self._bookmark_event(watcher.rtype))
                count += 1
        return count

    @property
    def open_watches(self) -> int:
        return len(self._watchers)

    def fail_next(self, status: int = 503, count: int = 1, kind: str | None = None) -> None:
        """Answer the next ``count`` requests (of ``kind``: "list", "watch", "patch"... or any) with ``status``.
        A 403 on a resource is worded as an RBAC denial (``<resource> "<name>" is forbidden: User
        "<user>" cannot <verb> resource "<plural>" in API group "<group>" in the namespace "<ns>"``)."""
        self._failures.extend([(status, kind)] * count)

    # -- storage ------------------------------------------------------------------------------
    def _bump(self) -> int:
        self.rv += 1
        waiters, self._rv_waiters = self._rv_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        return self.rv

    async def _wait_for_rv(self, rv: int, timeout: float) -> bool:
        """Wait up to ``timeout`` for the store to reach ``rv`` (as a watch cache does before
        answering "Too large resource version")."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.rv < rv:
            left = deadline - loop.time()
            if left <= 0:
                return False
            waiter = loop.create_future()
            self._rv_waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, left)
            except asyncio.TimeoutError:
                pass
        return True

    def _record(self, kind: str, key: tuple[str, str], ns: str, obj: dict[str, Any],
                prev: dict[str, Any] | None = None) -> None:
        event = _Event(self.rv, kind, key, ns, copy.deepcopy(obj), copy.deepcopy(prev) if prev is not None else None)
        self.history.append(event)
        if self.history_limit is not None and len(self.history) > self.history_limit:
            dropped = self.history[: len(self.history) - self.history_limit]
            del self.history[: len(dropped)]
            self.compacted_rv = dropped[-1].rv
        for watcher in self._watchers:
            out = watcher.translate(event)
            if out is not None:
                watcher.queue.put_nowait(out)

    def _store_new(self, ns: str, pod: dict[str, Any]) -> dict[str, Any]:
        """A Pod stored as given, status included (the test helpers' create)."""
        meta = pod.setdefault("metadata", {})
        name = meta.get("name")
        if not name:
            raise ValueError("metadata.name is required")
        if (ns, name) in self.pods:
            raise KeyError(f"pod {ns}/{name} already exists")
        meta.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1,
                    resourceVersion=str(self._bump()))
        pod.setdefault("apiVersion", "v1")
        pod.setdefault("kind", "Pod")
        pod.setdefault("status", {"phase": "Pending"})
        _drop_empty_maps(meta)
        self.pods[(ns, name)] = pod
        self._uids.add(meta["uid"])
        self._record("ADDED", ("", "pods"), ns, pod)
        return copy.deepcopy(pod)

    def _modify(self, namespace: str | None, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """The test helpers' Pod change (a merge patch that may touch status and deletionTimestamp)."""
        ns = namespace or self.namespace
        old = self.pods[(ns, name)]
        new = merge_patch(old, patch)
        meta = new.setdefault("metadata", {})
        for key in ("name", "namespace", "uid", "creationTimestamp", "resourceVersion", "generation"):
            if key in old["metadata"]:
                meta[key] = old["metadata"][key]
        if "deletionTimestamp" in old["metadata"]:  # once set, it stays
            meta["deletionTimestamp"] = old["metadata"]["deletionTimestamp"]
        _drop_empty_maps(meta)
        return self._commit(self._type_for_key(("", "pods")), ns, name, new, old)

    def _commit(self, rtype: ResourceType, ns: str, name: str, new: dict[str, Any],
                old: dict[str, Any]) -> dict[str, Any]:
        """Store a changed object (MODIFIED); a change that changes nothing stores and emits nothing."""
        new["metadata"]["resourceVersion"] = old["metadata"].get("resourceVersion")
        if new == old:
            return self._out(rtype, old)
        new["metadata"]["resourceVersion"] = str(self._bump())
        self.store[rtype.key][(ns, name)] = new
        self._record("MODIFIED", rtype.key, ns, new, old)
        return self._out(rtype, new)

    def _remove(self, rtype: ResourceType, ns: str, name: str) -> dict[str, Any]:
        """The object is gone (DELETED); then what depended on it: owner-reference garbage
        collection (background, or orphaning), a CRD's custom resources, a Namespace's contents."""
        obj = self.store[rtype.key].pop((ns, name))
        self._uids.discard(obj["metadata"].get("uid"))
        self._applied.pop(obj["metadata"].get("uid"), None)
        obj["metadata"]["resourceVersion"] = str(self._bump())  # the DELETED event carries a new rv
        self._record("DELETED", rtype.key, ns, obj)
        uid = obj["metadata"].get("uid")
        orphan = uid in self._orphan_on_removal
        self._orphan_on_removal.discard(uid)
        if rtype.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._unregister_crd(obj["metadata"]["name"])
        elif rtype.key == ("", "namespaces"):
            for key, objects in list(self.store.items()):
                kind = self._type_for_key(key)
                for (obj_ns, obj_name) in [k for k in objects if k[0] == name]:
                    if kind is not None and (obj_ns, obj_name) in self.store[key]:
                        self._remove(kind, obj_ns, obj_name)
        self._collect_dependents(uid, ns, orphan)
        return self._out(rtype, obj)

    def _collect_dependents(self, owner_uid: str | None, owner_ns: str, orphan: bool) -> None:
        if not owner_uid:
            return
        dependents = []
        for key, objects in self.store.items():
            for (obj_ns, obj_name), obj in objects.items():
                if owner_ns and obj_ns != owner_ns:
                    continue
                if any(ref.get("uid") == owner_uid for ref in obj["metadata"].get("ownerReferences") or ()):
                    dependents.append((key, obj_ns, obj_name))
        for key, obj_ns, obj_name in dependents:
            rtype = self._type_for_key(key)
            old = self.store[key].get((obj_ns, obj_name))
            if rtype is None or old is None:
                continue  # already collected through another owner
            if orphan:
                new = copy.deepcopy(old)
                refs = [r for r in new["metadata"]["ownerReferences"] if r.get("uid") != owner_uid]
                if refs:
                    new["metadata"]["ownerReferences"] = refs
                else:
                    del new["metadata"]["ownerReferences"]
                self._commit(rtype, obj_ns, obj_name, new, old)
            else:
                self.delete_object(rtype, obj_ns, obj_name)

    def _unregister_crd(self, crd_name: str) -> None:
        gone = [k for k, t in self.types.items() if t.crd == crd_name]
        keys = {self.types[k].key for k in gone}
        for key in keys:  # a CRD's deletion deletes its custom resources
            rtype = self._type_for_key(key)
            for obj_ns, obj_name in list(self.store.get(key, {})):
                self._remove(rtype, obj_ns, obj_name)
        for k in gone:
            del self.types[k]
        for key in keys:
            if self._type_for_key(key) is None:
                self.store.pop(key, None)
                for watcher in self._watchers:  # the kind is no longer served: its watches end
                    if watcher.rtype.key == key:
                        watcher.queue.put_nowait(_CLOSE)

    def _bookmark_event(self, rtype: ResourceType | None = None) -> dict[str, Any]:
        kind, api_version = (rtype.kind, rtype.api_version) if rtype is not None else ("Pod", "v1")
        return {"type": "BOOKMARK", "object": {"kind": kind, "apiVersion": api_version,
                                               "metadata": {"resourceVersion": str(self.rv)}}}

    def _ns(self, rtype: ResourceType, namespace: str | None) -> str:
        return (namespace or self.namespace) if rtype.namespaced else ""

    def _out(self, rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(obj)
        out["apiVersion"] = rtype.api_version
        return out

    def _list(self, rtype: ResourceType, ns: str | None, selector: list[Requirement],
              fields: list[Requirement]) -> list[dict[str, Any]]:
        field_map = KIND_FIELDS.get(rtype.key, GENERIC_FIELDS)
        return [self._out(rtype, obj) for (obj_ns, _), obj in sorted(self.store.get(rtype.key, {}).items())
                if (ns is None or obj_ns == ns) and selector_matches(selector, obj["metadata"].get("labels"))
                and fields_match(fields, obj, field_map)]

    # -- writes (what the HTTP verbs do; callable in-process too) ------------------------------
    def create_object(self, rtype: ResourceType, namespace: str | None, body: Any, *,
                      field_validation: str = "Warn", warnings: list[str] | None = None,
                      dry_run: bool = False) -> dict[str, Any]:
        """POST: store a new object (ADDED). KubeError: 409 AlreadyExists, 422 Invalid, 400."""
        body = self._checked_body(rtype, body)
        meta = body["metadata"]
        ns = self._ns(rtype, namespace)
        if rtype.namespaced and meta.get("namespace") not in (None, "", ns):
            raise KubeError(400, "BadRequest", "the namespace of the provided object does not match the namespace "
                                               "sent on the request")
        objects = self.store[rtype.key]
        name = meta.get("name")
        if not name and meta.get("generateName"):
            name = meta["generateName"] + uuid.uuid4().hex[:5]
            while (ns, name) in objects:
                name = meta["generateName"] + uuid.uuid4().hex[:5]
            meta["name"] = name
        if not name:
            raise invalid(rtype, "", [FieldError("metadata.name", "FieldValueRequired",
                                                 "metadata.name: Required value: name or generateName is required")])
        if (ns, name) in objects:
            raise KubeError(409, "AlreadyExists", f'{rtype.qualified} "{name}" already exists', _details(rtype, name))
        if rtype.status:
            body.pop("status", None)  # status is written through /status
        for key in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation",
                    "resourceVersion", "selfLink", "managedFields"):
            meta.pop(key, None)
        body = self._finish(rtype, ns, body, None, field_validation, warnings)
        crd_types = self._crd_types(rtype, body)
        meta = body["metadata"]
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1)
        if crd_types is not None:
            body["status"] = _crd_status(body)
        if dry_run:
            return self._out(rtype, body)
        meta["resourceVersion"] = str(self._bump())
        objects[(ns, name)] = body
        self._uids.add(meta["uid"])
        self._record("ADDED", rtype.key, ns, body)
        for served in crd_types or ():
            self._register(served)
        created = self._out(rtype, body)
        self._collect_if_dangling(rtype, ns, name)
        return created

    def update_object(self, rtype: ResourceType, namespace: str | None, name: str, body: Any, *,
                      subresource: str | None = None, field_validation: str = "Warn",
                      warnings: list[str] | None = None, dry_run: bool = False) -> dict[str, Any]:
        """PUT (of the object or its /status): a stale ``metadata.resourceVersion`` is 409 Conflict;
        ``generation`` moves only when something outside metadata and status changes; a change that
        changes nothing stores and emits nothing."""
        ns = self._ns(rtype, namespace)
        old = self.store[rtype.key].get((ns, name))
        if old is None:
            raise not_found(rtype, name)
        body = self._checked_body(rtype, body)
        meta = body["metadata"]
        if meta.get("name") not in (None, name):
            raise KubeError(400, "BadRequest", f"the name of the object ({meta['name']}) does not match the name "
                                               f"on the URL ({name})")
        expected = meta.get("resourceVersion")
        if expected and expected != old["metadata"].get("resourceVersion"):
            raise conflict(rtype, name)
        if subresource == "status":
            new = copy.deepcopy(old)  # /status writes change status only
            if "status" in body:
                new["status"] = body["status"]
            else:
                new.pop("status", None)
        else:
            new = body
            if rtype.status:  # the main resource's writes cannot change status
                if "status" in old:
                    new["status"] = copy.deepcopy(old["status"])
                else:
                    new.pop("status", None)
            for key in ("name", "namespace", "uid", "creationTimestamp", "deletionTimestamp",
                        "deletionGracePeriodSeconds", "generation"):
                if key in old["metadata"]:
                    new["metadata"][key] = old["metadata"][key]
                else:
                    new["metadata"].pop(key, None)
        new = self._finish(rtype, ns, new, old, field_validation, warnings)
        crd_types = self._crd_types(rtype, new)
        if _spec_part(new) != _spec_part(old):
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + 1
        if dry_run:
            return self._out(rtype, new)
        result = self._commit(rtype, ns, name, new, old)
        if crd_types is not None and new is self.store[rtype.key].get((ns, name)):
            self.types = {k: t for k, t in self.types.items() if t.crd != name}
            for served in crd_types:
                self._register(served)
        stored = self.store[rtype.key].get((ns, name))
        if stored is not None and _should_vanish(rtype, stored):
            return self._remove(rtype, ns, name)  # the last finalizer is gone
        self._collect_if_dangling(rtype, ns, name)
        return result

    def _collect_if_dangling(self, rtype: ResourceType, ns: str, name: str) -> None:
        """An object whose every owner is gone is garbage, as the garbage collector finds it (here at
        once, after the write that made it so: e.g. an operator applying one more object for a
        custom resource deleted meanwhile)."""
        obj = self.store[rtype.key].get((ns, name))
        refs = (obj or {}).get("metadata", {}).get("ownerReferences") or ()
        if refs and not any(ref.get("uid") in self._uids for ref in refs if isinstance(ref, dict)) \
                and not obj["metadata"].get("deletionTimestamp"):
            self.delete_object(rtype, ns, name)

    def patch_object(self, rtype: ResourceType, namespace: str | None, name: str, content_type: str, patch: Any, *,
                     subresource: str | None = None, field_manager: str | None = None,
                     field_validation: str = "Warn", warnings: list[str] | None = None,
                     dry_run: bool = False) -> tuple[dict[str, Any], bool]:
        """PATCH with any of the four patch types; returns (object, created) — server-side apply
        creates an absent object."""
        ns = self._ns(rtype, namespace)
        old = self.store[rtype.key].get((ns, name))
        if content_type == APPLY_PATCH:
            if not field_manager:
                raise KubeError(400, "BadRequest", "PATCH /apply requires fieldManager to be set: fieldManager: "
                                                   "Required value: is required for apply patch")
            if not isinstance(patch, dict):
                raise KubeError(400, "BadRequest", "the applied configuration must be an object")
            if (patch.get("metadata") or {}).get("name") not in (None, name):
                raise KubeError(400, "BadRequest", f"the name of the object ({patch['metadata']['name']}) does not "
                                                   f"match the name on the URL ({name})")
            if old is None:
                if subresource is not None:
                    raise not_found(rtype, name)
                body = copy.deepcopy(patch)
                body.setdefault("metadata", {})["name"] = name
                created = self.create_object(rtype, ns, body, field_validation=field_validation, warnings=warnings,
                                             dry_run=dry_run)
                if not dry_run:
                    self._applied.setdefault(created["metadata"]["uid"], {})[field_manager] = copy.deepcopy(patch)
                return created, True
            uid = old["metadata"].get("uid")
            previous = self._applied.get(uid, {}).get(field_manager)
            base = drop_unapplied(old, previous, patch) if previous is not None else old
            new = apply_merge(base, patch)
            new["metadata"]["resourceVersion"] = (patch.get("metadata") or {}).get("resourceVersion") \
                or old["metadata"].get("resourceVersion")
            updated = self.update_object(rtype, ns, name, new, subresource=subresource,
                                         field_validation=field_validation, warnings=warnings, dry_run=dry_run)
            if not dry_run and uid in self._uids:
                self._applied.setdefault(uid, {})[field_manager] = copy.deepcopy(patch)
            return updated, False
        if old is None:
            raise not_found(rtype, name)
        new = self._patched(rtype, old, content_type, patch)
        return self.update_object(rtype, ns, name, new, subresource=subresource, field_validation=field_validation,
                                  warnings=warnings, dry_run=dry_run), False

    def _patched(self, rtype: ResourceType, old: dict[str, Any], content_type: str, patch: Any) -> dict[str, Any]:
        if content_type == MERGE_PATCH:
            if not isinstance(patch, dict):
                raise KubeError(400, "BadRequest", "a merge patch must be a JSON object")
            new = merge_patch(old, patch)
        elif content_type == JSON_PATCH:
            if not isinstance(patch, list):
                raise KubeError(400, "BadRequest", "a JSON patch must be a JSON array of operations")
            try:
                new = jsonpatch.apply_patch(old, patch)
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
                raise KubeError(422, "Invalid", f"the server rejected our request due to an error in our "
                                                f"request: {exc}") from exc
        elif content_type == STRATEGIC_PATCH:
            if rtype.crd is not None:  # as a real server: custom resources have no patch strategies
                raise _unsupported_patch(content_type)
            if not isinstance(patch, dict):
                raise KubeError(400, "BadRequest", "a strategic merge patch must be a JSON object")
            new = strategic_merge_patch(old, patch)
        else:
            raise _unsupported_patch(content_type)
        if not isinstance(new, dict) or not isinstance(new.get("metadata"), dict):
            raise KubeError(422, "Invalid", "the patch removed the object's metadata")
        return new

    def delete_object(self, rtype: ResourceType, namespace: str | None, name: str, *,
                      grace_period_s: int | None = None, propagation: str | None = None,
                      preconditions: dict[str, Any] | None = None, dry_run: bool = False) -> dict[str, Any]:
        """DELETE: a bound Pod deleted with a grace period, or an object with finalizers, gets
        ``deletionTimestamp`` (MODIFIED) and stays; anything else is gone (DELETED) and its
        dependents are collected (``propagation`` "Orphan" keeps them, minus the owner reference)."""
        ns = self._ns(rtype, namespace)
        old = self.store[rtype.key].get((ns, name))
        if old is None:
            raise not_found(rtype, name)
        meta = old["metadata"]
        for key in ("uid", "resourceVersion"):
            wanted = (preconditions or {}).get(key)
            if wanted and wanted != meta.get(key):
                raise conflict(rtype, name, f"Precondition failed: {key.upper() if key == 'uid' else key} in "
                                            f"precondition: {wanted}, {key} in object meta: {meta.get(key)}")
        if dry_run:
            return self._out(rtype, old)
        if propagation == "Orphan" and meta.get("uid"):
            self._orphan_on_removal.add(meta["uid"])
        grace = grace_period_s
        if rtype.key == ("", "pods") and (old.get("spec") or {}).get("nodeName") and grace != 0:
            if grace is None:
                grace = (old.get("spec") or {}).get("terminationGracePeriodSeconds")
                grace = 30 if grace is None else grace
            if grace != 0:
                return self._mark_deleting(rtype, ns, name, grace)
        if meta.get("finalizers"):
            return self._mark_deleting(rtype, ns, name, 0)
        return self._remove(rtype, ns, name)

    def _mark_deleting(self, rtype: ResourceType, ns: str, name: str, grace: int) -> dict[str, Any]:
        old = self.store[rtype.key][(ns, name)]
        new = copy.deepcopy(old)
        meta = new["metadata"]
        current = meta.get("deletionGracePeriodSeconds")
        if "deletionTimestamp" not in meta or current is None or grace < current:
            meta["deletionTimestamp"] = _now(grace)
            meta["deletionGracePeriodSeconds"] = grace
        result = self._commit(rtype, ns, name, new, old)
        stored = self.store[rtype.key][(ns, name)]
        if _should_vanish(rtype, stored):  # a shorter grace on a Pod already without finalizers
            return self._remove(rtype, ns, name)
        return result

    def _checked_body(self, rtype: ResourceType, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise KubeError(400, "BadRequest", f"the body of a {rtype.kind} must be a JSON object")
        body = copy.deepcopy(body)
        if body.get("kind") not in (None, "", rtype.kind):
            raise KubeError(400, "BadRequest", f"the kind of the body ({body['kind']}) is not {rtype.kind}, "
                                               f"the kind of {rtype.qualified}")
        if body.get("apiVersion") not in (None, "") and body["apiVersion"].rpartition("/")[0] != rtype.group:
            raise KubeError(400, "BadRequest", f"the apiVersion of the body ({body['apiVersion']}) is not in "
                                               f"group {rtype.group or 'core'}")
        meta = body.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise KubeError(400, "BadRequest", "metadata must be an object")
        return body

    def _finish(self, rtype: ResourceType, ns: str, obj: dict[str, Any], old: dict[str, Any] | None,
                field_validation: str, warnings: list[str] | None) -> dict[str, Any]:
        """What every write does before it stores: kind, namespace, metadata checks, built-in
        defaults, and a custom resource's schema (validation, pruning, defaults)."""
        obj["apiVersion"] = rtype.api_version
        obj["kind"] = rtype.kind
        meta = obj["metadata"]
        if rtype.namespaced:
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        name = meta.get("name", "")
        errors = []
        for key in ("labels", "annotations"):
            values = meta.get(key)
            if values is None:
                continue
            if not isinstance(values, dict):
                errors.append(FieldError(f"metadata.{key}", "FieldValueInvalid",
                                         f'metadata.{key}: Invalid value: "{_type_name(values)}": must be a map'))
                continue
            for k, v in values.items():
                if not isinstance(v, str):
                    errors.append(FieldError(f"metadata.{key}.{k}", "FieldValueInvalid",
                                             f"metadata.{key}.{k}: Invalid value: {_shown(v)}: must be a string"))
        if errors:
            raise invalid(rtype, name, errors)
        _default_builtin(self, rtype, obj, old)
        if rtype.crd is None and field_validation == "Strict":
            unknown = self._builtin_fields.unknown_fields(obj)
            if unknown:
                raise _strict_error(rtype, unknown)
        if rtype.schema is not None:
            result = apply_schema(obj, rtype.schema)
            if result.errors:
                raise invalid(rtype, name, result.errors)
            if result.unknown and field_validation == "Strict":
                raise _strict_error(rtype, result.unknown)
            if result.unknown and field_validation == "Warn" and warnings is not None:
                warnings.extend(f'unknown field "{f}"' for f in result.unknown)
            obj = result.value
        _drop_empty_maps(obj["metadata"])
        return obj

    def _crd_types(self, rtype: ResourceType, crd: dict[str, Any]) -> list[ResourceType] | None:
        """A CRD's served types (None for anything else); 422 naming the field when it cannot be served."""
        if rtype.key != ("apiextensions.k8s.io", "customresourcedefinitions"):
            return None
        name = crd["metadata"].get("name", "")
        try:
            served = crd_resource_types(crd)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            message = str(exc)
            raise invalid(rtype, name, [FieldError(message.split(":", 1)[0], "FieldValueInvalid", message)]) from exc
        for candidate in served:
            existing = self.types.get((candidate.group, candidate.version, candidate.plural))
            if existing is not None and existing.crd != name:
                raise invalid(rtype, name, [FieldError("spec.names.plural", "FieldValueInvalid",
                                                       f'spec.names.plural: Invalid value: "{candidate.plural}": '
                                                       f"is already served by {existing.qualified}")])
        return served

    def _allocate_cluster_ip(self) -> str:
        """The next free address of :data:`SERVICE_IP_RANGE` from ``service_ip_start`` (wrapping)."""
        used = {(svc.get("spec") or {}).get("clusterIP") for svc in self.store[("", "services")].values()}
        low, high = (int(ipaddress.IPv4Address(a)) for a in SERVICE_IP_RANGE)
        candidate = int(self.service_ip_start)
        for _ in range(high - low + 1):
            address = ipaddress.IPv4Address(candidate)
            if candidate & 0xFF not in (0, 255) and str(address) not in used:
                return str(address)
            candidate = low if candidate >= high else candidate + 1
        raise KubeError(500, "InternalError", "no Service cluster IP left in the fake's range")

    def scale_of(self, rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        """The autoscaling/v1 Scale of a scalable object."""
        paths = rtype.scale
        meta = obj["metadata"]
        selector = _path_get(obj, paths.label_selector) if paths.label_selector else None
        status: dict[str, Any] = {"replicas": _path_get(obj, paths.status_replicas) or 0}
        if selector:
            status["selector"] = selector_string(selector)
        return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                             if k in meta},
                "spec": {"replicas": _path_get(obj, paths.spec_replicas) or 0}, "status": status}

    # -- HTTP ---------------------------------------------------------------------------------
    def _resolve(self, request: web.Request) -> _Target:
        """What the path names; KubeError 404 when nothing is served there."""
        parts = [p for p in request.path.split("/") if p]
        if parts == ["version"]:
            return _Target(discovery="version")
        if parts and parts[0] == "openapi":
            return _Target(discovery="openapi")
        if parts == ["api"] or parts == ["apis"]:
            return _Target(discovery=parts[0])
        if len(parts) >= 2 and parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        elif len(parts) >= 2 and parts[0] == "apis":
            if len(parts) == 2:
                if not any(t.group == parts[1] for t in self.types.values()):
                    raise KubeError(404, "NotFound", _NO_SUCH_PATH)
                return _Target(discovery="group", group=parts[1])
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise KubeError(404, "NotFound", _NO_SUCH_PATH)
        if not any(t.group == group and t.version == version for t in self.types.values()):
            raise KubeError(404, "NotFound", _NO_SUCH_PATH)
        if not rest:
            return _Target(discovery="resources", group=group, version=version)
        namespace = None
        if rest[0] == "namespaces" and len(rest) >= 3:
            inner = self.types.get((group, version, rest[2]))
            if inner is not None and inner.namespaced:
                namespace, rest = rest[1], rest[2:]
        rtype = self.types.get((group, version, rest[0]))
        if rtype is None or len(rest) > 3:
            raise KubeError(404, "NotFound", _NO_SUCH_PATH)
        name = rest[1] if len(rest) > 1 else None
        subresource = rest[2] if len(rest) > 2 else None
        if (name is not None and rtype.namespaced and namespace is None) or (not rtype.namespaced and namespace):
            raise KubeError(404, "NotFound", _NO_SUCH_PATH)
        if subresource is not None and not ((subresource == "status" and rtype.status)
                                            or (subresource == "scale" and rtype.scale is not None)
                                            or (subresource == "binding" and rtype.key == ("", "pods"))):
            raise KubeError(404, "NotFound", _NO_SUCH_PATH)
        return _Target(rtype, namespace, name, subresource, group=group, version=version)

    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            target = self._resolve(request)
        except KubeError as exc:
            target = exc
        request[_TARGET] = target
        kind = _request_kind(request, target)
        self.requests[kind] = self.requests.get(kind, 0) + 1
        self.request_log.append((asyncio.get_running_loop().time(), kind, dict(request.query)))
        response = await self._authorized(request, handler, kind, target)
        self.access_log.append((request.method, request.path_qs, response.status))
        return response

    async def _authorized(self, request: web.Request, handler, kind: str, target: Any) -> web.StreamResponse:
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return _error(401, "Unauthorized", "Unauthorized")
        for i, (status, only) in enumerate(self._failures):
            if only is None or only == kind:
                del self._failures[i]
                if status == 403 and isinstance(target, _Target) and target.rtype is not None:
                    return _error_status(self._forbidden(request, target, kind))
                reason = {410: "Expired", 429: "TooManyRequests", 404: "NotFound", 403: "Forbidden"}.get(
                    status, "InternalError" if status >= 500 else "BadRequest")
                return _error(status, reason, f"injected {status}")
        if isinstance(target, KubeError):
            return _error_status(target.status)
        try:
            return await handler(request)
        except KubeError as exc:
            return _error_status(exc.status)

    def _forbidden(self, request: web.Request, target: _Target, kind: str) -> dict[str, Any]:
        """An RBAC denial worded as kube-apiserver words it (for :meth:`fail_next` with 403)."""
        rtype = target.rtype
        verb = {"discovery": "get"}.get(kind, kind)
        if kind == "delete" and target.name is None:
            verb = "deletecollection"
        resource = f"{rtype.plural}/{target.subresource}" if target.subresource else rtype.plural
        subject = f'{rtype.qualified} "{target.name}"' if target.name else rtype.qualified
        where = f' in the namespace "{target.namespace}"' if target.namespace else " at the cluster scope"
        message = (f'{subject} is forbidden: User "{self.user}" cannot {verb} resource "{resource}" in API group '
                   f'"{rtype.group}"{where}')
        return status_body(403, "Forbidden", message, {"name": target.name or "", "group": rtype.group,
                                                       "kind": rtype.plural})

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        target: _Target = request[_TARGET]
        method = request.method
        if target.discovery is not None:
            if method != "GET":
                raise KubeError(405, "MethodNotAllowed", f"{method} is not supported here")
            return self._discovery(request, target)
        rtype = target.rtype
        if target.name is None:
            if method == "GET":
                return await self._list_or_watch(request, rtype, target.namespace)
            if method == "POST":
                return await self._create(request, rtype, target.namespace)
            if method == "DELETE":
                return await self._delete_collection(request, rtype, target.namespace)
        elif target.subresource == "binding":
            if method == "POST":
                return await self._bind(request, rtype, target.namespace, target.name)
        elif target.subresource == "scale":
            if method in ("GET", "PUT", "PATCH"):
                return await self._scale(request, rtype, target.namespace, target.name)
        elif method == "GET":
            obj = self.store[rtype.key].get((self._ns(rtype, target.namespace), target.name))
            if obj is None:
                raise not_found(rtype, target.name)
            if _wants_table(request):
                return _json_response(self._table(request, rtype, [self._out(rtype, obj)]))
            return _json_response(self._out(rtype, obj))
        elif method == "PUT":
            body = await _read_body(request)
            warnings: list[str] = []
            result = self.update_object(rtype, target.namespace, target.name, body, subresource=target.subresource,
                                        warnings=warnings, **_write_options(request))
            return _json_response(result, 200, warnings)
        elif method == "PATCH":
            return await self._patch(request, target)
        elif method == "DELETE" and target.subresource is None:
            return await self._delete(request, rtype, target.namespace, target.name)
        raise KubeError(405, "MethodNotAllowed", f"{method} is not supported on {request.path}")

    def _discovery(self, request: web.Request, target: _Target) -> web.Response:
        if target.discovery == "version":
            return _json_response({"major": "1", "minor": "37", "emulationMajor": "1", "emulationMinor": "37",
                                   "gitVersion": "v1.37.0-infera-fake", "gitCommit": "0" * 40,
                                   "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z",
                                   "goVersion": "go1.25.0", "compiler": "gc", "platform": "linux/amd64"})
        if target.discovery == "openapi":
            return self._openapi(request)
        if target.discovery == "api":
            return _json_response({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": f"127.0.0.1:{self.port}"}]})
        if target.discovery == "apis":
            return _json_response({"kind": "APIGroupList", "apiVersion": "v1",
                                   "groups": [self._group_doc(g) for g in self._groups() if g]})
        if target.discovery == "group":
            return _json_response(self._group_doc(target.group))
        resources = [entry for t in self.types.values() if t.group == target.group and t.version == target.version
                     for entry in t.discovery()]
        group_version = f"{target.group}/{target.version}" if target.group else target.version
        return _json_response({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version,
                               "resources": resources})

    def _openapi(self, request: web.Request) -> web.Response:
        """A minimal OpenAPI v3: per built-in group/version, one PATCH operation per kind that names its
        kind and the ``fieldValidation`` parameter. kubectl reads it to learn that the server
        validates fields (so it sends ``fieldValidation=Strict`` and validates nothing itself); a
        custom resource's group/version is absent, so kubectl checks the Namespace's operation
        instead, as it does for CRDs. The operations offer no strategic-merge content type, so
        kubectl computes strategic patches from its compiled-in types, not from this document."""
        parts = [p for p in request.path.split("/") if p][1:]
        if parts == ["v2"]:
            # An empty protobuf Document (zero bytes): kubectl's client-side fallbacks find no
            # schema in it and go on, as they do for a kind a real document does not describe.
            return web.Response(body=b"", content_type="application/com.github.proto-openapi.spec.v2.v1.0+protobuf")
        if parts[:1] != ["v3"]:
            raise KubeError(404, "NotFound", _NO_SUCH_PATH)
        builtin = [t for t in self.types.values() if t.crd is None]
        if parts == ["v3"]:
            paths = {}
            for rtype in builtin:
                prefix = f"apis/{rtype.group}/{rtype.version}" if rtype.group else f"api/{rtype.version}"
                paths[prefix] = {"serverRelativeURL": f"/openapi/v3/{prefix}?hash=fake"}
            return _json_response({"paths": paths})
        prefix = "/".join(parts[1:])
        kinds = [t for t in builtin if (f"apis/{t.group}/{t.version}" if t.group else f"api/{t.version}") == prefix]
        if not kinds:
            raise KubeError(404, "NotFound", _NO_SUCH_PATH)
        paths = {}
        for rtype in kinds:
            scope = "/namespaces/{namespace}" if rtype.namespaced else ""
            operation = {"operationId": f"patch{rtype.kind}",
                         "x-kubernetes-group-version-kind": {"group": rtype.group, "version": rtype.version,
                                                             "kind": rtype.kind},
                         "parameters": [{"name": "fieldValidation", "in": "query", "schema": {"type": "string"}},
                                        {"name": "fieldManager", "in": "query", "schema": {"type": "string"}}],
                         "requestBody": {"content": {MERGE_PATCH: {"schema": {"type": "object"}},
                                                     JSON_PATCH: {"schema": {"type": "object"}},
                                                     APPLY_PATCH: {"schema": {"type": "object"}}}},
                         "responses": {"200": {"description": "OK"}}}
            paths[f"/{prefix}{scope}/{rtype.plural}/{{name}}"] = {"patch": operation}
        return _json_response({"openapi": "3.0.0", "info": {"title": "Kubernetes (fake)", "version": "v1.37.0"},
                               "paths": paths, "components": {}})

    def _groups(self) -> list[str]:
        seen: dict[str, None] = {}
        for rtype in self.types.values():
            seen.setdefault(rtype.group)
        return list(seen)

    def _group_doc(self, group: str) -> dict[str, Any]:
        versions = sorted({t.version for t in self.types.values() if t.group == group}, key=_version_priority,
                          reverse=True)
        docs = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {"kind": "APIGroup", "apiVersion": "v1", "name": group, "versions": docs, "preferredVersion": docs[0]}

    async def _list_or_watch(self, request: web.Request, rtype: ResourceType, ns: str | None) -> web.StreamResponse:
        try:
            selector = parse_selector(request.query.get("labelSelector"))
        except ValueError as exc:
            return _error(400, "BadRequest", f"unable to parse requirement: {exc}")
        try:
            fields = parse_field_selector(request.query.get("fieldSelector"),
                                          KIND_FIELDS.get(rtype.key, GENERIC_FIELDS))
        except FieldSelectorError as exc:
            return _error(400, "BadRequest", str(exc))
        if request.query.get("watch") in _TRUE:
            return await self._watch(request, rtype, ns, selector, fields)
        self.list_params.append(dict(request.query))
        if _wants_table(request):
            return _json_response(self._table(request, rtype, self._list(rtype, ns, selector, fields)))
        return _json_response({"kind": f"{rtype.kind}List", "apiVersion": rtype.api_version,
                               "metadata": {"resourceVersion": str(self.rv)},
                               "items": self._list(rtype, ns, selector, fields)})

    def _table(self, request: web.Request, rtype: ResourceType, objects: list[dict[str, Any]]) -> dict[str, Any]:
        """A ``meta.k8s.io/v1`` Table (server-side printing, what ``kubectl get`` asks for): Name, a
        CRD version's ``additionalPrinterColumns`` or a built-in kind's few columns, and Age."""
        columns = _table_columns(rtype)
        include = request.query.get("includeObject", "Metadata")
        rows = []
        for obj in objects:
            row: dict[str, Any] = {"cells": [getter(obj) for _, _, _, getter in columns]}
            if include == "Object":
                row["object"] = obj
            elif include != "None":
                row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                 "metadata": obj["metadata"]}
            rows.append(row)
        return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": str(self.rv)},
                "columnDefinitions": [{"name": name, "type": typ, "format": "name" if name == "Name" else "",
                                       "description": "", "priority": priority}
                                      for name, typ, priority, _ in columns],
                "rows": rows}

    async def _watch(self, request: web.Request, rtype: ResourceType, ns: str | None, selector: list[Requirement],
                     fields: list[Requirement]) -> web.StreamResponse:
        query = request.query
        self.watch_params.append(dict(query))
        since = query.get("resourceVersion") or ""
        if since and not since.isdigit():
            return _error(400, "BadRequest", f"invalid resourceVersion {since!r}")
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        initial_events = query.get("sendInitialEvents") in _TRUE
        watcher = _Watcher(rtype, ns, selector, query.get("allowWatchBookmarks") in _TRUE or initial_events, fields)
        too_large = None
        if since and int(since) > self.rv and not await self._wait_for_rv(int(since), self.too_large_wait_s):
            self.too_large += 1
            too_large = too_large_status(int(since), self.rv)
            if self.too_large_as == "http":
                return _error_status(too_large)
        resp = web.StreamResponse(status=200, headers={"Content-Type": JSON})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        if too_large is not None:
            await resp.write(_line({"type": "ERROR", "object": too_large}))
            await resp.write_eof()
            return resp
        if since and int(since) < self.compacted_rv and not initial_events:
            # A real server answers 200 and then one ERROR event once the watch is open.
            message = f"too old resource version: {since} ({self.compacted_rv})"
            await resp.write(_line({"type": "ERROR", "object": status_body(410, "Expired", message)}))
            await resp.write_eof()
            return resp
        # Snapshot + register with no await in between, so no event can slip through the gap.
        if not since or since == "0" or initial_events:
            backlog = [{"type": "ADDED", "object": obj} for obj in self._list(rtype, ns, selector, fields)]
            if initial_events:  # a watch-list: the initial state ends with an annotated BOOKMARK
                end = self._bookmark_event(rtype)
                end["object"]["metadata"]["annotations"] = {"k8s.io/initial-events-end": "true"}
                backlog.append(end)
        else:
            backlog = [out for e in self.history if e.rv > int(since) if (out := watcher.translate(e)) is not None]
        for item in backlog:
            watcher.queue.put_nowait(item)
        self._watchers.add(watcher)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout else None
        try:
            while True:
                wait = self.bookmark_interval if watcher.bookmarks else None
                if deadline is not None:
                    left = deadline - loop.time()
                    if left <= 0:
                        break
                    wait = left if wait is None else min(wait, left)
                try:
                    item = await asyncio.wait_for(watcher.queue.get(), wait)
                except asyncio.TimeoutError:
                    if watcher.bookmarks and self.bookmark_interval and (deadline is None or loop.time() < deadline):
                        await resp.write(_line(self._bookmark_event(rtype)))
                    continue
                if item is _CLOSE:
                    break
                if item is _ABORT:
                    if request.transport is not None:
                        request.transport.abort()  # mid-chunk: the client sees a broken stream
                    raise asyncio.CancelledError  # nothing more to write on this connection
                await resp.write(_line(item))
        except ConnectionResetError:  # the client went away: its stream just ends
            return resp
        finally:
            self._watchers.discard(watcher)
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp

    async def _create(self, request: web.Request, rtype: ResourceType, ns: str | None) -> web.Response:
        if rtype.namespaced and ns is None:
            raise KubeError(404, "NotFound", _NO_SUCH_PATH)
        body = await _read_body(request)
        warnings: list[str] = []
        created = self.create_object(rtype, ns, body, warnings=warnings, **_write_options(request))
        return _json_response(created, 201, warnings)

    async def _patch(self, request: web.Request, target: _Target) -> web.Response:
        rtype, name = target.rtype, target.name
        content_type = request.content_type
        if content_type not in PATCH_TYPES:
            raise _unsupported_patch(content_type)
        raw = await request.read()
        try:
            patch = yaml.safe_load(raw) if content_type == APPLY_PATCH else json.loads(raw or b"null")
        except (ValueError, yaml.YAMLError) as exc:
            raise KubeError(400, "BadRequest", f"invalid patch: {exc}") from exc
        if rtype.key == ("", "pods") and content_type == MERGE_PATCH and isinstance(patch, dict):
            self.patches.append((name, patch))
        warnings: list[str] = []
        result, created = self.patch_object(
            rtype, target.namespace, name, content_type, patch, subresource=target.subresource,
            field_manager=request.query.get("fieldManager"), warnings=warnings, **_write_options(request))
        return _json_response(result, 201 if created else 200, warnings)

    async def _delete(self, request: web.Request, rtype: ResourceType, ns: str | None, name: str) -> web.Response:
        options = await _read_body(request, optional=True) or {}
        grace = request.query.get("gracePeriodSeconds", options.get("gracePeriodSeconds"))
        propagation = request.query.get("propagationPolicy", options.get("propagationPolicy"))
        if options.get("orphanDependents") is True or request.query.get("orphanDependents") in _TRUE:
            propagation = "Orphan"
        try:
            grace = int(grace) if grace is not None else None
        except ValueError as exc:
            raise KubeError(400, "BadRequest", f"gracePeriodSeconds: invalid value {grace!r}") from exc
        result = self.delete_object(rtype, ns, name, grace_period_s=grace, propagation=propagation,
                                    preconditions=options.get("preconditions"),
                                    dry_run="dryRun" in request.query)
        return _json_response(result)

    async def _delete_collection(self, request: web.Request, rtype: ResourceType, ns: str | None) -> web.Response:
        try:
            selector = parse_selector(request.query.get("labelSelector"))
            fields = parse_field_selector(request.query.get("fieldSelector"),
                                          KIND_FIELDS.get(rtype.key, GENERIC_FIELDS))
        except ValueError as exc:
            raise KubeError(400, "BadRequest", str(exc)) from exc
        gone = []
        for obj in self._list(rtype, ns, selector, fields):
            meta = obj["metadata"]
            if (meta.get("namespace", ""), meta["name"]) in self.store[rtype.key]:
                gone.append(self.delete_object(rtype, meta.get("namespace"), meta["name"]))
        return _json_response({"kind": f"{rtype.kind}List", "apiVersion": rtype.api_version,
                               "metadata": {"resourceVersion": str(self.rv)}, "items": gone})

    async def _bind(self, request: web.Request, rtype: ResourceType, ns: str | None, name: str) -> web.Response:
        """POST pods/<name>/binding (what a scheduler does): sets ``spec.nodeName`` once."""
        body = await _read_body(request)
        node = ((body or {}).get("target") or {}).get("name") if isinstance(body, dict) else None
        if not node:
            raise invalid(_BINDING_TYPE, name, [FieldError("target.name", "FieldValueRequired",
                                                           "target.name: Required value")])
        old = self.store[rtype.key].get((self._ns(rtype, ns), name))
        if old is None:
            raise not_found(rtype, name)
        bound = (old.get("spec") or {}).get("nodeName")
        if bound:
            raise conflict(rtype, name, f"pod {name} is already assigned to node \"{bound}\"")
        new = copy.deepcopy(old)
        new.setdefault("spec", {})["nodeName"] = node
        self._commit(rtype, self._ns(rtype, ns), name, new, old)
        return _json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                               "code": 201}, 201)

    async def _scale(self, request: web.Request, rtype: ResourceType, ns: str | None, name: str) -> web.Response:
        key = (self._ns(rtype, ns), name)
        obj = self.store[rtype.key].get(key)
        if obj is None:
            raise not_found(rtype, name)
        scale = self.scale_of(rtype, obj)
        if request.method == "GET":
            return _json_response(scale)
        if request.method == "PUT":
            wanted = await _read_body(request)
        else:
            content_type = request.content_type
            if content_type not in (MERGE_PATCH, JSON_PATCH, STRATEGIC_PATCH):
                raise _unsupported_patch(content_type)
            try:
                patch = json.loads(await request.read() or b"null")
            except ValueError as exc:
                raise KubeError(400, "BadRequest", f"invalid patch: {exc}") from exc
            wanted = self._patched(_SCALE_TYPE, scale, content_type, patch)
        if not isinstance(wanted, dict):
            raise KubeError(400, "BadRequest", "the body of a Scale must be a JSON object")
        expected = (wanted.get("metadata") or {}).get("resourceVersion")
        if expected and expected != obj["metadata"].get("resourceVersion"):
            raise conflict(rtype, name)
        replicas = (wanted.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise KubeError(422, "Invalid", f'Scale.autoscaling "{name}" is invalid: spec.replicas: Invalid value: '
                                            f"{_shown(replicas)}: must be a non-negative integer",
                            {"name": name, "group": "autoscaling", "kind": "Scale"})
        new = copy.deepcopy(obj)
        _path_set(new, rtype.scale.spec_replicas, replicas)
        updated = self.update_object(rtype, ns, name, new, **_write_options(request))
        return _json_response(self.scale_of(rtype, updated))


_SCALE_TYPE = ResourceType("autoscaling", "v1", "scale", "Scale")
_BINDING_TYPE = ResourceType("", "v1", "bindings", "Binding")


def _wants_table(request: web.Request) -> bool:
    return "as=Table" in request.headers.get("Accept", "") and request.query.get("watch") not in _TRUE


_JSONPATH_STEP = re.compile(r"\.(?P<key>[A-Za-z0-9_\-]+)|\[(?P<index>\d+)\]"
                            r"|\[\?\(@\.(?P<field>[A-Za-z0-9_.\-]+)\s*==\s*['\"](?P<value>[^'\"]*)['\"]\)\]")


def jsonpath_value(obj: Any, path: str) -> Any:
    """A printer column's ``jsonPath``: ``.a.b``, ``[0]`` and ``[?(@.type=="Ready")]`` steps (the
    first match); None when absent or when the path uses anything else."""
    path = path.strip().removeprefix("{").removesuffix("}").strip()
    position = 0
    while position < len(path):
        m = _JSONPATH_STEP.match(path, position)
        if m is None:
            return None
        position = m.end()
        if m["key"] is not None:
            obj = obj.get(m["key"]) if isinstance(obj, dict) else None
        elif m["index"] is not None:
            index = int(m["index"])
            obj = obj[index] if isinstance(obj, list) and index < len(obj) else None
        else:
            obj = next((item for item in obj if isinstance(item, dict)
                        and str(jsonpath_value(item, "." + m["field"])) == m["value"]), None) \
                if isinstance(obj, list) else None
        if obj is None:
            return None
    return obj


def human_age(timestamp: str | None, now: datetime.datetime | None = None) -> str | None:
    """kubectl's ``duration.HumanDuration`` of the time since ``timestamp`` (RFC 3339)."""
    if not timestamp:
        return None
    try:
        then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    except ValueError:
        return None
    seconds = int(((now or datetime.datetime.now(datetime.timezone.utc)) - then).total_seconds())
    if seconds < -1:
        return "<invalid>"
    seconds = max(seconds, 0)
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if seconds < 120:
        return f"{seconds}s"
    if minutes < 10:
        return f"{minutes}m" if seconds % 60 == 0 else f"{minutes}m{seconds % 60}s"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h" if minutes % 60 == 0 else f"{hours}h{minutes % 60}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 192:
        return f"{days}d" if hours % 24 == 0 else f"{days}d{hours % 24}h"
    if days < 730:
        return f"{days}d"
    years = days // 365
    return f"{years}y" if days % 365 == 0 or years >= 8 else f"{years}y{days % 365}d"


_Column = tuple  # (name, type, priority, getter)


def _column_cell(typ: str, value: Any) -> Any:
    if value is None:
        return None
    if typ == "date":
        return human_age(value) if isinstance(value, str) else None
    if typ == "integer":
        return value if isinstance(value, int) else None
    if typ == "number":
        return value if isinstance(value, (int, float)) else None
    if typ == "boolean":
        return value if isinstance(value, bool) else None
    return value if isinstance(value, str) else json.dumps(value)


def _pod_ready(pod: dict[str, Any]) -> str:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    total = len((pod.get("spec") or {}).get("containers") or []) or len(statuses)
    return f"{sum(1 for c in statuses if c.get('ready'))}/{total}"


def _pod_status(pod: dict[str, Any]) -> str:
    if pod["metadata"].get("deletionTimestamp"):
        return "Terminating"
    status = pod.get("status") or {}
    for container in status.get("containerStatuses") or ():
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason"):
            return waiting["reason"]
    return status.get("phase") or "Unknown"


def _replicas_ready(obj: dict[str, Any]) -> str:
    status = obj.get("status") or {}
    return f"{status.get('readyReplicas') or 0}/{(obj.get('spec') or {}).get('replicas', 0)}"


def _service_ports(svc: dict[str, Any]) -> str:
    ports = [f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in (svc.get("spec") or {}).get("ports") or ()]
    return ",".join(ports) or "<none>"


def _get(path: str) -> Any:
    return lambda obj: jsonpath_value(obj, path)


# A built-in kind's columns between Name and Age (a subset of kubectl's; priority 1 = ``-o wide``).
_BUILTIN_COLUMNS: dict[tuple[str, str], tuple[_Column, ...]] = {
    ("", "pods"): (("Ready", "string", 0, _pod_ready), ("Status", "string", 0, _pod_status),
                   ("Restarts", "integer", 0, lambda p: sum(c.get("restartCount", 0) for c in
                                                            (p.get("status") or {}).get("containerStatuses") or ())),
                   ("IP", "string", 1, _get(".status.podIP")), ("Node", "string", 1, _get(".spec.nodeName"))),
    ("", "services"): (("Type", "string", 0, _get(".spec.type")), ("Cluster-IP", "string", 0, _get(".spec.clusterIP")),
                       ("Port(s)", "string", 0, _service_ports)),
    ("apps", "deployments"): (("Ready", "string", 0, _replicas_ready),
                              ("Up-to-date", "integer", 0, lambda d: (d.get("status") or {}).get("updatedReplicas", 0)),
                              ("Available", "integer", 0,
                               lambda d: (d.get("status") or {}).get("availableReplicas", 0))),
    ("apps", "statefulsets"): (("Ready", "string", 0, _replicas_ready),),
    ("apps", "replicasets"): (("Desired", "integer", 0, _get(".spec.replicas")),
                              ("Ready", "integer", 0, lambda r: (r.get("status") or {}).get("readyReplicas", 0))),
    ("", "namespaces"): (("Status", "string", 0, _get(".status.phase")),),
}


def _table_columns(rtype: ResourceType) -> list[_Column]:
    columns: list[_Column] = [("Name", "string", 0, lambda obj: obj["metadata"].get("name"))]
    if rtype.printer_columns:
        for column in rtype.printer_columns:
            typ, path = column.get("type", "string"), column.get("jsonPath", "")
            columns.append((column.get("name", ""), typ, column.get("priority", 0),
                            lambda obj, typ=typ, path=path: _column_cell(typ, jsonpath_value(obj, path))))
        return columns
    columns.extend(_BUILTIN_COLUMNS.get(rtype.key, ()))
    columns.append(("Age", "string", 0, lambda obj: human_age(obj["metadata"].get("creationTimestamp"))))
    return columns


def _write_options(request: web.Request) -> dict[str, Any]:
    validation = request.query.get("fieldValidation") or "Warn"
    if validation not in ("Strict", "Warn", "Ignore"):
        raise KubeError(400, "BadRequest", f'fieldValidation: Unsupported value: "{validation}": supported values: '
                                           f'"Ignore", "Strict", "Warn"')
    return {"field_validation": validation, "dry_run": "dryRun" in request.query}


async def _read_body(request: web.Request, optional: bool = False) -> Any:
    if "protobuf" in request.content_type or "cbor" in request.content_type:
        # Typed client-go clients (kubectl create, ...) send protobuf; a 415 sends them back to JSON.
        raise KubeError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - accepted "
                                                     f"media types include: application/json, application/yaml "
                                                     f"(not {request.content_type})")
    raw = await request.read()
    if not raw.strip():
        if optional:
            return None
        raise KubeError(400, "BadRequest", "the request has no body")
    try:
        if request.content_type in ("application/yaml", "application/apply-patch+yaml"):
            return yaml.safe_load(raw)
        return json.loads(raw)
    except (ValueError, yaml.YAMLError) as exc:
        raise KubeError(400, "BadRequest", f"invalid body: {exc}") from exc


def _strict_error(rtype: ResourceType, unknown: list[str]) -> KubeError:
    fields_text = ", ".join(f'unknown field "{f}"' for f in unknown)
    return KubeError(400, "BadRequest", f'{rtype.kind} in version "{rtype.version}" cannot be handled as a '
                                        f"{rtype.kind}: strict decoding error: {fields_text}")


def _unsupported_patch(content_type: str) -> KubeError:
    return KubeError(415, "UnsupportedMediaType",
                     f"the body of the request was in an unknown format - accepted media types include: "
                     f"{', '.join(PATCH_TYPES)} (not {content_type})")


def _spec_part(obj: dict[str, Any]) -> dict[str, Any]:
    """What a change to moves ``generation``: everything outside metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


def _should_vanish(rtype: ResourceType, obj: dict[str, Any]) -> bool:
    """A deleting object with no finalizers left is gone (a Pod once its grace period is 0: the kubelet's delete)."""
    meta = obj["metadata"]
    if not meta.get("deletionTimestamp") or meta.get("finalizers"):
        return False
    return rtype.key != ("", "pods") or meta.get("deletionGracePeriodSeconds") == 0


def _crd_status(crd: dict[str, Any]) -> dict[str, Any]:
    """A CRD is established at once (a real server takes a moment)."""
    spec = crd["spec"]
    names = dict(spec["names"])
    names.setdefault("singular", names["kind"].lower())
    names.setdefault("listKind", f"{names['kind']}List")
    now = _now()
    return {"acceptedNames": names, "storedVersions": [v["name"] for v in spec["versions"] if v.get("storage")],
            "conditions": [
                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "lastTransitionTime": now,
                 "message": "no conflicts found"},
                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
                 "lastTransitionTime": now, "message": "the initial names have been accepted"}]}


def _default_builtin(api: FakeKubeApi, rtype: ResourceType, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
    """The defaults a real server fills in that clients here read back."""
    key = rtype.key
    if key == ("", "pods") and old is None:
        obj.setdefault("status", {"phase": "Pending"})
    elif key == ("", "namespaces") and old is None:
        obj.setdefault("status", {"phase": "Active"})
    elif key in (("apps", "deployments"), ("apps", "statefulsets"), ("apps", "replicasets")):
        spec = obj.setdefault("spec", {})
        if isinstance(spec, dict) and spec.get("replicas") is None:
            spec["replicas"] = 1
    elif key == ("", "services"):
        _default_service(api, obj, old)


def _default_service(api: FakeKubeApi, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
    spec = obj.setdefault("spec", {})
    if not isinstance(spec, dict):
        return
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    old_spec = (old or {}).get("spec") or {}
    if spec["type"] != "ExternalName":
        if not spec.get("clusterIP") and old_spec.get("clusterIP"):  # immutable once allocated
            spec["clusterIP"] = old_spec["clusterIP"]
        if not spec.get("clusterIP"):
            spec["clusterIP"] = api._allocate_cluster_ip()
        spec["clusterIPs"] = [spec["clusterIP"]]
        if spec["clusterIP"] != "None":
            spec.setdefault("ipFamilies", ["IPv4"])
            spec.setdefault("ipFamilyPolicy", "SingleStack")
    for port in spec.get("ports") or ():
        if isinstance(port, dict):
            port.setdefault("protocol", "TCP")
            if "port" in port:
                port.setdefault("targetPort", port["port"])
    if old is None:
        obj.setdefault("status", {"loadBalancer": {}})


def _line(event: dict[str, Any]) -> bytes:
    return json.dumps(event).encode() + b"\n"


def _drop_empty_maps(meta: dict[str, Any]) -> None:
    # A real server omits empty labels/annotations/finalizers/ownerReferences (omitempty).
    for key in ("labels", "annotations", "finalizers", "ownerReferences"):
        if key in meta and not meta[key]:
            del meta[key]


def _request_kind(request: web.Request, target: Any) -> str:
    if isinstance(target, _Target) and target.discovery is not None:
        return "discovery"
    if request.method == "GET":
        if isinstance(target, _Target) and target.name is not None:
            return "get"
        return "watch" if request.query.get("watch") in _TRUE else "list"
    return {"POST": "create", "PATCH": "patch", "DELETE": "delete", "PUT": "update"}.get(
        request.method, request.method.lower())


__all__ = ["APPLY_PATCH", "BUILTIN_TYPES", "FIELDS", "GENERIC_FIELDS", "JSON_PATCH", "KIND_FIELDS", "MERGE_KEYS",
           "MERGE_PATCH", "STRATEGIC_PATCH", "FakeKubeApi", "FieldError", "FieldSelectorError", "KubeError",
           "Requirement", "ResourceType", "ScalePaths", "apply_merge", "apply_schema", "crd_resource_types",
           "drop_unapplied", "fields_match", "human_age", "jsonpath_value", "merge_patch", "parse_field_selector",
           "parse_selector", "pod_fields", "selector_matches", "status_body", "strategic_merge_patch",
           "too_large_status"]
