"""A few Prometheus metrics, kept in process and rendered as the text exposition format.

Deliberately tiny (counters and cumulative histograms keyed by label tuples): the hot
path pays a dict update, nothing more.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

CounterKey = tuple[str, tuple[tuple[str, str], ...]]  # name, sorted labels

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    """A cumulative histogram's bucket counts and sum (:meth:`Metrics.histogram`)."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(_BUCKETS, seconds)] += 1
        self.sum += seconds


class Metrics:
    def __init__(self) -> None:
        self.counters: dict[CounterKey, float] = defaultdict(float)
        self._hist: dict[str, Histogram] = {}
        self._help: dict[str, str] = {}

    def inc(self, name: str, amount: float = 1.0, help_text: str = "", **labels: str) -> None:
        self.counters[self.key(name, help_text, **labels)] += amount

    def key(self, name: str, help_text: str = "", **labels: str) -> CounterKey:
        """A counter's key, for :meth:`add` (a hot path keeps its keys instead of labels)."""
        if help_text:
            self._help.setdefault(name, help_text)
        return name, tuple(sorted(labels.items()))

    def add(self, key: CounterKey, amount: float = 1.0) -> None:
        self.counters[key] += amount

    def observe(self, name: str, seconds: float, help_text: str = "") -> None:
        self.histogram(name, help_text).observe(seconds)

    def histogram(self, name: str, help_text: str = "") -> Histogram:
        """The histogram ``name`` (created empty): a hot path keeps it and calls its ``observe``."""
        if help_text:
            self._help.setdefault(name, help_text)
        histogram = self._hist.get(name)
        if histogram is None:
            histogram = self._hist[name] = Histogram()
        return histogram

    def render(self) -> str:
        lines: list[str] = []
        for name in sorted({n for n, _ in self.counters}):
            lines += [f"# HELP {name} {self._help.get(name, name)}", f"# TYPE {name} counter"]
            for (n, labels), value in sorted(self.counters.items()):
                if n == name:
                    lines.append(f"{name}{_labels(labels)} {value:g}")
        for name, histogram in sorted(self._hist.items()):
            lines += [f"# HELP {name} {self._help.get(name, name)}", f"# TYPE {name} histogram"]
            running = 0
            for bound, count in zip((*_BUCKETS, float("inf")), histogram.counts, strict=True):
                running += count
                le = "+Inf" if bound == float("inf") else f"{bound:g}"
                lines.append(f'{name}_bucket{{le="{le}"}} {running}')
            lines += [f"{name}_sum {histogram.sum:g}", f"{name}_count {running}"]
        return "\n".join(lines) + "\n"


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}"
