"""Pure helpers of ``bench/soak.py``: failure attribution, the summary, the checks, the table.

No I/O here, so each piece can be checked with hand-made samples.
"""
from __future__ import annotations

import math
import statistics
from typing import Any

# The issue's goals.
RSS_GROWTH_MAX_PCT = 5.0
# fds are "flat" when no sample after warm-up, outside the kill windows, lies more than
# max(10, 5 % of it) above the median of the first few after warm-up. Dips don't count (a kill
# closes the connections to its worker, they re-open elsewhere): a leak only ever climbs.
FD_TOLERANCE_ABS = 10
FD_TOLERANCE_PCT = 5.0
EDGE_SAMPLES_MAX = 5  # "the first few" / "the last few" samples after warm-up


def classify(failure: dict[str, Any], kills: list[dict[str, Any]], window_s: float) -> tuple[str, int | None]:
    """``("hang", None)``, ``("kill", i)`` (a failure the kills must cause: ``kills[i]``) or
    ``("other", None)`` (unexplained).

    Kill-caused: the request was already in flight when a worker was killed (start ≤ kill), it
    failed within ``window_s`` after that kill, and the server's error names that very worker or
    names none (a cut without a name falls back to the time window alone). A request sent after the
    kill has no excuse: the server should have failed it over before its first byte. Times are
    ``time.monotonic()`` of one host.
    """
    if failure.get("kind") == "hang":
        return "hang", None
    start, end, worker = failure["start"], failure["end"], failure.get("worker")
    for i, kill in enumerate(kills):
        if start <= kill["t"] <= end <= kill["t"] + window_s and worker in (None, kill["worker_id"]):
            return "kill", i
    return "other", None


def edge_count(n: int) -> int:
    """How many samples make "the first few" and "the last few" out of ``n`` after warm-up."""
    return max(1, min(EDGE_SAMPLES_MAX, n // 3))


def fd_tolerance(median_fds: float) -> int:
    return max(FD_TOLERANCE_ABS, math.ceil(median_fds * FD_TOLERANCE_PCT / 100.0))


def summarize(samples: list[dict[str, Any]], kills: list[dict[str, Any]], failures: list[dict[str, Any]],
              kill_every: float) -> dict[str, Any]:
    """The figures the goals are judged on, from the samples of the ``measure`` phase (after
    warm-up, before the drain) and every classified failure (``failure["class"]``)."""
    post = [s for s in samples if s.get("phase") == "measure"]
    out: dict[str, Any] = {"samples_after_warmup": len(post)}
    if post:
        k = edge_count(len(post))
        first = statistics.median(s["rss_mib"] for s in post[:k])
        last = statistics.median(s["rss_mib"] for s in post[-k:])
        fds = [s["fds"] for s in post]
        fd_first = statistics.median(fds[:k])
        steady = [s["fds"] for s in post if not s.get("kill_transient")] or fds
        out.update(
            edge_samples=k, rss_first_mib=round(first, 2), rss_last_mib=round(last, 2),
            rss_growth_pct=round((last - first) / first * 100.0, 3) if first else None,
            rss_min_mib=round(min(s["rss_mib"] for s in post), 2), rss_max_mib=round(max(s["rss_mib"] for s in post), 2),
            fds_min=min(fds), fds_max=max(fds), fds_range=max(fds) - min(fds), fds_first=fd_first,
            fds_last=statistics.median(fds[-k:]), fds_peak_steady=max(steady),
            fds_creep=max(steady) - fd_first, fds_tolerance=fd_tolerance(fd_first),
            conns_min=min((s["conns"] for s in post if s.get("conns") is not None), default=None),
            conns_max=max((s["conns"] for s in post if s.get("conns") is not None), default=None),
        )
    by_class = {"kill": 0, "other": 0, "hang": 0}
    by_kind: dict[str, int] = {}
    for f in failures:
        by_class[f["class"]] += 1
        by_kind[f["kind"]] = by_kind.get(f["kind"], 0) + 1
    out.update(ok=sum(s.get("ok", 0) for s in samples), failed_kill_caused=by_class["kill"],
               failed_unexplained=by_class["other"], hangs=by_class["hang"], failures_by_kind=by_kind,
               failures_not_itemized=sum(s.get("failures_dropped", 0) for s in samples), kills=len(kills),
               replacements_ready=sum(1 for k in kills if k.get("replacement_ready_s") is not None),
               kill_every_s=kill_every)
    return out


def checks(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """PASS/FAIL against the goals. Too few samples after warm-up to judge is a FAIL, not a pass."""
    res = []

    def add(name: str, ok: bool | None, detail: str) -> None:
        res.append({"check": name, "status": "FAIL" if not ok else "PASS", "detail": detail})

    growth = summary.get("rss_growth_pct")
    n, k = summary.get("samples_after_warmup", 0), summary.get("edge_samples")
    if growth is None or n < 2:
        add(f"RSS growth after warm-up < {RSS_GROWTH_MAX_PCT:g} %", False, f"only {n} sample(s) after warm-up")
    else:
        add(f"RSS growth after warm-up < {RSS_GROWTH_MAX_PCT:g} %", growth < RSS_GROWTH_MAX_PCT,
            f"{growth:+.2f} % (median of the last {k} samples {summary['rss_last_mib']:.1f} MiB vs the first {k} "
            f"after warm-up {summary['rss_first_mib']:.1f} MiB; range {summary['rss_min_mib']:.1f}–"
            f"{summary['rss_max_mib']:.1f})")
    if n < 2:
        add("open fds flat after warm-up", False, f"only {n} sample(s) after warm-up")
    else:
        add("open fds flat after warm-up", summary["fds_creep"] <= summary["fds_tolerance"],
            f"highest outside kill windows {summary['fds_peak_steady']} vs {summary['fds_first']:g} (median of "
            f"the first {k}): {summary['fds_creep']:+g}, tolerance {summary['fds_tolerance']} = max("
            f"{FD_TOLERANCE_ABS}, {FD_TOLERANCE_PCT:g} %); all samples {summary['fds_min']}–{summary['fds_max']}, "
            f"last {k} median {summary['fds_last']:g}")
    add("0 errors except those the kills must cause", summary["failed_unexplained"] == 0 and
        summary["failures_not_itemized"] == 0,
        f"{summary['failed_unexplained']} unexplained, {summary['failed_kill_caused']} kill-caused over "
        f"{summary['kills']} kill(s)" + (f"; {summary['failures_not_itemized']} failures not itemized (too many "
                                         "in one interval to attribute)" if summary["failures_not_itemized"] else ""))
    add("0 hung requests", summary["hangs"] == 0, f"{summary['hangs']} request(s) past the hang bound")
    if summary["kills"]:
        add("every replacement worker became active", summary["replacements_ready"] == summary["kills"],
            f"{summary['replacements_ready']} of {summary['kills']}")
    return res


def _f(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


TABLE_HEAD = (f"{'t s':>6} {'phase':<7}| {'RSS MiB':>8} {'fds':>5} {'conns':>5} {'cpu':>5} | {'wk':>2} | "
              f"{'ok':>6} {'kill':>5} {'other':>5} {'hang':>4} | {'p50 ms':>7} {'p99 ms':>7} | events")


def table_row(s: dict[str, Any]) -> str:
    fds = _f(s.get('fds'), 'd') + ("*" if s.get("kill_transient") else "")
    return (f"{s['t']:>6.1f} {s['phase']:<7}| {_f(s.get('rss_mib'), '.1f'):>8} {fds:>5} "
            f"{_f(s.get('conns'), 'd'):>5} {_f(s.get('cpu_cores'), '.2f'):>5} | {_f(s.get('workers_active'), 'd'):>2} | "
            f"{s.get('ok', 0):>6} {s.get('failed_kill', 0):>5} {s.get('failed_other', 0):>5} {s.get('hangs', 0):>4} | "
            f"{_f(s.get('lat_p50_ms'), '.0f'):>7} {_f(s.get('lat_p99_ms'), '.0f'):>7} | {'; '.join(s.get('events', []))}")
