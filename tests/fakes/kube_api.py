"""A fake Kubernetes API server for Pods: in-memory, aiohttp, started by tests on a loopback port.

Serves just what Infera's Kubernetes discovery and registration use, with the semantics they rely on:

* ``GET  /api/v1/namespaces/{ns}/pods`` (list; ``?watch=true`` streams), ``POST`` (create);
  ``GET  /api/v1/pods`` (all namespaces, list or watch);
* ``GET | PATCH | DELETE /api/v1/namespaces/{ns}/pods/{name}``; PATCH takes
  ``application/merge-patch+json`` (RFC 7386: objects merge recursively, ``null`` deletes a key);
* ``labelSelector``: ``a=b``, ``a==b``, ``a!=b``, ``a in (x,y)``, ``a notin (x,y)``, ``a``, ``!a``;
  a comma is AND;
* ``fieldSelector`` on lists and watches: ``=``, ``==``, ``!=`` on the Pod fields in
  :data:`FIELDS` (a comma is AND; a field's change in or out of the selector is ADDED / DELETED
  on a watch, as for labels). Any other field answers 400 ``field label not supported: <field>``,
  as a real server does for a field it does not index: a selector is never silently ignored;
* one global, monotonically increasing ``resourceVersion``, set on every written object and on list
  metadata; a no-op PATCH changes nothing and emits nothing (as on a real server);
* watches: newline-delimited ``{"type", "object"}`` events after the given resourceVersion (the
  history since then is replayed first), none/``0`` = synthetic ADDED for the current objects;
  a label change in or out of the selector is seen as ADDED / DELETED, as the watch cache does;
  ``allowWatchBookmarks`` (BOOKMARK on :meth:`FakeKubeApi.bookmark` and every
  ``bookmark_interval`` seconds when set); ``timeoutSeconds`` (the server ends the stream cleanly);
  a resourceVersion older than the kept history → an ``ERROR`` event carrying a ``Status`` with
  ``code: 410, reason: Expired`` (what a real server sends once a watch is open);
  a resourceVersion newer than the server's own: it waits ``too_large_wait_s`` for the store to
  get there (a real watch cache waits 3 s), then answers what kube-apiserver's
  ``storage.NewTooLargeResourceVersionError`` builds — a ``Status`` with ``code: 504``,
  ``reason: Timeout``, ``message: "Timeout: Too large resource version: X, current: Y"`` and the
  cause ``{reason: ResourceVersionTooLarge, message: "Too large resource version"}`` — as a watch
  ``ERROR`` event (``too_large_as="event"``, the cacher's errWatcher) or as the HTTP 504 answer
  itself (``too_large_as="http"``, an error returned before the watch opened);
* ``Authorization: Bearer <token>`` is required when the fake has a token (401 otherwise);
* every request is logged in :attr:`FakeKubeApi.request_log` as (loop time, kind, query).

Test helpers: :meth:`~FakeKubeApi.add_pod`, :meth:`~FakeKubeApi.set_phase`,
:meth:`~FakeKubeApi.set_annotation`, :meth:`~FakeKubeApi.set_labels`,
:meth:`~FakeKubeApi.begin_graceful_delete` (sets ``deletionTimestamp``: MODIFIED) then
:meth:`~FakeKubeApi.finish_delete` (DELETED), like the kubelet during the grace period;
:meth:`~FakeKubeApi.compact`, :meth:`~FakeKubeApi.close_watches` (clean end or abrupt drop),
:meth:`~FakeKubeApi.fail_next` (answer the next requests with an error status),
:meth:`~FakeKubeApi.stop` / :meth:`~FakeKubeApi.start` (an outage on the same port, state kept;
``start(fresh_watch_cache=True)`` is a restarted API server: its watch cache is rebuilt from
storage, so a watch from any earlier resourceVersion gets 410 Gone);
:meth:`~FakeKubeApi.snapshot` / :meth:`~FakeKubeApi.restore` (etcd restored from a backup: the
Pods and the resourceVersion go back, so a client's newer resourceVersion is "too large").

Where it differs from a real API server:

* Pods only (plus nothing else: no Nodes, Events, CRDs, discovery documents or ``/version``), and
  no schema validation: any JSON object is stored as given.
* PATCH: merge patch only (JSON patch, strategic merge and server-side apply answer 415); a
  ``metadata.resourceVersion`` in the patch is not checked (no optimistic-concurrency 409);
  PUT is not served. Status changes through the main resource are dropped, as on a real server,
  but there is no ``/status`` subresource either: tests change status with the helpers.
* DELETE over HTTP deletes at once (as a force delete, or a Pod not bound to a node); the
  graceful two-step delete is only reachable through the test helpers; DeleteOptions,
  finalizers and owner references are ignored.
* Lists ignore ``resourceVersion``/``resourceVersionMatch`` and ``limit``/``continue`` (always
  one page, always the latest state). Watches ignore ``sendInitialEvents`` and
  ``resourceVersionMatch``. Field selectors cover only :data:`FIELDS` (a real server has a few
  more, e.g. ``spec.restartPolicy``; those answer 400 here).
* History is kept in full until :meth:`compact` (or past ``history_limit`` events); a real server
  keeps a time/size-bounded watch cache. No periodic bookmarks unless ``bookmark_interval`` is set.
* No HTTP/2, TLS, RBAC, admission, rate limiting (429) or request timeouts; tokens are compared
  as plain strings.
"""
from __future__ import annotations

import asyncio
import copy
import datetime
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

from aiohttp import web

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
_TRUE = ("true", "1", "True")


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


def parse_field_selector(text: str | None) -> list[Requirement]:
    """Parse a field selector (``=``, ``==``, ``!=``; a comma is AND); ``""``/None selects everything.
    FieldSelectorError on a malformed term or a field not in :data:`FIELDS`."""
    if text is None or not text.strip():
        return []
    requirements = []
    for part in text.split(","):
        m = _FIELD_TERM.match(part)
        if m is None:
            raise FieldSelectorError(f"invalid selector: '{text}'; can't understand '{part}'")
        if m["key"] not in FIELDS:
            raise FieldSelectorError(f"field label not supported: {m['key']}", unsupported=m["key"])
        requirements.append(Requirement(m["key"], "!=" if m["op"] == "!=" else "=", (m["value"],)))
    return requirements


def pod_fields(pod: dict[str, Any]) -> dict[str, str]:
    """The :data:`FIELDS` of a Pod as a real server indexes them (a missing one is ``""``)."""
    out = {}
    for name, path in FIELDS.items():
        value: Any = pod
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        out[name] = "" if value is None else str(value)
    return out


def fields_match(requirements: Iterable[Requirement], pod: dict[str, Any]) -> bool:
    fields = pod_fields(pod)
    for key, op, (value,) in requirements:
        if (fields[key] == value) != (op == "="):
            return False
    return True


# --------------------------------------------------------------------------------------------
# JSON merge patch (RFC 7386)
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


def _json_response(body: Any, status: int = 200) -> web.Response:
    # Exactly "application/json" (no charset): lightkube turns an error into ApiError only then.
    return web.Response(status=status, body=json.dumps(body).encode(), headers={"Content-Type": JSON})


def _error(code: int, reason: str, message: str) -> web.Response:
    return _json_response(status_body(code, reason, message), code)


def _error_status(body: dict[str, Any]) -> web.Response:
    return _json_response(body, body["code"])


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Event(NamedTuple):
    rv: int
    type: str  # ADDED | MODIFIED | DELETED
    namespace: str
    obj: dict[str, Any]
    prev: dict[str, Any] | None  # the object before a MODIFIED (selector transitions)


_CLOSE = object()  # queue sentinel: end the stream cleanly
_ABORT = object()  # queue sentinel: drop the connection


@dataclass(eq=False)
class _Watcher:
    namespace: str | None  # None = all namespaces
    selector: list[Requirement]
    bookmarks: bool
    fields: list[Requirement] = field(default_factory=list)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def matches(self, pod: dict[str, Any]) -> bool:
        return selector_matches(self.selector, pod["metadata"].get("labels")) and fields_match(self.fields, pod)

    def translate(self, event: _Event) -> dict[str, Any] | None:
        """The event as this watcher sees it (selector transitions become ADDED / DELETED)."""
        if self.namespace is not None and event.namespace != self.namespace:
            return None
        now = self.matches(event.obj)
        if event.type == "MODIFIED":
            before = event.prev is not None and self.matches(event.prev)
            kind = "MODIFIED" if before and now else "ADDED" if now else "DELETED" if before else None
        else:
            kind = event.type if now else None
        return None if kind is None else {"type": kind, "object": event.obj}


class FakeKubeApi:
    """In-memory Pods behind an aiohttp server; see the module docstring for what it honours."""

    def __init__(self, *, namespace: str = "default", token: str | None = "test-token",
                 history_limit: int | None = None, bookmark_interval: float | None = None,
                 too_large_wait_s: float = 0.2, too_large_as: str = "event") -> None:
        if too_large_as not in ("event", "http"):
            raise ValueError("too_large_as is 'event' (a watch ERROR event) or 'http' (the HTTP 504 itself)")
        self.namespace = namespace  # the helpers' default namespace
        self.token = token
        self.history_limit = history_limit
        self.bookmark_interval = bookmark_interval
        self.too_large_wait_s = too_large_wait_s  # a real watch cache waits 3 s for a newer resourceVersion
        self.too_large_as = too_large_as
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.history: list[_Event] = []
        self.rv = 0
        self.compacted_rv = 0  # watches from an older resourceVersion get 410 Gone
        self.requests: dict[str, int] = {}  # "list" / "watch" / "get" / "patch" / "create" / "delete"
        self.watch_params: list[dict[str, str]] = []  # query of every watch request, in order
        self.list_params: list[dict[str, str]] = []  # query of every list request, in order
        self.request_log: list[tuple[float, str, dict[str, str]]] = []  # (loop time, kind, query)
        self.too_large = 0  # watches answered "Too large resource version"
        self.patches: list[tuple[str, dict[str, Any]]] = []  # (pod name, patch body)
        self._watchers: set[_Watcher] = set()
        self._failures: list[tuple[int, str | None]] = []  # (status, only this request kind | None)
        self._rv_waiters: list[asyncio.Future] = []  # watches waiting for a newer resourceVersion
        self._runner: web.AppRunner | None = None
        self.port = 0

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
        app = web.Application(middlewares=[self._middleware])
        app.router.add_get("/api/v1/pods", self._list_or_watch)
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._list_or_watch)
        app.router.add_post("/api/v1/namespaces/{ns}/pods", self._create)
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}", self._get)
        app.router.add_patch("/api/v1/namespaces/{ns}/pods/{name}", self._patch)
        app.router.add_delete("/api/v1/namespaces/{ns}/pods/{name}", self._delete)
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
        """Step two (or a force delete): the Pod is gone (DELETED)."""
        return self._remove(namespace or self.namespace, name)

    delete_pod = finish_delete

    # -- test helpers: watches and failures ----------------------------------------------------
    def compact(self) -> int:
        """Forget the whole history: a watch from any earlier resourceVersion gets 410 Gone."""
        self.history.clear()
        self.compacted_rv = self.rv
        return self.rv

    def snapshot(self) -> dict[str, Any]:
        """The stored state (Pods and resourceVersion), for :meth:`restore`."""
        return {"pods": copy.deepcopy(self.pods), "rv": self.rv}

    def restore(self, snapshot: dict[str, Any]) -> None:
        """etcd restored from a backup (do it while stopped): the Pods and the resourceVersion go
        back to ``snapshot``, and no watch history survives. A client's resourceVersion from after
        the backup is now "too large"; one from before it, "too old"."""
        self.pods = copy.deepcopy(snapshot["pods"])
        self.rv = snapshot["rv"]
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
                watcher.queue.put_nowait(self._bookmark_event())
                count += 1
        return count

    @property
    def open_watches(self) -> int:
        return len(self._watchers)

    def fail_next(self, status: int = 503, count: int = 1, kind: str | None = None) -> None:
        """Answer the next ``count`` requests (of ``kind``: "list", "watch", "patch"... or any) with ``status``."""
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

    def _record(self, kind: str, ns: str, obj: dict[str, Any], prev: dict[str, Any] | None = None) -> None:
        event = _Event(self.rv, kind, ns, copy.deepcopy(obj), copy.deepcopy(prev) if prev is not None else None)
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
        meta = pod.setdefault("metadata", {})
        name = meta.get("name")
        if not name:
            raise ValueError("metadata.name is required")
        if (ns, name) in self.pods:
            raise KeyError(f"pod {ns}/{name} already exists")
        meta.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now(), resourceVersion=str(self._bump()))
        pod.setdefault("apiVersion", "v1")
        pod.setdefault("kind", "Pod")
        pod.setdefault("status", {"phase": "Pending"})
        _drop_empty_maps(meta)
        self.pods[(ns, name)] = pod
        self._record("ADDED", ns, pod)
        return copy.deepcopy(pod)

    def _modify(self, namespace: str | None, name: str, patch: dict[str, Any], *,
                keep_status: bool = False) -> dict[str, Any]:
        ns = namespace or self.namespace
        old = self.pods[(ns, name)]
        new = merge_patch(old, patch)
        meta = new.setdefault("metadata", {})
        # Identity fields cannot be patched (a real server rejects or ignores such changes).
        for key in ("name", "namespace", "uid", "creationTimestamp", "resourceVersion"):
            if key in old["metadata"]:
                meta[key] = old["metadata"][key]
        if "deletionTimestamp" in old["metadata"]:  # once set, it stays
            meta["deletionTimestamp"] = old["metadata"]["deletionTimestamp"]
        if keep_status:  # the main resource's PATCH cannot change status (that's /status)
            new["status"] = copy.deepcopy(old.get("status"))
        _drop_empty_maps(meta)
        if new == old:  # a no-op patch: no new resourceVersion, no event
            return copy.deepcopy(old)
        meta["resourceVersion"] = str(self._bump())
        self.pods[(ns, name)] = new
        self._record("MODIFIED", ns, new, old)
        return copy.deepcopy(new)

    def _remove(self, ns: str, name: str) -> dict[str, Any]:
        pod = self.pods.pop((ns, name))
        pod["metadata"]["resourceVersion"] = str(self._bump())  # the DELETED event carries a new rv
        self._record("DELETED", ns, pod)
        return copy.deepcopy(pod)

    def _bookmark_event(self) -> dict[str, Any]:
        return {"type": "BOOKMARK", "object": {"kind": "Pod", "apiVersion": "v1",
                                               "metadata": {"resourceVersion": str(self.rv)}}}

    # -- HTTP ---------------------------------------------------------------------------------
    @web.middleware
    async def _middleware(self, request: web.Request, handler) -> web.StreamResponse:
        kind = _request_kind(request)
        self.requests[kind] = self.requests.get(kind, 0) + 1
        self.request_log.append((asyncio.get_running_loop().time(), kind, dict(request.query)))
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return _error(401, "Unauthorized", "Unauthorized")
        for i, (status, only) in enumerate(self._failures):
            if only is None or only == kind:
                del self._failures[i]
                reason = {410: "Expired", 429: "TooManyRequests", 404: "NotFound", 403: "Forbidden"}.get(
                    status, "InternalError" if status >= 500 else "BadRequest")
                return _error(status, reason, f"injected {status}")
        return await handler(request)

    async def _list_or_watch(self, request: web.Request) -> web.StreamResponse:
        ns = request.match_info.get("ns")  # None on /api/v1/pods: every namespace
        try:
            selector = parse_selector(request.query.get("labelSelector"))
        except ValueError as exc:
            return _error(400, "BadRequest", f"unable to parse requirement: {exc}")
        try:
            fields = parse_field_selector(request.query.get("fieldSelector"))
        except FieldSelectorError as exc:
            return _error(400, "BadRequest", str(exc))
        if request.query.get("watch") in _TRUE:
            return await self._watch(request, ns, selector, fields)
        self.list_params.append(dict(request.query))
        items = [copy.deepcopy(p) for (pns, _), p in sorted(self.pods.items())
                 if (ns is None or pns == ns) and selector_matches(selector, p["metadata"].get("labels"))
                 and fields_match(fields, p)]
        return _json_response({"kind": "PodList", "apiVersion": "v1",
                               "metadata": {"resourceVersion": str(self.rv)}, "items": items})

    async def _watch(self, request: web.Request, ns: str | None, selector: list[Requirement],
                     fields: list[Requirement]) -> web.StreamResponse:
        query = request.query
        self.watch_params.append(dict(query))
        since = query.get("resourceVersion") or ""
        if since and not since.isdigit():
            return _error(400, "BadRequest", f"invalid resourceVersion {since!r}")
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        watcher = _Watcher(ns, selector, query.get("allowWatchBookmarks") in _TRUE, fields)
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
        if since and int(since) < self.compacted_rv:
            # A real server answers 200 and then one ERROR event once the watch is open.
            message = f"too old resource version: {since} ({self.compacted_rv})"
            await resp.write(_line({"type": "ERROR", "object": status_body(410, "Expired", message)}))
            await resp.write_eof()
            return resp
        # Snapshot + register with no await in between, so no event can slip through the gap.
        if not since or since == "0":
            backlog = [{"type": "ADDED", "object": copy.deepcopy(p)} for (pns, _), p in sorted(self.pods.items())
                       if (ns is None or pns == ns) and watcher.matches(p)]
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
                        await resp.write(_line(self._bookmark_event()))
                    continue
                if item is _CLOSE:
                    break
                if item is _ABORT:
                    if request.transport is not None:
                        request.transport.abort()  # mid-chunk: the client sees a broken stream
                    raise asyncio.CancelledError  # nothing more to write on this connection
                await resp.write(_line(item))
        finally:
            self._watchers.discard(watcher)
        await resp.write_eof()
        return resp

    async def _create(self, request: web.Request) -> web.Response:
        ns = request.match_info["ns"]
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            return _error(400, "BadRequest", f"invalid body: {exc}")
        body.setdefault("metadata", {})
        body.pop("status", None)
        try:
            created = self._store_new(ns, body)
        except KeyError:
            return _error(409, "AlreadyExists", f'pods "{body["metadata"].get("name")}" already exists')
        except ValueError as exc:
            return _error(422, "Invalid", str(exc))
        return _json_response(created, 201)

    async def _get(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        pod = self.pods.get((ns, name))
        if pod is None:
            return _error(404, "NotFound", f'pods "{name}" not found')
        return _json_response(pod)

    async def _patch(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        if request.content_type != MERGE_PATCH:
            return _error(415, "UnsupportedMediaType",
                          f"the fake only serves {MERGE_PATCH}, not {request.content_type}")
        if (ns, name) not in self.pods:
            return _error(404, "NotFound", f'pods "{name}" not found')
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError as exc:
            return _error(400, "BadRequest", f"invalid merge patch: {exc}")
        self.patches.append((name, body))
        return _json_response(self._modify(ns, name, body, keep_status=True))

    async def _delete(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        if (ns, name) not in self.pods:
            return _error(404, "NotFound", f'pods "{name}" not found')
        return _json_response(self._remove(ns, name))


def _line(event: dict[str, Any]) -> bytes:
    return json.dumps(event).encode() + b"\n"


def _drop_empty_maps(meta: dict[str, Any]) -> None:
    # A real server omits empty labels/annotations maps (omitempty).
    for key in ("labels", "annotations"):
        if key in meta and not meta[key]:
            del meta[key]


def _request_kind(request: web.Request) -> str:
    if request.method == "GET":
        if "name" in request.match_info:
            return "get"
        return "watch" if request.query.get("watch") in _TRUE else "list"
    return {"POST": "create", "PATCH": "patch", "DELETE": "delete"}.get(request.method, request.method.lower())


__all__ = ["FIELDS", "FakeKubeApi", "FieldSelectorError", "Requirement", "fields_match", "merge_patch",
           "parse_field_selector", "parse_selector", "pod_fields", "selector_matches", "status_body",
           "too_large_status"]
