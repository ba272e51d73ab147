"""bench/gaie.py's pure parts: the round-robin Envoy bootstrap, the flags, the medians and their
comparisons with direct, issue 29's goal checks and the table (the benchmark itself runs real
processes: ``python bench/gaie.py --quick``)."""
from __future__ import annotations

import os
import sys

import pytest

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

import gaie  # noqa: E402


def test_rr_bootstrap_is_a_static_round_robin_cluster_over_the_workers():
    config = gaie.envoy_rr_bootstrap(18000, 18001, [("127.0.0.1", 9001), ("127.0.0.2", 9002)])
    assert config["admin"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 18001}
    (listener,) = config["static_resources"]["listeners"]
    assert listener["address"]["socket_address"]["port_value"] == 18000
    (chain,) = listener["filter_chains"]
    (hcm,) = chain["filters"]
    filters = [f["name"] for f in hcm["typed_config"]["http_filters"]]
    assert filters == ["envoy.filters.http.router"]  # nothing but the router: no ext_proc
    (route,) = hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"] == {"cluster": "workers", "timeout": "0s"}  # streams are never cut
    (cluster,) = config["static_resources"]["clusters"]
    assert (cluster["type"], cluster["lb_policy"]) == ("STATIC", "ROUND_ROBIN")
    endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"] for e in endpoints] == [
        {"address": "127.0.0.1", "port_value": 9001}, {"address": "127.0.0.2", "port_value": 9002}]


def test_rr_bootstrap_needs_a_worker():
    with pytest.raises(ValueError, match="workers"):
        gaie.envoy_rr_bootstrap(1, 2, [])


def test_host_port_parses_worker_urls_and_names_a_bad_one():
    assert gaie.host_port("http://127.0.0.1:8001") == ("127.0.0.1", 8001)
    assert gaie.host_port("http://10.0.0.5:30000/v1") == ("10.0.0.5", 30000)
    with pytest.raises(ValueError, match="worker url"):
        gaie.host_port("http://nohost")


def test_envoy_cmd_is_one_worker_thread_without_hot_restart():
    cmd = gaie.envoy_cmd("/tmp/x.json", 1234)
    assert cmd[0].endswith("envoy")
    assert cmd[cmd.index("--concurrency") + 1] == "1"
    assert cmd[cmd.index("--base-id") + 1] == "1234" and "--disable-hot-restart" in cmd


def test_flags_defaults_quick_and_errors():
    a = gaie.resolve_args(["--paths", "envoy-rr", "server-kv"])
    assert a.paths == ["direct", "envoy-rr", "server-kv"]  # direct is always measured: the baseline
    assert (a.runs, a.concurrency, a.streams, a.kv_concurrency) == (3, [16, 64], [False], [1, 16])
    q = gaie.resolve_args(["--quick", "--paths", "server-kv", "direct"])
    assert q.runs == 1 and q.duration < a.duration and q.kv_requests < a.kv_requests
    assert gaie.resolve_args(["--runs", "5", "--stream", "both"]).streams == [False, True]
    with pytest.raises(SystemExit):
        gaie.resolve_args(["--runs", "0"])
    with pytest.raises(SystemExit):
        gaie.resolve_args(["--paths", "nginx"])


def test_rotate_changes_who_goes_first():
    paths = ["direct", "envoy-rr", "server-kv"]
    assert [gaie.rotate(paths, k)[0] for k in range(4)] == ["direct", "envoy-rr", "server-kv", "direct"]
    assert sorted(gaie.rotate(paths, 2)) == sorted(paths)
    assert gaie.rotate([], 3) == []


def _overhead(path, run, c, p50, rps, errors=0, hop=None):
    return {"kind": "overhead", "path": path, "run": run, "concurrency": c, "stream": False, "rps": rps,
            "lat_p50_ms": p50, "lat_p99_ms": p50 * 2, "ttft_p50_ms": None, "errors": errors,
            "error_samples": [], "cpu_us_per_req": {"hop": hop} if hop is not None else {}}


def _kv(path, run, hit, errors=0, concurrency=1):
    return {"kind": "kv", "path": path, "run": run, "concurrency": concurrency, "hit_rate": hit, "ttft_p50_ms": 10.0, "rps": 100.0,
            "errors": errors, "error_samples": []}


def _rows(epp_p50=(4.0, 4.2, 4.1), epp_hit=0.78, epp_errors=0):
    rows = []
    for run in range(3):
        rows += [_overhead("direct", run, 16, 3.0 + run * 0.1, 1000.0), _overhead("direct", run, 64, 12.0, 1000.0),
                 _overhead("envoy-rr", run, 16, 3.5 + run * 0.1, 900.0, hop=60.0),
                 _overhead("envoy-rr", run, 64, 13.0, 900.0, hop=60.0),
                 _overhead("server-kv", run, 16, 4.0 + run * 0.1, 800.0, hop=150.0),
                 _overhead("server-kv", run, 64, 15.0, 700.0, hop=150.0),
                 _overhead("epp", run, 16, epp_p50[run], 850.0, errors=epp_errors, hop=200.0),
                 _overhead("epp", run, 64, 14.0, 750.0, hop=200.0),
                 _kv("direct", run, 0.30), _kv("envoy-rr", run, 0.31), _kv("server-kv", run, 0.78),
                 _kv("epp", run, epp_hit),
                 _kv("server-kv", run, 0.40, concurrency=16), _kv("epp", run, 0.45, concurrency=16)]
    return rows


PATHS = ["direct", "envoy-rr", "server-kv", "epp"]


def test_summary_takes_medians_and_compares_with_direct():
    s = gaie.summarize(_rows(), PATHS, [16, 64], [False])
    epp = s["paths"]["epp"]["cells"]["c16-unary"]
    assert epp["lat_p50_ms"] == 4.1 and epp["hop_cpu_us_per_req"] == 200.0 and epp["runs"] == 3
    assert epp["delta_p50_ms"] == pytest.approx(4.1 - 3.1)  # median of its runs − median of direct's
    assert epp["paired_delta_ms"] == pytest.approx([1.0, 1.1, 0.9])  # each round against its own direct
    assert s["paths"]["server-kv"]["cells"]["c64-unary"]["rps_ratio"] == 0.7
    assert s["paths"]["epp"]["kv"]["c1"]["hit_rate"] == 0.78 and s["paths"]["epp"]["kv"]["c1"]["runs"] == 3
    assert s["paths"]["epp"]["kv"]["c16"]["hit_rate"] == 0.45  # each hit-rate concurrency apart


def test_goals_pass_when_the_epp_costs_at_most_envoy_plus_server_and_hits_as_the_server():
    s = gaie.summarize(_rows(), PATHS, [16, 64], [False])
    latency, hit = gaie.goal_checks(s, ["epp"])
    # envoy-rr +0.5, server-kv +1.0: the bound is +1.5; the EPP adds +1.0
    assert latency["status"] == "PASS" and latency["bound"] == pytest.approx(1.5) and latency["value"] == 1.0
    assert hit["status"] == "PASS" and "c=1" in hit["check"]  # the picks alone, not c=16's 5-point gap
    assert gaie.goal_checks(s, ["epp"], hit_c=16)[1]["status"] == "FAIL"


def test_goals_fail_on_a_slower_epp_a_lower_hit_rate_or_errors():
    slow = gaie.summarize(_rows(epp_p50=(5.0, 5.2, 5.1)), PATHS, [16, 64], [False])
    assert gaie.goal_checks(slow, ["epp"])[0]["status"] == "FAIL"
    missed = gaie.summarize(_rows(epp_hit=0.76), PATHS, [16, 64], [False])
    assert gaie.goal_checks(missed, ["epp"])[1]["status"] == "FAIL"  # 2 points below the server's
    close = gaie.summarize(_rows(epp_hit=0.775), PATHS, [16, 64], [False])
    assert gaie.goal_checks(close, ["epp"])[1]["status"] == "PASS"  # within 1 point
    failing = gaie.summarize(_rows(epp_errors=2), PATHS, [16, 64], [False])
    assert gaie.goal_checks(failing, ["epp"])[0]["status"] == "FAIL"


def test_streamed_goal_reads_ttft():
    rows = []
    for row in _rows():
        rows.append(row)
        if row["kind"] == "overhead" and row["concurrency"] == 16:  # streams: TTFT is half the e2e p50
            rows.append({**row, "stream": True, "ttft_p50_ms": row["lat_p50_ms"] / 2})
    s = gaie.summarize(rows, PATHS, [16, 64], [False, True])
    (latency,) = gaie.goal_checks(s, ["epp"], stream=True, hit_c=None)
    assert "TTFT" in latency["check"] and latency["value"] == pytest.approx(0.5)  # (4.1 − 3.1) / 2
    assert latency["bound"] == pytest.approx(0.75) and latency["status"] == "PASS"


def test_goals_skip_when_a_path_was_not_measured():
    s = gaie.summarize([r for r in _rows() if r["path"] != "server-kv"], ["direct", "envoy-rr", "epp"],
                       [16, 64], [False])
    assert [c["status"] for c in gaie.goal_checks(s, ["epp"])] == ["SKIP", "SKIP"]


def test_table_has_a_row_per_path_with_deltas_against_direct():
    s = gaie.summarize(_rows(), PATHS, [16, 64], [False])
    text = gaie.render_table(s, PATHS, [16, 64], [False], [1, 16])
    lines = text.splitlines()
    assert "c=16 unary (e2e)" in lines[0] and "c=64 unary (e2e)" in lines[0]
    rows = {line.split("|")[0].strip(): line for line in lines[2:]}
    assert set(rows) == {gaie.PATH_LABELS[p] for p in PATHS}
    epp = [c.split() for c in rows[gaie.PATH_LABELS["epp"]].split("|")[1:-1]]
    assert lines[1].split("|")[1].split() == ["c=1", "c=16"]
    assert epp[0] == ["78.0", "45.0"]  # hit % at c=1 and c=16
    assert epp[1][:4] == ["4.10", "+1.00", "850.0", "0.85"]  # p50, Δp50 d, req/s, thr/d at c=16
    direct = [c.split() for c in rows["direct"].split("|")[1:-1]]
    assert direct[1][1] == "-" and direct[1][3] == "-"  # no delta against itself


def _with_floor(floor_p50=(6.0, 6.1, 6.2), floor_hop=500.0):
    rows = _rows()
    for run in range(3):
        rows.append(_overhead("epp-floor", run, 16, floor_p50[run], 500.0, hop=floor_hop))
    return rows


def test_floor_check_is_informational_and_compares_the_floor_with_the_goal_bound():
    s = gaie.summarize(_with_floor(), [*PATHS, "epp-floor"], [16, 64], [False])
    (floor,) = gaie.floor_checks(s, [False])
    assert floor["status"] == "INFO"  # never fails the run: it explains the goal, it is not one
    assert floor["value"] == pytest.approx(6.1 - 3.1) and floor["bound"] == pytest.approx(1.5)
    assert "(EPP − floor): -2.000 ms, -300 µs CPU/req" in floor["detail"]  # Δ 1.0 − 3.0; hop 200 − 500
    assert gaie.floor_checks(gaie.summarize(_rows(), PATHS, [16, 64], [False]), [False]) == []  # no floor, no line


def test_floor_server_answers_every_message_as_the_picker_does():
    import importlib

    floor = importlib.import_module("_ext_proc_floor")
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    answer = floor.pick_answer("10.0.0.7:8000", "floor-0")
    common = answer.request_body.response
    assert common.clear_route_cache
    assert {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers} == {
        "x-gateway-destination-endpoint": b"10.0.0.7:8000", "x-worker-instance-id": b"floor-0"}

    async def run():
        proc = floor.FloorProcessor(["a:1", "b:2"])

        async def messages():
            yield pb.ProcessingRequest(request_headers=pb.HttpHeaders())
            yield pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}", end_of_stream=True))
            yield pb.ProcessingRequest(response_headers=pb.HttpHeaders())
        return [m async for m in proc.Process(messages(), None)]

    import asyncio
    kinds = [m.WhichOneof("response") for m in asyncio.run(run())]
    assert kinds == ["request_headers", "request_body", "response_headers"]
