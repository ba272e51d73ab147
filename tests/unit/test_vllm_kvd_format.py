"""The kvd chunk format of the vLLM connector: keys, compat keys, blob header, lookup/save plans."""
import hashlib

import pytest

from infera.engine.vllm import kvd_format as fmt

H = [hashlib.sha256(bytes([i])).digest() for i in range(40)]  # stand-ins for vLLM's 32-byte block hashes


def test_chunk_key_is_sha256_prefix_with_group_byte():
    key = fmt.chunk_key(H[:4], group_id=3)
    assert len(key) == 8 and key[:7] == hashlib.sha256(b"".join(H[:4])).digest()[:7] and key[7] == 3
    assert fmt.chunk_key(H[:4]) != fmt.chunk_key(H[:3]) != fmt.chunk_key(H[1:4])
    with pytest.raises(ValueError):
        fmt.chunk_key([])


def test_compat_key_and_fingerprint(tmp_path):
    assert fmt.compat_key(1, 4, 0, 2) == "tp1of4_pp0of2"
    assert fmt.compat_key(0, 1, 0, 1, "abcd") == "tp0of1_pp0of1_wabcd"
    assert fmt.model_fingerprint("org/hub-id") is None
    assert fmt.model_fingerprint(str(tmp_path)) is None  # no config/tokenizer
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer.json").write_text("[]")
    assert fmt.model_fingerprint(str(tmp_path)) == hashlib.sha256(b"{}[]").hexdigest()[:16]


@pytest.mark.parametrize("raw,expected", [
    ("256", 256), ("300", 288), ("10", 32),  # multiples of the block size, at least one block
    (None, 2048), ("auto", 2048),  # auto: 128 MiB / 2 KiB per token = 64K tokens, capped at the context
])
def test_chunk_tokens(raw, expected):
    assert fmt.resolve_chunk_tokens(raw, 32, 2048, 2048) == expected


def test_chunk_tokens_auto_targets_mib_and_rejects_junk():
    assert fmt.resolve_chunk_tokens("auto", 16, 128 * 1024, 1 << 20) == 1024  # 128 MiB of 128 KiB tokens
    for bad in ("x", "0", "-32"):
        with pytest.raises(ValueError):
            fmt.resolve_chunk_tokens(bad, 32, 2048, 2048)


def test_retention_default_and_override():
    assert fmt.default_retention({}) == "short"
    assert fmt.default_retention({fmt.RETENTION_ENV: "LONG"}) == "long"
    with pytest.raises(ValueError):
        fmt.default_retention({fmt.RETENTION_ENV: "forever"})
    assert fmt.request_retention(None, "short") == ("short", None)
    assert fmt.request_retention({"infera_retention": "none"}, "short") == ("none", None)
    value, problem = fmt.request_retention({"infera_retention": "forever"}, "long")
    assert value == "long" and "forever" in problem


def test_header_roundtrip_aligned_and_checked():
    header = fmt.ChunkHeader(v=2, chunk_tokens=256, block_size=32, num_layers=2, layer_names=["a", "b"],
                             hidden_dim=256, dtype="bf16", cache_group_id=0, num_kv_channels=2,
                             payload_byte_offset=0)
    prefix = fmt.encode_header(header)
    assert len(prefix) % fmt.PAYLOAD_ALIGN == 0
    back = fmt.decode_header(prefix + b"payload")
    assert back.payload_byte_offset == len(prefix) and back.layer_names == ["a", "b"]
    assert fmt.payload_bytes(back, 2) == 2 * 2 * 256 * 256 * 2
    for bad in (b"", b"\x05\x00\x00\x00ab", b"\x02\x00\x00\x00\x81\x01", b"garbage!" * 4):
        with pytest.raises(ValueError):
            fmt.decode_header(bad)
    old = fmt.ChunkHeader(**{**{f: getattr(header, f) for f in header.__struct_fields__}, "v": 1})
    with pytest.raises(ValueError, match="version"):
        fmt.decode_header(fmt.encode_header(old))


def _present(refs, saved):
    return [r.key in saved for r in refs]


def test_lookup_full_chunks_then_tail():
    # 11 full pages, 4 pages per chunk: chunks at 0 and 4, tails at 8 of 3, 2, 1 pages
    full, tails = fmt.lookup_candidates(H[:11], 0, 4)
    assert [(r.first_page, r.num_pages) for r in full] == [(0, 4), (4, 4)]
    assert [(r.first_page, r.num_pages) for r in tails] == [(8, 3), (8, 2), (8, 1)]
    saved = {full[0].key, full[1].key, tails[1].key}
    chain, missed = fmt.matched_chain(full, _present(full, saved), tails, _present(tails, saved))
    assert [(r.first_page, r.num_pages) for r in chain] == [(0, 4), (4, 4), (8, 2)] and missed is None


def test_lookup_stops_at_a_missing_chunk_and_reports_where():
    full, tails = fmt.lookup_candidates(H[:16], 5, 4)  # local hit to page 5: start at the chunk holding it
    assert [r.first_page for r in full] == [4, 8, 12] and tails == []
    saved = {full[0].key, full[2].key}  # a hole at 8: chunk 12 cannot be used
    chain, missed = fmt.matched_chain(full, _present(full, saved), tails, _present(tails, saved))
    assert [r.first_page for r in chain] == [4] and missed == 8
    more = fmt.tail_candidates(H[:16], 8, 3)
    assert fmt.extend_with_tail(chain, 8, more, [False, True, False])[-1] == more[1]  # a 2-page tail at 8


def test_tail_only_counts_when_the_run_reaches_it():
    full, tails = fmt.lookup_candidates(H[:6], 0, 4)
    chain, _ = fmt.matched_chain(full, [False], tails, [True, True])
    assert chain == []  # the tail at page 4 does not follow a present chunk 0
    full, tails = fmt.lookup_candidates(H[:3], 0, 4)  # shorter than one chunk: tails at 0
    chain, missed = fmt.matched_chain(full, [], tails, [False, True, True])
    assert [(r.first_page, r.num_pages) for r in chain] == [(0, 2)] and missed is None


def test_save_plan_full_chunks_as_they_fill_tail_at_prefill_end():
    cursor = fmt.SaveCursor("short", held_pages=0)
    # chunked prefill of a 10-page prompt: 6 pages, then the rest
    assert [(r.first_page, r.num_pages) for r in fmt.chunks_to_save(cursor, H[:6], 6, False, 4)] == [(0, 4)]
    assert [(r.first_page, r.num_pages) for r in fmt.chunks_to_save(cursor, H[:10], 10, True, 4)] == \
        [(4, 4), (8, 2)]
    assert fmt.chunks_to_save(cursor, H[:11], 11, True, 4) == []  # the tail once only
    assert [(r.first_page, r.num_pages) for r in fmt.chunks_to_save(cursor, H[:12], 12, True, 4)] == [(8, 4)]


def test_save_plan_skips_what_was_cached_and_none_retention():
    cursor = fmt.SaveCursor("long", held_pages=8)
    assert [(r.first_page, r.num_pages) for r in fmt.chunks_to_save(cursor, H[:10], 10, True, 4)] == [(8, 2)]
    cursor = fmt.SaveCursor("long", held_pages=10)
    assert fmt.chunks_to_save(cursor, H[:10], 10, True, 4) == []
    assert fmt.chunks_to_save(fmt.SaveCursor("none", 0), H[:10], 10, True, 4) == []
    cursor = fmt.SaveCursor("short", 0)  # hashes lag the computed tokens: only hashed pages are saved
    assert [(r.first_page, r.num_pages) for r in fmt.chunks_to_save(cursor, H[:3], 9, True, 4)] == [(0, 3)]
