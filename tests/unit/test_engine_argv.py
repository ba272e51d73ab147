import pytest

from infera.engine.base.argv import flag_value, flag_values, has_flag
from infera.engine.base.prom import info_labels, sample_sum, sum_samples


@pytest.mark.parametrize(
    "argv, names, expected",
    [
        (["--model", "m", "--port", "1"], ("--port",), ["1"]),
        (["--port=2"], ("--port",), ["2"]),
        (["--served-model-name", "a", "b", "--port", "1"], ("--served-model-name",), ["a", "b"]),
        (["--enforce-eager", "--port", "1"], ("--enforce-eager",), []),
        (["--port", "1", "--port", "3"], ("--port",), ["3"]),  # last wins, like argparse
        (["--temperature", "-1.5"], ("--temperature",), ["-1.5"]),  # negative numbers are values
        (["-tp", "2"], ("-tp", "--tensor-parallel-size"), ["2"]),
        (["--model", "m"], ("--port",), None),
        (["--portal", "x"], ("--port",), None),  # a longer flag is not a match
    ],
)
def test_flag_values(argv, names, expected):
    assert flag_values(argv, *names) == expected


def test_flag_value_default_and_has_flag():
    assert flag_value(["--x"], "--y", default="d") == "d"
    assert flag_value(["--x"], "--x", default="d") == "d"  # bare switch has no value
    assert has_flag(["--x"], "--x") and not has_flag([], "--x")


METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 9.0
vllm:cache_config_info{block_size="32",enable_prefix_caching="True",num_gpu_blocks="1024"} 1.0
"""


@pytest.mark.parametrize("name, label, expected", [
    ("vllm:num_requests_running", "", 3.0),
    ("vllm:num_requests_running", 'engine="1"', 1.0),
    ("vllm:num_requests_waiting", "", 4.0),  # not vllm:num_requests_waiting_by_reason
    ("vllm:num_requests_waiting_by_reason", 'reason="capacity"', 9.0),
    ("vllm:absent", "", 0.0),
])
def test_sample_sum_matches_the_exact_name_and_a_label(name, label, expected):
    assert sample_sum(METRICS, name, label) == expected


def test_sum_samples_sums_every_label_set_and_only_named_metrics():
    assert sum_samples(METRICS, ("vllm:num_requests_running", "vllm:num_requests_waiting")) == 7
    assert sum_samples(METRICS, ("sglang:num_running_reqs",)) is None
    assert sum_samples("vllm:num_requests_running 0\n", ("vllm:num_requests_running",)) == 0


def test_info_labels():
    labels = info_labels(METRICS, "vllm:cache_config_info")
    assert labels["block_size"] == "32" and labels["num_gpu_blocks"] == "1024"
    assert info_labels(METRICS, "nope") is None


# -- ports handed to engines: below the ephemeral range, never a NodePort ------------------------------

@pytest.mark.parametrize("env, n", [({}, 1), ({}, 4), ({"INFERA_NODEPORT_RANGE": "off"}, 1),
                                    ({"INFERA_NODEPORT_RANGE": "20000-29999"}, 2)])
def test_free_port_block_avoids_ephemeral_and_nodeports(monkeypatch, env, n):
    from infera.engine.base import ports

    for k in ("INFERA_NODEPORT_RANGE",):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    eph_lo, _ = ports._ephemeral_range()
    nodeports = ports._nodeport_range()
    for _ in range(50):
        base = ports.free_port_block(n, "127.0.0.1")
        assert base + n - 1 < eph_lo
        if nodeports:
            assert base + n - 1 < nodeports[0] or base > nodeports[1]


class _ScriptedDraws:
    """Stands in for the ports' random generator: hands out the given bases in order."""

    def __init__(self, bases: list[int]) -> None:
        self.bases = iter(bases)

    def randint(self, lo: int, hi: int) -> int:
        return next(self.bases)


@pytest.mark.parametrize("draws, engine_port, expected", [
    ([12001, 12002], None, (12001, 12002)),
    # Two draws of one port (CI lost a sim engine to it): the replay socket is drawn again.
    ([12001, 12001, 12001, 12003], None, (12001, 12003)),
    # Neither socket may take the engine's own HTTP port, also still unbound at launch.
    ([12005, 12005, 12006, 12005, 12007], "12005", (12006, 12007)),
])
def test_injected_kv_event_ports_are_distinct_from_each_other_and_the_engine_port(
        monkeypatch, draws, engine_port, expected):
    import json

    from infera.engine.base import kv_events, ports

    monkeypatch.setattr(ports, "_port_rng", _ScriptedDraws(draws))
    monkeypatch.setattr(ports, "bindable", lambda port, host: True)
    argv = ["--model", "m", *(["--port", engine_port] if engine_port else [])]
    out, got = kv_events.with_kv_events(argv, True, "sim")
    assert got == expected
    cfg = json.loads(flag_value(out, "--kv-events-config"))
    assert (cfg["endpoint"], cfg["replay_endpoint"]) == (f"tcp://*:{expected[0]}", f"tcp://*:{expected[1]}")
