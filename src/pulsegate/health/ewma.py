"""Smoothing with explicit timestamps: every write takes `now`, no read ever mutates.

Three small estimators, one concept each (after linkerd's `ewma` crate):

- `Ewma`: fixed alpha per sample. R2 asks for heartbeat RTT smoothed with alpha 0.2: each new
  sample moves the value a fifth of the way, so a step change is 67% absorbed after 5 samples
  (1 - 0.8**5) and 89% after 10.
- `DecayingEwma`: the old value's weight halves every `half_life` seconds, whatever the sample
  rate. For gauges that arrive at uneven rates (a metrics scrape every second and agent pongs
  every 100 ms both report the queue): a burst of samples does not wipe the history faster.
- `ErrorRate`: decayed success and failure counts plus a prior of `prior` imaginary successes,
  so one failure on an idle backend reads 1 / (1 + 3) = 25%, not 100%, while a real outage with
  20 failures in the window reads 20 / 23 = 87%.

Staleness is the caller's business: each estimator exposes `at`, the time of its last sample.
"""

from __future__ import annotations

import math


def decay(elapsed: float, half_life: float) -> float:
    """The weight left to something `elapsed` seconds old: 1.0 now, 0.5 one half-life later.

    A negative elapsed time (a sample stamped before the last one) counts as zero: the clock is
    monotonic, but callers on different tasks may stamp a moment apart.
    """
    if elapsed <= 0.0:
        return 1.0
    if half_life <= 0.0:
        return 0.0
    return math.exp2(-elapsed / half_life)


class Ewma:
    """Exponentially weighted moving average with a fixed alpha per sample."""

    __slots__ = ("_value", "alpha", "at", "count")

    def __init__(self, alpha: float) -> None:
        self.set_alpha(alpha)
        self._value: float | None = None
        self.at: float | None = None  # time of the last sample
        self.count = 0  # samples seen (saturates; only compared against small floors)

    def set_alpha(self, alpha: float) -> None:
        """Weigh the samples from now on with `alpha`; the value so far is kept."""
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha

    def update(self, sample: float, now: float) -> None:
        """Fold one sample in; the first sample is taken as is."""
        v = self._value
        self._value = sample if v is None else v + self.alpha * (sample - v)
        self.at = now
        if self.count < 1_000_000:
            self.count += 1

    @property
    def value(self) -> float | None:
        """The smoothed value, None before the first sample."""
        return self._value

    def fresh(self, now: float, max_age: float) -> float | None:
        """The value if the last sample is at most `max_age` seconds old, else None."""
        if self.at is None or now - self.at > max_age:
            return None
        return self._value

    def reset(self) -> None:
        """Forget everything."""
        self._value = None
        self.at = None
        self.count = 0


class DecayingEwma:
    """Time-decayed EWMA: the previous value keeps weight 0.5 ** (elapsed / half_life)."""

    __slots__ = ("_value", "at", "half_life")

    def __init__(self, half_life: float) -> None:
        if half_life <= 0.0:
            raise ValueError(f"half_life must be positive, got {half_life}")
        self.half_life = half_life
        self._value: float | None = None
        self.at: float | None = None

    def update(self, sample: float, now: float) -> None:
        """Fold one sample in, weighted by the time since the previous one."""
        v = self._value
        if v is None or self.at is None:
            self._value = sample
        else:
            keep = decay(now - self.at, self.half_life)
            self._value = sample + keep * (v - sample)
        if self.at is None or now > self.at:
            self.at = now

    @property
    def value(self) -> float | None:
        """The smoothed value, None before the first sample."""
        return self._value

    def fresh(self, now: float, max_age: float) -> float | None:
        """The value if the last sample is at most `max_age` seconds old, else None."""
        if self.at is None or now - self.at > max_age:
            return None
        return self._value


class ErrorRate:
    """Share of failures among recent outcomes, from counts that halve every `half_life`.

    rate = failures / (failures + successes + prior). The prior is a handful of imaginary
    successes that never decay: with prior 3, one blip on an idle backend reads 25%, two in a
    row 40%; on a busy backend (hundreds of outcomes a half-life) the prior vanishes.
    `rate` is None until the first outcome: an unknown rate is left out of the score.
    """

    __slots__ = ("_fail", "_ok", "at", "half_life", "prior")

    def __init__(self, half_life: float, prior: float = 3.0) -> None:
        if half_life <= 0.0:
            raise ValueError(f"half_life must be positive, got {half_life}")
        if prior < 0.0:
            raise ValueError(f"prior must be >= 0, got {prior}")
        self.half_life = half_life
        self.prior = prior
        self._ok = 0.0
        self._fail = 0.0
        self.at: float | None = None

    def record(self, ok: bool, now: float) -> None:
        """Count one outcome at `now`."""
        if self.at is not None:
            keep = decay(now - self.at, self.half_life)
            if keep != 1.0:
                self._ok *= keep
                self._fail *= keep
        if ok:
            self._ok += 1.0
        else:
            self._fail += 1.0
        if self.at is None or now > self.at:
            self.at = now

    def rate(self, now: float) -> float | None:
        """Failure share at `now` (decayed, without mutating), None before any outcome."""
        if self.at is None:
            return None
        keep = decay(now - self.at, self.half_life)
        fail = self._fail * keep
        total = fail + self._ok * keep + self.prior
        if total <= 0.0:
            return 0.0
        return fail / total

    def volume(self, now: float) -> float:
        """Decayed number of outcomes (successes + failures) at `now`, without the prior."""
        if self.at is None:
            return 0.0
        return (self._ok + self._fail) * decay(now - self.at, self.half_life)
