"""``python -m infera.engine.sglang --infera-kvd-socket``: kvd becomes SGLang's HiCache storage
backend (spec §8.6). The probe runs against a real ``python -m infera.kvd``; the failures against
missing sockets and fake listeners."""
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from infera.engine.sglang import adapter as sglang_adapter
from infera.engine.sglang.adapter import SglangAdapter, kvd_hicache_flags, probe_kvd
from infera.engine.sim.sglang_standin import build_arg_parser as standin_parser
from tests.unit import launcher_helpers

KVD_CONFIG = {"backend_name": "infera-kvd", "module_path": "infera.engine.sglang.kvd_adapter",
              "class_name": "InferaKvdBackend", "prefetch_threshold": 64}
HICACHE = "--enable-hierarchical-cache"
BACKEND = ["--hicache-storage-backend", "dynamic"]
EXTRA = "--hicache-storage-backend-extra-config"
ALL_THREE = [HICACHE, *BACKEND, EXTRA, "CFG"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("INFERA_ENABLE_KV_EVENTS", "INFERA_DEFAULT_KV_FP8", "INFERA_KVD_SOCKET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sglang_adapter, "has_gpu", lambda: False)


def short_socket_dir() -> str:
    return tempfile.mkdtemp(prefix="kvdsg")  # Unix socket paths are limited to ~107 bytes


@pytest.fixture(scope="module")
def kvd_socket():
    """A real daemon for the module (the probe does connect + hello + stats against it)."""
    path = os.path.join(short_socket_dir(), "kvd.sock")
    proc = subprocess.Popen([sys.executable, "-m", "infera.kvd", "--socket", path, "--max-bytes", "4M",
                             "--shared-arena-bytes", "0"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "INFERA_KVD_STORAGE_SELFCHECK": "0"})
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                probe_kvd(path)
                break
            except SystemExit:
                assert proc.poll() is None, "kvd exited"
                assert time.monotonic() < deadline, "kvd did not come up in 20 s"
                time.sleep(0.05)
        yield path
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def prepare(argv, *launcher_flags):
    return launcher_helpers.prepare(SglangAdapter(), argv, *launcher_flags)


def kvd_part(argv):
    """The HiCache flags of a final argv, the extra config shown as CFG when it is kvd's."""
    out = []
    for i, tok in enumerate(argv):
        if tok in (HICACHE, "--enable-hicache"):
            out.append(tok)
        elif tok in ("--hicache-storage-backend", EXTRA):
            value = argv[i + 1]
            out += [tok, "CFG" if tok == EXTRA and json.loads(value) == KVD_CONFIG else value]
        elif tok.startswith("--hicache-storage-backend="):
            out.append(tok)
    return out


CASES = [
    ("mixed: all three appended", ["--model-path", "/m"], ALL_THREE, True),
    ("prefill: all three appended", ["--model-path", "/m", "--disaggregation-mode", "prefill"], ALL_THREE, True),
    ("SGLang's alias --enable-hicache counts as the switch", ["--model-path", "/m", "--enable-hicache"],
     ["--enable-hicache", *BACKEND, EXTRA, "CFG"], True),
    ("the user's own storage backend wins", ["--model-path", "/m", "--hicache-storage-backend", "file"],
     ["--hicache-storage-backend", "file", HICACHE], True),
    ("the user's backend in --flag=value form wins", ["--model-path", "/m", "--hicache-storage-backend=mooncake"],
     ["--hicache-storage-backend=mooncake", HICACHE], True),
    ("the user's extra config alone also wins", ["--model-path", "/m", EXTRA, '{"x":1}'],
     [EXTRA, '{"x":1}', HICACHE], True),
    ("everything given: nothing added", ["--model-path", "/m", HICACHE, "--hicache-storage-backend", "file"],
     [HICACHE, "--hicache-storage-backend", "file"], True),
    ("decode: skipped, no env", ["--model-path", "/m", "--disaggregation-mode", "decode"], [], False),
]


@pytest.mark.parametrize("name,user,expected,env_set", CASES, ids=[c[0] for c in CASES])
def test_argv_table(name, user, expected, env_set, kvd_socket, caplog):
    caplog.set_level(logging.INFO, logger="infera.launcher.sglang")
    _, _, spec = prepare(user, "--infera-kvd-socket", kvd_socket)
    assert spec.argv[:len(user)] == user  # the user's flags verbatim and first
    assert kvd_part(spec.argv) == expected
    assert spec.env.get("INFERA_KVD_SOCKET") == (kvd_socket if env_set else None)
    if not env_set:
        assert "ignored" in caplog.text
    elif "user" in name:
        assert "keeping the user's" in caplog.text
    # The final command line is one SGLang 0.5.23 (as the stand-in mirrors it) accepts.
    args = standin_parser().parse_args(spec.argv)
    assert args.enable_hierarchical_cache is bool(expected)


def test_no_flag_no_env_adds_nothing():
    _, args, spec = prepare(["--model-path", "/m"])
    assert args.infera_kvd_socket is None
    assert kvd_part(spec.argv) == [] and "INFERA_KVD_SOCKET" not in spec.env


def test_env_enables_and_the_flag_wins(kvd_socket, monkeypatch):
    monkeypatch.setenv("INFERA_KVD_SOCKET", kvd_socket)
    _, args, spec = prepare(["--model-path", "/m"])
    assert args.infera_kvd_socket == kvd_socket and kvd_part(spec.argv) == ALL_THREE
    assert spec.env["INFERA_KVD_SOCKET"] == kvd_socket
    monkeypatch.setenv("INFERA_KVD_SOCKET", "/nonexistent/env.sock")  # flag > env: the env socket is never probed
    _, args, spec = prepare(["--model-path", "/m"], "--infera-kvd-socket", kvd_socket)
    assert spec.env["INFERA_KVD_SOCKET"] == kvd_socket


def test_disable_radix_cache_is_refused():
    with pytest.raises(SystemExit, match="--disable-radix-cache"):
        prepare(["--model-path", "/m", "--disable-radix-cache"], "--infera-kvd-socket", "/nonexistent/k.sock")


def test_helper_is_pure():
    argv = ["--model-path", "/m"]
    added, kept = kvd_hicache_flags(argv)
    assert argv == ["--model-path", "/m"] and kept == []
    assert added[:3] == [HICACHE, *BACKEND] and json.loads(added[4]) == KVD_CONFIG


class FakeListener:
    """A Unix socket that accepts and then either closes at once, answers garbage, or stays silent."""

    def __init__(self, behaviour: str):
        self.path = os.path.join(short_socket_dir(), "fake.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(4)
        self.behaviour = behaviour
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.behaviour == "close":
                conn.close()
            elif self.behaviour == "garbage":
                conn.sendall(b"\x00\x00\x00\x03abc")

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()
        self.thread.join(5)
        shutil.rmtree(os.path.dirname(self.path), ignore_errors=True)


@pytest.mark.parametrize("behaviour", ["close", "garbage", "silent"])
def test_a_daemon_that_does_not_answer_fails_the_launch(behaviour):
    listener = FakeListener(behaviour)
    try:
        start = time.monotonic()
        with pytest.raises(SystemExit, match="does not answer.*python -m infera.kvd --socket"):
            prepare(["--model-path", "/m"], "--infera-kvd-socket", listener.path)
        assert time.monotonic() - start < 8  # bounded by the probe's 5 s timeout
    finally:
        listener.close()


def test_a_missing_socket_fails_the_launch(tmp_path):
    with pytest.raises(SystemExit, match="does not answer"):
        prepare(["--model-path", "/m"], "--infera-kvd-socket", str(tmp_path / "nobody.sock"))


@pytest.mark.parametrize("argv, socket_arg, expected", [
    (["--model-path", "m"], None, None),
    (["--model-path", "m", "--hicache-storage-backend", "dynamic", EXTRA, json.dumps(KVD_CONFIG)], None,
     "/var/run/infera-kvd.sock"),
    (["--model-path", "m", "--hicache-storage-backend", "dynamic", EXTRA, json.dumps(KVD_CONFIG)], "/tmp/k.sock",
     "/tmp/k.sock"),
    (["--model-path", "m", "--hicache-storage-backend", "file"], "/tmp/k.sock", None),
])
async def test_the_record_names_the_kvd_socket(argv, socket_arg, expected):
    import argparse

    adapter = SglangAdapter()
    fields = await adapter.describe(None, "http://unused", argv,
                                    argparse.Namespace(advertise_host="127.0.0.1", infera_kvd_socket=socket_arg))
    assert fields.get("kvd_socket") == expected


async def test_the_record_of_a_launched_worker(kvd_socket):
    _, spec, record = await launcher_helpers.record(SglangAdapter(), ["--model-path", "/m"],
                                                    "--infera-kvd-socket", kvd_socket)
    assert record.kvd_socket == kvd_socket
