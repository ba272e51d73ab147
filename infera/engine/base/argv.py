"""Reading engine flags out of a pass-through argv without consuming or reordering it."""
from __future__ import annotations

from typing import Sequence


def flag_values(argv: Sequence[str], *names: str) -> list[str] | None:
    """Values after the last occurrence of any of ``names`` (``--f v1 v2`` or ``--f=v``).

    Returns None when the flag is absent, [] for a bare switch.
    """
    found: list[str] | None = None
    i = 0
    while i < len(argv):
        tok = argv[i]
        for name in names:
            if tok == name:
                vals = []
                j = i + 1
                while j < len(argv) and not (argv[j].startswith("-") and len(argv[j]) > 1 and not _is_number(argv[j])):
                    vals.append(argv[j])
                    j += 1
                found = vals
                break
            if tok.startswith(name + "="):
                found = [tok[len(name) + 1:]]
                break
        i += 1
    return found


def flag_value(argv: Sequence[str], *names: str, default: str | None = None) -> str | None:
    vals = flag_values(argv, *names)
    if not vals:
        return default
    return vals[0]


def has_flag(argv: Sequence[str], *names: str) -> bool:
    return flag_values(argv, *names) is not None


def _is_number(tok: str) -> bool:
    try:
        float(tok)
        return True
    except ValueError:
        return False
