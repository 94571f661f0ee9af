"""One `/metrics` for the whole gateway: the workers' proxy metrics summed in the primary.

Each worker counts its own requests in its own registry (the proxy path is unchanged) and
sends the cumulative values of the proxy metrics (`proxy/metrics.py`) every STATS_INTERVAL_S
and when it stops.
The primary keeps the latest per worker slot, and a replaced worker's last values in a
`retired` sum so totals never go backwards (its levels, such as open client connections,
leave the sum: they died with it); it writes the sums into its own registry's
metrics of the same names, so `/metrics`, `/admin/summary` and the dashboard read them as
in a single process. The health-side metrics (ejections, probes, heartbeat RTT, gauges)
are the primary's own.
"""

from __future__ import annotations

from typing import Any

from pulsegate.observe.metrics import Counter, Histogram
from pulsegate.proxy.metrics import Level, ProxyMetrics

# Interval between a worker's metric updates: /metrics is at most this stale.
STATS_INTERVAL_S = 0.25

Snapshot = dict[str, dict[Any, Any]]


def snapshot(metrics: ProxyMetrics) -> Snapshot:
    """Copies of the proxy metrics' values: counters {labels: n}, histograms
    {labels: (bucket counts, sum)}."""
    out: Snapshot = {}
    for m in metrics.summed:
        if isinstance(m, Counter):
            out[m.name] = dict(m.values)
        elif isinstance(m, Histogram):
            out[m.name] = {k: (list(c), t[0]) for k, (c, t) in m.values.items()}
    return out


def _add(into: Snapshot, snap: Snapshot) -> None:
    for name, values in snap.items():
        acc = into.setdefault(name, {})
        for k, v in values.items():
            if isinstance(v, tuple):  # histogram: (bucket counts, sum)
                have = acc.get(k)
                if have is None:
                    acc[k] = (list(v[0]), v[1])
                else:
                    acc[k] = ([a + b for a, b in zip(have[0], v[0], strict=True)], have[1] + v[1])
            else:
                acc[k] = acc.get(k, 0.0) + v


class MetricsMerge:
    """Sums the workers' snapshots into the primary's registry."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self._targets: dict[str, Counter | Histogram] = {m.name: m for m in metrics.summed}
        # Levels (gauges) of a gone worker died with it: its open connections are closed.
        self._levels = frozenset(m.name for m in metrics.summed if isinstance(m, Level))
        self._live: dict[int, Snapshot] = {}
        self._retired: Snapshot = {}

    def update(self, slot: int, snap: Snapshot) -> None:
        self._live[slot] = snap
        self._apply()

    def retire(self, slot: int) -> None:
        """Worker `slot` is gone: its last counts stay in the totals, its levels leave them."""
        snap = self._live.pop(slot, None)
        if snap is not None:
            _add(self._retired, {n: v for n, v in snap.items() if n not in self._levels})
            self._apply()

    def _apply(self) -> None:
        total: Snapshot = {}
        _add(total, self._retired)
        for snap in self._live.values():
            _add(total, snap)
        for name, m in self._targets.items():
            values = total.get(name, {})
            if isinstance(m, Histogram):
                m.values = {k: (c, [s]) for k, (c, s) in values.items()}
            else:
                m.values = dict(values)
