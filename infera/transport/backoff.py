"""The retry delay every reconnecting loop of the transports uses: exponential, capped, jittered."""
from __future__ import annotations

import random


def retry_delay(failures: int, first: float, cap: float) -> float:
    """The wait before retry number ``failures`` (1, 2, ...): ``first`` doubling up to ``cap``,
    +-25% jitter (peers that failed together do not retry in step)."""
    return min(cap, first * 2 ** (max(failures, 1) - 1)) * random.uniform(0.75, 1.25)
