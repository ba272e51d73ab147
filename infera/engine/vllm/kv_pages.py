"""Views of vLLM's paged KV tensors as pages of channels, and the chunk payload they fill.

A layer's logical ``[B, H, N, C]`` tensor (any of the six stride orders) is viewed, without a copy,
as ``(blocks, channels, R, Nk, H', D')``: engine block, K/V (or the one MLA latent), kernel block
within the engine block, token within it, then the token's per-channel content as heads x dim.
The chunk payload ``[C, L, T, H]`` (spec §8.6) is the same thing over a chunk's pages:
``(channels, layers, pages, R, Nk, H', D')`` contiguous, so one ``index_select`` per layer gathers
a save and one ``index_copy_`` per layer scatters a load, on whatever device holds the cache.
"""
from __future__ import annotations

import torch

from infera.engine.vllm.kv_layouts import KvGeometry, UnsupportedKvLayout


class PagedLayer:
    """One layer's cache as ``pages``: ``(blocks, channels, R, Nk, H', D')`` (a view)."""

    def __init__(self, name: str, kv: torch.Tensor, geometry: KvGeometry, num_blocks: int):
        g = geometry
        shape = tuple(kv.shape)
        kernel_tokens = shape[2] if kv.dim() == 4 else 0
        fits = (kv.dim() == 4 and kernel_tokens > 0 and g.block_size % kernel_tokens == 0
                and str(kv.dtype).removeprefix("torch.") == g.storage
                and shape == g.logical_shape(num_blocks, kernel_tokens))
        if not fits:
            want = g.logical_shape(num_blocks, kernel_tokens or g.block_size)
            raise UnsupportedKvLayout(
                f"layer {name} has KV shape {shape} ({kv.dtype}); the {g.packing} layout {g.layout} needs vLLM's "
                f"logical [blocks, head slots, tokens, content] = {want} ({g.storage}), or a kernel-block split of it")
        self.name = name
        self.kernel_blocks = g.block_size // kernel_tokens
        t = kv.unflatten(0, (num_blocks, self.kernel_blocks))  # (B, R, H, Nk, C)
        half = g.content // 2
        if g.packing == "kv_interleaved":  # C = K | V of the token
            pages = t.unflatten(4, (2, half)).permute(0, 4, 1, 3, 2, 5)
        elif g.packing == "kv_rows":  # a kernel block's [H, Nk, C] bytes read as [H, 2, Nk, C/2]
            if t.stride(4) != 1 or t.stride(3) != g.content:
                raise UnsupportedKvLayout(f"layer {name}: the CPU layout needs contiguous token rows, strides "
                                          f"{tuple(kv.stride())}")
            pages = t.as_strided((num_blocks, self.kernel_blocks, g.heads, 2, kernel_tokens, half),
                                 (t.stride(0), t.stride(1), t.stride(2), kernel_tokens * half, half, 1),
                                 t.storage_offset()).permute(0, 3, 1, 4, 2, 5)
        elif g.packing in ("kv_planes", "latent"):  # H = the channels; C = heads x dim
            pages = t.permute(0, 2, 1, 3, 4).unsqueeze(4)
        else:
            raise UnsupportedKvLayout(f"layer {name}: unknown packing {g.packing}")
        self.pages = pages
        self.page_shape = tuple(pages.shape[1:])  # (channels, R, Nk, H', D')
        self.dtype = kv.dtype
        self.device = kv.device


def payload_view(buf: torch.Tensor, offset: int, layers: list[PagedLayer], pages: int) -> torch.Tensor:
    """``buf[offset:]`` (uint8) as the payload ``(channels, layers, pages, R, Nk, H', D')``."""
    l0 = layers[0]
    ch, r, nk, h, d = l0.page_shape
    count = ch * len(layers) * pages * r * nk * h * d
    raw = buf[offset:offset + count * l0.dtype.itemsize]
    return raw.view(l0.dtype).view(ch, len(layers), pages, r, nk, h, d)


def payload_nbytes(layers: list[PagedLayer], pages: int) -> int:
    l0 = layers[0]
    n = 1
    for dim in l0.page_shape:
        n *= dim
    return n * len(layers) * pages * l0.dtype.itemsize


def gather_layer(layer: PagedLayer, ids: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (channels, pages, R, Nk, H', D') <- the pages ``ids`` of ``layer``."""
    out.copy_(layer.pages.index_select(0, ids).transpose(0, 1))


def scatter_layer(layer: PagedLayer, ids: torch.Tensor, src: torch.Tensor) -> None:
    """The pages ``ids`` of ``layer`` <- ``src`` (channels, pages, R, Nk, H', D')."""
    layer.pages.index_copy_(0, ids, src.transpose(0, 1))


__all__ = ["PagedLayer", "gather_layer", "payload_nbytes", "payload_view", "scatter_layer"]
