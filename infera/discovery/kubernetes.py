"""Kubernetes discovery: worker records live in an annotation of each worker's own Pod.

* :class:`KubernetesDiscovery` (server side): list the Pods matching a label selector, reconcile
  the fleet, then watch from the list's resourceVersion (with bookmarks, so a quiet selector still
  advances its resourceVersion). A broken watch resumes from the last resourceVersion seen. Two
  answers mean that resourceVersion cannot be watched from, so only a re-list (from the latest
  state) and a reconcile help, as in client-go's reflector: 410 Gone (the history moved on, e.g. a
  restarted API server rebuilt its watch cache) and 504 "Too large resource version" (the server is
  behind the version, e.g. etcd restored from a backup, or another API server's lagging cache).
  Re-lists that keep meeting them back off. Other failures back off and retry the watch while the
  fleet keeps its last known content.
* :class:`KubernetesRegistration` (worker side): JSON-merge-patch the record into the annotation of
  its own Pod and re-assert it every ``refresh_s``; deregistering patches the annotation to null.

Per Pod: DELETED, no annotation, or ``status.phase != "Running"`` → no worker; a set
``metadata.deletionTimestamp`` → the record as ``draining`` (the Pod is terminating: routing stops
before the kubelet signals the worker); otherwise the record as written.

lightkube's public ``list``/``watch`` take label selectors only as dicts of operators and cannot ask
for bookmarks, so list and watch requests are built with its ``GenericAsyncClient``
(``AsyncClient._client``: ``prepare_request`` + ``list``/``watch``), passing ``labelSelector`` and
``allowWatchBookmarks`` as raw query parameters. Decoding, ERROR events (raised as ``ApiError``) and
auth stay lightkube's. lightkube does not read the body of an error answer to a watch request (a
stream); a response hook on its HTTP client reads it, so such an answer's ``Status`` is known too.

This module owns the discovery (server side); its neighbours own talking to the API
(``kubernetes_api``), what a Pod means to the fleet (``kubernetes_pods``) and the registration
(``kubernetes_registration``), whose names are re-exported here.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod

from infera.discovery.fleet import Fleet
# The other concerns, in their own modules; their names are re-exported here, where callers
# imported them from.
from infera.discovery.kubernetes_api import (  # noqa: F401
    DEFAULT_KUBECONFIG, MAX_ERROR_BODY_BYTES, TOO_LARGE_CAUSE, TOO_LARGE_MESSAGE, KubeConfigError, KubeConfigLike,
    KubernetesError, KubernetesRegistrationError, _api_status, _config, _describe, _httpx, _read_error_body,
    _retryable, _stale_resource_version, _status_code, _too_large_resource_version, load_kube_config)
from infera.discovery.kubernetes_pods import ANNOTATION, PodState, _generic, _pod_name, pod_state  # noqa: F401
from infera.discovery.kubernetes_registration import KubernetesRegistration  # noqa: F401
from infera.discovery.record import FleetKey, WorkerRecord
from infera.runtime import wait_for

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Discovery (server side)
# --------------------------------------------------------------------------------------------
class KubernetesDiscovery:
    """Keep a :class:`Fleet` equal to the worker records annotated on the Pods that ``label_selector``
    selects in ``namespace``.

    ``watch_timeout_s`` asks the server to end each watch after that long (lightkube then re-opens it
    from the last resourceVersion); ``idle_timeout_s`` (default: ``watch_timeout_s`` + 60 s) re-opens a
    watch on which nothing, not even a bookmark, arrived for that long — a half-open connection
    otherwise stays silent forever.
    """

    def __init__(
        self,
        label_selector: str,
        namespace: str,
        *,
        config: KubeConfigLike | None = None,
        backoff_initial: float = 0.5,
        backoff_max: float = 10.0,
        watch_timeout_s: float = 290.0,
        idle_timeout_s: float | None = None,
        fleet_key: FleetKey | None = None,
    ) -> None:
        self.label_selector = label_selector
        self.fleet_key = fleet_key  # set: only records signed with it are applied
        self.namespace = namespace
        self.config = _config(config)  # fail fast (at server start) when there is no API to talk to
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.watch_timeout_s = watch_timeout_s
        self.idle_timeout_s = idle_timeout_s if idle_timeout_s is not None else watch_timeout_s + 60.0
        self.ready = asyncio.Event()  # set after the first successful list
        self.resource_version: str | None = None  # latest seen (list, events, bookmarks); None = re-list
        self.relists = 0  # successful lists (the first one included)
        self.expired = 0  # 410 Gone answers (each one forces a re-list)
        self.too_large = 0  # "Too large resource version" answers (each one forces a re-list)
        self.bookmarks = 0
        self.last_error: str | None = None
        self._client: AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._failures = 0  # failed attempts in the current outage
        self._backoff = backoff_initial
        self._stale_in_a_row = 0  # 410s / too-large answers with no watch event in between (a loop guard)
        self._sleep = asyncio.sleep  # every backoff wait goes through here (tests record them)
        # Pod name → the record applied from it: a Pod whose annotation changes worker_id, or that
        # goes away, removes the id it held (unless another Pod still holds it).
        self._records_by_pod: dict[str, WorkerRecord] = {}
        self._bad_annotations: dict[str, str] = {}  # Pod → bad value already logged (log once)
        self._rejected_pods: set[str] = set()  # Pods whose unsigned/wrongly signed record was logged
        self._stopping = False

    async def start(self, fleet: Fleet) -> None:
        """Launch the background loop and return at once (the API server may be unreachable now)."""
        if self._task is not None:
            raise RuntimeError("KubernetesDiscovery already started")
        self._stopping = False
        self._client = AsyncClient(config=self.config, namespace=self.namespace, field_manager="infera")
        generic = _generic(self._client)  # an incompatible lightkube fails here, not in the background
        hooks = getattr(getattr(generic, "_client", None), "event_hooks", None)
        if isinstance(hooks, dict) and isinstance(hooks.get("response"), list):
            hooks["response"].append(_read_error_body)  # else: errors are described by their HTTP status only
        self._task = asyncio.create_task(self._run(fleet), name=f"k8s-discovery:{self.namespace}/{self.label_selector}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        client, self._client = self._client, None
        self._stopping = True  # the HTTP stack may turn our cancel into a read error: don't retry then
        if task is not None:
            task.cancel()
            # Let it unwind (closes the watch stream). A read cancelled inside httpx's stream can
            # stay parked until its connection goes away: closing the client below releases it.
            await asyncio.wait([task], timeout=1.0)
        if client is not None:
            await client.close()
        if task is not None and not task.done():
            _, pending = await asyncio.wait([task], timeout=5.0)
            if pending:
                log.warning("kubernetes discovery task did not stop within 6s")

    # -- loop ------------------------------------------------------------------------------
    async def _run(self, fleet: Fleet) -> None:
        while True:
            try:
                if self.resource_version is None:
                    await self._relist(fleet)
                await self._watch(fleet)
                continue  # idle: re-open at once (lightkube itself re-opens a watch the server ended)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never let discovery die
                if self._stopping:
                    return
                error = exc
            self.last_error = _describe(error)
            stale = _stale_resource_version(error)
            if stale is not None:
                # 410: our resourceVersion is older than the server's history. Too large: the
                # server is behind it (etcd restored from a backup, a lagging API server); retrying
                # the same version would fail for as long as that lasts, and what we hold may be
                # ahead of what the server will ever have. Either way only a re-list from the
                # latest state (replace_all) can tell which Pods there are.
                if stale == "expired":
                    self.expired += 1
                else:
                    self.too_large += 1
                self._stale_in_a_row += 1
                log.info("kubernetes watch cannot resume from resourceVersion %s (%s); re-listing",
                         self.resource_version, self.last_error)
                self.resource_version = None
                if self._stale_in_a_row > 1:  # normal once; again and again means back off
                    await self._sleep(min(self.backoff_initial * 2 ** (self._stale_in_a_row - 2), self.backoff_max))
                continue
            self._failures += 1
            # First failure of an outage at WARNING; repeats at DEBUG so an outage isn't log spam.
            log.log(logging.WARNING if self._failures == 1 else logging.DEBUG,
                    "kubernetes discovery of %r in %s failed (%s); retrying in %.1fs from resourceVersion %s",
                    self.label_selector, self.namespace, self.last_error, self._backoff, self.resource_version)
            await self._sleep(self._backoff)
            self._backoff = min(self._backoff * 2, self.backoff_max)

    def _progress(self) -> None:
        """The API answered (a list, or any watch event): the outage, if any, is over."""
        if self._failures:
            log.info("kubernetes discovery recovered after %d failed attempt(s)", self._failures)
            self._failures = 0
        self._backoff = self.backoff_initial

    def _request(self, watch: bool, params: dict[str, Any]) -> Any:
        assert self._client is not None
        params = {"labelSelector": self.label_selector, **params}
        return _generic(self._client).prepare_request("list", res=Pod, namespace=self.namespace, watch=watch,
                                                      params=params)

    async def _relist(self, fleet: Fleet) -> None:
        assert self._client is not None
        pods = _generic(self._client).list(self._request(False, {}))
        records: dict[str, WorkerRecord] = {}
        names: set[str] = set()
        async for pod in pods:
            names.add(_pod_name(pod))
            record = self._record_for(pod)
            if record is not None:
                records[_pod_name(pod)] = record
        self._records_by_pod = records
        self._bad_annotations = {n: v for n, v in self._bad_annotations.items() if n in names}
        self._rejected_pods &= names
        fleet.replace_all(records.values())
        self.resource_version = pods.resourceVersion
        self.relists += 1
        self.ready.set()
        self._progress()
        log.debug("kubernetes list of %s in %s at resourceVersion %s: %d worker(s)", self.label_selector,
                  self.namespace, self.resource_version, len(records))

    async def _watch(self, fleet: Fleet) -> None:
        assert self._client is not None
        br = self._request(True, {"resourceVersion": self.resource_version, "allowWatchBookmarks": "true",
                                  "timeoutSeconds": max(1, int(self.watch_timeout_s))})
        stream = _generic(self._client).watch(br).__aiter__()
        try:
            while True:
                try:
                    kind, pod = await wait_for(stream.__anext__(), self.idle_timeout_s)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    log.info("kubernetes watch silent for %.0fs (a dead connection?); re-watching from "
                             "resourceVersion %s", self.idle_timeout_s, self.resource_version)
                    return
                self._progress()
                self._stale_in_a_row = 0
                if kind == "BOOKMARK":
                    self.bookmarks += 1
                else:
                    try:
                        self._apply(fleet, kind, pod)
                    except Exception:  # one odd Pod must not wedge the watch
                        log.exception("kubernetes discovery could not apply %s of Pod %s", kind, _pod_name(pod))
                rv = pod.metadata.resourceVersion if pod.metadata is not None else None
                if rv:
                    self.resource_version = rv
        finally:
            await stream.aclose()  # release the HTTP stream promptly

    # -- applying --------------------------------------------------------------------------
    def _record_for(self, pod: Pod) -> WorkerRecord | None:
        name = _pod_name(pod)
        state = pod_state(pod, self.fleet_key)
        if state.reason == "bad-signature":
            if name not in self._rejected_pods:
                self._rejected_pods.add(name)
                log.warning("ignoring the worker record on Pod %s: %s; it is not routed to (a fleet key is set: "
                            "only records signed with it count)", name, state.detail)
        else:
            self._rejected_pods.discard(name)
        if state.reason == "bad-annotation":
            raw = (pod.metadata.annotations or {}).get(ANNOTATION, "")
            if self._bad_annotations.get(name) != raw:
                self._bad_annotations[name] = raw
                log.warning("skipping Pod %s: undecodable %s annotation: %s", name, ANNOTATION, state.detail)
        else:
            self._bad_annotations.pop(name, None)
        return state.record

    def _apply(self, fleet: Fleet, kind: str, pod: Pod) -> None:
        name = _pod_name(pod)
        if kind == "DELETED":
            record = None
            self._bad_annotations.pop(name, None)
            self._rejected_pods.discard(name)
        else:  # ADDED / MODIFIED
            record = self._record_for(pod)
        old = self._records_by_pod.pop(name, None)
        if record is not None:
            self._records_by_pod[name] = record
            fleet.upsert(record)
        if old is not None and (record is None or old.worker_id != record.worker_id):
            fleet.release(old.worker_id, self._records_by_pod.values())


__all__ = [
    "ANNOTATION",
    "KubeConfigError",
    "KubernetesDiscovery",
    "KubernetesError",
    "KubernetesRegistration",
    "KubernetesRegistrationError",
    "PodState",
    "load_kube_config",
    "pod_state",
]
