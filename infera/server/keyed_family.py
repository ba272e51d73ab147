"""A metric family with one sample (or one histogram) per row of label values, written straight to
the text exposition: the KV views' per-target series, ~25,000 of them at 1,000 workers.

prometheus_client builds a ``Sample`` (a tuple and a label dict) per series and formats each one
again in ``generate_latest``: at 1,000 workers most of a scrape's CPU, and objects enough to set off
full garbage collections (which hold the GIL) while the event loop serves. :meth:`KeyedFamily.write`
writes the same lines from plain rows, each label value escaped once per page (``Escapes``);
:meth:`KeyedFamily.to_metric` makes the library's family for a plain ``collect()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

__all__ = ["Escapes", "KeyedFamily", "cumulative"]

Kind = Literal["counter", "gauge", "histogram"]

# A value as the exposition writes it (the library's own formatting: +Inf, NaN, Go's exponents).
_value: Callable[[float], str] = floatToGoString


class Escapes(dict[str, str]):
    """Label values as the exposition quotes them, each escaped once per page."""

    def __missing__(self, value: str) -> str:
        escaped = self[value] = value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
        return escaped


def cumulative(bounds: Sequence[str], counts: Sequence[int]) -> list[tuple[str, int]]:
    """Counts per bucket (the last one +Inf) as Prometheus's cumulative (le, count) pairs."""
    out, running = [], 0
    for bound, n in zip((*bounds, "+Inf"), counts):
        running += n
        out.append((bound, running))
    return out


class KeyedFamily:
    """``kind`` rows: counter and gauge ``add(values, value)``; histogram ``add(values, counts,
    total)`` with ``counts`` per bucket of ``bounds`` (not cumulative), the last one +Inf."""

    __slots__ = ("bounds", "doc", "kind", "labels", "name", "rows")

    def __init__(self, name: str, kind: Kind, doc: str, labels: Sequence[str], bounds: Sequence[str] = ()) -> None:
        self.name = name
        self.kind = kind
        self.doc = doc
        self.labels = tuple(labels)
        self.bounds = tuple(bounds)  # a histogram's bucket bounds, formatted as their le labels
        # (label values, value or a histogram's counts per bucket, a histogram's sum)
        self.rows: list[tuple[tuple[str, ...], Any, float]] = []

    def add(self, values: tuple[str, ...], value: float | Sequence[int], total: float = 0.0) -> None:
        self.rows.append((values, value, total))

    def to_metric(self) -> Metric:
        """The library's family of the same samples."""
        if self.kind == "histogram":
            hist = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
            for values, counts, total in self.rows:
                hist.add_metric(list(values), cumulative(self.bounds, counts), total)
            return hist
        fam = (CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily)(
            self.name, self.doc, labels=self.labels
        )
        for values, value, _ in self.rows:
            fam.add_metric(list(values), value)
        return fam

    def write(self, out: list[str], escapes: Escapes, first: str = "") -> None:
        """This family's lines as ``generate_latest`` writes them (labels in name order), joined
        into one string: its small line strings are freed before the next family's are made.
        ``first``: a label written first in every sample's set (``process="1"``: what
        ``metrics.label_process`` would add), as it is written."""
        name = self.name + "_total" if self.kind == "counter" else self.name
        doc = self.doc.replace("\\", r"\\").replace("\n", r"\n")
        lines = [f"# HELP {name} {doc}\n# TYPE {name} {self.kind}\n"]
        order = sorted(range(len(self.labels)), key=self.labels.__getitem__)
        names = [self.labels[i] for i in order]
        if self.kind == "histogram":
            self._write_histogram(lines, name, names, order, escapes, first)
        elif len(names) == 1:  # (most of a page: a worker_id each)
            head = f'{name}{{{first},{names[0]}="' if first else f'{name}{{{names[0]}="'
            lines.extend([f'{head}{escapes[values[0]]}"}} {_value(value)}\n' for values, value, _ in self.rows])
        else:
            lead = [first] if first else []
            for values, value, _ in self.rows:
                labelset = ",".join([*lead, *[f'{n}="{escapes[values[i]]}"' for n, i in zip(names, order)]])
                lines.append(f"{name}{{{labelset}}} {_value(value)}\n" if labelset else f"{name} {_value(value)}\n")
        out.append("".join(lines))

    def _write_histogram(
        self, lines: list[str], name: str, names: list[str], order: list[int], escapes: Escapes, first: str
    ) -> None:
        # le goes where its name sorts among the family's labels
        before = [(n, i) for n, i in zip(names, order) if n < "le"]
        after = [(n, i) for n, i in zip(names, order) if n >= "le"]
        bounds = (*self.bounds, "+Inf")
        lead = f"{first}," if first else ""
        for values, counts, total in self.rows:
            pre = lead + "".join([f'{n}="{escapes[values[i]]}",' for n, i in before])
            post = "".join([f',{n}="{escapes[values[i]]}"' for n, i in after])
            running = 0
            for bound, n in zip(bounds, counts):
                running += n
                lines.append(f'{name}_bucket{{{pre}le="{bound}"{post}}} {_value(running)}\n')
            labelset = (pre + post[1:]) if post else pre[:-1]
            braces = f"{{{labelset}}}" if labelset else ""
            lines.append(f"{name}_count{braces} {_value(running)}\n{name}_sum{braces} {_value(total)}\n")
