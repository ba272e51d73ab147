"""``--workers`` (flag > env > default), the ``--replica-sync`` default it implies, the child
context a supervisor passes, and one ``/metrics`` merged over processes."""
import asyncio
import os

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.parser import text_string_to_metric_families

import infera.server.cli as cli
from infera.server.cli import MAX_SERVER_WORKERS, parse_args
from infera.server.metrics import (
    MetricsRegistry,
    ProcessMetrics,
    is_labelled,
    label_process,
    merge_labelled_texts,
    read_page,
)
from infera.server.supervisor import CHILD_ENV, ChildContext

BASE = ["--etcd-endpoint", "127.0.0.1:2379"]
NATS = ["--request-transport", "nats"]


@pytest.fixture
def cores(monkeypatch):
    """The CPU affinity this process has, as the default sees it (no cgroup quota)."""
    def set_cores(n, quota=None):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))
        monkeypatch.setattr(cli, "cgroup_cpu_quota", lambda *a: quota)
    return set_cores


@pytest.mark.parametrize("argv, env, n_cores, expected", [
    ([], {}, 2, 2),  # default: one per core this process may use
    ([], {}, 1, 1),
    ([], {}, 6, 6),
    ([], {"INFERA_SERVER_WORKERS": "3"}, 2, 3),  # env over the default
    (["--workers", "1"], {"INFERA_SERVER_WORKERS": "3"}, 2, 1),  # flag over env
    (["--workers", str(MAX_SERVER_WORKERS)], {}, 2, MAX_SERVER_WORKERS),
])
def test_workers_flag_env_default(cores, argv, env, n_cores, expected):
    cores(n_cores)
    assert parse_args(BASE + argv, environ=env).workers == expected


def test_default_follows_the_affinity_not_the_machine(cores, monkeypatch):
    cores(1)  # e.g. taskset -c 3
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert cli.default_server_workers() == 1


@pytest.mark.parametrize("n_cores, quota, expected", [(64, 2.0, 2), (64, 1.5, 2), (64, 0.5, 1), (1, 4.0, 1),
                                                      (8, None, 8)])
def test_default_is_capped_by_a_cgroup_cpu_quota(cores, n_cores, quota, expected):
    """A container limited to 2 CPUs on a 64-core node sees 64 cores in its affinity."""
    cores(n_cores, quota)
    assert cli.default_server_workers() == expected


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize("files, cgroup, expected", [
    ({"cpu.max": "200000 100000\n"}, "0::/\n", 2.0),  # cgroup v2, in a container (its own root)
    ({"kubepods/pod1/cpu.max": "150000 100000\n"}, "0::/kubepods/pod1\n", 1.5),  # v2, the process's cgroup
    ({"cpu.max": "max 100000\n"}, "0::/\n", None),  # no quota
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, "3:cpu,cpuacct:/\n", 3.0),  # v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, "3:cpu:/\n", None),
    ({}, "0::/\n", None),  # nothing readable
])
def test_cgroup_cpu_quota(tmp_path, files, cgroup, expected):
    for name, text in files.items():
        write(tmp_path / "fs" / name, text)
    write(tmp_path / "cgroup", cgroup)
    assert cli.cgroup_cpu_quota(str(tmp_path / "fs"), str(tmp_path / "cgroup")) == expected


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5", str(MAX_SERVER_WORKERS + 1), ""])
@pytest.mark.parametrize("via", ["flag", "env"])
def test_bad_workers_are_refused(capsys, value, via):
    argv, env = (BASE + ["--workers", value], {}) if via == "flag" else (BASE, {"INFERA_SERVER_WORKERS": value})
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, environ=env)
    assert exc.value.code == 2
    assert "--workers" in capsys.readouterr().err


@pytest.mark.parametrize("argv, expected", [
    (["--workers", "1"], "off"),
    (["--workers", "2"], "local"),  # several processes, no broker: they share among themselves
    (["--workers", "2", *NATS], "nats"),  # NATS plane: every process is a replica like any other
    (["--workers", "1", *NATS], "nats"),
    (["--workers", "2", "--kv-event-transport", "nats"], "nats"),
    (["--workers", "2", "--replica-sync", "off"], "off"),
    (["--workers", "2", "--replica-sync", "nats"], "nats"),
    (["--workers", "4", "--replica-sync", "local", *NATS], "local"),  # explicit wins
])
def test_replica_sync_default_follows_workers_and_plane(argv, expected):
    assert parse_args(BASE + argv, environ={}).replica_sync == expected


def test_replica_sync_local_needs_several_processes(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--workers", "1", "--replica-sync", "local"], environ={})
    assert "needs --workers > 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--workers", "1"], environ={"INFERA_REPLICA_SYNC": "local"})


def test_child_context_travels_in_the_environment_and_is_taken_out():
    ctx = ChildContext(index=1, count=3, runtime_dir="/tmp/x", port=8123, generation=2, replica_id="t-1.2",
                       ready_fd=7)
    env = {CHILD_ENV: ctx.to_env(), "OTHER": "1"}
    assert ChildContext.take(env) == ctx
    assert env == {"OTHER": "1"}  # nothing this child starts believes it is one
    assert ChildContext.take(env) is None
    assert ctx.metrics_socket(2) == "/tmp/x/metrics-2.sock"
    assert ctx.info() == {"index": 1, "count": 3, "pid": os.getpid(), "restarts": 2}


class Fams:
    def __init__(self, *families):
        self.families = families

    def collect(self):
        return self.families


def process_families(requests: float, workers: float):
    c = CounterMetricFamily("infera_requests", "Requests", labels=["route", "status"])
    c.add_metric(["/v1/chat/completions", "200"], requests)
    g = GaugeMetricFamily("infera_workers", "Workers", labels=["status"])
    g.add_metric(["active"], workers)
    h = HistogramMetricFamily("infera_request_duration_seconds", "Latency", labels=["route"])
    h.add_metric(["/v1/chat/completions"], [("0.1", requests), ("+Inf", requests)], 0.05 * requests)
    return [c, g, h]


def page(*families) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fams(*families))
    return generate_latest(registry).decode()


def merge_process_texts(parts: list[tuple[str, str]]) -> bytes:
    """Pages as a --workers N child writes them for the gather (labelled), merged."""
    return merge_labelled_texts([label_process(text, process) for process, text in parts])


def test_merged_metrics_label_every_sample_with_its_process():
    # each process's series arrive as text, as the private channel carries them
    text = merge_process_texts([("0", page(*process_families(3, 2))), ("1", page(*process_families(5, 2)))]).decode()
    assert text.count("# TYPE infera_requests_total counter") == 1  # one family, every process under it
    assert text.count("# HELP infera_request_duration_seconds Latency") == 1
    assert text.count("# TYPE infera_request_duration_seconds histogram") == 1
    assert 'infera_requests_total{process="0",route="/v1/chat/completions",status="200"} 3.0' in text
    assert 'infera_requests_total{process="1",route="/v1/chat/completions",status="200"} 5.0' in text
    assert 'infera_workers{process="0",status="active"} 2.0' in text  # per process: not summed to 4
    assert 'infera_request_duration_seconds_count{process="1",route="/v1/chat/completions"} 5.0' in text
    parsed = {f.name: f for f in text_string_to_metric_families(text)}  # valid exposition
    assert {s.labels["process"] for s in parsed["infera_request_duration_seconds"].samples} == {"0", "1"}
    assert len(parsed["infera_request_duration_seconds"].samples) == 2 * 4  # 2 buckets, count, sum; each process
    assert {(s.labels["process"], s.value) for s in parsed["infera_requests"].samples
            if s.name == "infera_requests_total"} == {("0", 3.0), ("1", 5.0)}


def test_merged_text_keeps_every_family_and_sample_form():
    bare = GaugeMetricFamily("infera_up", "Up")  # no labels
    bare.add_metric([], 1)
    empty = GaugeMetricFamily("infera_none", "Nothing yet", labels=["k"])  # no samples
    odd = GaugeMetricFamily("infera_odd", "Odd # HELP values", labels=["v"])
    odd.add_metric(['a{b} c="d"\n# HELP x'], 7)  # braces, spaces, quotes, a newline in a label value
    only_own = GaugeMetricFamily("infera_own", "Only process 0's")
    only_own.add_metric([], 2)
    own, sibling = page(bare, empty, odd, only_own), page(odd, bare, empty)
    text = merge_process_texts([("0", own), ("1", sibling)]).decode()
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(parsed) == {"infera_up", "infera_none", "infera_odd", "infera_own"}
    assert sorted((s.labels["process"], s.value) for s in parsed["infera_up"].samples) == [("0", 1.0), ("1", 1.0)]
    assert parsed["infera_none"].samples == []
    assert {(s.labels["process"], s.labels["v"]) for s in parsed["infera_odd"].samples} == {
        ("0", 'a{b} c="d"\n# HELP x'), ("1", 'a{b} c="d"\n# HELP x')}
    assert [(s.labels, s.value) for s in parsed["infera_own"].samples] == [({"process": "0"}, 2.0)]
    assert sum(line.startswith("# HELP ") for line in text.splitlines()) == 4 and text.endswith("\n")
    assert merge_process_texts([("0", "")]) == b""


@pytest.mark.parametrize("line, labelled", [
    ("a 1.0", 'a{process="3"} 1.0'),
    ('a{k="v"} 1.0', 'a{process="3",k="v"} 1.0'),
    ('a_bucket{le="+Inf"} 2.0 1700000000', 'a_bucket{process="3",le="+Inf"} 2.0 1700000000'),
    ("# HELP a b{c} d", "# HELP a b{c} d"),
    ("# TYPE a gauge", "# TYPE a gauge"),
])
def test_the_process_label_goes_on_samples_only(line, labelled):
    assert label_process(line + "\n", "3") == labelled + "\n"


def test_the_process_label_is_an_index():
    with pytest.raises(ValueError):
        label_process("a 1.0\n", '1"} 9')


def test_a_sibling_that_does_not_answer_is_skipped_and_counted(tmp_path):
    registry = MetricsRegistry()
    registry.register(Fams(*process_families(1, 1)))
    pm = ProcessMetrics(registry, index=0, count=3, socket_path=lambda i: str(tmp_path / f"m{i}.sock"),
                        timeout_s=0.5)
    registry.register(pm)
    text = asyncio.run(pm.render()).decode()  # no sibling listens: both skipped at once
    assert 'infera_server_metrics_siblings_skipped_total{process="0",sibling="1"} 1.0' in text
    assert 'infera_server_metrics_siblings_skipped_total{process="0",sibling="2"} 1.0' in text
    assert 'infera_server_processes{process="0"} 3.0' in text
    assert 'process="1"' not in text.replace('sibling="1"', "")


def test_the_gather_groups_labelled_pages_and_labels_an_unlabelled_one(tmp_path):
    registry = MetricsRegistry()
    registry.register(Fams(*process_families(1, 1)))
    pm = ProcessMetrics(registry, index=0, count=4, socket_path=lambda i: str(tmp_path / f"m{i}.sock"))
    sibling = page(*process_families(5, 2))
    labelled = label_process(sibling, "1")  # as a sibling writes its page for the gather
    assert is_labelled(labelled, "1") and not is_labelled(sibling, "2") and not is_labelled(labelled, "2")
    text = pm._merge(read_page(registry), [("1", labelled), ("2", sibling), ("3", "not a page")]).decode()
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    assert {(s.labels["process"], s.value) for s in parsed["infera_requests"].samples
            if s.name == "infera_requests_total"} == {("0", 1.0), ("1", 5.0), ("2", 5.0)}
    assert all(s.labels.get("process") in {"0", "1", "2"} for f in parsed.values() for s in f.samples)
    assert text.count("# HELP infera_requests_total ") == 1
    assert pm.skipped == {3: 1}
