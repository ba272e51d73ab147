"""The writer of tests/integration/test_kv_shared_view_processes.py, in its own process: a shared
NativeKvIndex whose arena fd goes to the test over the socket it was given, then events without end
(until killed, or its deadline): anchors that never change, and churn around them that grows the
table, reallocates the anchors' holder sets in every form and clears what it stored."""
from __future__ import annotations

import random
import socket
import sys
import time

from infera.kv.events import Cleared, EventBatch, Removed, Stored
from infera.kv.hashing import block_hashes  # noqa: F401  (the test hashes the same prompts)
from infera.kv.index import NativeKvIndex

BS = 4
TARGETS = 200
ANCHOR_BITS = [0, *range(70, 141)]  # bit 0 alone: an inline set; 70..140: an array, then a bitmap
CHURN_BITS = list(range(141, TARGETS))
ANCHOR_TOKENS = list(range(1000, 1000 + 32 * BS))


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    deadline = time.monotonic() + float(sys.argv[2])
    idx = NativeKvIndex(shared_bytes=256 << 20)
    keys = [f"w{t}" for t in range(TARGETS)]
    for k in keys:
        idx.add_target(k, BS)
    for b in ANCHOR_BITS:
        idx.apply(keys[b], EventBatch(0.0, [Stored(list(range(1, 33)), None, ANCHOR_TOKENS, BS)]))
    socket.send_fds(sock, [b"arena"], [idx.shared_fd()])
    rng = random.Random(5)
    next_hash = 1000
    stored: dict[str, int] = {}
    while time.monotonic() < deadline:
        k = keys[rng.choice(CHURN_BITS)]
        r = rng.random()
        if r < 0.4:  # join the anchors' blocks: their sets grow, change form, move
            idx.apply(k, EventBatch(0.0, [Stored(list(range(1, 33)), None, ANCHOR_TOKENS, BS)]))
        elif r < 0.7:
            idx.apply(k, EventBatch(0.0, [Removed(list(range(1, 33)))]))
        elif r < 0.98:  # fresh blocks: the table grows and is rebuilt
            n = rng.randint(16, 256)
            tokens = [rng.randrange(1 << 30) for _ in range(n * BS)]
            idx.apply(k, EventBatch(0.0, [Stored(list(range(next_hash, next_hash + n)), None, tokens, BS)]))
            next_hash += n
            stored[k] = stored.get(k, 0) + n
        else:  # a clear: many deletions, entries shifted back over the anchors' runs
            idx.apply(k, EventBatch(0.0, [Cleared()]))
            stored.pop(k, None)


if __name__ == "__main__":
    main()
