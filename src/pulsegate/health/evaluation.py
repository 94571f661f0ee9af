"""The periodic evaluation of one backend, every `health.evaluate_interval` (run from `tick`).

The score is judged only here, never per request, and what it may do depends on the state:

- ready / degraded: `eject_after` evaluations in a row with the score low eject (cause
  score). Otherwise, after a quiet interval (no failure, not suspect) one step of the backoff
  is forgiven and latency baselines learn; then the degrade conditions are judged.
- ejected: `rejoin_after` evaluations in a row above `rejoin_above`, the backoff over and the
  evidence clear: rejoin (probation).
- probation: one low score fails it.
- cold / warming: ready once the evidence allows (each probe checks that too, at once).

A move restarts both streaks, except between ready and degraded: the score ejection counts
across a ready -> degraded move. Late ticks do not replay missed evaluations.
"""

from __future__ import annotations

from pulsegate.config import HealthConfig, ProbesConfig
from pulsegate.health import conditions, rules
from pulsegate.health.backoff import Backoff
from pulsegate.health.evidence import Evidence
from pulsegate.health.probation import Probation
from pulsegate.health.rules import Fire
from pulsegate.health.signals import Signals
from pulsegate.health.standing import Standing
from pulsegate.health.verdict import State

SERVING = frozenset({State.READY, State.DEGRADED})


class Evaluation:
    """When one backend is next evaluated, the streaks its evaluations count, and the judgement
    (the backend's own signals, backoff, evidence and probation are handed in once)."""

    def __init__(
        self,
        health: HealthConfig,
        probes: ProbesConfig,
        signals: Signals,
        backoff: Backoff,
        evidence: Evidence,
        probation: Probation,
        now: float,
    ) -> None:
        self._h = health
        self._p = probes
        self._signals = signals
        self._backoff = backoff
        self._evidence = evidence
        self._probation = probation
        self.next_at = now + health.evaluate_interval
        self.low = 0  # evaluations in a row with the score low (ready, degraded)
        self.good = 0  # evaluations in a row with the score above rejoin_above (ejected)

    def reconfigure(self, health: HealthConfig, probes: ProbesConfig, now: float) -> None:
        """Judge with reloaded sections from the next evaluation on; the streaks are kept. A
        shorter interval brings the next evaluation forward to now + interval at the latest; a
        longer one starts after the one already scheduled."""
        self._h = health
        self._p = probes
        self.next_at = min(self.next_at, now + health.evaluate_interval)

    def due(self, now: float) -> bool:
        """Whether an evaluation is due at `now`; if so, the next one is scheduled."""
        if now < self.next_at:
            return False
        interval = self._h.evaluate_interval
        nxt = self.next_at + interval
        # Late ticks do not replay missed evaluations: no new evidence arrived for them.
        self.next_at = nxt if nxt > now else now + interval
        return True

    def moved(self, frm: State, to: State) -> None:
        """The backend moved: the streaks restart, unless between ready and degraded."""
        if not (frm in SERVING and to in SERVING):
            self.low = 0
            self.good = 0

    def judge(self, st: Standing, now: float) -> Fire | None:
        """Evaluate at `now` (the numbers in `st` freshly refreshed): what fires, if anything."""
        h = self._h
        sc = st.weighing.score
        inputs = st.weighing.inputs
        if st.state in SERVING:
            self.low = self.low + 1 if conditions.score_low(sc, inputs, h) else 0
            fire = rules.score_ejection(self.low, sc, inputs, h)
            if fire is not None:
                return fire
            s = self._signals
            # Quiet (no failure since the last evaluation, not suspect): forgive ejections and
            # let latency baselines learn. Degraded counts too - an engine that reserves 92% of
            # VRAM up front would otherwise never learn (the 1.5x ceiling guards the baseline).
            if conditions.quiet(s, st.suspicion.active, now, h.evaluate_interval):
                self._backoff.healthy(now)
                s.learn(now)
            else:
                self._backoff.unhealthy()
            return rules.degrade_or_recover(st.state, sc, inputs, s.kv_cache_usage(now), h)
        if st.state is State.EJECTED:
            self.good = self.good + 1 if sc is not None and sc > h.rejoin_above else 0
            blocker = conditions.rejoin_blocker(self._signals, now, self._evidence)
            over = self._backoff.elapsed(now)
            ejected_s = now - st.since
            return rules.rejoin(self.good, over, blocker, ejected_s, self._probation.duration, h)
        if st.state is State.PROBATION:
            return rules.probation_score(sc, inputs, h)
        # Cold or warming (drained: nothing).
        return rules.ready_seen(st.state, self._evidence, self._signals, h, self._p)
