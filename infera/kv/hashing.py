"""Block hashes in the router's own hash space: chained XXH3-64 over full blocks.

``hash_chunk(parent, tokens) = XXH3_64(parent as u64 LE ‖ each token as u32 LE)``, seed 0, with
``ROUTER_SEED`` (0) as the parent of the first block. Only full blocks are hashed; a trailing
partial block is dropped. Engine-reported token ids are re-hashed with the same chain, so the
router never depends on an engine's own hash function or seed.
"""
from __future__ import annotations

import struct
import sys
from array import array
from typing import Sequence

import xxhash

from infera.kv.native import native

ROUTER_SEED = 0
_xxh3 = xxhash.xxh3_64_intdigest
_U64 = (1 << 64) - 1


def tokens_le_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as consecutive 4-byte little-endian unsigned ints (one C-level conversion)."""
    buf = array("I", tokens)
    if buf.itemsize != 4:  # exotic platform: an explicit layout
        return struct.pack(f"<{len(tokens)}I", *tokens)
    if sys.byteorder != "little":
        buf.byteswap()
    return buf.tobytes()


def hash_chunk(parent: int, tokens: Sequence[int]) -> int:
    return _xxh3(parent.to_bytes(8, "little") + tokens_le_bytes(tokens))


def block_hashes(tokens: Sequence[int], block_size: int, parent_hash: int = ROUTER_SEED) -> list[int]:
    """Chained hashes of every full block of ``tokens`` (a sequence of ints, or a buffer of u32
    such as ``array('I')``). The C accelerator's where it is built, else :func:`_py_block_hashes`."""
    if native is not None:
        return native.block_hashes(tokens, block_size, parent_hash)
    return _py_block_hashes(tokens, block_size, parent_hash)


def block_hash_array(tokens: Sequence[int], block_size: int, parent_hash: int = ROUTER_SEED) -> array:
    """:func:`block_hashes` as an ``array('Q')``: how the router's hot path carries a prompt's chain
    (the C accelerator's walks read it in place; no int object per block)."""
    out = array("Q")
    if native is not None:
        out.frombytes(native.block_hash_bytes(tokens, block_size, parent_hash))
        if sys.byteorder != "little":  # (the bytes are little-endian)
            out.byteswap()
    else:
        out.extend(_py_block_hashes(tokens, block_size, parent_hash))
    return out


def _py_block_hashes(tokens: Sequence[int], block_size: int, parent_hash: int = ROUTER_SEED) -> list[int]:
    """:func:`block_hashes` in Python (one bytes conversion for the whole list)."""
    if block_size <= 0:
        return []
    n = len(tokens) // block_size
    if n == 0:
        return []
    data = tokens_le_bytes(tokens[: n * block_size])
    step = 4 * block_size
    out = []
    parent = parent_hash
    for i in range(n):
        parent = _xxh3(parent.to_bytes(8, "little") + data[i * step:(i + 1) * step])
        out.append(parent)
    return out
