"""A small Prometheus registry tuned for the proxy path.

Why not prometheus_client: its metrics take a lock and build label objects per call; here a
counter increment is one dict lookup on a tuple key, and histograms use bisect on fixed
buckets. Everything runs on one event loop thread, so no locks are needed.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    if not names:
        return ""
    return "{" + ",".join(f'{n}="{_esc(v)}"' for n, v in zip(names, values, strict=True)) + "}"


class Counter:
    def __init__(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.doc, self.labelnames = name, doc, labels
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, labels: tuple[str, ...] = (), amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def get(self, labels: tuple[str, ...] = ()) -> float:
        return self.values.get(labels, 0.0)

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.doc}"
        yield f"# TYPE {self.name} counter"
        for k, v in self.values.items():
            yield f"{self.name}{_labels(self.labelnames, k)} {v:g}"


class Histogram:
    def __init__(
        self,
        name: str,
        doc: str,
        labels: tuple[str, ...] = (),
        buckets: tuple[float, ...] = LATENCY_BUCKETS,
    ) -> None:
        self.name, self.doc, self.labelnames, self.buckets = name, doc, labels, buckets
        # per label set: [count per bucket..., +Inf count], sum
        self.values: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, value: float, labels: tuple[str, ...] = ()) -> None:
        entry = self.values.get(labels)
        if entry is None:
            entry = self.values[labels] = ([0] * (len(self.buckets) + 1), [0.0])
        entry[0][bisect.bisect_left(self.buckets, value)] += 1
        entry[1][0] += value

    def count(self, labels: tuple[str, ...] = ()) -> int:
        entry = self.values.get(labels)
        return sum(entry[0]) if entry else 0

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.doc}"
        yield f"# TYPE {self.name} histogram"
        for k, (counts, total) in self.values.items():
            base = _labels(self.labelnames, k)
            inner = base[1:-1] + "," if base else ""
            cum = 0
            for b, c in zip(self.buckets, counts, strict=False):
                cum += c
                yield f'{self.name}_bucket{{{inner}le="{b:g}"}} {cum}'
            cum += counts[-1]
            yield f'{self.name}_bucket{{{inner}le="+Inf"}} {cum}'
            yield f"{self.name}_sum{base} {total[0]:.6f}"
            yield f"{self.name}_count{base} {cum}"


class Gauge:
    """A gauge whose samples are computed at scrape time by `collect` (`kind="counter"`: a
    counter kept elsewhere, read at scrape time)."""

    def __init__(
        self,
        name: str,
        doc: str,
        labels: tuple[str, ...],
        collect: Callable[[], Iterable[tuple[tuple[str, ...], float]]],
        kind: str = "gauge",
    ) -> None:
        self.name, self.doc, self.labelnames, self.collect = name, doc, labels, collect
        self.kind = kind

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.doc}"
        yield f"# TYPE {self.name} {self.kind}"
        for k, v in self.collect():
            yield f"{self.name}{_labels(self.labelnames, k)} {v:g}"


class Registry:
    def __init__(self) -> None:
        self.metrics: list[Counter | Histogram | Gauge] = []

    def add(self, metric: Counter | Histogram | Gauge) -> None:
        self.metrics.append(metric)

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        c = Counter(name, doc, labels)
        self.add(c)
        return c

    def histogram(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Histogram:
        h = Histogram(name, doc, labels)
        self.add(h)
        return h

    def render(self) -> str:
        lines: list[str] = []
        for m in self.metrics:
            lines.extend(m.render())
        lines.append("")
        return "\n".join(lines)
