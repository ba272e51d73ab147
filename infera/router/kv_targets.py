"""The kv-aware policy's per-target state: what a target is (a worker, or one rank of a
rank-multiplexed worker, keyed by :func:`route_key`), and :class:`KvTargetState`, the tables the
policy keeps per route key (blocks and requests in flight, the recent picks' decaying charges,
image affinity, blocks served but not yet in the engine's events) with their housekeeping: what
is read from them outside the pick, dropping a target that left or whose engine restarted, and
sweeping expired claims. How the tables change as requests are picked, start and finish is
``kv_accounting.py``; how the pick reads them is ``kv_aware.py``.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from infera.discovery.record import WorkerRecord
from infera.kv.counts import BlockCounter, LandedClaims
from infera.kv.replica_share import ReplicaShare


def _NOTHING_HELD(key: str) -> int:
    return 0


def route_key(worker_id: str, dp_rank: int | None) -> str:
    return worker_id if dp_rank is None else f"{worker_id}#dp{dp_rank}"


def expand_targets(worker: WorkerRecord) -> list[tuple[int | None, str]]:
    """(dp_rank, route_key) per target: a rank-multiplexed worker is one target per rank."""
    if worker.dp_size and worker.dp_size > 1 and worker.dp_rank is None:
        return [(r, route_key(worker.worker_id, r)) for r in range(worker.dp_size)]
    return [(None, worker.worker_id)]


class KvTargetState:
    """The per-route-key tables of :class:`~infera.router.kv_aware.KvAwarePolicy` (a base of it;
    ``_init_target_state`` makes them). Every table is bounded by the fleet: a target's entries go
    when it leaves (``forget``), when nothing is in flight there, or when its claims expire."""

    _decay: float
    _picks: int
    _next_sweep: float
    replicas: ReplicaShare | None
    _first_unheld: Callable[..., int] | None

    def _init_target_state(self) -> None:
        # route key → block hash → requests in flight, this replica's and (with a sync) the others'
        self.active: dict[str, BlockCounter] = {}
        # route key → blocks in flight there beyond their prompts' horizons (estimated, not hashed)
        self.unhashed: dict[str, int] = {}
        # route key → requests in flight there (this replica's and the others'), weighed in the load
        # by what one costs a new request's TTFT, in missed blocks (see ttft_balance; None: learned)
        self.inflight: dict[str, int] = {}
        # route key → the recent picks' charges there, decaying by RECENT_DECAY per pick; stored
        # divided by ``_decay`` (RECENT_DECAY^picks since the last rebase), so that decaying every
        # target's is one multiplication per pick, not a walk over the fleet (``recent_charge``).
        self.recent: dict[str, float] = {}
        self._decay = 1.0
        self._picks = 0  # decay clock: remaining charge = charge × RECENT_DECAY^(picks since)
        self.mm_affinity: dict[str, OrderedDict[int, None]] = {}
        # route key → block hash → (wall time it finished, monotonic expiry), in order of arrival
        self.landed: dict[str, LandedClaims] = {}
        self._next_sweep = 0.0  # landed claims of targets no pick looks at are swept from pick()

    def recent_charge(self, key: str) -> float:
        """What is left of the recent picks' charges on ``key``."""
        return self.recent.get(key, 0.0) * self._decay

    def engine_restarted(self, key: str) -> None:
        """``key``'s engine restarted: the blocks served there that its events had not confirmed
        yet are not cached there any more (the view itself was dropped by its owner)."""
        self.landed.pop(key, None)

    def sweep_landed(self, now: float) -> None:
        """Drop expired landed claims of every target (a target no pick looks at keeps none)."""
        for key in list(self.landed):
            landed = self.landed[key]
            landed.expire(now)
            if not landed:
                del self.landed[key]

    def active_blocks(self, key: str) -> int:
        """Distinct hashed blocks in flight on ``key`` (what replicas share; the pick's load also
        counts ``unhashed``, the estimated blocks past prompts' horizons)."""
        return len(self.active.get(key, ()))

    def _held_anywhere(self, block: int) -> bool:
        """Whether some target holds ``block``: in its view, in flight there, or served there and
        not yet in its events (a claim past its time counts too: erring long). May run in a
        tokenizer thread (``Horizon``): the tables are read through snapshots of their values."""
        if self._first_unheld is not None and self._first_unheld((block,)):  # 1: not unheld at 0
            return True
        try:
            return (any(block in counts for counts in tuple(self.active.values()))
                    or any(block in claims for claims in tuple(self.landed.values())))
        except RuntimeError:  # changed under a tokenizer thread's snapshot: err long
            return True

    def forget(self, worker_id: str) -> None:
        prefix = worker_id + "#dp"
        if self.replicas is not None:
            self.replicas.forget(worker_id)
        for table in (self.active, self.recent, self.mm_affinity, self.landed, self.unhashed, self.inflight):
            for k in [k for k in table if k == worker_id or k.startswith(prefix)]:
                del table[k]
