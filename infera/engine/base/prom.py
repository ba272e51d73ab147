"""Reading the few engine metrics the launcher needs from Prometheus text."""
from __future__ import annotations

import re

_LABELS = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def sum_samples(text: str, names: tuple[str, ...]) -> int | None:
    """Sum of every sample (all label sets) of the named metrics; None if none is present."""
    total = 0.0
    seen = False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
        if name_end < 0 or line[:name_end] not in names:
            continue
        try:
            total += float(line.rsplit(" ", 1)[1])
            seen = True
        except (ValueError, IndexError):
            return None
    return int(total) if seen else None


def info_labels(text: str, name: str) -> dict[str, str] | None:
    """Labels of the first sample of an info-style metric (e.g. ``vllm:cache_config_info``)."""
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return dict(_LABELS.findall(line[len(name) + 1:line.rfind("}")]))
    return None


VLLM_INFLIGHT = ("vllm:num_requests_running", "vllm:num_requests_waiting")
