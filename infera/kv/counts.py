"""The kv-aware policy's per-target tables of block hashes, each the C accelerator's where it is
built (u64 open addressing) else its Python twin here, with the same methods:

* ``BlockCounter``: how many requests in flight on a target hold each block (``active``: this
  replica's requests and the other replicas'); ``add``, ``remove``, ``run``, ``count``, ``in``,
  ``len``, ``items``. Block hashes are u64: the C one skips any other value it is given (a peer
  replica's bad message), the Python one counts it where no router hash can ever match it.
* ``LandedClaims``: blocks computed there by requests that finished, until the target's KV events
  catch up (``landed``): hash -> (finished_at, expiry), oldest first; ``land``, ``extend``,
  ``expire``, ``get``, ``in``, ``len``, iteration (oldest first)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from infera.kv.native import native

try:
    from _collections import _count_elements  # CPython's C loop behind Counter.update
except ImportError:  # pragma: no cover - other interpreters
    def _count_elements(mapping: dict, iterable) -> None:  # type: ignore[misc]
        get = mapping.get
        for elem in iterable:
            mapping[elem] = get(elem, 0) + 1


class PyBlockCounter(dict):
    """block hash -> holders (a dict; see the module doc)."""

    __slots__ = ()

    def add(self, blocks: Sequence[int]) -> None:
        _count_elements(self, blocks)

    def remove(self, blocks: Sequence[int]) -> None:
        for h in blocks:
            n = self.get(h, 0) - 1
            if n > 0:
                self[h] = n
            else:
                self.pop(h, None)

    def run(self, hashes: Sequence[int], start: int) -> int:
        """The first position >= ``start`` whose hash is not held (``len(hashes)``: all are)."""
        i = max(start, 0)
        n = len(hashes)
        while i < n and hashes[i] in self:
            i += 1
        return max(i, start)

    def count(self, h: int) -> int:
        return self.get(h, 0)

    def items(self) -> list[tuple[int, int]]:  # type: ignore[override]
        return list(dict.items(self))


class PyLandedClaims(OrderedDict):
    """block hash -> (finished_at, expiry), oldest first (an OrderedDict; see the module doc)."""

    __slots__ = ()

    def land(self, blocks: Sequence[int], finished_at: float, expiry: float, cap: int) -> None:
        """Each block claimed (a claim already there keeps the later finish, takes the new expiry
        and moves to the end), then the oldest dropped beyond ``cap``."""
        get = OrderedDict.get
        for h in blocks:
            old = get(self, h)
            self[h] = (finished_at, expiry) if old is None or old[0] <= finished_at else (old[0], expiry)
            self.move_to_end(h)
        while len(self) > cap:
            self.popitem(last=False)

    def extend(self, hashes: Sequence[int], hit: int, caught_up: float, now: float) -> int:
        """``hit`` extended by the claims that still count (finished after ``caught_up``, not
        expired); the oldest that no longer count are dropped first."""
        while self:
            finished, expiry = self[next(iter(self))]
            if finished > caught_up and expiry > now:
                break
            self.popitem(last=False)
        get = OrderedDict.get
        n = len(hashes)
        while 0 <= hit < n:
            stamp = get(self, hashes[hit])
            if stamp is None or stamp[0] <= caught_up or stamp[1] <= now:
                break
            hit += 1
        return hit

    def expire(self, now: float) -> None:
        while self and self[next(iter(self))][1] <= now:
            self.popitem(last=False)


BlockCounter = native.BlockCounter if native is not None else PyBlockCounter
LandedClaims = native.LandedClaims if native is not None else PyLandedClaims
