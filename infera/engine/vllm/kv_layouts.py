"""Which of vLLM's paged KV layouts the kvd connector moves, and the key that keeps them apart.

vLLM 0.32 (RFC #42082) hands a connector every attention layer's cache as one logical 4-D tensor
``[B, H, N, C]``: blocks (kernel blocks when a backend splits the engine's block), head slots,
tokens per kernel block, content elements. Its strides follow the engine's resolved
``KVCacheLayout`` (``kv_cache_config.kv_cache_layout``): LBHNC (HND), LBNHC (NHD), LHBNC, BLHNC,
BLNHC, BHLNC. That replaced the per-backend ``get_kv_cache_shape``/``get_kv_cache_stride_order``
of older releases: what ``H`` and ``C`` mean is the backend's, published in the spec by its
``customize_spec`` (``num_head_slots``, ``state_content_bytes``). The packings it produces:

* ``kv_interleaved``: ``H`` = KV heads, ``C`` = K then V of one token (``head_size +
  head_size_v``). FlashAttention, FlashInfer (not NVFP4), Triton, ROCm AITER FA and AITER unified
  (without the shuffle layout): their kernels split ``C`` at ``head_size``.
* ``kv_planes``: ``H`` = 2 (K, V), ``C`` = KV heads x head size. ROCm paged attention
  (``rocm_attn``) and AITER FA with ``VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT``.
* ``kv_rows``: the CPU backend reads a block's ``[H, N, 2*D]`` bytes as ``[H, 2*N, D]``: N K
  rows, then N V rows, per head (LBHNC only).
* ``latent``: MLA, ``H`` = 1, ``C`` = the latent (kv_lora_rank + rope dims); one channel.

Refused, with the spec named: packed and scale-carrying content (NVFP4, per-token-head int8/fp8/
int4, TurboQuant, ``fp8_ds_mla``), K and V of different sizes, padded pages, compressed states,
and models with more than one KV-cache group (hybrid: sliding window, Mamba, ...), whose groups
share block hashes the connector would have to key apart per group.

The layout tag (platform, packing, stride order, ``H``, ``C``, dtype, quant mode) joins the compat
key, so a chunk saved under one layout or dtype is never found by an engine using another. Pure
Python (no torch, no vLLM): the scheduler, the worker and the tests compute the same tag.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

# KVCacheLayout names (vllm/v1/kv_cache_layout.py): the stride permutation of [L, B, H, N, C].
LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
DEFAULT_LAYOUT = "LBHNC"
# Element sizes of the cache tensors' dtypes (fp8 caches are stored as uint8).
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
             "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1}
_HEADER_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
_QUANT_OK = ("NONE", "FP8_PER_TENSOR")
_ATTENTION_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")


class UnsupportedKvLayout(ValueError):
    """The engine's KV cache is one the connector cannot move bit-exactly; the message says why."""


@dataclass(frozen=True)
class SpecFacts:
    """What the connector reads from a vLLM ``AttentionSpec`` (plain values, for the tests too)."""

    kind: str  # the spec's class name: FullAttentionSpec, MLAAttentionSpec, ...
    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype: str  # torch dtype name without "torch.": bfloat16, uint8 (fp8 caches), ...
    num_head_slots: int | None = None
    state_content_bytes: int | None = None
    quant: str = "NONE"  # KVQuantMode name
    cache_dtype_str: str | None = None  # MLA: "fp8_ds_mla" and other packed formats
    tokens_per_state: Any = 1
    page_size_padded: int | None = None
    sliding_window: int | None = None


def spec_facts(spec: Any) -> SpecFacts:
    """The facts of a real vLLM spec (duck-typed: no vLLM import)."""
    quant = getattr(spec, "kv_quant_mode", None)
    return SpecFacts(kind=type(spec).__name__, block_size=int(spec.block_size),
                     num_kv_heads=int(getattr(spec, "num_kv_heads", 0)), head_size=int(getattr(spec, "head_size", 0)),
                     head_size_v=int(getattr(spec, "head_size_v", 0) or 0),
                     dtype=str(getattr(spec, "dtype", "")).removeprefix("torch."),
                     num_head_slots=getattr(spec, "num_head_slots", None),
                     state_content_bytes=getattr(spec, "state_content_bytes", None),
                     quant=getattr(quant, "name", str(quant or "NONE")),
                     cache_dtype_str=getattr(spec, "cache_dtype_str", None),
                     tokens_per_state=getattr(spec, "tokens_per_state", 1),
                     page_size_padded=getattr(spec, "page_size_padded", None),
                     sliding_window=getattr(spec, "sliding_window", None))


@dataclass(frozen=True)
class KvGeometry:
    """One KV-cache group's page geometry as the connector moves it."""

    platform: str  # cpu | cuda | rocm (what reads the bytes)
    packing: str  # kv_interleaved | kv_planes | kv_rows | latent
    layout: str  # KVCacheLayout name
    heads: int  # H of the logical [B, H, N, C] tensor
    content: int  # C, in elements of `storage`
    storage: str  # the tensor's dtype name
    dtype: str  # the chunk header's dtype: bf16 | fp16 | fp32 | fp8_e4m3 | fp8_e5m2
    quant: str  # KVQuantMode name
    channels: int  # 2 (K, V) or 1 (MLA latent)
    hidden: int  # elements per token and channel: the payload's H of [C, L, T, H]
    block_size: int  # tokens per engine block (vLLM's block_size)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.storage]

    @property
    def page_elems(self) -> int:
        """Elements one layer holds for one engine block (all its kernel blocks)."""
        return self.heads * self.block_size * self.content

    def tag(self) -> str:
        return f"{self.platform}.{self.packing}.{self.layout}.h{self.heads}c{self.content}.{self.dtype}.{self.quant}"

    def logical_shape(self, num_blocks: int, kernel_tokens: int) -> tuple[int, int, int, int]:
        """The ``[B, H, N, C]`` shape vLLM gives a layer with ``kernel_tokens`` per kernel block."""
        return (num_blocks * (self.block_size // kernel_tokens), self.heads, kernel_tokens, self.content)


def header_dtype(storage: str, cache_dtype: str) -> str:
    """The chunk header's dtype name: the model dtype, or the fp8 format (fp8 caches are uint8)."""
    cache_dtype = (cache_dtype or "auto").lower()
    if cache_dtype.startswith("fp8"):
        return "fp8_e5m2" if "e5m2" in cache_dtype else "fp8_e4m3"
    return _HEADER_DTYPE.get(storage, storage)


def classify(facts: SpecFacts, *, layout: str, cache_dtype: str, platform: str) -> KvGeometry:
    """The geometry of a group with this spec, or UnsupportedKvLayout naming what is not moved."""
    what = (f"{facts.kind}(kv_heads={facts.num_kv_heads}, head_size={facts.head_size}/{facts.head_size_v}, "
            f"dtype={facts.dtype}, quant={facts.quant}, head_slots={facts.num_head_slots}, "
            f"content_bytes={facts.state_content_bytes}) in layout {layout}")
    if facts.kind not in _ATTENTION_SPECS:
        raise UnsupportedKvLayout(f"KV-cache group kind {facts.kind} is not a paged full-attention or MLA cache: {what}")
    if layout not in LAYOUTS:
        raise UnsupportedKvLayout(f"unknown KV cache layout {layout!r} (known: {', '.join(LAYOUTS)}): {what}")
    if facts.quant not in _QUANT_OK or (facts.cache_dtype_str or "auto") not in ("auto", "fp8", "fp8_e4m3",
                                                                                 "fp8_e5m2", "bfloat16", "float16"):
        raise UnsupportedKvLayout(f"packed KV content (quant {facts.quant}, cache dtype "
                                  f"{facts.cache_dtype_str}) is not moved: {what}")
    if facts.dtype not in _ITEMSIZE:
        raise UnsupportedKvLayout(f"KV dtype {facts.dtype} is not moved: {what}")
    if facts.tokens_per_state != 1 or facts.page_size_padded is not None:
        raise UnsupportedKvLayout(f"compressed or padded KV pages are not moved: {what}")
    item = _ITEMSIZE[facts.dtype]
    dtype = header_dtype(facts.dtype, cache_dtype)
    base = dict(platform=platform, layout=layout, storage=facts.dtype, dtype=dtype, quant=facts.quant,
                block_size=facts.block_size)
    if facts.kind == "MLAAttentionSpec" or facts.head_size_v == 0:
        content = facts.head_size
        if (facts.num_head_slots not in (None, 1) or facts.num_kv_heads != 1
                or facts.state_content_bytes not in (None, content * item)):
            raise UnsupportedKvLayout(f"an MLA cache other than one latent per token: {what}")
        return KvGeometry(packing="latent", heads=1, content=content, channels=1, hidden=content, **base)
    if facts.head_size != facts.head_size_v:
        raise UnsupportedKvLayout(f"K and V of different head sizes are not moved: {what}")
    hs, kvh = facts.head_size, facts.num_kv_heads
    if facts.num_head_slots is None and facts.state_content_bytes in (None, 2 * hs * item):
        if platform == "cpu":
            if layout != "LBHNC":
                raise UnsupportedKvLayout(f"the CPU backend's pages are head-major (LBHNC): {what}")
            return KvGeometry(packing="kv_rows", heads=kvh, content=2 * hs, channels=2, hidden=kvh * hs, **base)
        return KvGeometry(packing="kv_interleaved", heads=kvh, content=2 * hs, channels=2, hidden=kvh * hs, **base)
    if facts.num_head_slots == 2 and facts.state_content_bytes == kvh * hs * item:
        return KvGeometry(packing="kv_planes", heads=2, content=kvh * hs, channels=2, hidden=kvh * hs, **base)
    raise UnsupportedKvLayout(f"packed KV head slots are not moved: {what}")


def select_group(groups: Sequence[Any], transfer_group_ids: Iterable[int] | None = None) -> int:
    """The one KV-cache group the connector moves (its index), or UnsupportedKvLayout naming the
    groups of a hybrid model: their chunks would need keys and lookups per group."""
    ids = list(range(len(groups))) if transfer_group_ids is None else list(transfer_group_ids)
    if len(ids) == 1:
        return ids[0]
    kinds = ", ".join(f"group {i}: {type(groups[i].kv_cache_spec).__name__} x{len(groups[i].layer_names)} layers"
                      for i in ids)
    raise UnsupportedKvLayout(f"{len(ids)} KV-cache groups ({kinds or 'none'}); kvd moves a single full-attention "
                              "or MLA group, so a hybrid model is refused rather than half saved")


def compat_suffix(geometry: KvGeometry) -> str:
    """What the connector appends to ``kvd_format.compat_key``."""
    return f"_k{geometry.tag()}"


__all__ = ["DEFAULT_LAYOUT", "KvGeometry", "LAYOUTS", "SpecFacts", "UnsupportedKvLayout", "classify",
           "compat_suffix", "header_dtype", "select_group", "spec_facts"]
