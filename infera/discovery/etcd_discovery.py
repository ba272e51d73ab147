"""The server side of etcd discovery: :class:`EtcdDiscovery` keeps a :class:`Fleet` equal to the
worker records under a prefix (list, reconcile, watch from the next revision, re-list on any
trouble, a fleet key's signature checked on every record), riding out etcd outages with the last
known fleet. The client it reads through is in ``etcd_client.py``.
"""
from __future__ import annotations

import asyncio
import logging

import msgspec

from infera.discovery.etcd_client import EtcdAuth, EtcdClient, _client_for
from infera.discovery.etcd_codec import WatchCompacted, WatchEvent
from infera.discovery.fleet import Fleet
from infera.discovery.record import FleetKey, RecordSignatureError, WorkerRecord, decode_record
from infera.runtime import cancel_and_wait

log = logging.getLogger("infera.discovery.etcd")  # the name etcd's logs have always had


class EtcdDiscovery:
    """Keep a :class:`Fleet` equal to the records under ``prefix``.

    Loop: list → ``fleet.replace_all`` (reconcile: drops ghosts whose DELETE was missed while
    disconnected) → watch from ``revision + 1`` → on any error / stream end / compaction: back off
    and re-list. While etcd is unreachable the fleet keeps its last known content.
    """

    def __init__(
        self,
        endpoint_url: str | None,
        prefix: str,
        *,
        client: EtcdClient | None = None,
        backoff_initial: float = 0.2,
        backoff_max: float = 5.0,
        fleet_key: FleetKey | None = None,
        etcd_auth: EtcdAuth | None = None,
    ) -> None:
        self.client, self._owns_client = _client_for(endpoint_url, client, "EtcdDiscovery", etcd_auth)
        self.prefix = prefix
        # With a fleet key, only records it signed are applied (anyone able to write to etcd could
        # otherwise announce a worker and receive prompts).
        self.fleet_key = fleet_key
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.ready = asyncio.Event()  # set after the first successful list
        self.relists = 0  # successful lists (the first one included)
        self.last_error: str | None = None
        self._fleet: Fleet | None = None
        self._task: asyncio.Task[None] | None = None
        # key → record currently applied from it; lets a DELETE remove the record's worker_id even
        # when it differs from the key suffix (we trust the record).
        self._records_by_key: dict[str, WorkerRecord] = {}
        self._undecodable_keys: set[str] = set()  # log a bad value once, not on every re-list
        self._rejected_keys: set[str] = set()  # unsigned / wrongly signed records: logged once per key

    async def start(self, fleet: Fleet) -> None:
        """Launch the background loop and return at once (etcd may well be down right now)."""
        if self._task is not None:
            raise RuntimeError("EtcdDiscovery already started")
        self._fleet = fleet
        self._task = asyncio.create_task(self._run(fleet), name=f"etcd-discovery:{self.prefix}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)  # (our own cancellation, while it waits, still reaches us)
        if self._owns_client:
            await self.client.close()

    # -- loop ------------------------------------------------------------------------------
    async def _run(self, fleet: Fleet) -> None:
        backoff = self.backoff_initial
        failures = 0
        while True:
            try:
                revision = await self._relist(fleet)
                if failures:
                    log.info("etcd discovery recovered after %d failed attempt(s)", failures)
                failures = 0
                backoff = self.backoff_initial
                await self._watch(fleet, revision + 1)
                self.last_error = "watch stream ended"
                log.info("etcd watch stream on %s ended; re-listing", self.prefix)
            except asyncio.CancelledError:
                raise
            except WatchCompacted as exc:
                self.last_error = str(exc)
                log.warning("etcd watch on %s fell behind compaction (%s); re-listing", self.prefix, exc)
            except Exception as exc:  # never let discovery die: anything else means "re-list later"
                failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                # First failure of an outage at WARNING; repeats at DEBUG so a long outage isn't log spam.
                log.log(logging.WARNING if failures == 1 else logging.DEBUG,
                        "etcd discovery on %s failed (%s); retrying in %.1fs", self.prefix, self.last_error, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.backoff_max)

    async def _relist(self, fleet: Fleet) -> int:
        revision, items = await self.client.range_prefix(self.prefix)
        records_by_key: dict[str, WorkerRecord] = {}
        for key, value in items:
            record = self._decode(key, value)
            if record is not None:
                records_by_key[key] = record
        self._records_by_key = records_by_key
        fleet.replace_all(records_by_key.values())
        self.relists += 1
        self.ready.set()
        log.debug("etcd list of %s at revision %d: %d worker(s)", self.prefix, revision, len(records_by_key))
        return revision

    async def _watch(self, fleet: Fleet, start_revision: int) -> None:
        stream = self.client.watch_prefix(self.prefix, start_revision)
        try:
            async for batch in stream:
                for event in batch.events:
                    self._apply(fleet, event)
        finally:
            await stream.aclose()  # release the HTTP stream promptly

    def _apply(self, fleet: Fleet, event: WatchEvent) -> None:
        if event.kind == "put":
            record = self._decode(event.key, event.value)
            old = self._records_by_key.pop(event.key, None)
            if record is not None:
                self._records_by_key[event.key] = record
                fleet.upsert(record)
            if old is not None and (record is None or old.worker_id != record.worker_id):
                fleet.release(old.worker_id, self._records_by_key.values())
        else:
            old = self._records_by_key.pop(event.key, None)
            self._undecodable_keys.discard(event.key)
            self._rejected_keys.discard(event.key)
            if old is not None:
                fleet.release(old.worker_id, self._records_by_key.values())
            else:
                fleet.remove(self._key_suffix(event.key))

    def _decode(self, key: str, value: bytes) -> WorkerRecord | None:
        try:
            record = decode_record(value, self.fleet_key)
        except RecordSignatureError as exc:
            if key not in self._rejected_keys:
                self._rejected_keys.add(key)
                log.warning("ignoring worker record at %r: %s; it is not routed to (a fleet key is set: only "
                            "records signed with it count)", key, exc)
            return None
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            if key not in self._undecodable_keys:
                self._undecodable_keys.add(key)
                log.warning("skipping undecodable worker record at %s: %s", key, exc)
            return None
        self._undecodable_keys.discard(key)
        self._rejected_keys.discard(key)
        suffix = self._key_suffix(key)
        if record.worker_id != suffix:
            log.debug("record at %s names worker_id %r; trusting the record", key, record.worker_id)
        return record

    def _key_suffix(self, key: str) -> str:
        return key[len(self.prefix):] if key.startswith(self.prefix) else key
