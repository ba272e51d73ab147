"""The KV index of a server process that does not apply events itself (issue 30 item 4: one index
per host). With ``--workers N`` one process (the writer, ``infera.server.kv_share``) applies every
engine's events to a :class:`~infera.kv.index.NativeKvIndex` whose holder table lives in a shared
arena; every other process matches prompts against that arena through this class, without locks
(``infera.kv._native.GpuViewReader``), and learns the targets -- their bits, block counts and how
far their events are applied -- from the rows the writer sends (:meth:`SharedKvIndex.update`).

It answers as the writer's index would, for what the kv-aware policy asks (``match``,
``match_one``, ``first_unheld``, ``block_count(s)``, ``events_made_until``). When it cannot -- no
writer attached yet, the writer gone, or a read that found the table changing under it every time
-- it answers "nothing held" (every target misses, the load decides, as for a view still warming)
and counts it in ``unanswered``. Lower tiers are not shared: a reader routes on the GPU tier only.
"""
from __future__ import annotations

from typing import Any, Iterator, NamedTuple, Sequence

from infera.kv.native import native


class TargetRow(NamedTuple):
    """What the writer says about one target (route key)."""

    bit: int
    block_size: int
    blocks: int  # router hashes in its view
    made_until: float  # engine wall-clock time up to which its events are applied (0.0: unknown)
    evicted: int = 0  # (block, target) entries the writer's byte bound evicted from it


class SharedKvIndex:
    """The reader's side of a host's shared index (the module docstring). Event loop only."""

    def __init__(self) -> None:
        if native is None:
            raise RuntimeError("a shared KV index needs the C accelerator (infera.kv.native says why it is missing)")
        self._reader: Any = None
        self._rows: dict[str, TargetRow] = {}
        self._total_blocks = 0
        self.generation: int | None = None  # the writer's (a new writer, a new arena)
        self.unanswered = 0  # reads answered "nothing held" because the view could not be read

    # -- what the writer says ----------------------------------------------------------------------
    def attach(self, fd: int, generation: int) -> None:
        """Map the writer's arena (``fd`` stays the caller's to close): matches read it from now on."""
        assert native is not None  # (checked at construction)
        reader = native.GpuViewReader(fd)
        self._reader, self.generation = reader, generation
        self._rows = {}

    def detach(self) -> None:
        """The writer is gone: nothing is known held until another attaches."""
        self._reader = None
        self._rows = {}
        self._total_blocks = 0

    @property
    def attached(self) -> bool:
        return self._reader is not None

    def writer_alive(self) -> bool:
        return self._reader is not None and self._reader.writer_alive()

    def update(self, rows: dict[str, TargetRow], total_blocks: int) -> None:
        """The writer's targets, all of them (those not listed are gone)."""
        self._rows = rows
        self._total_blocks = total_blocks

    def stats(self) -> tuple[int, int, int, int]:
        """(arena bytes, bytes taken, reads taken again, reads with no answer); zeros when detached."""
        if self._reader is None:
            return 0, 0, 0, 0
        _pid, size, taken, _tables, retries, failures = self._reader.stats()
        return size, taken, retries, failures

    # -- what the policy asks ----------------------------------------------------------------------
    def _bits(self, keys: Sequence[str]) -> list[int]:
        rows = self._rows
        return [row.bit if (row := rows.get(k)) is not None else -1 for k in keys]

    def match(self, hashes: Sequence[int], keys: Sequence[str]) -> list[int]:
        reader = self._reader
        got = reader.match(hashes, self._bits(keys)) if reader is not None else None
        if got is None:
            if hashes and keys:
                self.unanswered += 1
            return [0] * len(keys)
        return got

    def match_one(self, hashes: Sequence[int], key: str) -> int:
        return self.match(hashes, [key])[0]

    def first_unheld(self, hashes: Sequence[int], start: int = 0) -> int:
        reader = self._reader
        got = reader.first_unheld(hashes, start) if reader is not None else None
        if got is None:
            if start < len(hashes):
                self.unanswered += 1
            return start
        return got

    def has_target(self, key: str) -> bool:
        return key in self._rows

    def block_size(self, key: str) -> int | None:
        row = self._rows.get(key)
        return None if row is None else row.block_size

    def keys(self) -> list[str]:
        return list(self._rows)

    def block_count(self, key: str) -> int:
        row = self._rows.get(key)
        return 0 if row is None else row.blocks

    def block_counts(self, keys: Sequence[str]) -> list[int]:
        rows = self._rows
        return [row.blocks if (row := rows.get(k)) is not None else 0 for k in keys]

    def events_made_until(self, key: str) -> float:
        row = self._rows.get(key)
        return 0.0 if row is None else row.made_until

    def evicted_entries(self, key: str) -> int:
        row = self._rows.get(key)
        return 0 if row is None else row.evicted

    def tier_block_counts(self, key: str) -> dict[str, int]:
        """Blocks per lower tier: not shared (module docstring), so none."""
        return {}

    def __len__(self) -> int:
        return self._total_blocks

    def __contains__(self, key: object) -> bool:
        return key in self._rows

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._rows))
