"""The kvd connector's KV layouts (issue 33): every layout vLLM's attention backends give a
connector, found from the installed backends themselves, round-trips bit-identically through a real
kvd; other layouts, dtypes and scales are kept apart by the compat key or the chunk header; what is
not moved is refused at start, naming it.

The pure classification runs here; the round trips run under the vLLM venv (torch, vLLM's own
``create_kv_cache_views``), as ``tests/real_engines.py`` does (a skip without it, a failure under
``INFERA_E2E_REQUIRED=1``).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from infera.engine.vllm import kv_layouts as kl
from tests.real_engines import run_engine_python


def facts(**kw) -> kl.SpecFacts:
    base = dict(kind="FullAttentionSpec", block_size=16, num_kv_heads=4, head_size=64, head_size_v=64,
                dtype="bfloat16")
    return kl.SpecFacts(**{**base, **kw})


@pytest.mark.parametrize("spec,platform,layout,packing,heads,content,dtype", [
    (facts(), "cuda", "LBNHC", "kv_interleaved", 4, 128, "bf16"),  # FlashAttention NHD
    (facts(), "cuda", "LBHNC", "kv_interleaved", 4, 128, "bf16"),  # FlashInfer/Triton HND
    (facts(), "cpu", "LBHNC", "kv_rows", 4, 128, "bf16"),
    (facts(dtype="uint8", quant="FP8_PER_TENSOR"), "cuda", "BLNHC", "kv_interleaved", 4, 128, "fp8_e4m3"),
    (facts(num_head_slots=2, state_content_bytes=4 * 64 * 2), "rocm", "LHBNC", "kv_planes", 2, 256, "bf16"),
    (facts(kind="MLAAttentionSpec", num_kv_heads=1, head_size=576, head_size_v=0), "cuda", "LBHNC", "latent",
     1, 576, "bf16"),
    (facts(kind="MLAAttentionSpec", num_kv_heads=1, head_size=576, head_size_v=0, dtype="uint8",
           quant="FP8_PER_TENSOR", cache_dtype_str="fp8"), "rocm", "LBHNC", "latent", 1, 576, "fp8_e4m3"),
])
def test_classify(spec, platform, layout, packing, heads, content, dtype):
    cache_dtype = "fp8" if spec.dtype == "uint8" else "auto"
    g = kl.classify(spec, layout=layout, cache_dtype=cache_dtype, platform=platform)
    assert (g.packing, g.heads, g.content, g.dtype) == (packing, heads, content, dtype)
    assert g.tag() in kl.compat_suffix(g) and layout in g.tag() and dtype in g.tag()
    assert g.channels == (1 if packing == "latent" else 2)


@pytest.mark.parametrize("spec,layout,platform,says", [
    (facts(kind="SlidingWindowSpec"), "LBHNC", "cuda", "SlidingWindowSpec"),
    (facts(kind="MambaSpec"), "LBHNC", "cuda", "MambaSpec"),
    (facts(quant="NVFP4", num_head_slots=8, state_content_bytes=36), "LBHNC", "cuda", "packed"),
    (facts(quant="FP8_PER_TOKEN_HEAD", state_content_bytes=136), "LBHNC", "cuda", "packed"),
    (facts(kind="MLAAttentionSpec", num_kv_heads=1, head_size=576, head_size_v=0, dtype="uint8",
           cache_dtype_str="fp8_ds_mla", state_content_bytes=656), "LBHNC", "cuda", "fp8_ds_mla"),
    (facts(head_size_v=32), "LBHNC", "cuda", "different head sizes"),
    (facts(), "LBNHC", "cpu", "head-major"),
    (facts(), "XYZ", "cuda", "unknown KV cache layout"),
    (facts(page_size_padded=1 << 20), "LBHNC", "cuda", "padded"),
    (facts(dtype="int8"), "LBHNC", "cuda", "int8"),
])
def test_refused_with_what_it_is(spec, layout, platform, says):
    with pytest.raises(kl.UnsupportedKvLayout, match=says):
        kl.classify(spec, layout=layout, cache_dtype="auto", platform=platform)


def test_tags_differ_by_layout_dtype_platform_and_packing():
    tags = {kl.classify(s, layout=lay, cache_dtype=cd, platform=p).tag()
            for s, cd in ((facts(), "auto"), (facts(dtype="float16"), "auto"),
                          (facts(dtype="uint8", quant="FP8_PER_TENSOR"), "fp8_e4m3"),
                          (facts(dtype="uint8", quant="FP8_PER_TENSOR"), "fp8_e5m2"))
            for lay in kl.LAYOUTS for p in ("cuda", "rocm")}
    assert len(tags) == 4 * len(kl.LAYOUTS) * 2


def test_hybrid_models_are_refused_naming_each_group():
    group = lambda kind, n: SimpleNamespace(kv_cache_spec=type(kind, (), {})(), layer_names=[f"l{i}" for i in range(n)])
    groups = [group("FullAttentionSpec", 6), group("SlidingWindowSpec", 18)]
    with pytest.raises(kl.UnsupportedKvLayout, match=r"2 KV-cache groups \(group 0: FullAttentionSpec x6 layers, "
                                                     r"group 1: SlidingWindowSpec x18 layers\)"):
        kl.select_group(groups)
    assert kl.select_group(groups, transfer_group_ids=[1]) == 1  # the other group is not transferable


# --- round trips under the vLLM venv -------------------------------------------------------------------

ROUND_TRIPS = r'''
import os, subprocess, sys, tempfile, time
from math import prod
from types import SimpleNamespace
import torch
from vllm._aiter_ops import rocm_aiter_ops
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor, KVQuantMode, MLAAttentionSpec,
                                        compute_layer_kv_cache_shape_bytes, compute_layout_strides,
                                        create_kv_cache_views)
from vllm.v1.kv_cache_layout import KVCacheLayout
from infera.engine.vllm import kv_layouts as kl, kvd_connector as k, kvd_format as fmt
from infera.engine.vllm.kv_staging import CpuDevice
from infera.kvd.client import SyncKvdClient

# (backend module, class, platform, MLA?, AITER shuffle?, the packing the table expects)
BACKENDS = [
    ("flash_attn", "FlashAttentionBackend", "cuda", False, False, "kv_interleaved"),
    ("triton_attn", "TritonAttentionBackend", "cuda", False, False, "kv_interleaved"),
    ("rocm_aiter_fa", "AiterFlashAttentionBackend", "rocm", False, False, "kv_interleaved"),
    ("rocm_aiter_fa", "AiterFlashAttentionBackend", "rocm", False, True, "kv_planes"),
    ("rocm_attn", "RocmAttentionBackend", "rocm", False, False, "kv_planes"),
    ("rocm_aiter_unified_attn", "RocmAiterUnifiedAttentionBackend", "rocm", False, False, "kv_interleaved"),
    ("cpu_attn", "CPUAttentionBackend", "cpu", False, False, "kv_rows"),
    ("mla.triton_mla", "TritonMLABackend", "cuda", True, False, "latent"),
    ("mla.flashmla", "FlashMLABackend", "cuda", True, False, "latent"),
    ("mla.rocm_aiter_mla", "AiterMLABackend", "rocm", True, False, "latent"),
    ("mla.cpu_mla", "CPUMLABackend", "cpu", True, False, "latent"),
]
# FlashInfer is not importable here (no flashinfer wheel). From flashinfer.py: customize_spec
# leaves every non-NVFP4 spec as it is, and supported_kv_cache_layouts is None (any layout) but
# (LBHNC, BLHNC) on SM100: the FlashAttention rows (kv_interleaved, all six orders) cover it.
DTYPES = [("auto", torch.bfloat16, KVQuantMode.NONE), ("fp8_e4m3", torch.uint8, KVQuantMode.FP8_PER_TENSOR),
          ("fp8_e5m2", torch.uint8, KVQuantMode.FP8_PER_TENSOR)]
BLOCK, NUM_BLOCKS, NAMES = 16, 6, ("model.layers.0.attn", "model.layers.1.attn")

sock = os.path.join(tempfile.mkdtemp(), "kvd.sock")
daemon = subprocess.Popen([sys.executable, "-m", "infera.kvd", "--socket", sock, "--max-bytes", "256M",
                           "--log-level", "WARNING"], env={**os.environ, "INFERA_KVD_STORAGE_SELFCHECK": "0"})
deadline = time.monotonic() + 30
while True:
    try:
        SyncKvdClient(sock, timeout=2).close(); break
    except OSError:
        assert daemon.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)

def caches(spec, layout, kernel=None, fill=None):
    """The layers' views exactly as vLLM allocates them (create_kv_cache_views), over one buffer."""
    shape = compute_layer_kv_cache_shape_bytes(spec, NUM_BLOCKS)
    strides = compute_layout_strides(spec, NUM_BLOCKS, len(NAMES), layout)
    size = len(NAMES) * prod(shape)
    raw = torch.zeros(size, dtype=torch.int8)
    if fill is not None:
        raw.copy_(torch.randint(-128, 128, (size,), dtype=torch.int8, generator=torch.Generator().manual_seed(fill)))
    views = create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, KVCacheTensor(size, list(NAMES), strides[0],
                                                                               strides[1]), kernel)
    return dict(zip(NAMES, views)), raw

def page_bytes(kv, block, kernel_ratio):
    return kv[block * kernel_ratio:(block + 1) * kernel_ratio].contiguous().view(torch.uint8)

def worker(g, cache_dtype, scales=1.0, staged=False):
    s = k._Settings(socket=sock, model="m", block_size=BLOCK, pages_per_chunk=4, group_id=0, layer_names=NAMES,
                    usable=True, tp_size=1, pp_size=1, collapse_tp=False, fingerprint=None,
                    default_retention="short", geometry=g, num_blocks=NUM_BLOCKS)
    ctx = {n: SimpleNamespace(_k_scale_float=scales, _v_scale_float=scales) for n in NAMES}
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, rank=0),
                          cache_config=SimpleNamespace(cache_dtype=cache_dtype),
                          compilation_config=SimpleNamespace(static_forward_context=ctx))
    return k._WorkerSide(s, cfg)

import atexit, importlib
atexit.register(daemon.kill)  # a failed assertion must not leave the daemon holding the test's pipes
cases, saved = 0, []
for module, cls_name, platform, mla, shuffle, packing in BACKENDS:
    backend = getattr(importlib.import_module(f"vllm.v1.attention.backends.{module}"), cls_name)
    # AITER's shuffle switch answers only where AITER runs: set its answer, as a ROCm host would give it
    rocm_aiter_ops.is_shuffle_kv_cache_enabled = staticmethod(lambda shuffle=shuffle: shuffle)
    layouts = backend.supported_kv_cache_layouts() or tuple(KVCacheLayout)
    for cache_dtype, dtype, quant in DTYPES:
        if mla:
            spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=96, dtype=dtype, kv_quant_mode=quant,
                                    cache_dtype_str=None if cache_dtype == "auto" else "fp8")
        else:
            spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=32, dtype=dtype, kv_quant_mode=quant)
        spec = backend.customize_spec(spec)
        for layout in layouts:
            g = kl.classify(kl.spec_facts(spec), layout=layout.name, cache_dtype=cache_dtype, platform=platform)
            assert g.packing == packing, (cls_name, layout, g)
            # vLLM splits an engine block into kernel blocks only where blocks are dense pages (L, B outermost)
            kernels = [None, BLOCK // 2] if layout.stride_order[:2] == (0, 1) else [None]
            for kernel in kernels:
                ratio = BLOCK // (kernel or BLOCK)
                for staged in (False, True):
                    cases += 1
                    src, _ = caches(spec, layout, kernel, fill=cases)
                    w = worker(g, cache_dtype)
                    w.register(src)
                    if staged:
                        w.use_device(CpuDevice(staged=True))
                    key = fmt.chunk_key([cases.to_bytes(4, "little") * 8])
                    w.save([k.ChunkSave("r", key, [5, 2, 0], "short")])
                    assert w.saver.idle(10) and w.saver.saved == 1, (cls_name, layout, w.saver.rejected)
                    dst, dst_raw = caches(spec, layout, kernel)
                    r = worker(g, cache_dtype)
                    r.register(dst)
                    if staged:
                        r.use_device(CpuDevice(staged=True))
                    # pages 1..2 of the chunk into blocks 4 and 1 of a zeroed cache
                    r.load([k.RequestLoad("r", [k.ChunkLoad(key, 0, 3, 1, 3, [4, 1])])])
                    r.wait_for_layer(NAMES[0]); r._finish_loads()
                    assert r.take_invalid() == set(), (cls_name, layout, cache_dtype)
                    for n in NAMES:
                        assert torch.equal(page_bytes(dst[n], 4, ratio), page_bytes(src[n], 2, ratio)), (cls_name, layout, n)
                        assert torch.equal(page_bytes(dst[n], 1, ratio), page_bytes(src[n], 0, ratio)), (cls_name, layout, n)
                        for b in (0, 2, 3, 5):
                            assert not page_bytes(dst[n], b, ratio).any(), (cls_name, layout, n, b)
                    if staged:
                        assert w.host_pool.in_use_bytes == 0 and r.host_pool.in_use_bytes == 0
                        assert r.device_pool.in_use_bytes == 0
                    if cache_dtype != "auto" and not staged:  # other fp8 scales: the header refuses the chunk
                        other = worker(g, cache_dtype, scales=0.5)
                        other.register(caches(spec, layout, kernel)[0])
                        other.load([k.RequestLoad("r", [k.ChunkLoad(key, 0, 3, 0, 3, [1, 2, 3])])])
                        assert other.take_invalid() == {1, 2, 3}
                        other.close()
                    saved.append((key, r.compat_key))
                    w.close(); r.close()

# the compat key keeps every other layout, dtype and packing from finding a chunk
with SyncKvdClient(sock) as c:
    compats = sorted({ck for _, ck in saved})
    for key, ck in saved[::7]:
        for other in compats:
            assert c.exists([key], model="m", compat_key=other) == [other == ck], (ck, other)

# start-up refuses other shapes, naming them
g = kl.classify(kl.spec_facts(FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=32, dtype=torch.bfloat16)),
                layout="LBNHC", cache_dtype="auto", platform="cuda")
for bad in (torch.zeros(2, NUM_BLOCKS, BLOCK, 4, 32, dtype=torch.bfloat16),   # vLLM <= 0.11 FlashAttention
            torch.zeros(NUM_BLOCKS, 4, BLOCK, 32, dtype=torch.bfloat16),      # K without V
            torch.zeros(NUM_BLOCKS, 4, BLOCK, 64, dtype=torch.float16)):      # another dtype
    w = worker(g, "auto")
    try:
        w.register({n: bad for n in NAMES})
        raise AssertionError(f"accepted {tuple(bad.shape)}")
    except kl.UnsupportedKvLayout as e:
        assert str(tuple(bad.shape)) in str(e), e
    w.close()
# both sides' settings from vLLM's own config objects: the tag in the compat key; hybrid refused
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
dense = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=32, dtype=torch.bfloat16)
vcfg = SimpleNamespace(model_config=SimpleNamespace(served_model_name=["m"], model="m", max_model_len=4096, use_mla=False),
                       cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto", kv_cache_layout=None),
                       parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1))
kcc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(NAMES), dense)],
                    kv_cache_layout="LBHNC")
st = k._settings(vcfg, kcc)
assert st.compat_key(1, 0) == "tp1of2_pp0of1_kcpu.kv_rows.LBHNC.h4c64.bf16.NONE", st.compat_key(1, 0)
assert st.num_blocks == NUM_BLOCKS and st.layer_names == NAMES
kcc.kv_cache_layout = "LBNHC"  # the CPU backend reads head-major blocks only
try:
    k._settings(vcfg, kcc); raise AssertionError("accepted LBNHC on the CPU")
except kl.UnsupportedKvLayout as e:
    assert "head-major" in str(e), e
window = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=4, head_size=32, dtype=torch.bfloat16, sliding_window=64)
hybrid = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_layout="LBHNC",
                       kv_cache_groups=[KVCacheGroupSpec(["a"], dense), KVCacheGroupSpec(["b", "c"], window)])
try:
    k._settings(vcfg, hybrid); raise AssertionError("accepted a hybrid model")
except kl.UnsupportedKvLayout as e:
    assert "group 0: FullAttentionSpec x1 layers, group 1: SlidingWindowSpec x2 layers" in str(e), e

# pinned staging is pooled and bounded: reused by size, other sizes released to make room
from infera.engine.vllm.kv_staging import BufferPool
pool = BufferPool(lambda n: torch.empty(n, dtype=torch.uint8), 100)
a, b = pool.take(40), pool.take(40)
assert pool.take(40) is None  # 120 bytes would pass the bound: the caller drops the save
pool.give(a)
assert pool.take(40) is a and pool.allocated == 2
pool.give(a); pool.give(b)
d = pool.take(60)
assert d is not None and d.numel() == 60 and pool.in_use_bytes == 60 and pool.allocated == 3
daemon.terminate(); daemon.wait(30)
print("OK", cases, len(compats))
'''


def test_round_trip_every_backend_layout_and_dtype():
    done = run_engine_python(ROUND_TRIPS, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1].startswith("OK"), \
        done.stdout[-3000:] + done.stderr[-6000:]
    _, cases, compats = done.stdout.strip().splitlines()[-1].split()
    assert int(cases) >= 100 and int(compats) >= 20


def test_gpu_check_script_smoke_runs_on_cpu_without_vllm(tmp_path):
    """bench/gpu_kvd_check.py (the GPU-host check, where vLLM is not installed) in its CPU smoke
    mode: every layout round-trips, direct and staged, with vLLM's import blocked."""
    out = tmp_path / "check.json"
    code = ("import sys, runpy; sys.modules['vllm'] = None\n"
            f"sys.argv = ['gpu_kvd_check.py', '--device', 'cpu', '--quick', '--out', {str(out)!r}]\n"
            "runpy.run_path('bench/gpu_kvd_check.py', run_name='__main__')\n")
    done = run_engine_python(code, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    import json
    result = json.loads(out.read_text())
    assert len(result["round_trips"]) == 40 and all(r["bit_identical"] for r in result["round_trips"])
    assert result["save_gbps"] > 0 and result["load_gbps"] > 0 and "step_with_save_ms" in result
