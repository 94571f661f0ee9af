"""Where one backend stands: its state, since when and why, its probation ramp, whether it is
suspect, and the verdict the balancer reads.

The state moves only through the machine's table (`move`, which returns the transition
record). The verdict is rebuilt from the state, the ramp, the suspicion, the in-flight limit
and the numbers (`weighing`) whenever one of them changes (`publish`), and cached: `version`
moves when the verdict differs (or on `touch`), so the fleet's routable cache stays valid
between. Which move to make, and when, is decided elsewhere (`rules`, `evaluation`,
`backend`).
"""

from __future__ import annotations

from pulsegate.config import BackendConfig, WeightsConfig
from pulsegate.health.auto_limit import AutoLimit
from pulsegate.health.events import Transition
from pulsegate.health.machine import Event, transition
from pulsegate.health.observations import EngineFacts, FirstByteOverdue
from pulsegate.health.probation import Probation
from pulsegate.health.signals import Signals
from pulsegate.health.suspect import SUSPECT_FACTOR, Suspicion
from pulsegate.health.verdict import State, Verdict
from pulsegate.health.weighing import Weighing


class Standing:
    """One backend's state and verdict (`signals` and `probation` are the backend's own)."""

    def __init__(
        self,
        config: BackendConfig,
        weights: WeightsConfig,
        signals: Signals,
        probation: Probation,
        now: float,
    ) -> None:
        self.config = config
        self._weights = weights
        self._signals = signals
        self._probation = probation
        self.state = State.COLD
        self.since = now
        self.last_cause = ""
        self.last_reason = ""
        self.ramp = 1.0  # the probation ramp; 1.0 in every other state
        self.suspicion = Suspicion()
        self.weighing = Weighing()
        # How much slower than its peers the backend is (`slowness.peer_ratio`), as of the
        # last evaluation: set by the backend, which sees the fleet.
        self.peer_ratio: float | None = None
        self._limit = AutoLimit(config.max_inflight)
        self.version = 0
        self._verdict = self._build()

    def reconfigure(self, config: BackendConfig, weights: WeightsConfig) -> None:
        """A reloaded config for the same engine: the state, the numbers, the suspicion and a
        learned `auto` limit are kept; the verdict is rebuilt at once, so a new weight, zone or
        `max_inflight` shows now. The score weights apply from the next refresh (evaluation)."""
        self.config = config
        self._weights = weights
        self._limit.reconfigure(config.max_inflight)
        self.publish()

    @property
    def verdict(self) -> Verdict:
        """The backend as the balancer sees it (outside panic)."""
        return self._verdict

    def panic_verdict(self) -> Verdict:
        """The verdict of an ejected-but-alive backend routed in panic mode (least-bad first)."""
        return self.weighing.panic_verdict(self.config, self._verdict)

    def move(self, event: Event, now: float, cause: str, reason: str) -> Transition:
        """Move by `event` (IllegalTransition if the table has no such move); the record."""
        frm = self.state
        to = transition(frm, event)
        self.state = to
        self.since = now
        self.last_cause = cause
        self.last_reason = reason
        if to is State.PROBATION:
            self._probation.start(now)
            self.ramp = self._probation.ramp(now)
            # Envoy: counters reset on un-eject, so one failure after return is one, not six.
            self._signals.reset_request_failures()
        else:
            self.ramp = 1.0
        self.refresh(now, self.peer_ratio)
        return Transition(
            backend=self.config.name,
            from_state=frm,
            to_state=to,
            event=event,
            cause=cause,
            reason=reason,
            at=now,
            score=self.weighing.score,
            signals=self._signals.snapshot(now),
        )

    def refresh(self, now: float, peer_ratio: float | None) -> None:
        """Recompute score, weight and rtt from the signals and `peer_ratio` (kept for the
        refreshes between evaluations), and publish the verdict."""
        self.peer_ratio = peer_ratio
        self.weighing.refresh(self._signals, self._weights, now, peer_ratio)
        self.publish()

    def step_ramp(self, now: float) -> None:
        """Follow the probation ramp to `now`."""
        r = self._probation.ramp(now)
        if r != self.ramp:
            self.ramp = r
            self.publish()

    def learn(self, facts: EngineFacts, now: float) -> None:
        """Engine gauges arrived (already in the signals): the in-flight limit (`auto`) and
        whether VRAM is under 5% free, both at once rather than at the next evaluation."""
        if self._limit.learn(facts):
            self.publish()
        if self.weighing.check_pickable(self._signals, now):
            self.publish()

    def suspect(self, o: FirstByteOverdue) -> None:
        """First bytes are overdue (`suspect`)."""
        if self.suspicion.report(o):
            self.publish()

    def clear_suspect(self) -> None:
        """A success: no longer suspect."""
        if self.suspicion.clear():
            self.publish()

    def touch(self) -> None:
        """Move `version` without a verdict change: something else the fleet's routable cache
        reads changed (whether panic mode may route here)."""
        self.version += 1

    def publish(self) -> None:
        """Rebuild the verdict; `version` moves if it differs."""
        v = self._build()
        if v != self._verdict:
            self._verdict = v
            self.version += 1

    def _build(self) -> Verdict:
        affinity = self.config.weight
        ramp = self.ramp if self.state is State.PROBATION else 1.0
        affinity *= ramp
        if self.suspicion.active:
            affinity *= SUSPECT_FACTOR
        return self.weighing.verdict(self.config, self.state, affinity, self._limit.value, ramp)
