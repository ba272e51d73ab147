"""The self-check reads the engine's cached prompt tokens out of reply bytes without decoding them."""
from __future__ import annotations

import pytest

from infera.router.dispatch import reported_cached_tokens

CASES = [
    (b'{"usage":{"prompt_tokens":40,"prompt_tokens_details":{"cached_tokens":32}}}', 32),
    (b'{"usage":{"prompt_tokens_details":{"cached_tokens" :  0}}}', 0),
    (b'{"usage":{"prompt_tokens":40}}', None),
    (b"", None),
    # a stream's tail: the usage chunk comes last, an earlier chunk's figure is not it
    (b'data: {"usage":{"prompt_tokens_details":{"cached_tokens":16}}}\n\n'
     b'data: {"usage":{"prompt_tokens_details":{"cached_tokens":48}}}\n\ndata: [DONE]\n\n', 48),
    # the last one is null (no figure): the one before it counts, as a scan over the whole body gave
    (b'{"a":{"cached_tokens":7},"usage":{"prompt_tokens_details":{"cached_tokens":null}}}', 7),
    (b'{"usage":{"prompt_tokens_details":{"cached_tokens":null}}}', None),
    # the words in generated text, not a JSON key
    (b'{"choices":[{"text":"cached_tokens: 5"}]}', None),
]


@pytest.mark.parametrize("data, expected", CASES)
def test_reported_cached_tokens(data: bytes, expected: int | None) -> None:
    assert reported_cached_tokens(data) == expected
