"""The accelerator guard: under ``INFERA_NATIVE_REQUIRED=1`` (``make test``) a missing or turned-off C
accelerator is a failure, never a skip. This module has no skip marks: the setup.py extension is
``optional=True``, so a broken C build would otherwise leave every C test skipped and the run green."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from infera.kv.native import native, why_not

ROOT = Path(__file__).resolve().parents[2]


def test_native_is_built_where_required():
    if os.environ.get("INFERA_NATIVE_REQUIRED") == "1":
        assert native is not None, f"the C accelerator is required here but {why_not}"


def _run_guard(**env: str) -> subprocess.CompletedProcess:
    """pytest on the guard alone, in a fresh interpreter (the accelerator is chosen at import)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("INFERA_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         f"{Path(__file__).relative_to(ROOT)}::test_native_is_built_where_required"],
        cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=120)


def test_the_guard_fails_when_the_accelerator_is_off_but_required():
    done = _run_guard(INFERA_NATIVE="0", INFERA_NATIVE_REQUIRED="1")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "1 failed" in done.stdout and "skipped" not in done.stdout
    assert "turned off by INFERA_NATIVE" in done.stdout  # the failure says why


def test_the_guard_passes_when_the_accelerator_is_off_and_not_required():
    done = _run_guard(INFERA_NATIVE="0")
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-2000:]
