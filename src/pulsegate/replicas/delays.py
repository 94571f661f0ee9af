"""The propagation delays this replica measured (publish on a peer -> folded here): the last
few thousand, for p50/p99 in `GET /admin/cluster`. Pure; the caller passes the values."""

from __future__ import annotations

import collections
import math


class Delays:
    def __init__(self, keep: int = 4096) -> None:
        self._values: collections.deque[float] = collections.deque(maxlen=keep)
        self.count = 0

    def add(self, seconds: float) -> None:
        self._values.append(max(0.0, seconds))
        self.count += 1

    def quantile(self, q: float) -> float | None:
        """The `q` quantile (nearest rank) of the values kept; None without one."""
        if not self._values:
            return None
        ordered = sorted(self._values)
        return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered)))) - 1]

    def summary_ms(self) -> dict[str, float | int | None]:
        p50, p99 = self.quantile(0.5), self.quantile(0.99)
        return {
            "count": self.count,
            "p50_ms": None if p50 is None else round(p50 * 1000, 3),
            "p99_ms": None if p99 is None else round(p99 * 1000, 3),
        }
