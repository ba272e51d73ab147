"""The kv-aware policy's in-flight and landed accounting: how a request's pick, start and finish
change the per-target tables (:class:`~infera.router.kv_targets.KvTargetState`). A pick charges
its missed blocks to the target's recent charge (decaying per pick, released when the request
finishes); a started request's blocks count in flight there, and its requests in the in-flight
count; a served request's blocks are claimed as landed there (cached, though the engine's events
saying so may still be on the way) until the events catch up or ``LANDED_TTL_S`` passes. With a
replica sync, starts and finishes are told to the other server replicas. The pick that reads all
this is ``kv_aware.py``.
"""
from __future__ import annotations

from typing import Callable, Sequence

from infera.discovery.record import WorkerRecord
from infera.kv.counts import BlockCounter, LandedClaims
from infera.router.kv_targets import KvTargetState
from infera.router.policy import RoutedRequest
from infera.router.ttft_balance import TtftBalance

RECENT_DECAY = 0.97
# The recent charges are kept divided by the decay applied since their last rebase; rebased (and
# the spent ones dropped) when that decay falls below this (every ~11,000 picks).
_REBASE_BELOW = 1e-150
_SPENT = 1e-3  # a recent charge below this is gone
# A served request's blocks count as cached where it ran until that engine's events catch up with
# the moment it finished (a batch made later is applied: the view then says what became of them,
# evictions included), or at most this long (an idle engine sends nothing). Engines publish KV
# events from a side thread: on a busy 2-core box vLLM's arrived up to 0.5 s after the reply
# (infera_kv_event_delay_seconds), and the next turn was routed on a view without its previous one.
LANDED_TTL_S = 2.0
LANDED_CAP = 1 << 16  # blocks per target: bounded whatever the request rate


class KvAccounting(KvTargetState):
    """The accounting half of :class:`~infera.router.kv_aware.KvAwarePolicy` (a base of it): the
    policy's hooks ``on_started``, ``on_first_byte`` and ``on_finished``, and the charge a pick
    makes (``_charge``) and the landed blocks it reads (``_with_landed``)."""

    clock: Callable[[], float]
    wall_clock: Callable[[], float]
    balance: TtftBalance
    _events_made_until: Callable[[str], float] | None
    _match_one: Callable[[Sequence[int], str], int] | None

    def _with_landed(self, key: str, hashes: Sequence[int], hit: int, now: float) -> int:
        """``hit`` extended by blocks served on ``key`` that its events have not caught up with
        (each block checked: entries from other replicas arrive a little out of order, so one
        behind a valid one may already be caught up with)."""
        landed = self.landed.get(key)
        if not landed:
            return hit
        caught_up = self._events_made_until(key) if self._events_made_until is not None else 0.0
        return landed.extend(hashes, hit, caught_up, now)

    def _add_recent(self, key: str, charge: float) -> None:
        self.recent[key] = self.recent.get(key, 0.0) + charge / self._decay

    def _rebase(self) -> None:
        """Fold the decay into the stored charges; the spent ones go (bounded by the fleet)."""
        decay, recent = self._decay, self.recent
        for k in list(recent):
            v = recent[k] * decay
            if v < _SPENT:
                del recent[k]
            else:
                recent[k] = v
        self._decay = 1.0

    def _charge(self, key: str, missed: int, total: int) -> float:
        # Decay per pick (not wall clock): one multiplication whatever the fleet's size.
        self._picks += 1
        self._decay *= RECENT_DECAY
        if self._decay < _REBASE_BELOW:
            self._rebase()
        charge = 1.0 if total == 0 else float(missed)
        if charge:
            recent = self.recent
            recent[key] = recent.get(key, 0.0) + charge / self._decay  # (_add_recent, inlined)
        if self.landed:
            # A target no pick looks at (it left, or lost every pick) would keep its expired claims
            # forever: a request still running on a worker that left lands after forget().
            now = self.clock()
            if now >= self._next_sweep:
                self._next_sweep = now + LANDED_TTL_S
                self.sweep_landed(now)
        return charge

    def on_started(self, worker: WorkerRecord, request: RoutedRequest) -> None:
        st = request.state
        key = st.get("route_key")
        if key is None:
            return
        inflight = self.inflight
        inflight[key] = inflight.get(key, 0) + 1
        blocks = st.get("blocks")
        if blocks:
            self._count_in(key, blocks)
            if self.replicas is not None:
                st["sync_rid"] = self.replicas.started(request.model, key, blocks, st.get("charge", (0.0, 0))[0])
        extra = st.get("unhashed")
        if extra:
            self.unhashed[key] = self.unhashed.get(key, 0) + extra

    def on_first_byte(self, request: RoutedRequest, seconds: float) -> None:
        """A streamed reply's first byte came ``seconds`` after it was sent: what its pick's missed
        blocks and the requests ahead of it cost (``TtftBalance``)."""
        obs = request.state.pop("pick_obs", None)
        if obs is not None:
            self.balance.observe(obs[0], obs[1], seconds)

    def on_finished(self, worker: WorkerRecord, request: RoutedRequest) -> None:
        st = request.state
        key = st.get("route_key")
        if key is None:
            return
        inflight = self.inflight
        n = inflight.get(key, 0) - 1
        if n > 0:
            inflight[key] = n
        else:
            inflight.pop(key, None)
        charge = st.pop("charge", None)
        if charge is not None and charge[0]:
            self._release_charge(key, charge[0], charge[1])
        blocks = st.get("blocks")
        finished_at = 0.0
        if blocks:
            if st.get("served"):  # the worker answered: it computed the prompt
                finished_at = self.wall_clock()
                self._land(key, blocks, finished_at, st.get("view_hit", 0))
            self._count_out(key, blocks)
        if self.replicas is not None:
            rid = st.pop("sync_rid", None)
            if rid is not None:
                self.replicas.finished(rid, finished_at)
        extra = st.pop("unhashed", 0)
        if extra and key in self.unhashed:
            left = self.unhashed[key] - extra
            if left > 0:
                self.unhashed[key] = left
            else:
                del self.unhashed[key]

    def _release_charge(self, key: str, charge: float, at: int) -> None:
        """A request charged ``charge`` at pick ``at`` finished: what is left of it goes."""
        stored = self.recent.get(key)
        if charge and stored is not None:
            left = stored * self._decay - charge * RECENT_DECAY ** (self._picks - at)
            if left < _SPENT:
                del self.recent[key]
            else:
                self.recent[key] = left / self._decay

    def _inflight_out(self, key: str) -> None:
        n = self.inflight.get(key, 0) - 1
        if n > 0:
            self.inflight[key] = n
        else:
            self.inflight.pop(key, None)

    def _count_in(self, key: str, blocks: Sequence[int]) -> None:
        if not blocks:
            return
        counts = self.active.get(key)
        if counts is None:
            counts = self.active[key] = BlockCounter()
        counts.add(blocks)

    def _count_out(self, key: str, blocks: Sequence[int]) -> None:
        counts = self.active.get(key)
        if counts is None or not blocks:
            return
        counts.remove(blocks)
        if not counts:  # bounded by what is in flight, not by every target ever seen
            del self.active[key]

    def _land(self, key: str, blocks: Sequence[int], finished_at: float, view_hit: int = 0) -> None:
        """``blocks`` were computed on ``key`` by a request that finished at ``finished_at`` (wall
        clock, compared with the engine's event timestamps): cached there until the events catch up.
        The leading blocks its view already holds need no claim (a shared prefix: most of them):
        the events already said so, and a later eviction event is what happened to them after.

        ``view_hit``: how many leading blocks the view held at the pick; they are not looked up
        again. The request used them, so they were there; one evicted since is what the events say
        (a claim would contradict them). This is the walk a request ends with, long after its
        hashes left the CPU caches: over the whole prompt it cost ~67 us in the server (one cache
        miss or more per block) for ~3 us in a benchmark loop."""
        if self._match_one is not None:
            tail = blocks[view_hit:] if view_hit else blocks
            held = view_hit + self._match_one(tail, key) if tail else view_hit
            if held:
                blocks = blocks[held:]
                if not blocks:
                    return
        landed = self.landed.get(key)
        if landed is None:
            landed = self.landed[key] = LandedClaims()
        landed.land(blocks, finished_at, self.clock() + LANDED_TTL_S, LANDED_CAP)
