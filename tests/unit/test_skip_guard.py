"""``make test`` sets INFERA_E2E_REQUIRED=1, under which tests/conftest.py turns every skip (a
missing venv, wheel, browser or accelerator) into a failure with the skip's reason; without it a
skip stays a skip. Run on a throwaway module in a fresh pytest with the suite's conftest loaded."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

MODULE = '''
import pytest

def test_skips_at_run():
    pytest.skip("no widget installed")

@pytest.mark.skipif(True, reason="marked off")
def test_skipped_by_mark():
    pass

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    assert False

def test_passes():
    pass
'''


def _pytest_on_module(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_throwaway.py").write_text(MODULE)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("INFERA_")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           "-rA", str(tmp_path / "test_throwaway.py")],
                          cwd=ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=120)


def test_a_skip_is_a_failure_where_every_component_is_required(tmp_path):
    done = _pytest_on_module(tmp_path, INFERA_E2E_REQUIRED="1")
    out = done.stdout
    assert done.returncode == 1, out[-3000:]
    assert "1 failed, 1 passed, 1 xfailed, 1 error" in out and "skipped" not in out.splitlines()[-1]
    assert "where nothing may be missing: Skipped: no widget installed" in out
    assert "where nothing may be missing: Skipped: marked off" in out


@pytest.mark.parametrize("value", [None, "0"])
def test_a_skip_stays_a_skip_otherwise(tmp_path, value):
    done = _pytest_on_module(tmp_path, **({} if value is None else {"INFERA_E2E_REQUIRED": value}))
    assert done.returncode == 0 and "1 passed, 2 skipped, 1 xfailed" in done.stdout, done.stdout[-3000:]
