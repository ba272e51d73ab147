#!/usr/bin/env python3
"""Bytes per (block, target) entry of the router's GPU view (``KvIndex``'s C tables), in process.

Two fleets' worth of views at 100 / 300 / 1,000 targets, each target holding ``--blocks`` blocks:

* **distinct**: every target's blocks are its own (a block is held by one target);
* **shared**: every target holds the same blocks (a block is held by all of them).

Measured two ways: ``tracemalloc`` over the applies (every PyMem allocation the view's tables
make, what RSS would see from them, less the allocator's own rounding), and the view's own
``GpuView.memory_bytes()`` where the build has it. Entries = Σ block_count over the targets.
Per target fixed costs (its Python object, its empty tables) are excluded: they are not per entry.

    python bench/kv_view_bytes.py                     # 100, 300, 1000 targets × 2,000 blocks
    python bench/kv_view_bytes.py --targets 1000 --blocks 500,2000

Writes ``--out`` (default ``bench/results/kv_view_bytes.json``); prints a table. Exit status 0 when
every row is ≤ ``--goal`` bytes per entry (48) at 1,000 targets, else 1.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import tracemalloc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from infera.kv.events import EventBatch, Stored  # noqa: E402
from infera.kv.index import KvIndex, NativeKvIndex  # noqa: E402


def measure(n_targets: int, blocks: int, shared: bool) -> dict:
    idx = KvIndex()
    keys = [f"w{t}" for t in range(n_targets)]
    for k in keys:
        idx.add_target(k, 1)  # block size 1: one token per block keeps the events small
    batches = []
    for t, k in enumerate(keys):
        base = 0 if shared else (t + 1) * 4_000_000
        tokens = list(range(base, base + blocks))
        batches.append((k, EventBatch(0.0, [Stored(list(range(1, blocks + 1)), None, tokens, 1)])))
    gc.collect()
    view = getattr(idx, "_view", None)
    nbytes0 = view.memory_bytes() if view is not None and hasattr(view, "memory_bytes") else None
    tracemalloc.start()
    before, _ = tracemalloc.get_traced_memory()
    for k, b in batches:
        idx.apply(k, b)
    after, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    entries = sum(idx.block_counts(keys))
    assert entries == n_targets * blocks, entries
    nbytes = view.memory_bytes() if nbytes0 is not None else None
    return {
        "targets": n_targets, "blocks_per_target": blocks, "layout": "shared" if shared else "distinct",
        "entries": entries, "distinct_blocks": len(idx),
        "traced_bytes": after - before, "traced_b_per_entry": (after - before) / entries,
        "peak_b_per_entry": (peak - before) / entries,
        "memory_bytes": nbytes, "memory_b_per_entry": None if nbytes is None else (nbytes - nbytes0) / entries,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="100,300,1000", help="comma-separated fleet sizes")
    ap.add_argument("--blocks", default="2000", help="blocks per target, comma-separated")
    ap.add_argument("--goal", type=float, default=48.0, help="bytes per entry at 1,000 targets")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results", "kv_view_bytes.json"))
    args = ap.parse_args()
    if KvIndex is not NativeKvIndex:
        print("the C accelerator is not built: nothing to measure", file=sys.stderr)
        return 1
    rows = []
    for n in (int(x) for x in args.targets.split(",")):
        for blocks in (int(x) for x in args.blocks.split(",")):
            for shared in (False, True):
                r = measure(n, blocks, shared)
                rows.append(r)
                gc.collect()
    head = ("targets", "blocks/target", "layout", "entries", "B/entry (traced)", "B/entry (memory_bytes)",
            "peak B/entry")
    table = [head] + [(str(r["targets"]), str(r["blocks_per_target"]), r["layout"], f"{r['entries']:,}",
                       f"{r['traced_b_per_entry']:.1f}",
                       "-" if r["memory_b_per_entry"] is None else f"{r['memory_b_per_entry']:.1f}",
                       f"{r['peak_b_per_entry']:.1f}") for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    print("GpuView bytes per (block, target) entry")
    for i, row in enumerate(table):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    at_goal = [r for r in rows if r["targets"] >= 1000]
    ok = all(r["traced_b_per_entry"] <= args.goal for r in at_goal)
    print(f"check ≤ {args.goal:g} B/entry at 1,000 targets: {'PASS' if ok else 'FAIL'}"
          + ("" if at_goal else " (no 1,000-target row)"))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "args": vars(args), "rows": rows, "ok": ok}, f,
                  indent=1)
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
