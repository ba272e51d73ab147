"""Pure pieces of ``bench/fleet_scale.py``: the server's /metrics read for the KV-event families,
histogram quantiles, the memory slope, window verdicts, the table and the goals. No I/O."""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

GOAL_BYTES_PER_ENTRY = 48.0
GOAL_WORKERS_RATIO = 1.1
GOAL_EVENTS_PER_CORE = 1_000_000.0
GOAL_LAG_S = 1.0
GOAL_PICK_P99_MS = 1.0
HELD_FRACTION = 0.995  # of the block events sent, applied (by every server process) after the drain

_PROCESS = re.compile(r'process="([^"]*)"')
_LE = re.compile(r'le="([^"]*)"')
_ROLE = re.compile(r'role="([^"]*)"')


@dataclass
class ProcessKv:
    """One server process's KV-event counters, summed over its workers."""
    block_events: float = 0.0
    batches: float = 0.0
    view_blocks: float = 0.0
    gaps: float = 0.0
    resets: float = 0.0
    delay_count: float = 0.0
    delay_sum: float = 0.0
    delay_buckets: dict[float, float] = field(default_factory=dict)  # le → cumulative count
    # infera_router_pick_seconds{role="mixed"}: the policy's pick alone (le → cumulative count)
    pick_buckets: dict[float, float] = field(default_factory=dict)
    heap_trims: float = 0.0  # infera_process_heap_trims_total (--heap-trim-interval)
    heap_trim_interval: float = 0.0  # infera_process_heap_trim_interval_seconds (0: the trimmer is off)
    role: str = "own"  # infera_kv_index_role: own, or writer / reader of the host's shared index


_SIMPLE = {"infera_kv_block_events_total": "block_events", "infera_kv_event_batches_total": "batches",
           "infera_policy_cache_view_size": "view_blocks", "infera_kv_event_gaps_total": "gaps",
           "infera_kv_view_resets_total": "resets", "infera_kv_event_delay_seconds_count": "delay_count",
           "infera_kv_event_delay_seconds_sum": "delay_sum", "infera_process_heap_trims_total": "heap_trims",
           "infera_process_heap_trim_interval_seconds": "heap_trim_interval"}


def parse_kv_metrics(text: str) -> dict[str, ProcessKv]:
    """The KV-event families of a /metrics page, summed over workers, per ``process`` label ("0"
    when there is none: a one-process server)."""
    out: dict[str, ProcessKv] = {}
    for line in text.split("\n"):
        if not line.startswith(("infera_kv_", "infera_policy_cache_view_size", "infera_router_pick_seconds_bucket",
                                "infera_process_heap_trim")):
            continue
        brace = line.find("{")
        name = line[:brace] if brace >= 0 else line.split(" ", 1)[0]
        if name == "infera_router_pick_seconds_bucket":
            if 'role="mixed"' in line:
                m = _PROCESS.search(line, brace)
                proc = out.setdefault(m.group(1) if m else "0", ProcessKv())
                le = _LE.search(line, brace)
                bound = float("inf") if le.group(1) == "+Inf" else float(le.group(1))
                proc.pick_buckets[bound] = proc.pick_buckets.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
            continue
        if name == "infera_kv_index_role":
            m = _PROCESS.search(line, brace)
            role = _ROLE.search(line, brace)
            if role and float(line.rsplit(" ", 1)[1]) == 1.0:
                out.setdefault(m.group(1) if m else "0", ProcessKv()).role = role.group(1)
            continue
        attr = _SIMPLE.get(name)
        if attr is None and name != "infera_kv_event_delay_seconds_bucket":
            continue
        m = _PROCESS.search(line, brace) if brace >= 0 else None
        proc = out.setdefault(m.group(1) if m else "0", ProcessKv())
        value = float(line.rsplit(" ", 1)[1])
        if attr is not None:
            setattr(proc, attr, getattr(proc, attr) + value)
        else:
            le = _LE.search(line, brace)
            bound = float("inf") if le.group(1) == "+Inf" else float(le.group(1))
            proc.delay_buckets[bound] = proc.delay_buckets.get(bound, 0.0) + value
    return out


def bucket_delta(after: dict[float, float], before: dict[float, float]) -> list[tuple[float, float]]:
    """Cumulative (le, count) of what was observed between two reads, sorted by bound."""
    return [(le, after[le] - before.get(le, 0.0)) for le in sorted(after)]


def hist_quantile(cumulative: Sequence[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile of a cumulative histogram, linearly interpolated inside its bucket (as
    Prometheus' histogram_quantile); the last finite bound when it falls in +Inf; None if empty."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    prev_le, prev_n = 0.0, 0.0
    for le, n in cumulative:
        if n >= rank:
            if le == float("inf"):
                return prev_le
            if n == prev_n:
                return le
            return prev_le + (le - prev_le) * (rank - prev_n) / (n - prev_n)
        prev_le, prev_n = le, n
    return prev_le


def slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of ys over xs (None with fewer than two distinct xs)."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def percentile(values: Sequence[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def window_held(sent: float, applied_min: float, drain_s: float, p99_s: float | None) -> bool:
    """A rate is held when every process applied (nearly) all that was sent, drained within the lag
    bound after the senders stopped, and 99% of the batches were applied within it."""
    return (sent > 0 and applied_min >= HELD_FRACTION * sent and drain_s <= GOAL_LAG_S
            and p99_s is not None and p99_s < GOAL_LAG_S)


def median_of(rows: Iterable[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


METRICS = ("entries", "pss_mb", "events_per_core", "lag_p50_ms", "lag_p99_ms", "sent_at_rate", "server_busy_at_rate",
           "max_held_rate",
           "pick_p50_ms", "pick_p99_ms", "added_p50_ms", "added_p99_ms", "cpu_ms_per_request",
           "policy_pick_p50_ms", "policy_pick_p99_ms", "scrape_cpu_ms", "scrape_wall_ms", "health_idle_p99_ms",
           "health_scrape_p50_ms", "health_scrape_p99_ms", "health_scrape_max_ms")


def medians(results: list[dict]) -> list[dict]:
    """One row per (sharing, --workers, engines): the median of each metric over the runs."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["sharing"], r["workers"], r["engines"]), []).append(r)
    rows = []
    for (sharing, workers, engines), rs in sorted(groups.items()):
        row: dict[str, Any] = {"sharing": sharing, "workers": workers, "engines": engines, "runs": len(rs)}
        for k in METRICS:
            row[k] = median_of(rs, k)
        rows.append(row)
    return rows


def memory_slopes(results: list[dict]) -> dict[tuple[float, int], dict]:
    """Per (sharing, --workers): bytes per (block, worker) entry, the slope of the server's memory
    (PSS, all its processes) over the fleet sizes, and the same per run (median reported)."""
    out: dict[tuple[float, int], dict] = {}
    keys = sorted({(r["sharing"], r["workers"]) for r in results})
    for key in keys:
        rs = [r for r in results if (r["sharing"], r["workers"]) == key]
        per_run = []
        for run in sorted({r["run"] for r in rs}):
            pts = [(r["entries"], r["pss_bytes"]) for r in rs if r["run"] == run]
            s = slope([x for x, _ in pts], [y for _, y in pts])
            if s is not None:
                per_run.append(s)
        rss_pts = [(r["entries"], r["rss_bytes"]) for r in rs]
        out[key] = {"bytes_per_entry": statistics.median(per_run) if per_run else None, "per_run": per_run,
                    "rss_bytes_per_entry": slope([x for x, _ in rss_pts], [y for _, y in rss_pts])}
        # the same read before the server's first heap trim after the fill (its freed heap still held)
        untrimmed = []
        for run in sorted({r["run"] for r in rs}):
            pts = [(r["entries"], r["pss_untrimmed_bytes"]) for r in rs if r["run"] == run and "pss_untrimmed_bytes" in r]
            s = slope([x for x, _ in pts], [y for _, y in pts]) if len(pts) > 1 else None
            if s is not None:
                untrimmed.append(s)
        if untrimmed:
            out[key]["untrimmed_bytes_per_entry"] = statistics.median(untrimmed)
    return out


def _fmt(v: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v / scale, spec)


def _render(head: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    widths = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head))]
    out = ["  ".join(c.rjust(w) for c, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
    return "\n".join(out)


def table(rows: list[dict], slopes: dict[tuple[float, int], dict]) -> str:
    head = ("sharing", "--workers", "engines", "entries", "PSS MB", "B/entry", "ev/s/core", "lag p50/p99 ms",
            "sent@rate", "busy@rate", "max held", "pick p50/p99 ms", "added p50/p99", "CPU ms/req",
            "policy pick p50/p99 µs")
    lines = []
    for r in rows:
        s = slopes.get((r["sharing"], r["workers"]), {}).get("bytes_per_entry")
        lines.append((f"{r['sharing']:g}", str(r["workers"]), str(r["engines"]), _fmt(r["entries"], ",.0f"),
                      _fmt(r["pss_mb"], ",.0f"), _fmt(s, ".0f"), _fmt(r["events_per_core"], ",.0f", 1e3) + "k",
                      f"{_fmt(r['lag_p50_ms'], '.0f')} / {_fmt(r['lag_p99_ms'], '.0f')}",
                      _fmt(r["sent_at_rate"], ",.0f", 1e3) + "k", _fmt(r.get("server_busy_at_rate"), ".2f"),
                      _fmt(r["max_held_rate"], ",.0f", 1e3) + "k",
                      f"{_fmt(r['pick_p50_ms'], '.2f')} / {_fmt(r['pick_p99_ms'], '.2f')}",
                      f"{_fmt(r['added_p50_ms'], '.2f')} / {_fmt(r['added_p99_ms'], '.2f')}",
                      _fmt(r["cpu_ms_per_request"], ".2f"),
                      f"{_fmt(r.get('policy_pick_p50_ms'), '.0f', 1e-3)} / {_fmt(r.get('policy_pick_p99_ms'), '.0f', 1e-3)}"))
    return _render(head, lines)


def scrape_table(rows: list[dict]) -> str:
    """A /metrics read at each fleet size: the server's CPU for it, its wall time, and /health's wait
    while scrapes run (the event loop's stall) against without."""
    head = ("sharing", "--workers", "engines", "scrape CPU ms", "scrape wall ms", "/health p99 idle ms",
            "/health p50/p99/max in scrapes ms")
    lines = [(f"{r['sharing']:g}", str(r["workers"]), str(r["engines"]), _fmt(r.get("scrape_cpu_ms"), ".0f"),
              _fmt(r.get("scrape_wall_ms"), ".0f"), _fmt(r.get("health_idle_p99_ms"), ".1f"),
              f"{_fmt(r.get('health_scrape_p50_ms'), '.1f')} / {_fmt(r.get('health_scrape_p99_ms'), '.1f')} / "
              f"{_fmt(r.get('health_scrape_max_ms'), '.1f')}") for r in rows]
    return _render(head, lines)


def total_pss_ratios(rows: list[dict]) -> dict[str, float]:
    """--workers 2's whole PSS over --workers 1's at the largest fleet, per sharing: the index and
    the processes' fixed cost (an interpreter each, the supervisor) together."""
    if not rows:
        return {}
    top = max(r["engines"] for r in rows)
    out = {}
    for sharing in sorted({r["sharing"] for r in rows}):
        one = next((r for r in rows if (r["engines"], r["sharing"], r["workers"]) == (top, sharing, 1)), None)
        two = next((r for r in rows if (r["engines"], r["sharing"], r["workers"]) == (top, sharing, 2)), None)
        if one and two and one["pss_mb"]:
            out[f"{sharing:g}"] = two["pss_mb"] / one["pss_mb"]
    return out


def goals(rows: list[dict], slopes: dict[tuple[float, int], dict]) -> dict[str, dict]:
    """The issue's goals, at the largest fleet measured (memory: the slope over all sizes). Each:
    goal, value, ok (None: not measured)."""
    if not rows:
        return {}
    top = max(r["engines"] for r in rows)
    at_top = [r for r in rows if r["engines"] == top]
    checks: dict[str, dict] = {}
    # The per-entry, per-core and held-rate goals are the server's (--workers 1, the smallest --workers
    # measured); what more processes cost is the two ratio goals.
    base = min(r["workers"] for r in rows)
    per_entry = [v["bytes_per_entry"] for (_, w), v in slopes.items() if w == base and v["bytes_per_entry"] is not None]
    worst = max(per_entry) if per_entry else None
    checks["bytes_per_entry"] = {"goal": GOAL_BYTES_PER_ENTRY, "value": worst,
                                 "ok": None if worst is None else worst <= GOAL_BYTES_PER_ENTRY}
    mem_ratio = cpu_ratio = None
    for sharing in sorted({r["sharing"] for r in at_top}):
        one = next((r for r in at_top if r["sharing"] == sharing and r["workers"] == 1), None)
        two = next((r for r in at_top if r["sharing"] == sharing and r["workers"] == 2), None)
        # Memory: what the index costs per (block, worker) entry, the slopes: a second process's
        # interpreter (~45 MB whatever the fleet; workers2_total_pss_ratio below) is not the index.
        s1 = slopes.get((sharing, 1), {}).get("bytes_per_entry")
        s2 = slopes.get((sharing, 2), {}).get("bytes_per_entry")
        if s1 and s2:
            mem_ratio = max(mem_ratio or 0.0, s2 / s1)
        if one and two and one["events_per_core"] and two["events_per_core"]:
            cpu_ratio = max(cpu_ratio or 0.0, one["events_per_core"] / two["events_per_core"])  # CPU per event
    checks["workers2_memory_per_entry_ratio"] = {"goal": GOAL_WORKERS_RATIO, "value": mem_ratio,
                                       "ok": None if mem_ratio is None else mem_ratio <= GOAL_WORKERS_RATIO}
    checks["workers2_event_cpu_ratio"] = {"goal": GOAL_WORKERS_RATIO, "value": cpu_ratio,
                                          "ok": None if cpu_ratio is None else cpu_ratio <= GOAL_WORKERS_RATIO}
    per_core = [r["events_per_core"] for r in at_top if r["workers"] == base and r["events_per_core"] is not None]
    low = min(per_core) if per_core else None
    checks["events_per_core"] = {"goal": GOAL_EVENTS_PER_CORE, "value": low,
                                 "ok": None if low is None else low >= GOAL_EVENTS_PER_CORE}
    held = [r["max_held_rate"] or 0.0 for r in at_top if r["workers"] == base]
    low_held = min(held) if held else None
    checks["held_rate_lag_under_1s"] = {"goal": GOAL_EVENTS_PER_CORE, "value": low_held,
                                        "ok": None if low_held is None else low_held >= GOAL_EVENTS_PER_CORE}
    # the pick itself (infera_router_pick_seconds) when the server exports it, else the added latency
    p99 = [r["policy_pick_p99_ms"] if r.get("policy_pick_p99_ms") is not None else r["added_p99_ms"]
           for r in at_top if r.get("policy_pick_p99_ms") is not None or r["added_p99_ms"] is not None]
    worst_p99 = max(p99) if p99 else None
    checks["pick_p99_ms"] = {"goal": GOAL_PICK_P99_MS, "value": worst_p99,
                             "ok": None if worst_p99 is None else worst_p99 <= GOAL_PICK_P99_MS}
    return checks
