"""``python -m infera.operator run``: the InferaDeployment operator (kopf; spec §10 "Reconcile").

kopf watches (its API client, watch streams, namespaces, liveness endpoint, Kubernetes Events);
the reconcile is ours, level-triggered and idempotent:

* every event of a CR, every event of a Deployment / StatefulSet / LeaderWorkerSet the operator
  manages (watched with a server-side label selector, routed to the owner CR), and a resync every
  ``--resync-s`` seconds (which lists the CRs itself, not trusting kopf's watch alone) mark the CR
  dirty;
* a dirty CR is reconciled by one task at a time (marks made while it runs coalesce into one more
  pass): read the CR as it is now, render it, server-side apply every object (field manager
  ``infera-operator``, forced), delete the owned objects the render no longer has, read the owned
  workloads' status and write the CR's ``status`` when it changed (plus an Event on a state change);
* a failed pass is retried after ``RETRY_S`` (§10: 5 s after a failed status update); a refused
  spec or object is reported in the status and not retried until the next resync.

Only ``kopf.on.event`` handlers are registered: kopf adds no finalizer and stores no progress on
the CR, so deleting a CR completes at once (even with the operator down) and the API server's
garbage collector deletes everything it owns through the owner references.
"""
from __future__ import annotations

import argparse
import asyncio
import fnmatch
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import kopf
from lightkube import KubeConfig
from lightkube.config import client_adapter

from infera.config import add_flag, choice_of, positive_float
from infera.discovery.kubernetes import KubeConfigError, load_kube_config
from infera.operator.apply import (CRD_GROUP, CRD_KIND, CRD_PLURAL, CRD_VERSION, PRUNE_KINDS,
                                   WORKLOAD_RESOURCES, KubeApiError, KubeRest, collection_path,
                                   deployment_selector, object_key, owned_by, select_prunable,
                                   state_event)
from infera.operator.status import (COMPONENT_LABEL, MANAGED_BY, MANAGED_BY_LABEL, Outcome, compute_status,
                                    gaie_status, now_rfc3339, status_merge_patch, workload_readiness)
from infera.runtime import cancel_all_and_wait, cancel_and_wait

log = logging.getLogger("infera.operator")

RETRY_S = 5.0
DEFAULT_RESYNC_S = 15.0
NAMESPACES_ENV = "INFERA_OPERATOR_NAMESPACES"

Key = tuple[str, str]  # (namespace, name) of a CR

# The owned workloads whose events re-reconcile their owner CR (so Ready follows at once).
WATCHED_WORKLOADS = (("apps", "v1", "deployments"), ("apps", "v1", "statefulsets"),
                     ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"))

_transport_errors = (client_adapter.httpx.TransportError,)


# --------------------------------------------------------------------------------------------
# The reconcile
# --------------------------------------------------------------------------------------------
class Reconciler:
    """Reconciles CRs by key; see the module docstring."""

    def __init__(self, rest: KubeRest, render: Callable[[dict], list[dict]], spec_error: type[Exception],
                 *, retry_s: float = RETRY_S, clock: Callable[[], str] = now_rfc3339) -> None:
        self._rest = rest
        self._render = render
        self._spec_error = spec_error
        self._retry_s = retry_s
        self._clock = clock
        self._known: set[Key] = set()
        self._dirty: set[Key] = set()
        self._running: dict[Key, asyncio.Task[None]] = {}
        self._retries: dict[Key, asyncio.TimerHandle] = {}

    # ---- scheduling ----
    def track(self, key: Key) -> None:
        self._known.add(key)

    def forget(self, key: Key) -> None:
        self._known.discard(key)
        retry = self._retries.pop(key, None)
        if retry is not None:
            retry.cancel()

    def kick(self, key: Key) -> None:
        """Mark ``key`` dirty; one task per key runs passes until it stays clean."""
        self._dirty.add(key)
        if key not in self._running:
            self._running[key] = asyncio.create_task(self._drain(key), name=f"reconcile {key[0]}/{key[1]}")

    async def _drain(self, key: Key) -> None:
        try:
            while key in self._dirty:
                self._dirty.discard(key)
                try:
                    await self.reconcile(key)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.warning("reconcile of %s/%s failed (retry in %.0f s): %s", key[0], key[1], self._retry_s,
                                exc, exc_info=not isinstance(exc, (KubeApiError, *_transport_errors)))
                    self._retry_later(key)
        finally:
            self._running.pop(key, None)

    def _retry_later(self, key: Key) -> None:
        if key in self._retries:
            return
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._retries.pop(key, None)
            self.kick(key)
        self._retries[key] = loop.call_later(self._retry_s, fire)

    async def resync_forever(self, interval_s: float, scope: "NamespaceScope") -> None:
        """Level-triggered: every ``interval_s``, list the CRs in scope and reconcile each, events
        or not. The list does not trust kopf's watch alone: a CRD created while kopf scans the API
        is missed by its watch (kopf ignores the CRD list it starts its watch with), and such CRs
        would never be served."""
        missing_logged = False
        while True:
            await asyncio.sleep(interval_s)
            try:
                listed = await self._list_crs(scope)
            except (KubeApiError, *_transport_errors) as exc:
                log.warning("resync: listing InferaDeployments failed: %s", exc)
                listed = set()
            if listed is None:
                if not missing_logged:
                    log.warning("resync: the InferaDeployment CRD (%s.%s) is not served; install it "
                                "(kubectl apply -k deploy/kubernetes)", CRD_PLURAL, CRD_GROUP)
                missing_logged = True
                listed = set()
            else:
                missing_logged = False
            self._known |= listed
            for key in sorted(self._known):
                self.kick(key)

    async def _list_crs(self, scope: "NamespaceScope") -> set[Key] | None:
        """The CRs in scope (None: the kind is not served)."""
        api_version = f"{CRD_GROUP}/{CRD_VERSION}"
        found: set[Key] = set()
        for namespace in scope.list_namespaces():
            listed = await self._rest.list(collection_path(api_version, CRD_KIND, namespace))
            if not listed.served:
                return None
            for item in listed.items:
                meta = item.get("metadata") or {}
                if meta.get("name") and scope.includes(meta.get("namespace", "")):
                    found.add((meta.get("namespace", ""), meta["name"]))
        return found

    async def close(self) -> None:
        for handle in self._retries.values():
            handle.cancel()
        self._retries.clear()
        await cancel_all_and_wait(list(self._running.values()))

    async def idle(self) -> None:
        """Wait until no pass runs (tests)."""
        while self._running:
            await asyncio.gather(*list(self._running.values()), return_exceptions=True)

    # ---- one pass ----
    async def reconcile(self, key: Key) -> None:
        namespace, name = key
        cr_path = collection_path(f"{CRD_GROUP}/{CRD_VERSION}", CRD_KIND, namespace) + f"/{name}"
        cr = await self._rest.get(cr_path)
        if cr is None:
            self.forget(key)
            return
        meta = cr.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            return  # being deleted: re-applying would recreate what the garbage collector removes
        generation = meta.get("generation")
        try:
            objects = self._render(cr)
        except self._spec_error as exc:
            log.warning("%s/%s: invalid spec: %s", namespace, name, exc)
            await self._write_status(cr, Outcome(generation=generation, spec_error=str(exc)))
            return
        transient: Exception | None = None
        apply_error: str | None = None
        try:
            for obj in objects:
                await self._rest.apply(obj, namespace)
        except KubeApiError as exc:
            if exc.transient:
                transient = exc
            else:
                apply_error = str(exc)
        except ValueError as exc:  # a kind this operator cannot address: a bug to report, not retry
            apply_error = str(exc)
        except _transport_errors as exc:
            transient = exc
        if transient is not None or apply_error is not None:
            outcome = Outcome(generation=generation, apply_error=apply_error,
                              transient_error=str(transient) if transient else None)
            await self._write_status(cr, outcome)
            if transient is not None:
                raise transient
            return
        gaie_objects: dict[str, dict] = {}
        workloads = await self._prune_and_read(cr, objects, gaie_objects)
        readiness = tuple(workload_readiness(w) for w in workloads)
        gaie = None
        if any(obj.get("kind") == "InferencePool" for obj in objects):
            epp = next((w for w, obj in zip(readiness, workloads)
                        if ((obj.get("metadata") or {}).get("labels") or {}).get(COMPONENT_LABEL) == "epp"), None)
            gaie = gaie_status(epp, gaie_objects.get("InferencePool"), gaie_objects.get("HTTPRoute"))
        await self._write_status(cr, Outcome(generation=generation, applied=True, workloads=readiness, gaie=gaie))

    async def _prune_and_read(self, cr: Mapping[str, Any], rendered: list[dict],
                              gaie_objects: dict[str, dict] | None = None) -> list[dict]:
        """Delete the owned objects the render no longer has; return each rendered workload as it
        is live (as rendered, so 0 ready, when the list does not have it yet). The live
        InferencePool and HTTPRoute it lists go into ``gaie_objects`` by kind (for status.gaie)."""
        meta = cr["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
        kinds = list(PRUNE_KINDS)
        for obj in rendered:
            kind = (obj.get("apiVersion", ""), obj.get("kind", ""))
            if kind not in kinds:
                kinds.append(kind)
        selector = deployment_selector(name)
        live_workloads: dict[tuple[str, str, str], dict] = {}
        for api_version, kind in kinds:
            listed = await self._rest.list(collection_path(api_version, kind, namespace), selector)
            if not listed.served:
                continue
            # List answers may leave out each item's apiVersion/kind.
            items = [{**item, "apiVersion": api_version, "kind": kind} for item in listed.items]
            for obj in select_prunable(items, rendered, name, uid):
                log.info("%s/%s: deleting %s %s (no longer rendered)", namespace, name, kind,
                         obj["metadata"]["name"])
                await self._rest.delete(obj, namespace)
            if (api_version, kind) in WORKLOAD_RESOURCES:
                live_workloads.update((object_key(i), i) for i in items if owned_by(i, uid))
            elif gaie_objects is not None and kind in ("InferencePool", "HTTPRoute"):
                owned = [i for i in items if owned_by(i, uid)]
                if owned:
                    gaie_objects[kind] = owned[0]
        return [live_workloads.get(object_key(obj), obj) for obj in rendered
                if (obj.get("apiVersion"), obj.get("kind")) in WORKLOAD_RESOURCES]

    async def _write_status(self, cr: Mapping[str, Any], outcome: Outcome) -> None:
        old = cr.get("status") or {}
        new = compute_status(old, outcome, self._clock())
        patch = status_merge_patch(old, new)
        if not patch:
            return  # unchanged: no write, no event, no loop
        meta = cr["metadata"]
        try:
            await self._rest.patch_status(cr, patch)
        except KubeApiError as exc:
            if exc.code == 404:  # deleted meanwhile: nothing left to report on
                self.forget((meta["namespace"], meta["name"]))
                return
            raise
        changed = new.get("state") != old.get("state")
        log.log(logging.INFO if changed else logging.DEBUG, "%s/%s: state %s%s", meta["namespace"], meta["name"],
                new.get("state"), f": {new['message']}" if new.get("message") else "")
        if changed:
            ready = next((c for c in new.get("conditions", []) if c.get("type") == "Ready"), {})
            event = state_event(cr, new["state"], ready.get("reason", ""), new.get("message", ""), self._clock())
            try:
                await self._rest.post_event(event)
            except (KubeApiError, *_transport_errors) as exc:  # best effort: the status has it all
                log.debug("%s/%s: event not posted: %s", meta["namespace"], meta["name"], exc)


@dataclass(frozen=True)
class NamespaceScope:
    """The namespaces served: all, or kopf-style patterns (exact names, globs, ``!`` negations)."""
    patterns: tuple[str, ...] = ()  # empty: every namespace

    @property
    def exact(self) -> bool:
        return bool(self.patterns) and not any(set(p) & set("*?[!") for p in self.patterns)

    def list_namespaces(self) -> list[str | None]:
        """Where to list: each exact namespace, else once across every namespace (then filtered)."""
        return list(self.patterns) if self.exact else [None]

    def includes(self, namespace: str) -> bool:
        if not self.patterns:
            return True
        positive = [p for p in self.patterns if not p.startswith("!")]
        negative = [p[1:] for p in self.patterns if p.startswith("!")]
        return ((not positive or any(fnmatch.fnmatchcase(namespace, p) for p in positive))
                and not any(fnmatch.fnmatchcase(namespace, p) for p in negative))


# --------------------------------------------------------------------------------------------
# kopf wiring
# --------------------------------------------------------------------------------------------
def connection_info(config: Any) -> kopf.ConnectionInfo:
    """kopf's credentials from a lightkube kubeconfig (service account or ``KUBECONFIG``)."""
    single = config.get() if isinstance(config, KubeConfig) else config
    cluster, user = single.cluster, single.user
    if user is not None and (user.exec or user.auth_provider):
        raise KubeConfigError(f"kubeconfig context {single.context_name!r}: exec and auth-provider "
                              "credentials are not supported by the operator; use a token or a client certificate")
    token = None
    if user is not None and user.token_file:
        with open(user.token_file, encoding="utf-8") as f:  # re-read: service-account tokens rotate
            token = f.read().strip()
    elif user is not None:
        token = user.token
    return kopf.ConnectionInfo(
        server=cluster.server,
        ca_path=str(single.abs_file(cluster.certificate_auth)) if cluster.certificate_auth else None,
        ca_data=cluster.certificate_auth_data,
        insecure=bool(cluster.insecure),
        username=user.username if user else None,
        password=user.password if user else None,
        scheme="Bearer" if token else None,
        token=token,
        certificate_path=str(single.abs_file(user.client_cert)) if user and user.client_cert else None,
        certificate_data=user.client_cert_data if user else None,
        private_key_path=str(single.abs_file(user.client_key)) if user and user.client_key else None,
        private_key_data=user.client_key_data if user else None,
        default_namespace=single.namespace,
    )


def owner_keys(body: Mapping[str, Any], namespace: str | None) -> list[Key]:
    """The CRs (namespace, name) that own a workload, from its owner references."""
    refs = (body.get("metadata") or {}).get("ownerReferences") or []
    return [(namespace or "", r["name"]) for r in refs
            if isinstance(r, Mapping) and r.get("kind") == CRD_KIND
            and str(r.get("apiVersion", "")).startswith(CRD_GROUP + "/") and r.get("name")]


def build_registry(reconciler: Reconciler, config_loader: Callable[[], Any]) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(config_loader())

    @kopf.on.event(CRD_GROUP, CRD_VERSION, CRD_PLURAL, registry=registry, id="inferadeployment")
    async def on_inferadeployment(event: Mapping[str, Any], namespace: str, name: str, **_: Any) -> None:
        key = (namespace, name)
        if event.get("type") == "DELETED":
            reconciler.forget(key)
            return
        reconciler.track(key)
        reconciler.kick(key)

    async def on_workload(body: Mapping[str, Any], namespace: str, **_: Any) -> None:
        for key in owner_keys(body, namespace):
            reconciler.kick(key)

    for group, version, plural in WATCHED_WORKLOADS:
        kopf.on.event(group, version, plural, labels={MANAGED_BY_LABEL: MANAGED_BY}, registry=registry,
                      id=f"owned-{plural}")(on_workload)
    return registry


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    environ = os.environ if environ is None else environ
    p = argparse.ArgumentParser(prog="python -m infera.operator run",
                                description="Reconcile InferaDeployment resources (kopf operator).")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=None, metavar="NS",
                       help=f"watch this namespace (repeatable; a kopf glob pattern is allowed) [env {NAMESPACES_ENV}, "
                            "comma-separated]")
    add_flag(scope, "--all-namespaces", "-A", env="INFERA_OPERATOR_ALL_NAMESPACES", default=False,
             action="store_true", environ=environ, help="watch every namespace (cluster-wide)")
    add_flag(p, "--sim-engines", env="INFERA_OPERATOR_SIM_ENGINES", default=False, action="store_true",
             environ=environ, help="render every engine as Infera's simulated engine (RenderOptions(sim=True))")
    add_flag(p, "--resync-s", env="INFERA_OPERATOR_RESYNC_S", default=DEFAULT_RESYNC_S, type=positive_float,
             environ=environ, help="reconcile every CR again after this many seconds, events or not")
    add_flag(p, "--liveness", env="INFERA_OPERATOR_LIVENESS", default=None, metavar="URL", environ=environ,
             help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
    add_flag(p, "--log-level", env="INFERA_LOG_LEVEL", default="info", environ=environ,
             type=choice_of("debug", "info", "warning", "error"), help="the operator's log level")
    return p


def _namespaces(args: argparse.Namespace, environ: Mapping[str, str]) -> list[str]:
    if args.namespace:
        return [n for n in args.namespace if n]
    return [n.strip() for n in environ.get(NAMESPACES_ENV, "").split(",") if n.strip()]


async def run_operator(args: argparse.Namespace, namespaces: list[str], config_loader: Callable[[], Any]) -> int:
    from infera.operator.render import RenderOptions, render
    from infera.operator.spec import SpecError

    options = RenderOptions(sim=args.sim_engines)
    rest = KubeRest(config_loader())
    reconciler = Reconciler(rest, lambda cr: render(cr, options), SpecError)
    registry = build_registry(reconciler, config_loader)
    settings = kopf.OperatorSettings()
    settings.posting.level = logging.WARNING  # Kubernetes Events for problems only, not every pass
    settings.watching.server_timeout = 300    # re-open watches now and then, as client-go does
    for group, version, plural in WATCHED_WORKLOADS:
        # Filter on the server: watch only the operator's workloads, not every Deployment in the cluster.
        settings.watching.label_selectors[group, version, plural] = f"{MANAGED_BY_LABEL}={MANAGED_BY}"
    scope = NamespaceScope(() if args.all_namespaces else tuple(namespaces))
    resync = asyncio.create_task(reconciler.resync_forever(args.resync_s, scope), name="resync")
    try:
        await kopf.operator(registry=registry, settings=settings, standalone=True,
                            clusterwide=args.all_namespaces, namespaces=namespaces,
                            liveness_endpoint=args.liveness)
    finally:
        await cancel_and_wait(resync)
        await reconciler.close()
        await rest.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    environ = os.environ
    args = build_parser(environ).parse_args(sys.argv[1:] if argv is None else argv)
    namespaces = _namespaces(args, environ)
    if not args.all_namespaces and not namespaces:
        print(f"error: give --namespace NS (repeatable, or {NAMESPACES_ENV}) or --all-namespaces", file=sys.stderr)
        return 2
    try:
        load_kube_config()  # fail now, with a clear message, rather than in kopf's login retries
    except KubeConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per HTTP request (and per liveness probe), and kopf's "Handler ... succeeded" per
    # watch event, at INFO.
    for chatty in ("httpx", "httpx2", "httpcore", "kopf.objects", "aiohttp.access"):
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        return asyncio.run(run_operator(args, namespaces, load_kube_config))
    except KeyboardInterrupt:
        return 0
