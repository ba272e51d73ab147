"""The KV index's byte bound (``--kv-index-max-bytes``, issue 30 item 3): what it counts, its default,
and how a size is written.

The index counts the bytes it holds by a model of the C view's compact layout, the same in both
implementations (so the Python twin evicts exactly what the C view evicts, and the differential
tests hold past the bound), kept as two running counts (blocks, entries), so checking it per batch
is O(1):

    bytes = BLOCK_BYTES × blocks + HOLDER_BYTES × (entries − blocks) + ENTRY_BYTES × entries

where a *block* is a router hash some target holds (its slot in the holder table and its age byte)
and an *entry* a (block, target) pair (the engine-hash map entry that names it, and the holder id past
a block's first). The costs are the C tables' per item at their mean load (``tests/unit/
test_kv_bound.py`` checks the model against ``GpuView.memory_bytes()``): distinct blocks cost ~41 B
per entry, blocks held by every target of 1,000 ~24 B. Past the bound the coldest blocks go: ages
are epochs of stores and matches (``u64table.h``), evicted oldest first, a whole age at a time, down
to 95% of the bound (so each round frees a twentieth at least and its passes are amortised).

The default is an eighth of the host's memory (``/proc/meminfo`` MemTotal, read once at start; 4 GiB
where that cannot be read): a router replica shares its host with the rest of the serving stack.
"""

from __future__ import annotations

import argparse
import re
from typing import NamedTuple

__all__ = ["BLOCK_BYTES", "ENTRY_BYTES", "HOLDER_BYTES", "BoundStats", "default_max_bytes", "model_bytes", "parse_size"]

#: a block's slot in the holder table (key and set word, 16 B, and its age byte) at ~0.76 load
BLOCK_BYTES = 25
#: a holder id past a block's first (an id in a sorted array; a bitmap costs less)
HOLDER_BYTES = 4
#: an engine-hash map entry (key and the router hash's low half, 12 B, and its used bit) at ~0.76 load
ENTRY_BYTES = 16

#: where the default cannot read the host's memory
FALLBACK_HOST_BYTES = 32 << 30
DEFAULT_SHARE = 8  # the default bound: 1/8 of the host's memory

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([KMGTkmgt])i?[Bb]?|[Bb])?")


class BoundStats(NamedTuple):
    """The index's bound as it stands (``KvIndex.bound_stats()``)."""

    bytes_held: int  #: by the model above
    max_bytes: int  #: 0: unbounded
    evicted_entries: int  #: (block, target) entries evicted, ever
    evicted_blocks: int  #: blocks evicted, ever
    rounds: int  #: eviction rounds


def model_bytes(blocks: int, entries: int) -> int:
    """The model's bytes for ``blocks`` blocks and ``entries`` (block, target) entries."""
    return BLOCK_BYTES * blocks + HOLDER_BYTES * max(0, entries - blocks) + ENTRY_BYTES * entries


def parse_size(value: str) -> int:
    """Bytes, or a size with a binary unit: ``512Mi``, ``4G``, ``4GiB``, ``64K`` (0: unbounded)."""
    m = _SIZE.fullmatch(str(value).strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size (bytes, or a number with K/M/G/T, e.g. 512Mi): {value!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def host_memory_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """MemTotal of ``meminfo`` in bytes, or None when it cannot be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    parts = line.split()
                    return int(parts[1]) * (1024 if len(parts) > 2 and parts[2].lower() == "kb" else 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_max_bytes(meminfo: str = "/proc/meminfo") -> int:
    """An eighth of the host's memory (of FALLBACK_HOST_BYTES when MemTotal cannot be read)."""
    total = host_memory_bytes(meminfo)
    return (total or FALLBACK_HOST_BYTES) // DEFAULT_SHARE
