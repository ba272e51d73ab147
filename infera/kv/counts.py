"""Multisets of block hashes: how many requests in flight on a target hold each block (the
kv-aware policy's ``active``, its own requests' and other replicas').

``BlockCounter`` is the C accelerator's (``infera.kv._native.BlockCounter``, u64 open addressing)
where it is built, else :class:`PyBlockCounter`; both have ``add``, ``remove``, ``run``, ``count``,
``in``, ``len`` and ``items``. Block hashes are u64: the C one skips any other value it is given
(a peer replica's bad message), the Python one counts it where no router hash can ever match it."""
from __future__ import annotations

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


BlockCounter = native.BlockCounter if native is not None else PyBlockCounter
