"""The first-byte watch: in-flight evidence before any probe fires.

A stream still waiting for its first token after `OVERDUE_FACTOR` times its backend's usual
time to first token (and at least `OVERDUE_FLOOR_S`) is evidence against the backend: the
watch reports `FirstByteOverdue`, at most once per limit period per backend (evidence, not a
flood). Time our own loop stood still is not the backend's delay. `check(now)` does the
work and is driven by the owner's loop every `WATCH_INTERVAL_S`; tests call it by hand.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from pulsegate.clock import Clock, running
from pulsegate.health.observations import FirstByteOverdue, Observation

OVERDUE_FACTOR = 4.0
OVERDUE_FLOOR_S = 0.5
WATCH_INTERVAL_S = 0.05


class FirstByteWatch:
    __slots__ = ("_clock", "_report", "_reported", "_tokens", "_usual", "_waiting")

    def __init__(
        self,
        names: Iterable[str],
        clock: Clock,
        usual_ttft: Callable[[str, float], float | None],
        report: Callable[[str, Observation], None],
    ) -> None:
        self._clock = clock
        self._usual = usual_ttft
        self._report = report
        self._waiting: dict[str, dict[int, float]] = {n: {} for n in names}
        self._reported: dict[str, float] = {}
        self._tokens = itertools.count()

    def track(self, names: Iterable[str]) -> None:
        """Watch these backends from now on (a reload added them); others stay as they are
        until `forget`."""
        for n in names:
            self._waiting.setdefault(n, {})

    def forget(self, name: str) -> None:
        """A removed backend whose last request ended."""
        self._waiting.pop(name, None)
        self._reported.pop(name, None)

    def watch(self, name: str, t0: float) -> int:
        token = next(self._tokens)
        self._waiting[name][token] = t0
        return token

    def seen(self, name: str, token: int) -> None:
        self._waiting[name].pop(token, None)

    def check(self, now: float) -> None:
        for name, waiting in self._waiting.items():
            if not waiting:
                continue
            since = min(waiting.values())
            oldest = now - since
            limit = max(OVERDUE_FLOOR_S, OVERDUE_FACTOR * (self._usual(name, now) or 0.0))
            if oldest < limit:
                continue
            # Time our own loop stood still is not the backend's delay (pulsegate.clock).
            oldest = running(self._clock, since, now)
            if oldest < limit:
                continue
            last = self._reported.get(name, -1e9)
            if now - last < limit:
                continue
            self._reported[name] = now
            count = sum(1 for t in waiting.values() if now - t >= limit)
            self._report(name, FirstByteOverdue(count, oldest))
