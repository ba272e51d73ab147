"""Shared hypothesis strategies for the wire-format fuzz tests (tests/unit/test_fuzz_*.py)."""
from __future__ import annotations

from hypothesis import strategies as st

# bytes a length, a flag or a type tag is most often broken into
INTERESTING_BYTES = (0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x7F, 0x80, 0xC0, 0xFF)


@st.composite
def mutated(draw, data: bytes, max_edits: int = 3) -> bytes:
    """``data`` as a flaky wire or a buggy or hostile sender might deliver it: up to ``max_edits`` of
    a bit flipped, a byte overwritten (with an arbitrary or an interesting value), bytes inserted,
    dropped or repeated, or the rest cut off. Zero edits leave it whole."""
    b = bytearray(data)
    for _ in range(draw(st.integers(0, max_edits))):
        how = draw(st.sampled_from(["flip", "byte", "insert", "drop", "dup", "cut"]))
        if not b:
            b += draw(st.binary(min_size=1, max_size=4))
            continue
        i = draw(st.integers(0, len(b) - 1))
        if how == "flip":
            b[i] ^= 1 << draw(st.integers(0, 7))
        elif how == "byte":
            b[i] = draw(st.sampled_from(INTERESTING_BYTES) | st.integers(0, 255))
        elif how == "insert":
            b[i:i] = draw(st.binary(min_size=1, max_size=9))
        elif how == "drop":
            del b[i:i + draw(st.integers(1, 9))]
        elif how == "dup":
            j = draw(st.integers(i, min(len(b), i + 16)))
            b[j:j] = b[i:j]
        else:
            del b[i:]
    return bytes(b)
