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
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, NamedTuple, Union

import msgspec
from lightkube import ApiError, AsyncClient, ConfigError, KubeConfig, SingleConfig
from lightkube.core import generic_client as _generic_client
from lightkube.models.meta_v1 import Status
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from infera.config import SERVICE_ACCOUNT_DIR
from infera.discovery.fleet import Fleet
from infera.discovery.record import FleetKey, RecordSignatureError, WorkerRecord, decode_record, encode_record

log = logging.getLogger(__name__)

ANNOTATION = "infera.amd.com/worker-info"
DEFAULT_KUBECONFIG = "~/.kube/config"

# The HTTP library lightkube is built on (httpx2 in lightkube 1.x, httpx before): its transport
# errors are what a broken connection raises.
_httpx = _generic_client.httpx

KubeConfigLike = Union[KubeConfig, SingleConfig]


# --------------------------------------------------------------------------------------------
# Errors and config
# --------------------------------------------------------------------------------------------
class KubernetesError(Exception):
    """Base class for the failures this module raises."""


class KubeConfigError(KubernetesError):
    """No usable API server configuration (neither in a Pod nor a kubeconfig file)."""


class KubernetesRegistrationError(KubernetesError):
    """The worker could not write its record into its own Pod's annotation."""


def load_kube_config(service_account_dir: str = SERVICE_ACCOUNT_DIR) -> KubeConfig:
    """In-cluster service-account config inside a Pod, else ``$KUBECONFIG``, else ``~/.kube/config``.

    Same order as lightkube's ``KubeConfig.from_env``, except that ``KUBECONFIG`` may be a
    ``:``-separated list as with kubectl (the first existing file is used; files are not merged).
    """
    try:
        return KubeConfig.from_service_account(service_account_dir)
    except (ConfigError, KeyError):
        # ConfigError: no token/namespace files; KeyError: files present but not inside a Pod
        # (KUBERNETES_SERVICE_HOST/PORT unset).
        pass
    candidates = [p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p] or [DEFAULT_KUBECONFIG]
    for path in candidates:
        if os.path.isfile(os.path.expanduser(path)):
            try:
                return KubeConfig.from_file(path)
            except Exception as exc:  # bad YAML, missing sections, bad types: all "unusable"
                raise KubeConfigError(f"unusable kubeconfig {path}: {_describe(exc)}") from exc
    raise KubeConfigError(
        f"no Kubernetes API config: not inside a Pod (no service account at {service_account_dir} or "
        f"KUBERNETES_SERVICE_HOST unset) and no kubeconfig file at {', '.join(candidates)}")


def _config(config: KubeConfigLike | None) -> KubeConfigLike:
    return config if config is not None else load_kube_config()


def _api_status(exc: BaseException) -> Status | None:
    """The Kubernetes ``Status`` an error carries: an ``ApiError``'s (a watch ERROR event, an error
    answer lightkube decoded), or the body of an HTTP error answer that was read (see
    :func:`_read_error_body`)."""
    if isinstance(exc, ApiError):
        return exc.status
    if isinstance(exc, _httpx.HTTPStatusError):
        try:
            body = exc.response.json()
        except Exception:  # not read (a stream, a body past the bound), not JSON: no Status to go by
            return None
        if isinstance(body, dict) and body.get("kind") == "Status":
            try:
                return Status.from_dict(body)
            except Exception:
                return None
    return None


def _describe(exc: BaseException) -> str:
    status = _api_status(exc)
    if status is not None:
        code = status.code or _status_code(exc)
        return f"HTTP {code} {status.reason or ''}: {status.message or ''}".strip()
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _status_code(exc: BaseException) -> int | None:
    if isinstance(exc, ApiError) and exc.status is not None and exc.status.code:
        return int(exc.status.code)
    if isinstance(exc, _httpx.HTTPStatusError):
        return exc.response.status_code
    return None


TOO_LARGE_CAUSE = "ResourceVersionTooLarge"  # metav1.CauseTypeResourceVersionTooLarge
TOO_LARGE_MESSAGE = "Too large resource version"


def _too_large_resource_version(exc: BaseException) -> bool:
    """kube-apiserver's answer to a watch (or a list) from a resourceVersion newer than it has: a
    504 Timeout ``Status`` whose cause is ``ResourceVersionTooLarge`` (servers before 1.18.6: only
    the cause message or the status message says "Too large resource version"). The same test as
    client-go's reflector (``isTooLargeResourceVersionError``)."""
    status = _api_status(exc)
    if status is None:
        return False
    causes = (status.details.causes or []) if status.details is not None else []
    if any(c.reason == TOO_LARGE_CAUSE for c in causes):
        return True
    if (status.code or _status_code(exc)) != 504:
        return False
    return any(c.message == TOO_LARGE_MESSAGE for c in causes) or TOO_LARGE_MESSAGE in (status.message or "")


def _stale_resource_version(exc: BaseException) -> str | None:
    """Why the watch cannot resume from our resourceVersion ("expired" / "too-large"), or None."""
    if _status_code(exc) == 410:
        return "expired"
    if _too_large_resource_version(exc):
        return "too-large"
    return None


MAX_ERROR_BODY_BYTES = 64 * 1024  # a Status is a few hundred bytes; a longer error body is not one


async def _read_error_body(response: Any) -> None:
    """An httpx response hook: read the body of an error answer before lightkube sees it, up to
    ``MAX_ERROR_BODY_BYTES`` (a hostile or broken server's endless error body is closed, not read on).
    lightkube streams a watch and raises on its status without reading the body, which holds the
    ``Status`` (why: 410 Expired, 504 Too large resource version, 403 Forbidden...)."""
    if response.status_code < 400:
        return
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > MAX_ERROR_BODY_BYTES:
            await response.aclose()
            return
        chunks.append(chunk)
    # what httpx's own aread() leaves behind (a bounded aread): .content and .json() read it, and a
    # later aread() by lightkube (a non-streamed request) returns it instead of re-reading the stream
    response._content = b"".join(chunks)


def _retryable(exc: BaseException) -> bool:
    """Server-side trouble or a broken connection is worth retrying; 4xx (RBAC, no such Pod) is not."""
    code = _status_code(exc)
    if code is not None:
        return code >= 500 or code == 429
    return isinstance(exc, (_httpx.TransportError, OSError, asyncio.TimeoutError))


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
                    kind, pod = await asyncio.wait_for(stream.__anext__(), self.idle_timeout_s)
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


# --------------------------------------------------------------------------------------------
# Registration (worker side)
# --------------------------------------------------------------------------------------------
class KubernetesRegistration:
    """Publish one worker record in the ``infera.amd.com/worker-info`` annotation of its own Pod.

    The annotation is re-asserted every ``refresh_s`` (a no-op patch on a real API server when it is
    unchanged), so one that someone removed comes back. The Pod's deletion removes it for good.
    """

    def __init__(
        self,
        namespace: str,
        pod_name: str,
        *,
        config: KubeConfigLike | None = None,
        refresh_s: float = 30.0,
        first_timeout: float = 30.0,
        request_timeout: float = 10.0,
        fleet_key: FleetKey | None = None,
    ) -> None:
        self.namespace = namespace
        self.pod_name = pod_name
        self.fleet_key = fleet_key  # signs the record (servers with the key ignore unsigned ones)
        self.config = _config(config)
        self.refresh_s = refresh_s
        self.first_timeout = first_timeout
        self.request_timeout = request_timeout
        self.record: WorkerRecord | None = None
        self.refreshes = 0  # successful re-assertions by the background loop
        self._client: AsyncClient | None = None
        self._refresh_task: asyncio.Task[None] | None = None
        self._stop_refresh: asyncio.Event | None = None
        self._lock = asyncio.Lock()  # one patch at a time: the last write carries the latest record
        self._first_error: str | None = None  # why the first registration is still retrying

    def _get_client(self) -> AsyncClient:
        if self._client is None:
            self._client = AsyncClient(config=self.config, namespace=self.namespace, field_manager="infera")
        return self._client

    async def _patch(self, value: str | None) -> None:
        body = {"metadata": {"annotations": {ANNOTATION: value}}}
        await asyncio.wait_for(
            self._get_client().patch(Pod, self.pod_name, body, namespace=self.namespace, patch_type=PatchType.MERGE),
            self.request_timeout)

    async def _write_record(self) -> None:
        async with self._lock:
            assert self.record is not None
            await self._patch(encode_record(self.record, self.fleet_key).decode())

    async def register(self, record: WorkerRecord) -> None:
        """Annotate the Pod, then keep re-asserting it in the background.

        Raises KubernetesRegistrationError at once on a non-retryable answer (no such Pod, RBAC), or
        when the API server could not be reached within ``first_timeout`` seconds.
        """
        if self._refresh_task is not None:
            raise RuntimeError("already registered; use update() to change the record")
        self.record = record
        where = f"Pod {self.namespace}/{self.pod_name}"
        try:
            await asyncio.wait_for(self._first_registration(), self.first_timeout)
        except asyncio.TimeoutError:
            raise KubernetesRegistrationError(
                f"could not annotate {where} with {record.worker_id} within {self.first_timeout:g}s "
                f"(last error: {self._first_error or 'none: the request hung'})") from None
        except KubernetesRegistrationError:
            raise
        except Exception as exc:
            raise KubernetesRegistrationError(f"could not annotate {where} with {record.worker_id}: "
                                              f"{_describe(exc)}") from exc
        log.info("registered %s in the %s annotation of %s", record.worker_id, ANNOTATION, where)
        self._stop_refresh = asyncio.Event()
        self._refresh_task = asyncio.create_task(self._refresh_loop(self._stop_refresh),
                                                 name=f"k8s-registration:{self.pod_name}")

    async def _first_registration(self) -> None:
        delay = 0.1
        self._first_error = None
        while True:
            try:
                await self._write_record()
                return
            except Exception as exc:
                if not _retryable(exc):
                    raise
                self._first_error = _describe(exc)
                log.info("kubernetes API not ready for registration (%s); retrying in %.1fs", _describe(exc), delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def update(self, record: WorkerRecord) -> bool:
        """Re-annotate with a changed record. True when written now; False when the API is
        unreachable — the refresh loop then writes the latest record on its next round."""
        if self._refresh_task is None:
            raise RuntimeError("update() needs a live registration (call register() first)")
        self.record = record
        try:
            await self._write_record()
            return True
        except Exception as exc:
            log.warning("could not update %s on Pod %s: %s (the refresh retries)", record.worker_id, self.pod_name,
                        _describe(exc))
            return False

    async def _refresh_loop(self, stop: asyncio.Event) -> None:
        failing = False
        while True:
            try:
                await asyncio.wait_for(stop.wait(), self.refresh_s)
                return
            except asyncio.TimeoutError:
                pass
            try:
                await self._write_record()
                self.refreshes += 1
                if failing:
                    log.info("kubernetes API reachable again; %s is annotated", self.pod_name)
                    failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep trying at the same cadence; never die
                if not failing:
                    log.warning("re-asserting the worker record on Pod %s failed: %s (retrying every %.1fs)",
                                self.pod_name, _describe(exc), self.refresh_s)
                    failing = True

    async def _stop_refresh_loop(self) -> None:
        task, self._refresh_task = self._refresh_task, None
        if task is None:
            return
        assert self._stop_refresh is not None
        # Ask it to stop and let a patch in flight finish: cancelling a sent request could let the
        # server apply it after our own deregistering patch, re-adding the record.
        self._stop_refresh.set()
        done, _ = await asyncio.wait([task], timeout=self.request_timeout + 1)
        if not done:
            task.cancel()
            await asyncio.wait([task])

    async def deregister(self) -> None:
        """Stop the refresh, then patch the annotation to null. Logs failures; never raises."""
        await self._stop_refresh_loop()  # FIRST, so it cannot re-assert the record behind our back
        if self.record is None:
            return
        try:
            async with self._lock:
                await self._patch(None)
            log.info("deregistered %s (cleared the annotation of Pod %s)", self.record.worker_id, self.pod_name)
        except Exception as exc:
            if _status_code(exc) == 404:
                log.info("deregister: Pod %s is already gone", self.pod_name)
            else:
                log.warning("deregister: could not clear the annotation of Pod %s: %s", self.pod_name, _describe(exc))

    async def close(self) -> None:
        """Stop the refresh and close the client. Does NOT clear the annotation (deregister() does);
        the Pod's deletion removes it anyway."""
        await self._stop_refresh_loop()
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.close()
            except Exception as exc:  # closing must not fail a shutdown
                log.debug("closing the kubernetes client failed: %s", exc)


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
