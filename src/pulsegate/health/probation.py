"""Half-open probation (R8): a recovered backend earns its traffic back in small steps.

For `duration` seconds after rejoining, every micro-inference must succeed (the rules fail
probation on the first failure of any kind), at least one must have run, and at the end the
smoothed latency must be back under baseline x 1.5 - or within 1.5x of its peers' latency,
when the whole pool is slower than its baselines (see `shortfall`). Meanwhile traffic ramps:
the ramp factor starts at `ramp_step` and grows by `ramp_step` every `duration x ramp_step`
seconds, reaching 1.0 exactly at `duration`.

Worked example with the defaults (60 s, 0.01): k whole steps of 0.6 s have passed after
k x 0.6 s and the factor is max(0.01, 0.01 x k): 0.01 until 1.2 s, 0.02 at 1.2 s, 0.50 at 30 s,
0.99 at 59.4 s, and 1.0 only at 60 s, when probation passes.
"""

from __future__ import annotations

import math

LATENCY_TOLERANCE = 1.5  # smoothed latency must end under baseline x 1.5


class Probation:
    """The ramp and bookkeeping of one probation period (pure arithmetic on `now`)."""

    __slots__ = ("_steps", "duration", "micro_ok", "ramp_step", "started")

    def __init__(self, duration: float, ramp_step: float) -> None:
        self.reconfigure(duration, ramp_step)
        self.started = float("-inf")
        self.micro_ok = 0  # micro-inferences passed during this probation

    def reconfigure(self, duration: float, ramp_step: float) -> None:
        """A reloaded duration and ramp step. A probation under way keeps its start and its
        micro-inferences, and follows the new ramp from that start (a shorter duration already
        over ends it at the next tick)."""
        self.duration = max(0.0, duration)
        self.ramp_step = min(1.0, max(1e-6, ramp_step))
        # Steps to reach 1.0 (100 for 0.01); ceil so that step x (steps - 1) < 1.
        self._steps = max(1, math.ceil(1.0 / self.ramp_step - 1e-9))

    def start(self, now: float) -> None:
        """Begin a probation period at `now`."""
        self.started = now
        self.micro_ok = 0

    def micro_passed(self) -> None:
        """Count one micro-inference that succeeded during this probation."""
        self.micro_ok += 1

    def elapsed(self, now: float) -> float:
        """Seconds since the start (0 before it)."""
        return max(0.0, now - self.started)

    def done(self, now: float) -> bool:
        """Whether the full duration has passed."""
        return self.elapsed(now) >= self.duration

    def progress(self, now: float) -> float:
        """Share of the period passed, 0..1."""
        if self.duration <= 0.0:
            return 1.0
        return min(1.0, self.elapsed(now) / self.duration)

    def ramp(self, now: float) -> float:
        """Traffic factor at `now`: ramp_step x whole steps passed, at least ramp_step,
        below 1.0 until the duration is over, then 1.0."""
        if self.done(now):
            return 1.0
        k = int(self.elapsed(now) * self._steps / self.duration)
        k = min(k, self._steps - 1)
        return max(self.ramp_step, min(1.0, k * self.ramp_step))

    def next_step_at(self, now: float) -> float:
        """When the ramp next changes (the end of the period at the latest)."""
        if self.done(now):
            return now
        k = int(self.elapsed(now) * self._steps / self.duration) + 1
        return min(self.started + self.duration, self.started + k * self.duration / self._steps)

    def shortfall(
        self,
        latency_ratio: float | None,
        own_s: float | None = None,
        peers_s: float | None = None,
    ) -> str | None:
        """Why the period may not pass at its end, or None if it may.

        An unknown latency ratio is no evidence against; a micro-inference that never ran is
        (a recovered node must prove its compute pipeline, R8). Latency over its own
        baseline x 1.5 fails, unless the backend's smoothed probe latency `own_s` is within
        1.5x of `peers_s`, the median of its peers in service: then the whole pool is slower
        (load, a shared network path) and this backend is no worse than what already serves.
        """
        if self.micro_ok == 0:
            return "no micro-inference succeeded during probation"
        if latency_ratio is None or latency_ratio <= LATENCY_TOLERANCE:
            return None
        if self.excused_by_peers(latency_ratio, own_s, peers_s):
            return None
        peers = "" if peers_s is None else f"; its peers answer in {peers_s * 1000:.0f} ms"
        return (
            f"latency still {latency_ratio:.1f}x baseline at the end of probation "
            f"(must be under {LATENCY_TOLERANCE:g}x){peers}"
        )

    def summary(
        self, latency_ratio: float | None, own_s: float | None, peers_s: float | None
    ) -> str:
        """A passed probation in words: its length, the micro-inferences that passed, the
        latency (and the peers that excused it)."""
        lat = "unknown" if latency_ratio is None else f"{latency_ratio:.2f}x baseline"
        if self.excused_by_peers(latency_ratio, own_s, peers_s):
            assert own_s is not None and peers_s is not None
            lat += (
                f" but {own_s * 1000:.0f} ms against its peers' {peers_s * 1000:.0f} ms "
                "(the slowdown is shared)"
            )
        return (
            f"recovered: {self.duration:g}s probation passed, {self.micro_ok} micro-inferences "
            f"ok, latency {lat}"
        )

    @staticmethod
    def excused_by_peers(
        latency_ratio: float | None, own_s: float | None, peers_s: float | None
    ) -> bool:
        """Slow against its own baseline, but within 1.5x of its peers in service."""
        return (
            latency_ratio is not None
            and latency_ratio > LATENCY_TOLERANCE
            and own_s is not None
            and peers_s is not None
            and own_s <= LATENCY_TOLERANCE * peers_s
        )
