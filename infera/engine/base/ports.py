"""Several blocks of free ports for one engine, none overlapping.

The shared finder (``free_port_block``) only checks that ports are bindable *now*; ports handed
to the same engine (KV-event publisher and replay, NIXL side channel) are all still unbound when
the next one is chosen, so each choice must avoid the others. A block of ``n`` ports serves ``n``
data-parallel ranks: vLLM binds each rank's socket at the base port + its DP rank.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from infera.engine.base.kv_events import free_port_block


def free_port_blocks(sizes: Sequence[int], avoid: Iterable[range] = (), attempts: int = 64) -> list[int]:
    """First port of a free block per size in ``sizes``, disjoint from each other and ``avoid``."""
    taken = list(avoid)
    starts: list[int] = []
    for n in sizes:
        for _ in range(attempts):
            start = free_port_block(n)
            block = range(start, start + n)
            if not any(block.start < t.stop and t.start < block.stop for t in taken):
                break
        else:
            raise OSError(f"no block of {n} free TCP ports apart from the ones already chosen")
        taken.append(block)
        starts.append(start)
    return starts
