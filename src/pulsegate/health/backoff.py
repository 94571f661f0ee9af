"""Ejection backoff, after Envoy's outlier detector: base x n, capped, plus jitter.

n counts ejections not yet forgiven. Each ejection raises n by one and keeps the backend out
for at least min(base x n, cap) plus up to 10% jitter (so a fleet ejected together does not
return together). While the backend stays healthy, n drops by one every 6 x base seconds.

Worked example with the defaults (base 5 s, cap 300 s): ejected, back, ejected again within
30 s -> out 10 s (+ <= 1 s); a third time -> 15 s. After 30 s of health n falls back from 3 to 2,
after 90 s to 0. A backend that keeps failing reaches 300 s after 60 ejections in a row.
"""

from __future__ import annotations

import random

JITTER = 0.10  # up to 10% of the backoff is added at random
DECAY_BASES = 6  # one step of n is forgiven per 6 x base seconds of health


class Backoff:
    """How long an ejected backend stays out, with the ejection count that drives it."""

    __slots__ = ("_healthy_since", "base", "cap", "decay_every", "n", "rng", "total", "until")

    def __init__(self, base: float, cap: float, rng: random.Random) -> None:
        self.base = base
        self.cap = max(cap, base)
        self.rng = rng
        self.decay_every = base * DECAY_BASES
        self.n = 0  # ejections in a row, not yet forgiven
        self.total = 0  # ejections ever (for display)
        self.until = float("-inf")  # earliest time the backend may leave ejection
        self._healthy_since: float | None = None

    def reconfigure(self, base: float, cap: float) -> None:
        """A reloaded base and cap: they shape the next ejection and the forgiveness period;
        n, the total and the current `until` are kept (an ejected backend stays out as long
        as it was told)."""
        self.base = base
        self.cap = max(cap, base)
        self.decay_every = base * DECAY_BASES

    def duration(self) -> float:
        """The backoff for the current n, without jitter: min(base x n, cap)."""
        return min(self.base * max(self.n, 1), self.cap)

    def eject(self, now: float) -> float:
        """Count one ejection at `now`; returns how long the backend stays out."""
        self.n += 1
        self.total += 1
        d = self.duration()
        d += self.rng.uniform(0.0, JITTER * d)
        self.until = now + d
        self._healthy_since = None
        return d

    def elapsed(self, now: float) -> bool:
        """Whether the backoff of the last ejection is over."""
        return now >= self.until

    def healthy(self, now: float) -> None:
        """Note that the backend is healthy at `now`; forgives one step per decay period."""
        if self.n <= 0:
            self._healthy_since = None
            return
        if self._healthy_since is None:
            self._healthy_since = now
        elif now - self._healthy_since >= self.decay_every:
            self.n -= 1
            self._healthy_since = now

    def unhealthy(self) -> None:
        """Note that the backend is not healthy: the forgiveness clock restarts."""
        self._healthy_since = None
