"""``InferaKvdBackend`` driven as SGLang 0.5.23's HiCache drives a ``dynamic`` storage backend
(``managers/cache_controller.py``: ``_generic_page_set`` / ``_generic_page_get`` /
``_storage_hit_query``), against a real ``python -m infera.kvd``. Most tests run in this venv,
which has neither SGLang nor torch: the host pool's pages are ``array('H')`` buffers (2-byte items,
like bf16), which the backend reads through the buffer protocol exactly as it reads a CPU tensor's
uint8 view. The last ones run SGLang's own HiCacheStorage / StorageBackendFactory on torch pages in
the vLLM venv, with the SGLang wheel that ``make setup-sglang`` unpacks (tests/real_engines.py)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from array import array
from dataclasses import dataclass, field
from typing import List, Optional

import pytest

from infera.engine.sglang import kvd_adapter
from infera.engine.sglang.kvd_adapter import InferaKvdBackend, kvd_key
from infera.kvd import resilient
from infera.kvd.client import SyncKvdClient
from tests.integration.test_kvd_daemon import KvdProcess, connectable

pytestmark = pytest.mark.integration

MODEL = "Qwen-Qwen3-0.6B"
PAGE_TOKENS = 4
ITEMS_PER_PAGE = 96  # 192 bytes a page


@dataclass
class StorageConfig:
    """The fields of SGLang 0.5.23's ``HiCacheStorageConfig`` (``mem_cache/hicache_storage.py``)."""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = False
    is_page_first_layout: bool = True
    model_name: Optional[str] = MODEL
    tp_lcm_size: Optional[int] = None
    should_split_heads: bool = False
    dp_rank: int = 0
    extra_config: Optional[dict] = field(default_factory=lambda: {
        "backend_name": "infera-kvd", "module_path": "infera.engine.sglang.kvd_adapter",
        "class_name": "InferaKvdBackend"})  # prefetch_threshold is popped by SGLang before this
    dcp_size: int = 1
    dcp_rank: int = 0
    logical_page_size: Optional[int] = None


@dataclass
class ExtraInfo:
    """SGLang's ``HiCacheStorageExtraInfo``."""
    prefix_keys: Optional[List[str]] = None
    extra_info: Optional[dict] = None


class HostPool:
    """The parts of SGLang's ``HostKVCache`` the generic page path touches: ``page_size``,
    ``layout``, ``dtype``, ``get_data_page``, ``get_dummy_flat_data_page``,
    ``set_from_flat_data_page`` (indices are token slots, a page every ``page_size``)."""

    layout = "page_first"
    dtype = "torch.bfloat16"

    def __init__(self, pages: int, page_size: int = PAGE_TOKENS, items: int = ITEMS_PER_PAGE):
        self.page_size = page_size
        self.items = items
        self.pages = [array("H", bytes(2 * items)) for _ in range(pages)]

    def fill(self, page: int, seed: int) -> None:
        self.pages[page] = array("H", [(seed * 131 + i) & 0xFFFF for i in range(self.items)])

    def get_data_page(self, index, flat=True):
        return self.pages[int(index) // self.page_size]

    def get_dummy_flat_data_page(self):
        return array("H", bytes(2 * self.items))

    def set_from_flat_data_page(self, index, data_page):
        self.pages[int(index) // self.page_size] = array("H", data_page)


def page_hashes(n: int, salt: str = "") -> list[str]:
    """Chained sha256 hex strings, the shape of SGLang's ``get_hash_str`` page keys."""
    out, prior = [], salt.encode()
    for i in range(n):
        prior = hashlib.sha256(prior + i.to_bytes(4, "little")).digest()
        out.append(prior.hex())
    return out


# -- the calls SGLang makes, as it makes them ---------------------------------------------------------

def generic_page_set(backend, host: HostPool, hashes: list[str], host_indices: list[int]) -> bool:
    data = [host.get_data_page(host_indices[i * host.page_size]) for i in range(len(hashes))]
    return backend.batch_set(hashes, data)


def generic_page_get(backend, host: HostPool, hashes: list[str], host_indices: list[int]) -> int:
    dummy = [host.get_dummy_flat_data_page() for _ in hashes]
    page_data = backend.batch_get(hashes, dummy)
    if page_data is None:
        return 0
    count = 0
    for i in range(len(hashes)):
        if page_data[i] is None:
            break
        host.set_from_flat_data_page(host_indices[i * host.page_size], page_data[i])
        count += 1
    return count


def attach(config: StorageConfig, host: HostPool) -> InferaKvdBackend:
    """``StorageBackendFactory._create_dynamic_backend`` + ``attach_storage_backend``."""
    backend = InferaKvdBackend(config, {})
    backend.register_mem_pool_host(host)
    backend.on_host_pools_registered()
    return backend


def slots(pages: range) -> list[int]:
    return [p * PAGE_TOKENS + t for p in pages for t in range(PAGE_TOKENS)]


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def start_daemon(arena: bool, workdir: str | None = None) -> KvdProcess:
    extra = ["--shared-arena-bytes", "256K", "--no-shared-arena-pin"] if arena else ["--shared-arena-bytes", "0"]
    d = KvdProcess("--max-bytes", "1M", *extra, workdir=workdir).start()
    wait_until(lambda: d.proc.poll() is not None or connectable(d.socket), 20, "kvd to listen")
    assert d.proc.poll() is None, d.output()
    return d


@pytest.fixture(params=["arena", "socket"])
def kvd(request, monkeypatch):
    monkeypatch.delenv("INFERA_KVD_RETENTION_DEFAULT", raising=False)
    d = start_daemon(request.param == "arena")
    d.arena = request.param == "arena"
    monkeypatch.setenv("INFERA_KVD_SOCKET", d.socket)
    yield d
    d.stop()
    shutil.rmtree(d.dir, ignore_errors=True)


def test_backup_then_prefetch_round_trips(kvd):
    writer_host = HostPool(8)
    for p in range(8):
        writer_host.fill(p, seed=p + 1)
    writer = attach(StorageConfig(), writer_host)
    assert (writer.daemon.client.arena is not None) is kvd.arena  # pages go through the shared arena when offered
    hashes = page_hashes(6)
    assert writer.batch_exists(hashes, ExtraInfo()) == 0
    assert generic_page_set(writer, writer_host, hashes, slots(range(6))) is True

    # Another engine on the host (same model, same rank geometry) prefetches them into other slots.
    reader_host = HostPool(8)
    reader = attach(StorageConfig(), reader_host)
    assert reader.batch_exists(hashes, ExtraInfo(prefix_keys=None)) == 6
    assert generic_page_get(reader, reader_host, hashes, slots(range(2, 8))) == 6
    assert [reader_host.pages[p + 2] for p in range(6)] == writer_host.pages[:6]
    assert reader.exists(hashes[0]) and not reader.exists(page_hashes(1, salt="other")[0])
    writer.close()
    reader.close()


def test_a_gap_ends_the_prefix(kvd):
    host = HostPool(4)
    for p in range(4):
        host.fill(p, seed=10 + p)
    backend = attach(StorageConfig(), host)
    hashes = page_hashes(4)
    assert backend.batch_set([hashes[0], hashes[1], hashes[3]], [host.pages[0], host.pages[1], host.pages[3]])
    assert backend.batch_exists(hashes, ExtraInfo()) == 2
    got = backend.batch_get(hashes, [host.get_dummy_flat_data_page() for _ in hashes])
    assert got[0] == host.pages[0] and got[1] == host.pages[1] and got[2:] == [None, None]
    backend.close()


def test_single_page_calls(kvd):
    host = HostPool(2)
    host.fill(0, seed=7)
    backend = attach(StorageConfig(), host)
    key = page_hashes(1)[0]
    assert backend.get(key, host.get_dummy_flat_data_page()) is None
    assert backend.set(key, host.get_data_page(0)) is True
    target = host.get_dummy_flat_data_page()
    assert backend.get(key, target) is target and target == host.pages[0]
    assert backend.get(key) == host.pages[0].tobytes()  # no target: the raw value
    # A page of another size (another layout) is a miss, never a partial load.
    assert backend.get(key, array("H", bytes(2 * (ITEMS_PER_PAGE + 8)))) is None
    assert backend.get(key, array("H", bytes(2 * (ITEMS_PER_PAGE - 8)))) is None
    backend.close()


def test_namespaces_keys_and_retention(kvd, monkeypatch):
    monkeypatch.setenv("INFERA_KVD_RETENTION_DEFAULT", "long")
    host = HostPool(1)
    host.fill(0, seed=3)
    rank0 = attach(StorageConfig(tp_rank=0, tp_size=2), host)
    assert rank0.compat_key == "sglang_page_first_p4_bfloat16_tp0of2_pp0of1"
    key = page_hashes(1)[0]
    assert rank0.batch_set([key], [host.pages[0]])
    rank1 = attach(StorageConfig(tp_rank=1, tp_size=2), host)
    assert rank1.batch_exists([key]) == 0  # another TP shard's bytes are not this rank's
    other_model = attach(StorageConfig(model_name="other"), host)
    assert other_model.batch_exists([key]) == 0
    # The kvd entry: the page hash's raw bytes, the model, the rank's compat key, the retention.
    with SyncKvdClient(kvd.socket) as client:
        value, retention = client.get_with_retention(bytes.fromhex(key), model=MODEL, compat_key=rank0.compat_key)
    assert value == host.pages[0].tobytes() and retention == "long"
    # MLA KV is the same on every TP rank: one shared namespace.
    mla = [attach(StorageConfig(tp_rank=r, tp_size=4, is_mla_model=True), host) for r in (0, 3)]
    assert mla[0].compat_key == mla[1].compat_key == "sglang_page_first_p4_bfloat16_tp0of1_pp0of1"
    for b in (rank0, rank1, other_model, *mla):
        b.close()


def test_retention_none_saves_nothing(kvd, monkeypatch):
    monkeypatch.setenv("INFERA_KVD_RETENTION_DEFAULT", "none")
    host = HostPool(1)
    backend = attach(StorageConfig(), host)
    key = page_hashes(1)[0]
    assert backend.batch_set([key], [host.pages[0]]) is False
    assert backend.batch_exists([key]) == 0
    backend.close()


def test_clear_drops_this_ranks_pages(kvd):
    host = HostPool(2)
    backend = attach(StorageConfig(), host)
    hashes = page_hashes(2)
    assert backend.batch_set(hashes, host.pages)
    assert backend.clear() is True
    assert backend.batch_exists(hashes) == 0
    backend.close()


def test_kvd_key_mapping():
    h = page_hashes(1)[0]
    assert kvd_key(h) == bytes.fromhex(h) and len(kvd_key(h)) == 32  # what a router prewarm sends
    assert kvd_key("abc.mamba") == b"abc.mamba"
    assert kvd_key("x" * 65) == hashlib.sha256(b"x" * 65).digest()


def test_unreachable_daemon_at_construction_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERA_KVD_SOCKET", str(tmp_path / "nobody.sock"))
    with pytest.raises(RuntimeError, match="does not answer"):
        InferaKvdBackend(StorageConfig(), {})


def test_a_bad_retention_env_fails_the_attach(kvd, monkeypatch):
    monkeypatch.setenv("INFERA_KVD_RETENTION_DEFAULT", "forever")
    with pytest.raises(ValueError, match="INFERA_KVD_RETENTION_DEFAULT"):
        InferaKvdBackend(StorageConfig(), {})


def test_hybrid_sidecar_pools_are_refused(kvd):
    backend = InferaKvdBackend(StorageConfig(), {})
    backend.register_mem_pool_host(HostPool(1))
    backend.register_mem_host_pool_v2(HostPool(1), "kv")
    backend.register_mem_host_pool_v2(HostPool(1), "mamba")
    with pytest.raises(RuntimeError, match="mamba"):
        backend.on_host_pools_registered()
    backend.close()


def test_a_daemon_that_dies_turns_calls_into_misses(kvd, monkeypatch, caplog):
    monkeypatch.setattr(resilient, "RECONNECT_EVERY_S", 0.2)
    host = HostPool(3)
    for p in range(3):
        host.fill(p, seed=p)
    backend = attach(StorageConfig(), host)
    hashes = page_hashes(3)
    assert backend.batch_set(hashes, host.pages)
    kvd.kill()
    caplog.set_level(logging.WARNING, logger="infera.engine.sglang.kvd_adapter")
    caplog.set_level(logging.WARNING, logger="infera.kvd.resilient")  # the connection's outage lines
    for _ in range(3):  # every call a miss, none raises
        assert backend.batch_exists(hashes, ExtraInfo()) == 0
        assert backend.batch_get(hashes, [host.get_dummy_flat_data_page() for _ in hashes]) == [None] * 3
        assert backend.get(hashes[0], host.get_dummy_flat_data_page()) is None
        assert backend.exists(hashes[0]) is False
        assert backend.batch_set(hashes, host.pages) is False
        assert backend.set(hashes[0], host.pages[0]) is False
        assert backend.clear() is False
        time.sleep(0.25)  # past the reconnect interval: the next round tries the socket again
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "HiCache storage misses" in errors[0].getMessage()

    # The daemon comes back (empty: L2 is memory) on the same socket: storage resumes.
    revived = start_daemon(arena=False, workdir=kvd.dir)
    try:
        wait_until(lambda: backend.batch_set(hashes[:1], host.pages[:1]), 10, "writes to resume")
        assert backend.batch_exists(hashes) == 1
        assert any("reachable again" in r.getMessage() for r in caplog.records)
    finally:
        backend.close()
        revived.stop()


# -- SGLang's own code: its HiCacheStorage base, StorageBackendFactory and torch pages ---------------
# Run under the vLLM venv's interpreter (it has torch) with SGLang 0.5.23's wheel unpacked beside it
# (make setup-sglang): tests/real_engines.py.

REAL_SGLANG_ATTACH = r'''
import json, torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from infera.engine.sglang.adapter import KVD_BACKEND_CONFIG
from infera.engine.sglang.kvd_adapter import InferaKvdBackend
assert issubclass(InferaKvdBackend, HiCacheStorage)  # the real base, not the fallback


def attach(model="m"):
    """As SGLang does it: parse the extra config, build through the factory, register the host pool."""
    extra = json.loads(json.dumps(KVD_BACKEND_CONFIG))
    extra.pop("prefetch_threshold")  # popped by parse_storage_backend_extra_config before the factory
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                  model_name=model, extra_config=extra)
    backend = StorageBackendFactory.create_backend("dynamic", config, None)
    assert type(backend) is InferaKvdBackend
    backend.register_mem_pool_host(type("Host", (), dict(layout="page_first", page_size=4, dtype=torch.bfloat16))())
    backend.on_host_pools_registered()
    return backend
'''

REAL_SGLANG_ROUND_TRIP = REAL_SGLANG_ATTACH + r'''
backend = attach()
assert (backend.daemon.client.arena is not None) is ARENA
page = torch.randn(64, dtype=torch.bfloat16)
key = page_hashes(1)[0]
assert backend.batch_exists([key], HiCacheStorageExtraInfo()) == 0
assert backend.batch_set([key], [page]) is True
assert backend.batch_exists([key], HiCacheStorageExtraInfo()) == 1
target = torch.zeros(64, dtype=torch.bfloat16)
out = backend.batch_get([key], [target])
assert out[0] is target and torch.equal(out[0], page)
assert attach(model="other").batch_exists([key], HiCacheStorageExtraInfo()) == 0  # another model's namespace
backend.close()
print("OK")
'''

REAL_SGLANG_TORCH_PAGES = REAL_SGLANG_ATTACH + r'''
layers, item = 3, 16
src = torch.randn((4, layers, item), dtype=torch.bfloat16)  # a page_first kv_buffer: [page, layer, item]
backend = attach()
hashes = page_hashes(4)
pages = [src[i].flatten() for i in range(3)] + [src[3].t()]  # the last one non-contiguous
assert not pages[3].is_contiguous()
assert backend.batch_set(hashes, pages)
dst = torch.zeros((4, layers, item), dtype=torch.bfloat16)
dummies = [torch.zeros((layers, item), dtype=torch.bfloat16).flatten() for _ in range(3)]
got = backend.batch_get(hashes[:3], dummies)
for i, page in enumerate(got):
    assert page is dummies[i]  # filled in place and returned, as set_from_flat_data_page expects
    dst[i] = page.view(torch.bfloat16).reshape(layers, item)
assert torch.equal(dst[:3], src[:3])
back = torch.zeros(layers * item, dtype=torch.bfloat16)
assert backend.get(hashes[3], back) is back and torch.equal(back, src[3].t().contiguous().flatten())
strided = torch.zeros((item, layers), dtype=torch.bfloat16).t()  # a GET target that cannot alias bytes
assert backend.get(hashes[3], strided) is None  # a logged miss, not an exception
backend.close()
print("OK")
'''


def _run_with_sglang(kvd, script: str) -> None:
    from tests.real_engines import run_engine_python

    import inspect

    # this module imports pytest, which the vLLM venv lacks: the script gets page_hashes' source
    prelude = f"import hashlib\nARENA = {kvd.arena!r}\n{inspect.getsource(page_hashes)}\n"
    done = run_engine_python(prelude + script, sglang=True,
                             env={"INFERA_KVD_SOCKET": kvd.socket})
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stdout[-2000:] + done.stderr[-3000:]


def test_real_sglang_factory_builds_and_drives_the_backend(kvd):
    """SGLang 0.5.23's own HiCacheStorage and StorageBackendFactory create the backend from the extra
    config our launcher writes; a bf16 page round-trips through kvd (arena and socket)."""
    _run_with_sglang(kvd, REAL_SGLANG_ROUND_TRIP)


def test_torch_pages_as_sglang_hands_them(kvd):
    """SGLang's own pages (bf16 CPU tensors): a page_first host buffer's flat pages are stored and
    loaded in place, a non-contiguous page too; a target that cannot alias bytes is a miss."""
    _run_with_sglang(kvd, REAL_SGLANG_TORCH_PAGES)


# -- the launcher end to end: a stand-in SGLang worker started with --infera-kvd-socket ---------------

from tests.integration.test_standin_launchers import _stop_and_check, spawn  # noqa: E402,F401  (fixture)


async def test_launcher_with_kvd_registers_and_passes_the_socket(make_server, spawn, kvd):  # noqa: F811
    from tests.conftest import cmdline
    from tests.integration.conftest import wait_workers

    server = await make_server()
    w = await spawn("sglang", "--model-path", "sim-model", "--page-size", "4",
                    launcher_args=("--infera-kvd-socket", kvd.socket))
    await wait_workers(server, {w.worker_id})
    assert server.fleet.get(w.worker_id).kvd_socket == kvd.socket  # the record says the engine uses kvd
    pid = await w.find_engine()
    argv = cmdline(pid)
    assert "--enable-hierarchical-cache" in argv
    assert argv[argv.index("--hicache-storage-backend") + 1] == "dynamic"
    cfg = json.loads(argv[argv.index("--hicache-storage-backend-extra-config") + 1])
    assert cfg["module_path"] == "infera.engine.sglang.kvd_adapter" and cfg["class_name"] == "InferaKvdBackend"
    with open(f"/proc/{pid}/environ", "rb") as f:
        environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    assert environ[b"INFERA_KVD_SOCKET"] == kvd.socket.encode()
    await _stop_and_check(server, w, within=15)
