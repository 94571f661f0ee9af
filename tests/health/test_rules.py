"""The rules as pure functions: what fires, with which event, in which state."""

from __future__ import annotations

from pulsegate.config import HealthConfig, ProbesConfig
from pulsegate.health import rules
from pulsegate.health.evidence import Evidence
from pulsegate.health.machine import Event
from pulsegate.health.observations import (
    FirstByteOverdue,
    Heartbeat,
    Outcome,
    ProbeKind,
    ProbeResult,
)
from pulsegate.health.signals import Signals
from pulsegate.health.suspect import Suspicion
from pulsegate.health.verdict import State

H = HealthConfig()
P = ProbesConfig()
MICRO_FAIL = ProbeResult(ProbeKind.MICRO, ok=False, reason="timeout")


def test_not_ready_warms_where_the_table_allows_else_is_a_failure() -> None:
    """Cold, ready, degraded: NOT_READY; anywhere else a hard failure (probation fails)."""
    for state in State:
        fire = rules.not_ready(state, "loading")
        expect = Event.NOT_READY if state in (State.COLD, State.READY, State.DEGRADED) else None
        assert fire.event is expect, state
        assert fire.reason == "engine not ready: loading"


def test_one_request_failure_fails_probation_only() -> None:
    """On probation one failed request fires; when serving it takes a streak."""
    s = Signals(0.3)
    s.record_request_failure(Outcome.HTTP_5XX, 503, 0.0)
    fire = rules.request_failure(State.PROBATION, s, H)
    assert fire is not None and fire.cause == "request_failure" and fire.event is None
    assert rules.request_failure(State.READY, s, H) is None
    for _ in range(H.consecutive_failures - 1):
        s.record_request_failure(Outcome.HTTP_5XX, 503, 0.0)
    fire = rules.request_failure(State.READY, s, H)
    assert fire is not None and fire.cause == "consecutive_failures"


def test_a_failing_probe_after_overdue_reports_is_a_stall() -> None:
    """One micro failure is nothing, unless first bytes were overdue twice (cause stalled)."""
    s = Signals(0.3)
    s.record_probe(MICRO_FAIL, 0.0)
    sus = Suspicion()
    assert rules.probe_failure(State.READY, ProbeKind.MICRO, s, P, sus) is None
    sus.report(FirstByteOverdue(2, 3.0))
    sus.report(FirstByteOverdue(2, 3.0))
    fire = rules.probe_failure(State.READY, ProbeKind.MICRO, s, P, sus)
    assert fire is not None and fire.cause == "stalled"
    assert rules.probe_failure_words(ProbeKind.MICRO, s) == "micro-inference failed 1x: timeout"


def test_ready_seen_needs_evidence_and_no_hard_evidence() -> None:
    """Cold: ready only with the evidence, and not while the heartbeat is dead."""
    s = Signals(0.3)
    e = Evidence()
    assert rules.ready_seen(State.COLD, e, s, H, P) is None
    e.on_ready()
    e.on_micro(True)
    fire = rules.ready_seen(State.COLD, e, s, H, P)
    assert fire is not None and fire.event is Event.READY_SEEN
    assert rules.ready_seen(State.EJECTED, e, s, H, P) is None
    for _ in range(P.heartbeat.misses_to_dead):
        s.record_heartbeat(Heartbeat(None), 0.0)
    assert rules.ready_seen(State.COLD, e, s, H, P) is None
