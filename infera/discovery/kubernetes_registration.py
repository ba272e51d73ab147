"""Kubernetes registration, the worker side (:class:`KubernetesRegistration`, re-exported by
:mod:`infera.discovery.kubernetes`): JSON-merge-patch the worker's record into the annotation of
its own Pod, retry the first registration while the API is not ready, re-assert the record every
``refresh_s`` so that a removed annotation comes back, and patch it to null on deregistering.
"""
from __future__ import annotations

import asyncio
import logging

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from infera.discovery.kubernetes_api import (KubeConfigLike, KubernetesRegistrationError, _config, _describe,
                                             _retryable, _status_code)
from infera.discovery.kubernetes_pods import ANNOTATION
from infera.discovery.record import FleetKey, WorkerRecord, encode_record
from infera.runtime import cancel_and_wait, wait_for

# (the logger's name is the one registration logged under before the split: log configurations name it)
log = logging.getLogger("infera.discovery.kubernetes")


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
        await wait_for(
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
            await wait_for(self._first_registration(), self.first_timeout)
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
                await wait_for(stop.wait(), self.refresh_s)
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
            await cancel_and_wait(task)

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
