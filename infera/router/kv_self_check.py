"""What the kv-aware policy predicts for the self-check: the server compares, per worker, the
prompt tokens the engine reports as cached with the tokens the pick predicted would be
(``predicted_hit_blocks`` in the request's state, 0 when the pick was made by load alone while a
view warmed up: ``kv_load_only``), in ``infera/server/kv.py``. This module owns the conversion from
predicted hit blocks to the cached tokens an engine can report.
"""
from __future__ import annotations


def predicted_cached_tokens(hit_blocks: int, block_size: int, prompt_tokens: int) -> int:
    """What the engine should report as cached: full hit blocks, but never the whole prompt
    (vLLM always recomputes at least the last prompt token, dropping that block's hit)."""
    if block_size <= 0 or prompt_tokens <= 0:
        return 0
    return min(hit_blocks * block_size, ((prompt_tokens - 1) // block_size) * block_size)
