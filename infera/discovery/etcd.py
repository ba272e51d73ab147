"""etcd v3 discovery over etcd's JSON gateway (plain HTTP; no gRPC dependency).

Three layers, one module each:

* codec helpers and errors (``etcd_codec.py``; pure functions, unit-tested): base64 request
  bodies, ``prefix_end``, parsing of range/keepalive responses and of the newline-delimited JSON
  lines of a watch stream;
* :class:`EtcdClient` and :class:`EtcdAuth` (``etcd_client.py``): a small async client over one
  keep-alive aiohttp session;
* :class:`EtcdDiscovery` (``etcd_discovery.py``; server side: list → reconcile → watch → re-list on
  any trouble) and :class:`EtcdRegistration` (here; worker side: lease + put + keepalive,
  re-asserting a lost lease).

This module owns the registration and keeps the public names of the three importable from here.

Gateway facts this relies on (etcd 3.4 / 3.5): keys and values are base64 in every body; int64 ids
and revisions are JSON strings; a PUT watch event has no ``type`` field; a watch from a compacted
revision answers ``compact_revision`` and is cancelled (the HTTP stream itself stays open).
"""
from __future__ import annotations

import asyncio
import logging
import math

# The parts' public names (and the test-used _parse_response) stay importable from here, where the
# server, the workers, the benches and the tests find them.
from infera.discovery.etcd_client import EtcdAuth, EtcdClient, _client_for
from infera.discovery.etcd_codec import (ETCD_PASSWORD_ENV, EtcdAuthError, EtcdConnectionError, EtcdError,
                                         EtcdRequestError, EtcdTlsError, LeaseNotFound, WatchBatch, WatchCanceled,
                                         WatchCompacted, WatchEvent, _parse_response, b64decode, b64encode,
                                         normalize_endpoint, parse_keepalive_ttl, parse_range_response,
                                         parse_watch_line, prefix_end, put_body, range_prefix_body,
                                         watch_create_body)
from infera.discovery.etcd_discovery import EtcdDiscovery
from infera.discovery.record import FleetKey, WorkerRecord, encode_record
from infera.runtime import cancel_and_wait, wait_for

__all__ = ["ETCD_PASSWORD_ENV", "KEEPALIVE_RETRY_S", "EtcdAuth", "EtcdAuthError", "EtcdClient",
           "EtcdConnectionError", "EtcdDiscovery", "EtcdError", "EtcdRegistration", "EtcdRequestError",
           "EtcdTlsError", "LeaseNotFound", "WatchBatch", "WatchCanceled", "WatchCompacted", "WatchEvent",
           "_parse_response", "b64decode", "b64encode", "normalize_endpoint", "parse_keepalive_ttl",
           "parse_range_response", "parse_watch_line", "prefix_end", "put_body", "range_prefix_body",
           "watch_create_body"]

log = logging.getLogger(__name__)

# How soon a keepalive that failed is tried again (never later than the normal ttl/3 cadence).
KEEPALIVE_RETRY_S = 1.0


# --------------------------------------------------------------------------------------------
# Registration (worker side)
# --------------------------------------------------------------------------------------------
class EtcdRegistration:
    """Publish one worker record at ``<prefix><worker_id>`` under a lease kept alive in the background.

    If the lease is found gone (etcd wiped, lease expired while paused) the record is re-granted
    and re-put; while etcd is unreachable the keepalive retries every ``KEEPALIVE_RETRY_S`` (at
    most its normal cadence) until etcd answers.
    """

    def __init__(
        self,
        endpoint_url: str | None,
        prefix: str,
        ttl: float = 10,
        *,
        client: EtcdClient | None = None,
        first_timeout: float = 30.0,
        fleet_key: FleetKey | None = None,
        etcd_auth: EtcdAuth | None = None,
    ) -> None:
        self.client, self._owns_client = _client_for(endpoint_url, client, "EtcdRegistration", etcd_auth)
        self.prefix = prefix
        self.fleet_key = fleet_key  # signs every record put (servers with the key ignore unsigned ones)
        self.lease_ttl = max(1, math.ceil(ttl))  # etcd leases are whole seconds
        self.keepalive_interval = max(self.lease_ttl / 3, 0.5)
        self.first_timeout = first_timeout
        self.lease_id: int | None = None
        self.record: WorkerRecord | None = None
        self.reregistrations = 0  # times the lease had to be re-granted after being lost
        self._pending_put = False  # an update() that could not be written yet
        self._registered = False
        self._keepalive_task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # serialises lease/put changes between update() and keepalive

    @property
    def key(self) -> str:
        if self.record is None:
            raise RuntimeError("not registered")
        return self.prefix + self.record.worker_id

    async def register(self, record: WorkerRecord) -> None:
        """Grant a lease, put the record, start the keepalive.

        Raises EtcdError when etcd cannot be reached within ``first_timeout`` seconds (or refuses
        the request outright); later outages are ridden out in the background.
        """
        if self._keepalive_task is not None:
            raise RuntimeError("already registered; use update() to change the record")
        self.record = record
        try:
            await wait_for(self._first_registration(), self.first_timeout)
        except asyncio.TimeoutError:
            raise EtcdConnectionError(
                f"could not register {record.worker_id} in etcd at {self.client.base_url} "
                f"within {self.first_timeout:.0f}s") from None
        self._registered = True
        self._keepalive_task = asyncio.create_task(self._keepalive_loop(), name=f"etcd-keepalive:{record.worker_id}")

    async def _first_registration(self) -> None:
        delay = 0.1
        while True:
            try:
                await self._grant_and_put()
                return
            except EtcdTlsError:
                raise  # a wrong certificate does not fix itself
            except EtcdRequestError as exc:
                if not exc.retryable:
                    raise
                error: EtcdError = exc
            except EtcdError as exc:
                error = exc
            log.info("etcd not ready for registration (%s); retrying in %.1fs", error, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _grant_and_put(self) -> None:
        async with self._lock:
            assert self.record is not None
            # A lease that failed halfway (granted, put failed) is simply left to expire.
            self.lease_id = await self.client.grant(self.lease_ttl)
            await self.client.put(self.key, encode_record(self.record, self.fleet_key), self.lease_id)
            self._pending_put = False
            log.info("registered %s in etcd (lease %x, ttl %ds)", self.key, self.lease_id, self.lease_ttl)

    async def update(self, record: WorkerRecord) -> bool:
        """Re-put a changed record under the current lease.

        Returns True when written now; False when etcd is unreachable — the keepalive loop then
        writes the latest record as soon as etcd answers again. A lost lease is re-granted.
        """
        if not self._registered or self.record is None:
            raise RuntimeError("update() needs a live registration (call register() first)")
        if record.worker_id != self.record.worker_id:
            raise ValueError("update() cannot change worker_id; deregister and register instead")
        self.record = record
        try:
            async with self._lock:
                await self.client.put(self.key, encode_record(record, self.fleet_key), self.lease_id)
                self._pending_put = False
            return True
        except LeaseNotFound:
            try:
                await self._grant_and_put()
                self.reregistrations += 1
                return True
            except EtcdError as exc:
                log.warning("could not re-register %s: %s (will retry)", self.key, exc)
        except EtcdError as exc:
            log.warning("could not update %s: %s (will retry)", self.key, exc)
        self._pending_put = True
        return False

    async def _keepalive_loop(self) -> None:
        failing = False
        while True:
            # After a failure, try again soon rather than a whole interval later: at the default
            # ttl/3 cadence a lease only gets two more tries before it lapses.
            await asyncio.sleep(min(self.keepalive_interval, KEEPALIVE_RETRY_S) if failing else self.keepalive_interval)
            try:
                # Bound each call by the cadence so one hung request can't outlive the lease.
                timeout = max(self.keepalive_interval, 1.0)
                ttl = await self.client.keepalive(self.lease_id, timeout=timeout) if self.lease_id else 0
                if ttl <= 0:
                    log.warning("lease for %s is gone (etcd wiped or lease expired); re-registering", self.key)
                    await self._grant_and_put()
                    self.reregistrations += 1
                elif self._pending_put:
                    async with self._lock:
                        await self.client.put(self.key, encode_record(self.record, self.fleet_key), self.lease_id,
                                              timeout=timeout)
                        self._pending_put = False
                if failing:
                    log.info("etcd reachable again; %s is registered", self.key)
                    failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep trying at the same cadence; never die
                if not failing:
                    log.warning("etcd keepalive for %s failed: %s (retrying every %.1fs)", self.key, exc,
                                min(self.keepalive_interval, KEEPALIVE_RETRY_S))
                    failing = True

    async def deregister(self) -> None:
        """Stop the keepalive, delete the key, revoke the lease. Logs failures; never raises."""
        await self._stop_keepalive()  # FIRST, so it cannot re-assert the record behind our back
        self._registered = False
        lease_id, self.lease_id = self.lease_id, None
        if self.record is not None:
            try:
                await self.client.delete(self.key, timeout=10)
            except Exception as exc:
                log.warning("deregister: could not delete %s: %s", self.key, exc)
        if lease_id is not None:
            try:
                await self.client.revoke(lease_id, timeout=10)
            except Exception as exc:
                log.warning("deregister: could not revoke lease %x: %s (it expires in %ds)", lease_id, exc,
                            self.lease_ttl)
        if self.record is not None:
            log.info("deregistered %s", self.key)

    async def close(self) -> None:
        """Stop the keepalive and close an owned client. Does NOT delete the key: without
        deregister() first, the record lingers until its lease expires (like a crashed worker)."""
        await self._stop_keepalive()
        self._registered = False
        if self._owns_client:
            await self.client.close()

    async def _stop_keepalive(self) -> None:
        task, self._keepalive_task = self._keepalive_task, None
        await cancel_and_wait(task)
