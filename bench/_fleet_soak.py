"""``bench/fleet_scale.py --soak-seconds S``: the server's memory over a long run at the KV index's
byte bound (issue 30: RSS flat, < 5 % growth after warm-up).

One fleet (the first ``--engines``, ``--workers``, ``--sharing``), the server started with
``--kv-index-max-bytes`` (passed as ``INFERA_KV_INDEX_MAX_BYTES`` in its environment; unset: the
server's default). The engines fill their pools (``--warm-rate``), then replay their steady state at
``--soak-rate`` block events/s for S seconds, in chunks of ``--soak-sample`` s; after each chunk the
server's RSS and PSS (all its processes) and its ``infera_kv_index_bytes`` /
``infera_kv_index_evicted_entries_total`` are read. Growth is measured from the first sample after
``--soak-warmup`` s (default: a third of the run) to the last one, and to the highest one.
"""
from __future__ import annotations

import argparse
import os
import re
import time
from typing import Any

import aiohttp

from _fleet_procs import Server, memory

_SERIES = re.compile(r"^(infera_kv_index_bytes|infera_kv_index_max_bytes|infera_kv_index_evicted_entries_total)"
                     r"(?:\{[^}]*\})? (\S+)$", re.M)


async def index_series(server: Server, session: aiohttp.ClientSession) -> dict[str, float]:
    """The index's bound series, summed over the server's processes."""
    async with session.get(f"{server.url}/metrics", headers=server.auth) as r:
        r.raise_for_status()
        text = await r.text()
    out: dict[str, float] = {}
    for name, value in _SERIES.findall(text):
        out[name] = out.get(name, 0.0) + float(value)
    return out


async def soak(args: argparse.Namespace, etcd_url: str, pubs: Any, engines: list[int], workers: int,
               log_dir: str, tag: str) -> dict:
    """Run the soak on a fleet already registered; returns the samples and the growth."""
    if args.kv_index_max_bytes is not None:
        os.environ["INFERA_KV_INDEX_MAX_BYTES"] = str(args.kv_index_max_bytes)  # the server's env (Server.start)
    server = Server(args, etcd_url, workers, log_dir, tag)
    samples: list[dict] = []
    warmup = args.soak_warmup if args.soak_warmup is not None else args.soak_seconds / 3
    try:
        await server.start(len(engines), args.ready_timeout, args.server_cores)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            await pubs.command("warm", engines, args.warm_rate)
            t0 = time.monotonic()
            sent = 0
            while time.monotonic() - t0 < args.soak_seconds:
                parts = await pubs.command("run", engines, args.soak_rate, duration=args.soak_sample)
                sent += sum(p["block_events"] for p in parts)
                pss, rss = memory(server.pids)
                series = await index_series(server, session)
                s = {"t_s": round(time.monotonic() - t0, 1), "rss_bytes": rss, "pss_bytes": pss, "sent": sent,
                     "index_bytes": series.get("infera_kv_index_bytes"),
                     "max_bytes": series.get("infera_kv_index_max_bytes"),
                     "evicted_entries": series.get("infera_kv_index_evicted_entries_total")}
                samples.append(s)
                print(f"  soak t={s['t_s']:>6.1f}s RSS {rss / 2**20:,.1f} MiB PSS {pss / 2**20:,.1f} MiB index "
                      f"{(s['index_bytes'] or 0) / 2**20:,.1f}/{(s['max_bytes'] or 0) / 2**20:,.1f} MiB evicted "
                      f"{s['evicted_entries'] or 0:,.0f} sent {sent:,}", flush=True)
    finally:
        await server.proc.stop()
    after = [s for s in samples if s["t_s"] >= warmup]
    base = after[0] if after else None
    out: dict[str, Any] = {"engines": len(engines), "workers": workers, "soak_s": args.soak_seconds,
                           "warmup_s": warmup, "rate": args.soak_rate, "kv_index_max_bytes": args.kv_index_max_bytes,
                           "samples": samples}
    if base is not None and len(after) >= 2:
        last, peak = after[-1], max(s["rss_bytes"] for s in after)
        out["rss_growth_pct"] = 100.0 * (last["rss_bytes"] - base["rss_bytes"]) / base["rss_bytes"]
        out["rss_peak_growth_pct"] = 100.0 * (peak - base["rss_bytes"]) / base["rss_bytes"]
        out["pss_growth_pct"] = 100.0 * (last["pss_bytes"] - base["pss_bytes"]) / base["pss_bytes"]
        out["evicted_after_warmup"] = (last["evicted_entries"] or 0) - (base["evicted_entries"] or 0)
        out["index_bytes_max"] = max((s["index_bytes"] or 0) for s in samples)
    return out


def soak_table(r: dict) -> str:
    if "rss_growth_pct" not in r:
        return "soak: too few samples after the warm-up to measure growth (run longer)"
    s0 = next(s for s in r["samples"] if s["t_s"] >= r["warmup_s"])
    s1 = r["samples"][-1]
    rows = [("engines", f"{r['engines']:,}"), ("--workers", str(r["workers"])),
            ("run / warm-up", f"{r['soak_s']:.0f} s / {r['warmup_s']:.0f} s"),
            ("offered", f"{r['rate'] / 1e3:,.0f}k block events/s"),
            ("--kv-index-max-bytes", "server default" if r["kv_index_max_bytes"] is None
             else f"{r['kv_index_max_bytes'] / 2**20:,.1f} MiB"),
            ("index bytes (max seen)", f"{r['index_bytes_max'] / 2**20:,.1f} MiB"),
            ("entries evicted after warm-up", f"{r['evicted_after_warmup']:,.0f}"),
            ("RSS after warm-up -> end", f"{s0['rss_bytes'] / 2**20:,.1f} -> {s1['rss_bytes'] / 2**20:,.1f} MiB"),
            ("RSS growth (end / peak)", f"{r['rss_growth_pct']:+.2f} % / {r['rss_peak_growth_pct']:+.2f} %"),
            ("PSS growth (end)", f"{r['pss_growth_pct']:+.2f} %")]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
