"""The kvd connector's worker side on a GPU, without vLLM (issue 33): one script, one run.

For every layout the connector moves (``kv_layouts``: interleaved K|V in all six stride orders,
ROCm K/V planes, the MLA latent; bf16 and fp8 bytes) it builds the layers' caches on the device the
way vLLM 0.32 lays them out (a ``[L, B, H, N, C]`` buffer in the layout's physical order, one
logical ``[B, H, N, C]`` view per layer), fills them with known bytes, saves a chunk through a real
kvd daemon, loads it into a zeroed cache of the same layout and checks the pages come back
bit-identical (and nothing else was written). Then, for one layout:

* save and load GB/s (the worker's staged side-stream path, daemon included) against a plain
  torch device-to-host / host-to-device copy of the same bytes from pinned memory;
* the step-time cost of a save: median time of a busy compute "step" (matmuls) with and without a
  save issued after it, on the same stream.

Prints a table and writes JSON (medians of ``--runs``). ``--device cpu`` runs the same code on the
CPU, the connector's direct path, plus its staged path with plain tensors: a smoke test that keeps
this script from rotting where no GPU is (numbers there mean nothing). Needs torch and infera's own
dependencies, not vLLM.

    python bench/gpu_kvd_check.py                   # CUDA or ROCm: about a minute on an H200
    python bench/gpu_kvd_check.py --device cpu --quick
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from infera.engine.vllm import kv_layouts as kl, kvd_format as fmt  # noqa: E402
from infera.engine.vllm.kv_staging import CpuDevice  # noqa: E402
from infera.engine.vllm.kvd_meta import ChunkLoad, ChunkSave, RequestLoad, _Settings  # noqa: E402
from infera.engine.vllm.kvd_worker import _WorkerSide  # noqa: E402
from infera.kvd.client import SyncKvdClient  # noqa: E402

ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
          "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


def layout_cases(heads: int, head_dim: int) -> list[tuple[str, kl.SpecFacts, str, str, str]]:
    """(label, spec facts, layout, cache dtype, platform) for every layout the connector moves."""
    dense = dict(kind="FullAttentionSpec", num_kv_heads=heads, head_size=head_dim, head_size_v=head_dim)
    mla = dict(kind="MLAAttentionSpec", num_kv_heads=1, head_size=576, head_size_v=0)
    out = []
    for dtype, cache_dtype, quant in (("bfloat16", "auto", "NONE"), ("uint8", "fp8_e4m3", "FP8_PER_TENSOR")):
        for layout in ORDERS:
            out.append((f"interleaved {layout} {cache_dtype}", dict(dense, dtype=dtype, quant=quant), layout,
                        cache_dtype, "cuda"))
        for layout in ("LHBNC", "LBHNC"):
            out.append((f"planes {layout} {cache_dtype}",
                        dict(dense, dtype=dtype, quant=quant, num_head_slots=2,
                             state_content_bytes=heads * head_dim * (1 if dtype == "uint8" else 2)),
                        layout, cache_dtype, "rocm"))
        for layout in ("LBHNC", "LBNHC"):
            out.append((f"mla {layout} {cache_dtype}",
                        dict(mla, dtype=dtype, quant=quant, cache_dtype_str=None if cache_dtype == "auto" else "fp8"),
                        layout, cache_dtype, "cuda"))
    return out


def make_caches(g: kl.KvGeometry, layout: str, layers: int, num_blocks: int, device: str, seed: int | None):
    """Per-layer logical [B, H, N, C] views over one buffer laid out in ``layout``'s physical order."""
    logical = (layers, num_blocks, g.heads, g.block_size, g.content)
    order = ORDERS[layout]
    dtype = getattr(torch, g.storage)
    raw = torch.zeros([logical[d] for d in order], dtype=dtype, device=device)
    if seed is not None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        data = torch.randint(0, 256, (raw.numel() * raw.element_size(),), dtype=torch.uint8, generator=gen)
        raw.view(-1).view(torch.uint8).copy_(data.to(device))
    inverse = [order.index(i) for i in range(5)]
    view = raw.permute(*inverse)
    return {f"layers.{i}.attn": view[i] for i in range(layers)}


def worker(sock: str, g: kl.KvGeometry, names: tuple[str, ...], pages: int, num_blocks: int, cache_dtype: str):
    s = _Settings(socket=sock, model="gpu-check", block_size=g.block_size, pages_per_chunk=pages, group_id=0,
                  layer_names=names, usable=True, tp_size=1, pp_size=1, collapse_tp=False, fingerprint=None,
                  default_retention="short", geometry=g, num_blocks=num_blocks)
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, rank=0),
                          cache_config=SimpleNamespace(cache_dtype=cache_dtype),
                          compilation_config=SimpleNamespace(static_forward_context={}))
    return _WorkerSide(s, cfg)


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def start_daemon(sock: str, max_bytes: str) -> subprocess.Popen:
    daemon = subprocess.Popen([sys.executable, "-m", "infera.kvd", "--socket", sock, "--max-bytes", max_bytes,
                               "--log-level", "WARNING"], env={**os.environ, "INFERA_KVD_STORAGE_SELFCHECK": "0"})
    deadline = time.monotonic() + 60
    while True:
        try:
            SyncKvdClient(sock, timeout=2).close()
            return daemon
        except OSError:
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("kvd did not start")
            time.sleep(0.05)


def round_trips(sock: str, args, staged_cpu: bool) -> list[dict]:
    rows = []
    names = tuple(f"layers.{i}.attn" for i in range(args.layers))
    ids = list(range(1, args.chunk_pages * 2, 2))  # every other block, so a page mix-up shows
    dst_ids = list(reversed(range(args.num_blocks - args.chunk_pages, args.num_blocks)))
    for n, (label, facts, layout, cache_dtype, platform) in enumerate(layout_cases(args.heads, args.head_dim)):
        g = kl.classify(kl.SpecFacts(block_size=args.block_size, **facts), layout=layout, cache_dtype=cache_dtype,
                        platform=platform)
        src = make_caches(g, layout, args.layers, args.num_blocks, args.device, seed=n)
        dst = make_caches(g, layout, args.layers, args.num_blocks, args.device, seed=None)
        w, r = (worker(sock, g, names, args.chunk_pages, args.num_blocks, cache_dtype) for _ in range(2))
        w.register(src)
        r.register(dst)
        if staged_cpu:
            w.use_device(CpuDevice(staged=True))
            r.use_device(CpuDevice(staged=True))
        key = fmt.chunk_key([n.to_bytes(4, "little") * 8])
        w.save([ChunkSave("r", key, ids, "short")])
        ok = w.saver.idle(60) and w.saver.saved == 1
        r.load([RequestLoad("r", [ChunkLoad(key, 0, len(ids), 0, len(ids), dst_ids)])])
        for name in names:
            r.wait_for_layer(name)
        sync(args.device)
        ok = ok and not r.take_invalid()
        for name in names:
            a, b = src[name], dst[name]
            ok = ok and all(torch.equal(a[s].cpu().contiguous().view(torch.uint8),
                                        b[d].cpu().contiguous().view(torch.uint8)) for s, d in zip(ids, dst_ids))
            untouched = [i for i in range(args.num_blocks) if i not in dst_ids]
            ok = ok and not b[untouched].cpu().contiguous().view(torch.uint8).any()
        rows.append({"layout": label, "tag": g.tag(), "bit_identical": bool(ok)})
        w.close()
        r.close()
    return rows


def bandwidth(sock: str, args) -> dict:
    """Save/load GB/s through the worker vs plain pinned copies, and a save's step-time cost."""
    names = tuple(f"layers.{i}.attn" for i in range(args.layers))
    g = kl.classify(kl.SpecFacts(kind="FullAttentionSpec", block_size=args.block_size, num_kv_heads=args.heads,
                                 head_size=args.head_dim, head_size_v=args.head_dim, dtype="bfloat16"),
                    layout="LBNHC", cache_dtype="auto", platform="cuda")
    caches = make_caches(g, "LBNHC", args.layers, args.num_blocks, args.device, seed=1)
    w = worker(sock, g, names, args.chunk_pages, args.num_blocks, "auto")
    w.register(caches)
    ids = list(range(args.chunk_pages))
    nbytes = g.page_elems * g.itemsize * len(names) * len(ids)
    saves, loads, d2h, h2d, busy, busy_save = [], [], [], [], [], []
    dev = torch.empty(nbytes, dtype=torch.uint8, device=args.device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=args.device != "cpu")
    a = torch.randn(args.matmul, args.matmul, device=args.device)

    def step() -> None:
        for _ in range(4):
            torch.mm(a, a)

    for run in range(args.runs):
        key = fmt.chunk_key([(1000 + run).to_bytes(4, "little") * 8])
        sync(args.device)
        t = time.perf_counter()
        w.save([ChunkSave("r", key, ids, "short")])
        assert w.saver.idle(120)
        saves.append(time.perf_counter() - t)
        sync(args.device)
        t = time.perf_counter()
        w.load([RequestLoad("r", [ChunkLoad(key, 0, len(ids), 0, len(ids), ids)])])
        for name in names:
            w.wait_for_layer(name)
        sync(args.device)
        loads.append(time.perf_counter() - t)
        assert not w.take_invalid()
        t = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        sync(args.device)
        d2h.append(time.perf_counter() - t)
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        sync(args.device)
        h2d.append(time.perf_counter() - t)
        # a busy stream: the step alone, then the step followed by a save (its gather and copy queued)
        for with_save, out in ((False, busy), (True, busy_save)):
            sync(args.device)
            t = time.perf_counter()
            step()
            if with_save:
                w.save([ChunkSave("r", fmt.chunk_key([(5000 + run).to_bytes(4, "little") * 8]), ids, "short")])
            step()  # the next step: what it waits for is the save's cost to the engine
            sync(args.device)
            out.append(time.perf_counter() - t)
        w.saver.idle(120)
    w.close()
    gbps = lambda xs: nbytes / statistics.median(xs) / 1e9  # noqa: E731
    return {"chunk_bytes": nbytes, "save_gbps": gbps(saves), "load_gbps": gbps(loads), "torch_d2h_gbps": gbps(d2h),
            "torch_h2d_gbps": gbps(h2d), "step_ms": statistics.median(busy) * 1e3,
            "step_with_save_ms": statistics.median(busy_save) * 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (CUDA or ROCm) or cpu (smoke)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--chunk-pages", type=int, default=32)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--matmul", type=int, default=4096, help="the busy step's matmul size")
    parser.add_argument("--quick", action="store_true", help="small shapes, 3 runs (the CPU smoke run)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "gpu_kvd_check.json"))
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.heads, args.head_dim, args.num_blocks, args.chunk_pages, args.runs, args.matmul = \
            2, 2, 32, 16, 4, 3, 128
    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit("no CUDA/ROCm device (use --device cpu for the smoke run)")
    sock = os.path.join(tempfile.mkdtemp(), "kvd.sock")
    daemon = start_daemon(sock, "8G" if not args.quick else "256M")
    try:
        rows = round_trips(sock, args, staged_cpu=False)
        if args.device == "cpu":  # the accelerator's staging path, with plain tensors
            rows += [{**row, "layout": row["layout"] + " (staged)"} for row in round_trips(sock, args, True)]
        bw = bandwidth(sock, args)
    finally:
        daemon.terminate()
        daemon.wait(30)
    device = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    print(f"device: {device}")
    print(f"{'layout':<34} bit-identical")
    for row in rows:
        print(f"{row['layout']:<34} {'yes' if row['bit_identical'] else 'NO'}")
    print(f"\nchunk {bw['chunk_bytes'] / (1 << 20):.1f} MiB, medians of {args.runs} runs")
    print(f"{'path':<22} {'GB/s':>8}")
    for name in ("save_gbps", "torch_d2h_gbps", "load_gbps", "torch_h2d_gbps"):
        print(f"{name.removesuffix('_gbps'):<22} {bw[name]:>8.2f}")
    print(f"save / torch d2h: {bw['save_gbps'] / bw['torch_d2h_gbps']:.2f}   "
          f"load / torch h2d: {bw['load_gbps'] / bw['torch_h2d_gbps']:.2f}")
    print(f"busy step pair: {bw['step_ms']:.2f} ms alone, {bw['step_with_save_ms']:.2f} ms with a save "
          f"(+{bw['step_with_save_ms'] - bw['step_ms']:.2f} ms)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": device, "args": vars(args), "round_trips": rows, **bw}, indent=1))
    failed = [r["layout"] for r in rows if not r["bit_identical"]]
    if failed:
        print("FAILED:", ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
