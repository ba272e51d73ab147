"""Reading the few engine metrics the launcher needs from Prometheus text."""
from __future__ import annotations

import re
from typing import Iterator

_LABELS = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str) -> Iterator[tuple[str, str, float]]:
    """``(name, labels, value)`` per sample line (``labels`` is the raw ``{…}`` text, or "");
    lines that do not parse are skipped."""
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        series, _, value = line.rpartition(" ")
        brace = series.find("{")
        name, labels = (series, "") if brace < 0 else (series[:brace], series[brace:])
        try:
            yield name, labels, float(value)
        except ValueError:
            continue


def sample_sum(text: str, name: str, label: str = "") -> float:
    """Sum of the samples of metric ``name`` whose labels contain ``label`` (e.g. 'source="x"')."""
    return sum(v for n, labels, v in samples(text) if n == name and label in labels)


def sum_samples(text: str, names: tuple[str, ...]) -> int | None:
    """Sum of every sample (all label sets) of the named metrics; None if none is present."""
    found = [v for n, _, v in samples(text) if n in names]
    return int(sum(found)) if found else None


def info_labels(text: str, name: str) -> dict[str, str] | None:
    """Labels of the first sample of an info-style metric (e.g. ``vllm:cache_config_info``)."""
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return dict(_LABELS.findall(line[len(name) + 1:line.rfind("}")]))
    return None


VLLM_INFLIGHT = ("vllm:num_requests_running", "vllm:num_requests_waiting")
