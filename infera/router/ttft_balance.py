"""What an in-flight request costs a new one's time to first token, learned from the replies.

The kv-aware cost of a target is ``w × missed blocks + load``. Missed blocks stand for prefill
work; the load counts the distinct blocks in flight there, which is KV memory, not queueing: five
conversations of one system prompt running on a worker add a few distinct blocks, yet every one of
them takes a decode slot and a share of each step. Whether a cache hit is worth queueing behind
them depends on the fleet: when prefill is expensive, a missed block costs more than a request
ahead; when it is cheap (small prompts, fast engines), the request ahead costs more, and a policy
that always follows the cache loses TTFT to round-robin.

``TtftBalance`` fits ``TTFT ≈ a + b·missed + c·in_flight`` over the streamed replies routed
lately (exponentially weighted least squares: each observation O(1); the 2×2 solve every
``SOLVE_EVERY`` observations), where ``missed`` and ``in_flight`` are the picked target's missed
blocks and requests in flight when it was picked, and TTFT is the upstream's time to first byte.
``ratio = c / b`` is then what one request in flight weighs, in missed blocks; the policy adds
``w × ratio × in_flight`` to a target's load. Prefill that costs nothing (b ≤ 0) gives the cap,
queueing that costs nothing (c ≤ 0) gives 0 (the policy's upstream form). Until ``MIN_SAMPLES``
replies are seen, the ratio is 0. A fixed ratio (``--kv-inflight-weight <n>``) skips the fit.
"""
from __future__ import annotations

HALF_LIFE = 2000  # observations: the fit follows a fleet whose speed changes within minutes
MIN_SAMPLES = 200
SOLVE_EVERY = 32
MAX_RATIO = 256.0  # missed blocks per in-flight request: above a long prompt's worth, pure balance


class TtftBalance:
    __slots__ = ("fixed", "ratio", "samples", "_decay", "_s", "_since_solve", "b", "c")

    def __init__(self, fixed: float | None = None, *, half_life: int = HALF_LIFE) -> None:
        if fixed is not None and fixed < 0:
            raise ValueError("a fixed in-flight weight must be >= 0")
        self.fixed = fixed
        self.ratio = fixed if fixed is not None else 0.0
        self.samples = 0
        self._decay = 0.5 ** (1.0 / half_life)
        # weighted sums: n, x1, x2, y, x1², x1·x2, x2², x1·y, x2·y
        self._s = [0.0] * 9
        self._since_solve = 0
        self.b = self.c = None  # the last fit's slopes (seconds per missed block / per request)

    def observe(self, missed: int, in_flight: int, ttft_s: float) -> None:
        if self.fixed is not None or ttft_s < 0:
            return
        d, s = self._decay, self._s
        x1, x2, y = float(missed), float(in_flight), ttft_s
        s[0] = s[0] * d + 1.0
        s[1] = s[1] * d + x1
        s[2] = s[2] * d + x2
        s[3] = s[3] * d + y
        s[4] = s[4] * d + x1 * x1
        s[5] = s[5] * d + x1 * x2
        s[6] = s[6] * d + x2 * x2
        s[7] = s[7] * d + x1 * y
        s[8] = s[8] * d + x2 * y
        self.samples += 1
        self._since_solve += 1
        if self._since_solve >= SOLVE_EVERY and self.samples >= MIN_SAMPLES:
            self._since_solve = 0
            self._solve()

    def _solve(self) -> None:
        n, x1, x2, y, x11, x12, x22, x1y, x2y = self._s
        m1, m2, my = x1 / n, x2 / n, y / n
        v11 = x11 / n - m1 * m1
        v12 = x12 / n - m1 * m2
        v22 = x22 / n - m2 * m2
        c1y = x1y / n - m1 * my
        c2y = x2y / n - m2 * my
        det = v11 * v22 - v12 * v12
        if det <= 1e-12 * max(v11 * v22, 1e-300):  # one of them never varied: nothing to tell apart
            return
        b = (c1y * v22 - c2y * v12) / det
        c = (c2y * v11 - c1y * v12) / det
        self.b, self.c = b, c
        if c <= 0:
            self.ratio = 0.0
        elif b <= 0:
            self.ratio = MAX_RATIO
        else:
            self.ratio = min(MAX_RATIO, c / b)
