"""The fp8 KV-cache default shared by the SGLang and vLLM launchers.

On a GPU host the engine gets ``--kv-cache-dtype fp8_e4m3`` (half the KV memory of bf16, so about
twice the cached prefixes a KV-aware router can route to) unless the user chose a dtype or turned
the default off with ``INFERA_DEFAULT_KV_FP8=0``. A CPU host keeps the engine's own default: the
CPU backends do not all implement fp8 KV. Every skip is logged with its reason.
"""
from __future__ import annotations

import logging
import os
from typing import Mapping, Sequence

from infera.config import parse_bool
from infera.engine.base.argv import flag_value, has_flag

KV_DTYPE_FLAG = "--kv-cache-dtype"
FP8_KV_DTYPE = "fp8_e4m3"
DEFAULT_KV_FP8_ENV = "INFERA_DEFAULT_KV_FP8"


def has_gpu() -> bool:
    """NVIDIA or ROCm device nodes: cheap, and no torch import in the launcher."""
    return os.path.exists("/dev/nvidia0") or os.path.exists("/dev/kfd")


def kv_fp8_decision(argv: Sequence[str], gpu_host: bool, environ: Mapping[str, str]) -> str | None:
    """None: append ``--kv-cache-dtype fp8_e4m3``; else why not. ValueError for a bad env value.

    The user's flag wins over the env, the env over the built-in default (on, for GPU hosts).
    """
    if has_flag(argv, KV_DTYPE_FLAG):
        return f"the user's {KV_DTYPE_FLAG} {flag_value(argv, KV_DTYPE_FLAG, default='')}".rstrip()
    raw = environ.get(DEFAULT_KV_FP8_ENV, "")
    if raw.strip():  # set but empty: as unset
        try:
            on = parse_bool(raw)
        except Exception:
            raise ValueError(f"{DEFAULT_KV_FP8_ENV} is not a boolean: {raw!r}") from None
        if not on:
            return f"{DEFAULT_KV_FP8_ENV}={raw}"
    if not gpu_host:
        return f"no GPU found ({FP8_KV_DTYPE} is a GPU default)"
    return None


def with_kv_fp8_default(argv: list[str], gpu_host: bool, environ: Mapping[str, str], engine: str, prog: str,
                        log: logging.Logger) -> list[str]:
    """``argv`` with ``--kv-cache-dtype fp8_e4m3`` appended when the default applies (logged either way)."""
    try:
        why_not = kv_fp8_decision(argv, gpu_host, environ)
    except ValueError as exc:
        raise SystemExit(f"{prog}: {exc}") from None
    if why_not is not None:
        log.info("KV-cache dtype: leaving %s's choice (%s)", engine, why_not)
        return argv
    log.info("KV-cache dtype: %s %s (GPU host default; set %s=0 or pass %s to choose)", KV_DTYPE_FLAG,
             FP8_KV_DTYPE, DEFAULT_KV_FP8_ENV, KV_DTYPE_FLAG)
    return [*argv, KV_DTYPE_FLAG, FP8_KV_DTYPE]
