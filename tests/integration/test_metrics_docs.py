"""Docs and dashboards cannot drift from what the server exports: every series a live server's
/metrics lists is in the metrics table of docs/observability.md, and every PromQL query of the Grafana dashboard
names only series a live server exports."""
from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp
import pytest

from infera.server.metrics import ProcessMetrics
from tests.conftest import wait_for
from tests.integration.conftest import wait_workers

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "infera.json"
SUFFIXES = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count"),
            "info": ("",), "unknown": ("",)}


def exported_families(text: str) -> dict[str, str]:
    """Family name (as scraped: counters with ``_total``) → type, from the ``# TYPE`` lines (an empty
    family, e.g. a labelled histogram nothing observed yet, has no sample but has its TYPE line)."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def exported_series(families: dict[str, str]) -> set[str]:
    return {name + suffix for name, kind in families.items() for suffix in SUFFIXES[kind]}


def readme_metric_names() -> set[str]:
    """First column of the metrics table (docs/observability.md): ``| `name` | type | labels | meaning |``."""
    text = (REPO / "docs" / "observability.md").read_text()
    section = text[text.index("## Metrics"):]
    return set(re.findall(r"^\| `([a-z_:]+)` \|", section, re.M))


PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                   "offset", "le", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, aggregations,
    keywords, label names in matchers or groupings, or range durations."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values)
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)  # label lists
    e = re.sub(r"\[[^\]]*\]", "", e)  # ranges ($__rate_interval included)
    names = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end():].lstrip().startswith("(") or m.group(0).lower() in PROMQL_KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def dashboard_exprs() -> list[str]:
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", ()) if t.get("expr"))
            walk(p.get("panels", ()))

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return exprs


def test_promql_name_extraction():
    assert promql_metric_names('histogram_quantile(0.99, sum by (le, worker_id) (rate(a_bucket{x="y"}[5m])))') == {
        "a_bucket"}
    assert promql_metric_names("sum(rate(a_total[$__rate_interval])) / on (w) group_left b > bool 0") == {
        "a_total", "b"}


@pytest.fixture
async def live_metrics(make_server, spawn_worker, nats_server, tmp_path) -> str:
    """The /metrics of a kv-aware server fronting two sim workers after some traffic (so the
    per-worker and kv families have samples), of one on the NATS plane (NATS and replica-sync
    families) with API keys and the fair queue on (their families), and a ``--workers N``
    process's own families."""
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"keys:\n  - sha256: '{'0' * 64}'\n    tenant: team-a\n    requests_per_minute: 10\n")
    server = await make_server("--engine-scrape-interval", "0.2")
    workers = [await spawn_worker() for _ in range(2)]
    await wait_workers(server, {w.worker_id for w in workers})
    nats_plane = await make_server("--request-transport", "nats", "--kv-event-transport", "nats",
                                   "--nats-server", nats_server.url, "--api-keys-file", str(keys),
                                   "--max-inflight-per-worker", "4")
    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as s:
        await wait_for(lambda: all(server.kv.subscriber.stats(w.worker_id).get("connected") for w in workers), 10,
                       message="KV-event subscriptions connected")
        for i in range(4):
            body = {"model": "sim-model", "max_tokens": 2, "stream": i % 2 == 0,
                    "messages": [{"role": "user", "content": f"hello {i} " * 40}]}
            async with s.post(base + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()
        await wait_for(lambda: server.engine_window.rounds >= 2, 10, message="two self-check scrapes")
        await wait_for(lambda: nats_plane.nats.connected, 10, message="NATS connected")
        texts = []
        for port in (server.port, nats_plane.port):
            async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                texts.append(await r.text())
    # The families only a --workers N child exports (its supervisor's sockets are not needed to list them).
    process = ProcessMetrics(server.metrics.registry, index=0, count=2, socket_path=lambda i: f"/nonexistent/{i}")
    texts.append("".join(f"# TYPE {f.name}{'_total' if f.type == 'counter' else ''} {f.type}\n"
                         for f in process.collect()))
    return "\n".join(texts)


async def test_every_exported_metric_is_in_the_readme_table(live_metrics):
    families = exported_families(live_metrics)
    assert "infera_kv_window_engine_hit_rate" in families and "infera_nats_connected" in families
    assert 'infera_kv_prompt_tokens_total{worker_id="' in live_metrics  # traffic reached the kv counters
    documented = readme_metric_names()
    missing = sorted(set(families) - documented)
    assert not missing, f"exported by /metrics but not in docs/observability.md's metrics table: {missing}"
    stale = sorted(n for n in documented - set(families) if n.startswith("infera_"))
    assert not stale, f"in docs/observability.md's metrics table but exported by no server: {stale}"


async def test_every_dashboard_query_names_exported_metrics(live_metrics):
    series = exported_series(exported_families(live_metrics))
    exprs = dashboard_exprs()
    assert len(exprs) >= 10
    for expr in exprs:
        names = promql_metric_names(expr)
        assert names, f"no metric in {expr!r}"
        unknown = sorted(names - series)
        assert not unknown, f"{expr!r} names {unknown}, which no server exports"
