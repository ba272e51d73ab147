"""Fleet: the live set of worker records a server routes over.

Discovery backends feed it (upsert / remove / replace_all); routers read from it. Reads are
O(1) lookups into per-model lists that are rebuilt only when the fleet changes, never per request.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable

from infera.discovery.record import WorkerRecord

log = logging.getLogger(__name__)

Listener = Callable[[str, "WorkerRecord | None"], None]
# Why this server cannot reach a worker (None: it can), e.g. a NATS-only worker and no NATS here.
Unroutable = Callable[[WorkerRecord], "str | None"]


class Fleet:
    def __init__(self, unroutable: Unroutable | None = None) -> None:
        self._unroutable = unroutable
        self.unroutable_reasons: dict[str, str] = {}  # worker id → why it is never routed to
        self._workers: dict[str, WorkerRecord] = {}
        self._active_by_key: dict[tuple[str | None, str | None], tuple[WorkerRecord, ...]] = {}
        self._models: list[str] = []
        self._listeners: list[Listener] = []
        self.generation = 0  # bumps on every change; cheap staleness check for caches

    # -- writes (discovery side) -------------------------------------------------------------
    def subscribe(self, listener: Listener) -> None:
        """``listener(worker_id, record)`` on add/update; ``record is None`` on removal."""
        self._listeners.append(listener)

    def upsert(self, record: WorkerRecord) -> None:
        old = self._workers.get(record.worker_id)
        if old == record:
            return
        self._workers[record.worker_id] = record
        if old is None:
            log.info("worker added: %s (%s, model=%s)", record.worker_id, record.url, record.model_name)
        self._changed(record.worker_id, record)

    def remove(self, worker_id: str) -> None:
        if self._workers.pop(worker_id, None) is not None:
            log.info("worker removed: %s", worker_id)
            self._changed(worker_id, None)

    def release(self, worker_id: str, holders: Iterable[WorkerRecord]) -> None:
        """One registry entry (etcd key, Pod) stopped holding ``worker_id``: keep the worker if
        another entry in ``holders`` still holds it (taking that record), else remove it."""
        for record in holders:
            if record.worker_id == worker_id:
                self.upsert(record)
                return
        self.remove(worker_id)

    def replace_all(self, records: Iterable[WorkerRecord]) -> None:
        """Reconcile to exactly ``records`` (after a re-list): drops ghosts, adds/updates the rest."""
        fresh = {r.worker_id: r for r in records}
        for wid in [w for w in self._workers if w not in fresh]:
            self.remove(wid)
        for rec in fresh.values():
            self.upsert(rec)

    def _changed(self, worker_id: str, record: WorkerRecord | None) -> None:
        # Precompute every (model, mode) view, with None meaning "any": routers then read a
        # ready tuple per request instead of filtering the fleet.
        if self._unroutable is not None:
            reason = self._unroutable(record) if record is not None else None
            if reason is None:
                self.unroutable_reasons.pop(worker_id, None)
            elif self.unroutable_reasons.get(worker_id) != reason:
                self.unroutable_reasons[worker_id] = reason
                log.error("worker %s is not routed to: it %s", worker_id, reason)
        index: dict[tuple[str | None, str | None], list[WorkerRecord]] = {}
        for r in sorted(self._workers.values(), key=lambda r: r.worker_id):
            if not r.is_active or r.worker_id in self.unroutable_reasons:
                continue
            for key in ((r.model_name, r.disagg_mode), (r.model_name, None), (None, r.disagg_mode), (None, None)):
                index.setdefault(key, []).append(r)
        self._active_by_key = {k: tuple(v) for k, v in index.items()}
        self._models = sorted({m for m, _ in index if m is not None})
        self.generation += 1
        for listener in self._listeners:
            try:
                listener(worker_id, record)
            except Exception:  # a listener bug must not break discovery
                log.exception("fleet listener failed")

    # -- reads (router side) -----------------------------------------------------------------
    def get(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.get(worker_id)

    def all(self) -> list[WorkerRecord]:
        return sorted(self._workers.values(), key=lambda r: r.worker_id)

    def active(self, model: str | None = None, mode: str | None = None) -> tuple[WorkerRecord, ...]:
        """Active, reachable workers serving ``model`` in disaggregation ``mode`` (None matches any)."""
        return self._active_by_key.get((model, mode), ())

    def models(self) -> list[str]:
        """Models served by at least one active worker."""
        return self._models

    def knows_model(self, model: str) -> bool:
        """True if any worker, active or draining, serves ``model``."""
        return any(r.model_name == model for r in self._workers.values())

    def __len__(self) -> int:
        return len(self._workers)
