import argparse

import pytest

from infera.engine.base.launcher import (EngineProcessSpec, Launcher, _exit_code, build_launcher_parser,
                                         default_advertise_host, engine_command)
from infera.engine.sim.launcher import SimAdapter


def _launcher(*flags):
    adapter = SimAdapter()
    args, argv = build_launcher_parser(adapter, "t", environ={}).parse_known_args(["--etcd-endpoint", "e", *flags])
    launcher = Launcher(adapter, args, argv, registration=object())
    launcher.spec = EngineProcessSpec(cmd=["x"], port=9001)
    return launcher


@pytest.mark.parametrize("flags, bind, expected", [
    ((), "0.0.0.0", "127.0.0.1"),
    ((), "10.0.0.7", "10.0.0.7"),
    ((), None, "127.0.0.1"),
    (("--advertise-host", "gpu-node-3"), "0.0.0.0", "gpu-node-3"),
    (("--advertise-host", "gpu-node-3"), None, "gpu-node-3"),
])
def test_record_address(flags, bind, expected):
    rec = _launcher(*flags)._make_record({"model_name": "m", "kv_block_size": 16, "bind_host": bind})
    assert (rec.worker_id, rec.url, rec.engine) == (f"{expected}:9001", f"http://{expected}:9001", "sim")


@pytest.mark.parametrize("host, expected", [("0.0.0.0", "127.0.0.1"), ("::", "127.0.0.1"), ("", "127.0.0.1"),
                                            ("192.168.1.2", "192.168.1.2"), ("localhost", "localhost")])
def test_default_advertise_host(host, expected):
    assert default_advertise_host(host) == expected


@pytest.mark.parametrize("code, expected", [(0, 0), (3, 3), (-9, 137), (-15, 143), (None, 1)])
def test_exit_code_mirrors_the_engine(code, expected):
    assert _exit_code(code) == expected


def test_unknown_and_prefix_flags_reach_the_engine_untouched():
    # allow_abbrev=False: "--drain" must not be taken as --drain-timeout
    adapter = SimAdapter()
    args, argv = build_launcher_parser(adapter, "t", environ={}).parse_known_args(
        ["--etcd-endpoint", "e", "--drain", "--lease", "5", "--model", "m"])
    assert argv == ["--drain", "--lease", "5", "--model", "m"]
    assert args.lease_ttl == 10.0


def test_engine_command_default_and_override():
    ns = argparse.Namespace(engine_entrypoint=None)
    assert engine_command(ns, "pkg.mod", ["--a"])[1:] == ["-m", "pkg.mod", "--a"]
    ns.engine_entrypoint = "/opt/bin/engine --flag 'two words'"
    assert engine_command(ns, "pkg.mod", ["--a"]) == ["/opt/bin/engine", "--flag", "two words", "--a"]
