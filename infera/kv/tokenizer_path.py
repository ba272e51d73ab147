"""Where a router tokenizer comes from: ``resolve_tokenizer_path`` turns ``--router-tokenizer-path``
(a folder, a ``tokenizer.json`` file, or a Hugging Face hub id when the hub is reachable) into the
folder the tokenizer is loaded from. ``infera.kv.prompt`` re-exports it."""
from __future__ import annotations

import os


def resolve_tokenizer_path(path: str) -> str:
    """A folder, a ``tokenizer.json`` file (→ its folder), or a hub id (only if the hub is reachable)."""
    if os.path.isfile(path):
        return os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise ValueError(f"router tokenizer folder {path!r} has no tokenizer.json")
        return path
    try:
        from huggingface_hub import snapshot_download  # optional: only for hub ids
    except ImportError:
        raise ValueError(f"router tokenizer {path!r} is not a local folder or file (and huggingface_hub is "
                         "not installed to resolve it as a hub id)") from None
    try:
        return snapshot_download(path, allow_patterns=["tokenizer*", "chat_template*", "special_tokens_map.json"])
    except Exception as exc:  # offline, unknown id, …
        raise ValueError(f"cannot resolve router tokenizer {path!r}: {exc}") from None
