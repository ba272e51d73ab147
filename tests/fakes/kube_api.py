"""A fake Kubernetes API server for Pods: in-memory, aiohttp, started by tests on a loopback port.

Serves just what Infera's Kubernetes discovery and registration use, with the semantics they rely on:

* ``GET  /api/v1/namespaces/{ns}/pods`` (list; ``?watch=true`` streams), ``POST`` (create);
  ``GET  /api/v1/pods`` (all namespaces, list or watch);
* ``GET | PATCH | DELETE /api/v1/namespaces/{ns}/pods/{name}``; PATCH takes
  ``application/merge-patch+json`` (RFC 7386: objects merge recursively, ``null`` deletes a key);
* ``labelSelector``: ``a=b``, ``a==b``, ``a!=b``, ``a in (x,y)``, ``a notin (x,y)``, ``a``, ``!a``;
  a comma is AND;
* one global, monotonically increasing ``resourceVersion``, set on every written object and on list
  metadata; a no-op PATCH changes nothing and emits nothing (as on a real server);
* watches: newline-delimited ``{"type", "object"}`` events after the given resourceVersion (the
  history since then is replayed first), none/``0`` = synthetic ADDED for the current objects;
  a label change in or out of the selector is seen as ADDED / DELETED, as the watch cache does;
  ``allowWatchBookmarks`` (BOOKMARK on :meth:`FakeKubeApi.bookmark` and every
  ``bookmark_interval`` seconds when set); ``timeoutSeconds`` (the server ends the stream cleanly);
  a resourceVersion older than the kept history → an ``ERROR`` event carrying a ``Status`` with
  ``code: 410, reason: Expired`` (what a real server sends once a watch is open);
* ``Authorization: Bearer <token>`` is required when the fake has a token (401 otherwise).

Test helpers: :meth:`~FakeKubeApi.add_pod`, :meth:`~FakeKubeApi.set_phase`,
:meth:`~FakeKubeApi.set_annotation`, :meth:`~FakeKubeApi.set_labels`,
:meth:`~FakeKubeApi.begin_graceful_delete` (sets ``deletionTimestamp``: MODIFIED) then
:meth:`~FakeKubeApi.finish_delete` (DELETED), like the kubelet during the grace period;
:meth:`~FakeKubeApi.compact`, :meth:`~FakeKubeApi.close_watches` (clean end or abrupt drop),
:meth:`~FakeKubeApi.fail_next` (answer the next requests with an error status),
:meth:`~FakeKubeApi.stop` / :meth:`~FakeKubeApi.start` (an outage on the same port, state kept).

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
* Lists ignore ``resourceVersion``/``resourceVersionMatch``, ``limit``/``continue`` (always one
  page, always the latest state) and ``fieldSelector``. Watches ignore ``fieldSelector``,
  ``sendInitialEvents`` and ``resourceVersionMatch``.
* A watch from a resourceVersion newer than the server's is accepted as is (a real server waits
  for it or answers "Too large resource version").
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
def status_body(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


def _json_response(body: Any, status: int = 200) -> web.Response:
    # Exactly "application/json" (no charset): lightkube turns an error into ApiError only then.
    return web.Response(status=status, body=json.dumps(body).encode(), headers={"Content-Type": JSON})


def _error(code: int, reason: str, message: str) -> web.Response:
    return _json_response(status_body(code, reason, message), code)


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
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def translate(self, event: _Event) -> dict[str, Any] | None:
        """The event as this watcher sees it (selector transitions become ADDED / DELETED)."""
        if self.namespace is not None and event.namespace != self.namespace:
            return None
        now = selector_matches(self.selector, event.obj["metadata"].get("labels"))
        if event.type == "MODIFIED":
            before = event.prev is not None and selector_matches(self.selector, event.prev["metadata"].get("labels"))
            kind = "MODIFIED" if before and now else "ADDED" if now else "DELETED" if before else None
        else:
            kind = event.type if now else None
        return None if kind is None else {"type": kind, "object": event.obj}


class FakeKubeApi:
    """In-memory Pods behind an aiohttp server; see the module docstring for what it honours."""

    def __init__(self, *, namespace: str = "default", token: str | None = "test-token",
                 history_limit: int | None = None, bookmark_interval: float | None = None) -> None:
        self.namespace = namespace  # the helpers' default namespace
        self.token = token
        self.history_limit = history_limit
        self.bookmark_interval = bookmark_interval
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.history: list[_Event] = []
        self.rv = 0
        self.compacted_rv = 0  # watches from an older resourceVersion get 410 Gone
        self.requests: dict[str, int] = {}  # "list" / "watch" / "get" / "patch" / "create" / "delete"
        self.watch_params: list[dict[str, str]] = []  # query of every watch request, in order
        self.patches: list[tuple[str, dict[str, Any]]] = []  # (pod name, patch body)
        self._watchers: set[_Watcher] = set()
        self._failures: list[tuple[int, str | None]] = []  # (status, only this request kind | None)
        self._runner: web.AppRunner | None = None
        self.port = 0

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int | None = None) -> "FakeKubeApi":
        """Serve on ``port`` (default: the previous port, else a free one). State survives restarts."""
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
        return self.rv

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
        if request.query.get("watch") in _TRUE:
            return await self._watch(request, ns, selector)
        items = [copy.deepcopy(p) for (pns, _), p in sorted(self.pods.items())
                 if (ns is None or pns == ns) and selector_matches(selector, p["metadata"].get("labels"))]
        return _json_response({"kind": "PodList", "apiVersion": "v1",
                               "metadata": {"resourceVersion": str(self.rv)}, "items": items})

    async def _watch(self, request: web.Request, ns: str | None, selector: list[Requirement]) -> web.StreamResponse:
        query = request.query
        self.watch_params.append(dict(query))
        since = query.get("resourceVersion") or ""
        if since and not since.isdigit():
            return _error(400, "BadRequest", f"invalid resourceVersion {since!r}")
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        watcher = _Watcher(ns, selector, query.get("allowWatchBookmarks") in _TRUE)
        resp = web.StreamResponse(status=200, headers={"Content-Type": JSON})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        if since and int(since) < self.compacted_rv:
            # A real server answers 200 and then one ERROR event once the watch is open.
            message = f"too old resource version: {since} ({self.compacted_rv})"
            await resp.write(_line({"type": "ERROR", "object": status_body(410, "Expired", message)}))
            await resp.write_eof()
            return resp
        # Snapshot + register with no await in between, so no event can slip through the gap.
        if not since or since == "0":
            backlog = [{"type": "ADDED", "object": copy.deepcopy(p)} for (pns, _), p in sorted(self.pods.items())
                       if (ns is None or pns == ns) and selector_matches(selector, p["metadata"].get("labels"))]
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


__all__ = ["FakeKubeApi", "Requirement", "merge_patch", "parse_selector", "selector_matches", "status_body"]
