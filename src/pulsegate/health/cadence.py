"""How often the probers look at a backend (R14): the slow intervals only while it is stable.

Stable means ready or drained, not suspect, and no failure or heartbeat miss in the last 30 s;
anything else (not ready, degraded, ejected, probation, suspect, failing) is probed at the
fast intervals.
"""

from __future__ import annotations

import enum

from pulsegate.health.signals import Signals
from pulsegate.health.verdict import State

UNSTABLE_HOLD_S = 30.0  # a failure keeps probing fast for this long

_STABLE_STATES = frozenset({State.READY, State.DRAINED})


class Cadence(enum.Enum):
    """How often the probers should look at a backend (R14)."""

    STABLE = "stable"  # the slow intervals
    UNSTABLE = "unstable"  # fast: not ready, degraded, ejected, probation, suspect, failing


def cadence(state: State, suspect: bool, s: Signals, now: float) -> Cadence:
    """Stable only when ready or drained, not suspect, and without a failure or heartbeat miss
    in the last UNSTABLE_HOLD_S."""
    if (
        state in _STABLE_STATES
        and not suspect
        and s.heartbeat_misses == 0
        and (s.last_failure_at is None or now - s.last_failure_at >= UNSTABLE_HOLD_S)
    ):
        return Cadence.STABLE
    return Cadence.UNSTABLE
