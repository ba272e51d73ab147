"""What kv-aware server replicas share: this replica's requests in flight, told to the others, and
theirs, counted in this replica's policy as if they were its own (:class:`ReplicaShare`), with the
bounds of every table. Pure bookkeeping on the event loop, no I/O: the policy
(``infera.router.kv_aware.KvAwarePolicy``, through :class:`SharingPolicy`) owns one, and a replica
sync (``infera.transport.replica_sync``) carries its deltas between replicas. It lives here, below
both, so that the transport never imports the router.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Protocol, Sequence

# Every table is bounded: what does not fit is not shared, and is counted.
SYNC_OUTBOX_CAP = 8192  # deltas waiting for the sync task; a full outbox drops the oldest
SYNC_LIVE_CAP = 8192  # this replica's requests in flight that are shared (heartbeats list them)
SYNC_BLOCKS_PER_REQUEST = 2048  # a request's first blocks are shared (prefixes are what routing matches)
PEER_TIMEOUT_S = 3.0  # a replica not heard from for this long is dropped, with all it had in flight
PEERS_CAP = 64
PEER_REQUESTS_CAP = 8192  # in-flight requests kept per other replica
REMOTE_BLOCKS_CAP = 1 << 20  # block references kept over all other replicas' requests

class SharingPolicy(Protocol):
    """The policy's counts that another replica's requests go through, exactly as its own do."""

    clock: Callable[[], float]
    inflight: dict[str, int]  # route key → requests in flight there
    _picks: int  # the decay clock of recent charges
    _events_made_until: Callable[[str], float] | None  # how far a target's KV events have got (wall time)

    def _count_in(self, key: str, blocks: Sequence[int]) -> None: ...

    def _count_out(self, key: str, blocks: Sequence[int]) -> None: ...

    def _inflight_out(self, key: str) -> None: ...

    def _add_recent(self, key: str, charge: float) -> None: ...

    def _release_charge(self, key: str, charge: float, at: int) -> None: ...

    def _land(self, key: str, blocks: Sequence[int], finished_at: float, view_hit: int = 0) -> None: ...

    def sweep_landed(self, now: float) -> None: ...


class _Peer:
    """Another replica: its requests in flight, as it announced them."""

    __slots__ = ("last_heard", "entries")

    def __init__(self, now: float) -> None:
        self.last_heard = now
        # request id → (model, route key, blocks, charge, pick count when it was charged here)
        self.entries: dict[int, tuple[str, str, list[int], float, int]] = {}


class ReplicaShare:
    """The policy's side of a replica sync: what this replica tells the others, and what they told
    it. Event loop only, no I/O, no locks.

    Outgoing: :meth:`started`/:meth:`finished` (the pick's hot path) record the request in ``live``
    and append a delta to ``outbox``, a bounded deque that the transport drains every few ms; a
    full outbox drops its oldest delta (counted in ``outbox_dropped``) and sets ``lossy``, and the
    transport then sends its whole state (``live``) again.

    Incoming (called by the transport, on the event loop): another replica's request in flight adds
    its blocks to the policy's ``active`` counts and its pick's charge to ``recent``, exactly as a
    local one does, until its finish removes them, and a finish after a reply adds its blocks to
    ``landed`` (with the sender's wall time, so the same caught-up rule applies). Lossy-tolerant: a
    heartbeat lists everything a replica has in flight and what it does not list is dropped (a
    lost finish leaves no phantom load); a replica silent for :data:`PEER_TIMEOUT_S` is dropped
    with all it had (:meth:`expire`)."""

    def __init__(self, policy: SharingPolicy) -> None:
        self.policy = policy
        self.outbox: deque[tuple] = deque(maxlen=SYNC_OUTBOX_CAP)
        # this replica's requests in flight: sync id → (model, route key, blocks, charge)
        self.live: dict[int, tuple[str, str, Sequence[int], float]] = {}
        self._next_rid = 0
        self.wake: Callable[[], None] | None = None  # set by the transport: a delta is waiting
        self.lossy = False
        self.peers: dict[str, _Peer] = {}
        self.remote_blocks = 0  # block references held in peers' entries
        # counters (the transport's own are on it)
        self.outbox_dropped = 0
        self.live_overflow = 0
        self.remote_started = 0
        self.remote_finished = 0
        self.remote_expired = 0  # dropped without a finish: missing from a heartbeat, or their replica left
        self.remote_rejected = 0  # not kept: a bound was reached
        self.peers_dropped = 0

    # -- outgoing (hot path) -------------------------------------------------------------------
    def started(self, model: str, key: str, blocks: Sequence[int], charge: float = 0.0) -> int | None:
        """A request of this replica started on ``key`` (``charge``: the missed blocks its pick
        charged there); returns its sync id (None: not shared)."""
        if len(self.live) >= SYNC_LIVE_CAP:
            self.live_overflow += 1
            return None
        self._next_rid += 1
        rid = self._next_rid
        self.live[rid] = (model, key, blocks, charge)
        self._push((rid, model, key, blocks, charge))
        return rid

    def finished(self, rid: int, finished_at: float) -> None:
        """``finished_at``: wall time the served request finished (0.0: the worker did not serve it)."""
        entry = self.live.pop(rid, None)
        if entry is not None:
            self._push((rid, entry[0], finished_at))

    def _push(self, delta: tuple) -> None:
        if len(self.outbox) == SYNC_OUTBOX_CAP:
            self.outbox_dropped += 1
            self.lossy = True
        self.outbox.append(delta)
        if self.wake is not None:
            self.wake()

    def drain(self) -> list[tuple]:
        """The deltas since the last drain, oldest first: ``(rid, model, key, blocks, charge)`` for a
        start, ``(rid, model, finished_at)`` for a finish."""
        out = list(self.outbox)
        self.outbox.clear()
        return out

    # -- incoming ------------------------------------------------------------------------------
    def heard(self, replica: str, now: float) -> _Peer | None:
        peer = self.peers.get(replica)
        if peer is None:
            if len(self.peers) >= PEERS_CAP:
                self.remote_rejected += 1
                return None
            peer = self.peers[replica] = _Peer(now)
        peer.last_heard = now
        return peer

    def can_take(self, peer: _Peer) -> bool:
        return len(peer.entries) < PEER_REQUESTS_CAP and self.remote_blocks < REMOTE_BLOCKS_CAP

    def remote_start(self, peer: _Peer, rid: int, model: str, key: str, blocks: list[int],
                     charge: float = 0.0) -> None:
        if rid in peer.entries:  # idempotent: a full state repeats what was already heard
            return
        if len(peer.entries) >= PEER_REQUESTS_CAP or self.remote_blocks + len(blocks) > REMOTE_BLOCKS_CAP:
            self.remote_rejected += 1
            return
        policy = self.policy
        charge = min(max(charge, 0.0), float(len(blocks)) or 1.0)
        peer.entries[rid] = (model, key, blocks, charge, policy._picks)
        self.remote_blocks += len(blocks)
        policy._count_in(key, blocks)
        policy.inflight[key] = policy.inflight.get(key, 0) + 1
        if charge:
            policy._add_recent(key, charge)
        self.remote_started += 1

    def remote_finish(self, peer: _Peer, rid: int, finished_at: float) -> None:
        entry = peer.entries.pop(rid, None)
        if entry is None:  # its start was lost or not kept: nothing to release
            return
        _, key, blocks, charge, at = entry
        self.remote_blocks -= len(blocks)
        self.policy._count_out(key, blocks)
        self.policy._inflight_out(key)
        self.policy._release_charge(key, charge, at)
        made_until = self.policy._events_made_until
        # (no claim where the engine's events already got past its finish: they say what is there)
        if finished_at > 0 and blocks and (made_until is None or made_until(key) < finished_at):
            self.policy._land(key, blocks, finished_at)
        self.remote_finished += 1

    def remote_live(self, peer: _Peer, model: str, rids: set[int]) -> int:
        """A heartbeat: ``rids`` is everything ``peer`` has in flight for ``model``. Its other
        entries of that model are gone (their finish was lost). Returns how many of ``rids`` are
        unknown here (their start was lost: the transport asks for the full state)."""
        gone = [rid for rid, entry in peer.entries.items() if entry[0] == model and rid not in rids]
        for rid in gone:
            self._drop_entry(peer, rid)
        self.remote_expired += len(gone)
        return sum(1 for rid in rids if rid not in peer.entries)

    def _drop_entry(self, peer: _Peer, rid: int) -> None:
        _, key, blocks, charge, at = peer.entries.pop(rid)
        self.remote_blocks -= len(blocks)
        self.policy._count_out(key, blocks)
        self.policy._inflight_out(key)
        self.policy._release_charge(key, charge, at)

    def drop_peer(self, replica: str) -> None:
        peer = self.peers.pop(replica, None)
        if peer is None:
            return
        self.remote_expired += len(peer.entries)
        for rid in list(peer.entries):
            self._drop_entry(peer, rid)
        self.peers_dropped += 1

    def expire(self, now: float, timeout: float = PEER_TIMEOUT_S) -> list[str]:
        """Drop the replicas not heard from for ``timeout`` s (stopped, crashed, cut off), and the
        expired landed claims; returns the replicas dropped."""
        silent = [r for r, p in self.peers.items() if now - p.last_heard > timeout]
        for replica in silent:
            self.drop_peer(replica)
        self.policy.sweep_landed(self.policy.clock())
        return silent

    def forget(self, worker_id: str) -> None:
        """The worker left: the other replicas' requests on it are dropped too (their finishes,
        if they come, then find nothing to release). Called by the policy's ``forget``, which
        then drops the target's counts whole, so nothing is counted out here."""
        prefix = worker_id + "#dp"
        for peer in self.peers.values():
            for rid in [rid for rid, e in peer.entries.items() if e[1] == worker_id or e[1].startswith(prefix)]:
                self.remote_blocks -= len(peer.entries.pop(rid)[2])
