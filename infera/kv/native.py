"""Which implementation runs the router's per-block and per-token loops: the C accelerator
``infera.kv._native`` (built with the package where a C compiler is at hand), or Python.

Both compute the same values: the accelerator hashes with the xxhash package's own library, and
``tests/unit/test_native.py`` checks every function against its Python twin. ``INFERA_NATIVE=0``
turns the accelerator off (the Python code then runs, as where it is not built); ``make test``
sets ``INFERA_NATIVE_REQUIRED=1``, under which a missing accelerator fails the tests instead.
"""
from __future__ import annotations

import os
from types import ModuleType

NATIVE_ENV = "INFERA_NATIVE"
_OFF = ("0", "off", "false", "no")


def _load() -> tuple[ModuleType | None, str | None]:
    if os.environ.get(NATIVE_ENV, "").strip().lower() in _OFF:
        return None, f"turned off by {NATIVE_ENV}"
    try:
        from infera.kv import _native
    except ImportError as exc:
        return None, f"not built or not loadable: {exc}"
    return _native, None


#: the accelerator module, or None (then ``why_not`` says why)
native, why_not = _load()


def describe() -> str:
    """One line for the logs: which implementation runs."""
    return "native (infera.kv._native)" if native is not None else f"python ({why_not})"
