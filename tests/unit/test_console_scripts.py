"""The console scripts beside the ``python -m`` forms: every one pyproject.toml declares points at a
callable that exists, is installed in the environment's bin folder, and answers ``--help``."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    SCRIPTS = tomllib.load(f)["project"]["scripts"]
BIN = os.path.dirname(sys.executable)
# one per python -m form: infera.up, .server, .gaie, .kvd, .operator, .engine.{vllm,sglang,atom,sim}, .preflight
COMMANDS = {"infera-up", "infera-server", "infera-gaie", "infera-kvd", "infera-operator", "infera-vllm",
            "infera-sglang", "infera-atom", "infera-sim", "infera-preflight"}


def test_every_entry_point_of_the_python_m_forms_has_a_script():
    assert set(SCRIPTS) == COMMANDS


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_the_script_resolves_and_answers_help(name):
    module, _, attr = SCRIPTS[name].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    path = os.path.join(BIN, name)
    assert os.access(path, os.X_OK), f"{name} is not installed in {BIN} (pip install -e .)"
    out = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage" in (out.stdout + out.stderr).lower()
