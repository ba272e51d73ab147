"""Block hashes in the router's own hash space: chained XXH3-64 over full blocks.

``hash_chunk(parent, tokens) = XXH3_64(parent as u64 LE ‖ each token as u32 LE)``, seed 0, with
``ROUTER_SEED`` (0) as the parent of the first block. Only full blocks are hashed; a trailing
partial block is dropped. Engine-reported token ids are re-hashed with the same chain, so the
router never depends on an engine's own hash function or seed.

A request with a ``cache_salt`` (vLLM's per-request cache isolation: the salt is one of the first
block's extra keys, so every block of the prompt hashes apart from the same tokens unsalted or
under another salt) is chained from ``salt_root(salt)`` instead of ``ROUTER_SEED``: the same
separation in the router's space, at no cost per block. An engine's ``BlockStored`` names the salt
among the first block's ``extra_keys`` (``event_salt``), so the index re-hashes it from the same
root.
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


# Domain tag of a salted root: no salt's root can equal an unsalted chain's seed or hash by design
# (a 64-bit collision aside), and it is not the XXH3 of a bare token run.
_SALT_TAG = b"infera-cache-salt\x00"


def salt_root(salt: str | None) -> int:
    """The parent of a prompt's first block in the router's chain: ``ROUTER_SEED`` without a salt
    (None or "": vLLM ignores an empty salt), else XXH3-64 of a tag and the salt's UTF-8 (never
    ``ROUTER_SEED`` itself)."""
    if not salt:
        return ROUTER_SEED
    root = _xxh3(_SALT_TAG + salt.encode("utf-8", "surrogatepass"))
    return root if root != ROUTER_SEED else 1


# Domain tag of an adapter's root (vLLM folds the LoRA name into every block's extra keys, so an
# adapter's blocks never match the base model's or another adapter's: here, a root of its own).
_LORA_TAG = b"infera-lora\x00"


def chain_root(salt: str | None, lora: str | None = None) -> int:
    """The parent of a prompt's first block for a request under ``salt`` and LoRA adapter ``lora``
    (None or "": the base model): ``salt_root(salt)`` for the base model, else XXH3-64 of a tag, the
    adapter's name (length-prefixed, so no name/salt pair reads as another) and the salt."""
    if not lora:
        return salt_root(salt)
    name = lora.encode("utf-8", "surrogatepass")
    data = _LORA_TAG + len(name).to_bytes(4, "little") + name + (salt or "").encode("utf-8", "surrogatepass")
    root = _xxh3(data)
    return root if root != ROUTER_SEED else 1


def event_salt(extra_keys: Sequence | None, lora_name: str | None = None) -> str | None:
    """The ``cache_salt`` a vLLM ``BlockStored`` names for its first block, or None.

    vLLM (0.32, ``to_event_extra_keys``) publishes one entry per block, each None or a tuple, in
    order: the LoRA name (when the request has one), ``(mm_identifier, offset)`` pairs, the salt,
    prompt-embeds digests (bytes). The salt is on the prompt's first block only, so only the first
    entry is read: its last string that is not the event's own ``lora_name`` is the salt."""
    if not extra_keys:
        return None
    first = extra_keys[0]
    if not isinstance(first, (list, tuple)):
        return None
    lora_seen = lora_name is None
    salt = None
    for item in first:
        if isinstance(item, str):
            if not lora_seen and item == lora_name:
                lora_seen = True  # (the LoRA name comes first; a salt equal to it still counts after)
                continue
            salt = item
    return salt or None


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
