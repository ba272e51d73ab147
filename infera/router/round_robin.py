"""Round-robin: rotate over the candidate set, one counter per distinct set.

A counter per set (not one global) keeps the rotation even for each model and for retries that
exclude an already-tried worker.
"""
from __future__ import annotations

from typing import Sequence

from infera.discovery.record import WorkerRecord
from infera.router.policy import RoutedRequest

# Distinct candidate sets kept: the breaker and retries make subsets of a model's workers, so the
# map is bounded by the fleet's size only combinatorially; past this, rotation restarts from 0.
COUNTERS_CAP = 4096


class RoundRobinPolicy:
    name = "round-robin"

    def __init__(self) -> None:
        self._counters: dict[tuple[str, ...], int] = {}

    def pick(self, candidates: Sequence[WorkerRecord], request: RoutedRequest, role: str = "mixed") -> WorkerRecord:
        # Prefill and decode pools are distinct sets, so each rotates on its own counter.
        if len(candidates) == 1:
            return candidates[0]
        key = tuple(w.worker_id for w in candidates)
        n = self._counters.get(key, 0)
        if n == 0 and len(self._counters) >= COUNTERS_CAP:
            self._counters.clear()
        self._counters[key] = n + 1
        return candidates[n % len(candidates)]

    def on_started(self, worker: WorkerRecord, request: RoutedRequest) -> None:
        pass

    def on_finished(self, worker: WorkerRecord, request: RoutedRequest) -> None:
        pass

    def forget(self, worker_id: str) -> None:
        # Sets that named the departed worker can never recur; drop them so the map stays
        # bounded by the live fleet, not by its history.
        for key in [k for k in self._counters if worker_id in k]:
            del self._counters[key]
