"""Which tokenizer an engine was started with, for the worker record (``tokenizer``,
``tokenizer_sha256``): a kv-aware server with no ``--router-tokenizer-path`` loads what its
workers name, so prompts hash in the engines' token space.

Read from the engine's own flags: ``--tokenizer`` (vLLM, ATOM) or ``--tokenizer-path`` (SGLang),
else the model (``--model``, ``--model-path``). A local path is made absolute; a hub id is kept.
The simulator (and its stand-ins) load a folder's ``tokenizer.json`` and otherwise their built-in
tokenizer, whatever the name: that is recorded as ``BUILTIN_TOKENIZER``.
"""
from __future__ import annotations

import os
from typing import Sequence

from infera.discovery.record import BUILTIN_TOKENIZER, tokenizer_fingerprint
from infera.engine.base.argv import flag_value

TOKENIZER_FLAGS = ("--tokenizer", "--tokenizer-path")
MODEL_FLAGS = ("--model", "--model-path")
SIM_MODULE = "infera.engine.sim"


def tokenizer_source(engine_argv: Sequence[str], *, sim: bool) -> str | None:
    """What the record's ``tokenizer`` says (None: the argv names no model)."""
    named = flag_value(engine_argv, *TOKENIZER_FLAGS) or flag_value(engine_argv, *MODEL_FLAGS)
    if not named:
        return None
    if sim:
        return os.path.abspath(named) if os.path.isfile(os.path.join(named, "tokenizer.json")) else BUILTIN_TOKENIZER
    return os.path.abspath(named) if os.path.exists(named) else named


def runs_sim_tokenizer(engine: str, entrypoint: str | None) -> bool:
    """The simulator, or a sim stand-in for another engine (``--engine-entrypoint`` into
    ``infera.engine.sim``): they tokenize as the simulator does."""
    return engine == "sim" or SIM_MODULE in (entrypoint or "")


def tokenizer_fields(engine: str, engine_argv: Sequence[str], entrypoint: str | None = None) -> dict[str, str | None]:
    """The record's tokenizer fields. Hashes a file: call it off the event loop."""
    source = tokenizer_source(engine_argv, sim=runs_sim_tokenizer(engine, entrypoint))
    if source is None:
        return {}
    return {"tokenizer": source, "tokenizer_sha256": tokenizer_fingerprint(source)}
