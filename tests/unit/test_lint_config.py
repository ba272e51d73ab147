"""The lint ratchet's lists stay honest (make lint; pyproject.toml's [tool.ruff] and [tool.mypy]): every
file held strict exists and no legacy exception hides errors in it, and every legacy exception names a
file or module that still exists, so the lists only shrink as the code is fixed."""

from __future__ import annotations

import glob
import re
from pathlib import Path
from typing import Any

import pytest

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parents[2]


def strict_files() -> list[str]:
    """The Makefile's LINT_STRICT, its ``$(wildcard ...)`` entries expanded."""
    text = (REPO / "Makefile").read_text()
    m = re.search(r"^LINT_STRICT :=((?:.*\\\n)*.*)$", text, re.M)
    assert m is not None, "the Makefile has no LINT_STRICT"
    files: list[str] = []
    for word in re.findall(r"\$\(wildcard [^)]*\)|\S+", m.group(1).replace("\\\n", " ")):
        if word.startswith("$(wildcard "):
            files += sorted(str(Path(p).relative_to(REPO)) for p in glob.glob(str(REPO / word[11:-1])))
        else:
            files.append(word)
    return files


def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())  # type: ignore[no-any-return]


def legacy_mypy_modules() -> set[str]:
    """Our modules with errors mypy is told to let pass (not third-party modules without stubs)."""
    out: set[str] = set()
    for override in pyproject()["tool"]["mypy"]["overrides"]:
        if "disable_error_code" in override or override.get("ignore_errors"):
            out.update(override["module"])
    return out


def module_of(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def test_strict_files_exist_and_are_python() -> None:
    files = strict_files()
    assert files and len(files) == len(set(files))
    for f in files:
        assert f.endswith(".py") and (REPO / f).is_file(), f


def test_no_legacy_exception_masks_a_strict_file() -> None:
    masked = sorted({module_of(f) for f in strict_files()} & legacy_mypy_modules())
    assert not masked, f"strict files with a mypy legacy exception in pyproject.toml (it would hide errors): {masked}"


def test_every_legacy_exception_names_something_that_exists() -> None:
    for module in legacy_mypy_modules():
        path = REPO / module.replace(".", "/")
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), f"stale mypy exception: {module}"
    for pattern in pyproject()["tool"]["ruff"]["lint"]["per-file-ignores"]:
        assert glob.glob(str(REPO / pattern), recursive=True), f"stale ruff exception: {pattern}"
