"""kvd under SGLang's HiCache host pools in every page layout the generic storage path serves
(issue 33 item 3), checked against the SGLang 0.5.23 wheel's own code.

SGLang's pool modules import its CUDA kernels, so they cannot load here; their layout code can. The
script compiles the wheel's own ``init_kv_buffer``, ``get_data_page``, ``get_dummy_flat_data_page``
and ``set_from_flat_data_page`` (``mem_cache/pool_host/mha.py``, ``mla.py``: the methods that
decide which bytes make a page) onto a host pool of plain CPU tensors, then drives
``InferaKvdBackend`` as SGLang's cache controller does (``batch_set`` of ``get_data_page``,
``batch_get`` into dummy flat pages, ``set_from_flat_data_page``) against a real kvd:

* MHA: ``layer_first``, ``page_first``, ``page_first_direct`` (the direct I/O variant) and
  ``page_head``; MLA: ``layer_first``, ``page_first``, ``page_first_direct``; bf16 and fp8 bytes;
* every page comes back bit-identical into other slots of a zeroed pool, nothing else written;
* a flat page's byte order differs per layout, so the compat key names the layout: a pool in
  another layout (or dtype, or page size) finds none of them.

Runs under the vLLM venv with the unpacked wheel (``tests/real_engines.py``; a skip without, a
failure under ``INFERA_E2E_REQUIRED=1``).
"""
from __future__ import annotations

from tests.real_engines import run_engine_python

SCRIPT = r'''
import ast, hashlib, os, subprocess, sys, tempfile, textwrap, time
from types import SimpleNamespace
import torch
from infera.engine.sglang.kvd_adapter import InferaKvdBackend
from infera.kvd.client import SyncKvdClient

POOLS = os.path.join(os.environ["INFERA_TEST_SGLANG_DIR"], "sglang", "srt", "mem_cache", "pool_host")
METHODS = ("init_kv_buffer", "get_data_page", "get_dummy_flat_data_page", "set_from_flat_data_page",
           "_storage_page_index")


def wheel_methods(filename, class_name):
    """The wheel's own layout methods of ``class_name``, compiled on their own."""
    tree = ast.parse(open(os.path.join(POOLS, filename)).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    found = {}
    alloc = {"cpu": lambda dims, dtype, device, pin_memory, allocator, registration_granularity_bytes:
             torch.zeros(dims, dtype=dtype, device=device)}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name in METHODS:
            scope = {"torch": torch, "ALLOC_MEMORY_FUNCS": alloc}
            exec(compile(ast.Module([node], []), f"{filename}:{class_name}.{node.name}", "exec"), scope)
            found[node.name] = scope[node.name]
    return found


MHA = wheel_methods("mha.py", "MHATokenToKVPoolHost")
MLA = wheel_methods("mla.py", "MLATokenToKVPoolHost")
assert set(MHA) >= set(METHODS) - {"_storage_page_index"} and set(MLA) == set(METHODS), (set(MHA), set(MLA))


class Pool:
    """A host pool with the wheel's layout methods (the attributes they read, as SGLang sets them)."""

    def __init__(self, mla, layout, dtype, page_size=4, pages=6, layers=3, heads=2, head_dim=16, latent=40):
        methods = MLA if mla else MHA
        for name, fn in methods.items():
            setattr(self, name, fn.__get__(self))
        self.layout, self.dtype, self.page_size, self.layer_num = layout, dtype, page_size, layers
        self.size, self.page_num = pages * page_size, pages
        self.head_num, self.head_dim, self.kv_cache_dim = heads, head_dim, latent
        self.device, self.pin_memory, self.allocator = "cpu", False, None
        self._transfer_device = torch.device("cpu")
        self.dcp_size = 1
        self.kv_buffer = self.init_kv_buffer()


sock = os.path.join(tempfile.mkdtemp(), "kvd.sock")
daemon = subprocess.Popen([sys.executable, "-m", "infera.kvd", "--socket", sock, "--max-bytes", "64M",
                           "--log-level", "WARNING"], env={**os.environ, "INFERA_KVD_STORAGE_SELFCHECK": "0"})
import atexit
atexit.register(daemon.kill)
deadline = time.monotonic() + 30
while True:
    try:
        SyncKvdClient(sock, timeout=2).close(); break
    except OSError:
        assert daemon.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
os.environ["INFERA_KVD_SOCKET"] = sock


def attach(pool, mla):
    config = SimpleNamespace(tp_rank=0, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                             is_mla_model=mla, enable_storage_metrics=False,
                             is_page_first_layout=pool.layout != "layer_first", model_name="m", tp_lcm_size=None,
                             should_split_heads=False, dp_rank=0, extra_config={}, dcp_size=1, dcp_rank=0,
                             logical_page_size=None)
    backend = InferaKvdBackend(config, {})
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    return backend


def hashes(tag, n):
    out, prior = [], tag.encode()
    for i in range(n):
        prior = hashlib.sha256(prior + bytes([i])).digest()
        out.append(prior.hex())
    return out


CASES = [(False, layout) for layout in ("layer_first", "page_first", "page_first_direct", "page_head")]
CASES += [(True, layout) for layout in ("layer_first", "page_first", "page_first_direct")]
saved = []
for mla, layout in CASES:
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        src = Pool(mla, layout, dtype)
        src.kv_buffer.view(torch.uint8).copy_(torch.randint(0, 256, src.kv_buffer.view(torch.uint8).shape,
                                                            dtype=torch.uint8))
        writer = attach(src, mla)
        keys = hashes(f"{mla}{layout}{dtype}", 3)
        pages = [src.get_data_page(p * src.page_size) for p in (0, 2, 4)]  # as the cache controller backs up
        assert writer.batch_set(keys, pages) is True
        dst = Pool(mla, layout, dtype)
        reader = attach(dst, mla)
        assert reader.batch_exists(keys, None) == 3
        got = reader.batch_get(keys, [dst.get_dummy_flat_data_page() for _ in keys])
        assert all(page is not None for page in got), (layout, dtype)
        for page, slot in zip(got, (1, 3, 5)):
            dst.set_from_flat_data_page(slot * dst.page_size, page)
        for s, d in ((0, 1), (2, 3), (4, 5)):
            a = src.get_data_page(s * src.page_size).view(torch.uint8)
            b = dst.get_data_page(d * dst.page_size).view(torch.uint8)
            assert torch.equal(a, b), (mla, layout, dtype, s)
        for d in (0, 2, 4):
            assert not dst.get_data_page(d * dst.page_size).view(torch.uint8).any(), (mla, layout, dtype, d)
        saved.append((mla, layout, dtype, keys[0], writer.compat_key))
        writer.close(); reader.close()

# the compat key names layout, dtype and page size: no pool of another kind finds these pages
compats = {c for *_, c in saved}
assert len(compats) == len(saved), sorted(compats)
for mla, layout, dtype, key, compat in saved:
    for other_mla, other_layout in CASES:
        for other_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            for page_size in (4, 8):
                same = (other_mla, other_layout, other_dtype, page_size) == (mla, layout, dtype, 4)
                probe = attach(Pool(other_mla, other_layout, other_dtype, page_size=page_size), other_mla)
                assert probe.batch_exists([key], None) == int(same), (layout, other_layout, dtype, other_dtype)
                probe.close()
daemon.terminate(); daemon.wait(30)
print("OK", len(saved), sorted(compats)[0])
'''


def test_every_generic_host_layout_round_trips_and_stays_apart():
    done = run_engine_python(SCRIPT, sglang=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1].startswith("OK"), \
        done.stdout[-3000:] + done.stderr[-5000:]
    assert done.stdout.strip().splitlines()[-1].split()[1] == "14"
