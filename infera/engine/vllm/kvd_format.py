"""The kvd chunk format shared by the vLLM connector's scheduler and worker sides (spec §8.6):
compat keys, chunk keys, the v2 chunk blob header, and which chunks to look up, load and save.

Pure Python (no torch, no vLLM) so the rules are unit-tested on their own.

* A chunk holds the KV of ``pages_per_chunk`` consecutive engine pages (blocks). Its 8-byte key is
  ``sha256(concat of the pages' vLLM block hashes)[:8]`` with the last byte replaced by the KV-cache
  group id. vLLM's block hashes chain (each covers its whole prefix), so a key names a prefix.
* A prompt's trailing pages that do not fill a chunk are saved as a shorter *tail chunk* (its key
  covers only its pages); a lookup that misses a full chunk tries the tail lengths at that position.
* Namespaced in kvd by ``(model, compat_key, key)``: ``compat_key = "tp{r}of{T}_pp{p}of{P}[_w{fp}]"``.
"""
from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import msgspec

CHUNK_TOKENS_ENV = "INFERA_KVD_CHUNK_TOKENS"
CHUNK_TARGET_MIB_ENV = "INFERA_KVD_CHUNK_TARGET_MIB"
RETENTION_ENV = "INFERA_KVD_RETENTION_DEFAULT"
DEFAULT_CHUNK_TARGET_MIB = 128
DEFAULT_RETENTION = "short"
# kvd's classes plus "none" (do not save); the per-request override is
# kv_transfer_params.infera_retention.
RETENTIONS = ("none", "ephemeral", "short", "long")
BLOB_VERSION = 2
PAYLOAD_ALIGN = 64
_U32 = struct.Struct("<I")


def compat_key(tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, fingerprint: str | None = None) -> str:
    key = f"tp{tp_rank}of{tp_size}_pp{pp_rank}of{pp_size}"
    return f"{key}_w{fingerprint}" if fingerprint else key


def model_fingerprint(model: str) -> str | None:
    """sha256[:16] over ``config.json`` + ``tokenizer.json`` of a local model folder; None for a
    hub id or a folder without them (the compat key then has no ``_w`` part)."""
    folder = Path(model)
    if not folder.is_dir():
        return None
    digest = hashlib.sha256()
    found = False
    for name in ("config.json", "tokenizer.json"):
        path = folder / name
        if path.is_file():
            digest.update(path.read_bytes())
            found = True
    return digest.hexdigest()[:16] if found else None


def chunk_key(block_hashes: Sequence[bytes], group_id: int = 0) -> bytes:
    if not block_hashes:
        raise ValueError("a chunk covers at least one page")
    return hashlib.sha256(b"".join(block_hashes)).digest()[:7] + bytes([group_id & 0xFF])


def resolve_chunk_tokens(raw: str | None, block_size: int, bytes_per_token: int, max_model_len: int,
                         target_mib: int = DEFAULT_CHUNK_TARGET_MIB) -> int:
    """Tokens per chunk, a multiple of the block size. ``auto`` (or unset): about ``target_mib`` of
    KV, never more than the model's context (a chunk longer than any prompt would only be saved
    as tails)."""
    if raw is None or raw.strip().lower() in ("", "auto"):
        tokens = (target_mib << 20) // max(bytes_per_token, 1)
        tokens = min(tokens, max_model_len)
    else:
        try:
            tokens = int(raw)
        except ValueError:
            raise ValueError(f"{CHUNK_TOKENS_ENV} must be 'auto' or a token count, not {raw!r}") from None
        if tokens <= 0:
            raise ValueError(f"{CHUNK_TOKENS_ENV} must be > 0, not {tokens}")
    return max(block_size, tokens // block_size * block_size)


def default_retention(environ: Mapping[str, str] | None = None) -> str:
    environ = os.environ if environ is None else environ
    value = environ.get(RETENTION_ENV, DEFAULT_RETENTION).strip().lower()
    if value not in RETENTIONS:
        raise ValueError(f"{RETENTION_ENV} must be one of {', '.join(RETENTIONS)}, not {value!r}")
    return value


def request_retention(kv_transfer_params: Mapping | None, default: str) -> tuple[str, str | None]:
    """(retention, problem): ``kv_transfer_params.infera_retention`` when valid, else the default
    (with the problem to log)."""
    raw = (kv_transfer_params or {}).get("infera_retention")
    if raw is None:
        return default, None
    value = str(raw).strip().lower()
    if value in RETENTIONS:
        return value, None
    return default, f"infera_retention {raw!r} is not one of {', '.join(RETENTIONS)}; using {default!r}"


# --- chunk plans ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ChunkRef:
    key: bytes
    first_page: int  # the request's page index the chunk starts at
    num_pages: int

    @property
    def end_page(self) -> int:
        return self.first_page + self.num_pages


def ref_for(block_hashes: Sequence[bytes], first_page: int, num_pages: int, group_id: int = 0) -> ChunkRef:
    return ChunkRef(chunk_key(block_hashes[first_page:first_page + num_pages], group_id), first_page, num_pages)


def lookup_candidates(block_hashes: Sequence[bytes], start_page: int, pages_per_chunk: int,
                      group_id: int = 0) -> tuple[list[ChunkRef], list[ChunkRef]]:
    """(full chunks from the one holding ``start_page`` on, tails at the end, longest first): the
    keys one ``exists`` round trip asks for."""
    n = len(block_hashes)
    first = start_page // pages_per_chunk * pages_per_chunk
    full = [ref_for(block_hashes, p, pages_per_chunk, group_id)
            for p in range(first, n - pages_per_chunk + 1, pages_per_chunk)]
    tail_at = full[-1].end_page if full else first
    return full, tail_candidates(block_hashes, tail_at, min(n - tail_at, pages_per_chunk - 1), group_id)


def tail_candidates(block_hashes: Sequence[bytes], at_page: int, max_pages: int, group_id: int = 0) -> list[ChunkRef]:
    return [ref_for(block_hashes, at_page, k, group_id) for k in range(max_pages, 0, -1)]


def matched_chain(full: Sequence[ChunkRef], full_present: Sequence[bool], tails: Sequence[ChunkRef],
                  tails_present: Sequence[bool]) -> tuple[list[ChunkRef], int | None]:
    """(the leading run of present chunks, the page where a full chunk missed before the end — its
    tails are worth a second look — or None). A tail only extends a run that reaches it."""
    chain: list[ChunkRef] = []
    for ref, present in zip(full, full_present):
        if not present:
            return chain, ref.first_page
        chain.append(ref)
    at = chain[-1].end_page if chain else (tails[0].first_page if tails else None)
    return extend_with_tail(chain, at, tails, tails_present), None


def extend_with_tail(chain: list[ChunkRef], at: int | None, tails: Sequence[ChunkRef],
                     present: Sequence[bool]) -> list[ChunkRef]:
    """``chain`` plus the longest present tail that starts at page ``at``."""
    for ref, ok in zip(tails, present):
        if ok and ref.first_page == at:
            return [*chain, ref]
    return chain


@dataclass(slots=True)
class SaveCursor:
    """Per request: what has been handed to the worker for saving."""

    retention: str
    held_pages: int  # pages the request found cached at admission (local or kvd): never re-saved
    next_page: int = 0  # the next full chunk starts here
    tail_done: bool = False


def chunks_to_save(cursor: SaveCursor, block_hashes: Sequence[bytes], computed_pages: int, prefill_done: bool,
                   pages_per_chunk: int, group_id: int = 0) -> list[ChunkRef]:
    """Chunks whose pages are all computed after this step and not yet saved (advances the cursor).

    Full chunks are saved as soon as they fill (decode pages too); the prompt's tail once prefill
    is done. Chunks inside the admission hit are skipped: this engine saved them or kvd gave them.
    """
    if cursor.retention == "none":
        return []
    done = min(computed_pages, len(block_hashes))
    out: list[ChunkRef] = []
    while cursor.next_page + pages_per_chunk <= done:
        if cursor.next_page + pages_per_chunk > cursor.held_pages:
            out.append(ref_for(block_hashes, cursor.next_page, pages_per_chunk, group_id))
        cursor.next_page += pages_per_chunk
    if prefill_done and not cursor.tail_done:
        cursor.tail_done = True
        if done > cursor.next_page and done > cursor.held_pages:
            out.append(ref_for(block_hashes, cursor.next_page, done - cursor.next_page, group_id))
    return out


# --- chunk blob v2 -------------------------------------------------------------------------------

class ChunkHeader(msgspec.Struct, omit_defaults=False):
    """Blob = u32 LE header length + msgpack header + zero padding + payload ``[C, L, T, H]``
    (C: 2 = K and V, 1 = MLA latent; L layers; T = pages * block_size tokens; H = heads * head_dim)."""

    v: int
    chunk_tokens: int
    block_size: int
    num_layers: int
    layer_names: list[str]
    hidden_dim: int
    dtype: str
    cache_group_id: int
    num_kv_channels: int
    payload_byte_offset: int


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(ChunkHeader)


def payload_bytes(header: ChunkHeader, itemsize: int) -> int:
    return header.num_kv_channels * header.num_layers * header.chunk_tokens * header.hidden_dim * itemsize


def encode_header(header: ChunkHeader) -> bytes:
    """The blob's prefix up to the payload, with ``payload_byte_offset`` filled in (aligned)."""
    offset = 0
    while True:
        header.payload_byte_offset = offset
        raw = _header_encoder.encode(header)
        need = -(-(_U32.size + len(raw)) // PAYLOAD_ALIGN) * PAYLOAD_ALIGN
        if need == offset:
            return _U32.pack(len(raw)) + raw + bytes(offset - _U32.size - len(raw))
        offset = need


def decode_header(prefix: bytes | bytearray | memoryview) -> ChunkHeader:
    """Raises ValueError on anything that is not a v2 header."""
    if len(prefix) < _U32.size:
        raise ValueError("blob shorter than its header length")
    (length,) = _U32.unpack_from(prefix)
    if _U32.size + length > len(prefix):
        raise ValueError("blob shorter than its header")
    try:
        header = _header_decoder.decode(bytes(prefix[_U32.size:_U32.size + length]))
    except msgspec.DecodeError as e:
        raise ValueError(f"bad chunk header: {e}") from None
    if header.v != BLOB_VERSION:
        raise ValueError(f"chunk blob version {header.v}, expected {BLOB_VERSION}")
    if header.payload_byte_offset < _U32.size + length:
        raise ValueError("payload offset inside the header")
    return header


__all__ = ["ChunkHeader", "ChunkRef", "SaveCursor", "chunk_key", "chunks_to_save", "compat_key", "decode_header",
           "default_retention", "encode_header", "extend_with_tail", "lookup_candidates", "matched_chain",
           "model_fingerprint", "payload_bytes", "ref_for", "request_retention", "resolve_chunk_tokens",
           "tail_candidates"]
