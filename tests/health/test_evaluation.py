"""The periodic evaluation's clock and streaks (its judgement is tested through the fleet)."""

from __future__ import annotations

import random

from pulsegate.config import HealthConfig, ProbesConfig
from pulsegate.health.backoff import Backoff
from pulsegate.health.evaluation import Evaluation
from pulsegate.health.evidence import Evidence
from pulsegate.health.probation import Probation
from pulsegate.health.signals import Signals
from pulsegate.health.verdict import State


def _evaluation(health: HealthConfig) -> Evaluation:
    b = Backoff(health.ejection_base, health.ejection_max, random.Random(1))
    p = Probation(health.probation.duration, health.probation.ramp_step)
    return Evaluation(health, ProbesConfig(), Signals(0.3), b, Evidence(), p, 0.0)


def test_late_ticks_do_not_replay_missed_evaluations() -> None:
    """Due once per interval; a tick 10 intervals late runs one evaluation, not ten."""
    h = HealthConfig()
    e = _evaluation(h)
    i = h.evaluate_interval
    assert not e.due(0.5 * i)
    assert e.due(i)
    assert not e.due(1.5 * i)
    assert e.due(12 * i)
    assert e.next_at == 13 * i
    assert not e.due(12.5 * i)


def test_streaks_survive_ready_degraded_and_restart_on_other_moves() -> None:
    """Ready <-> degraded keeps the streaks (the score ejection counts across it)."""
    e = _evaluation(HealthConfig())
    e.low, e.good = 2, 3
    e.moved(State.READY, State.DEGRADED)
    assert (e.low, e.good) == (2, 3)
    e.moved(State.DEGRADED, State.EJECTED)
    assert (e.low, e.good) == (0, 0)
