"""Which event one backend's observations and evaluations fire, as pure functions.

Each rule reads the backend's numbers (signals, evidence, score) and returns a `Fire` - the
event, a cause code for the metrics, the reason in words with the numbers - or None when
nothing fires. A `Fire` without an event is hard failure evidence, and the state decides what
it fires (`machine.FAILURE_EVENTS`): an ejection from ready or degraded, a failed probation,
nothing in any other state. `BackendHealth` folds each observation into its signals first,
asks the rule, and applies what fired; the thresholds themselves live in `conditions`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pulsegate.config import HealthConfig, ProbesConfig
from pulsegate.health import conditions
from pulsegate.health.evidence import Evidence
from pulsegate.health.machine import Event, allowed
from pulsegate.health.observations import ProbeKind, ProbeResult
from pulsegate.health.probation import Probation
from pulsegate.health.score import ScoreInputs
from pulsegate.health.signals import Signals
from pulsegate.health.suspect import Suspicion
from pulsegate.health.verdict import State


@dataclass(frozen=True, slots=True)
class Fire:
    """What a rule fired: `event` (None: hard failure evidence), `cause` and `reason` as the
    transition will carry them."""

    cause: str
    reason: str
    event: Event | None = None


# -- observations -----------------------------------------------------------------------------


def request_failure(state: State, s: Signals, health: HealthConfig) -> Fire | None:
    """A real request failed: on probation that fails it at once; otherwise it takes
    `health.consecutive_failures` in a row (cause consecutive_failures)."""
    if state is State.PROBATION:
        return Fire(
            "request_failure", f"request failed during probation ({s.last_request_failure})"
        )
    if s.request_failures < health.consecutive_failures:
        return None
    why = f"{s.request_failures} requests failed in a row (last: {s.last_request_failure})"
    return Fire("consecutive_failures", why)


def heartbeat_death(s: Signals, probes: ProbesConfig) -> Fire | None:
    """`probes.heartbeat.misses_to_dead` heartbeat misses in a row (cause heartbeat)."""
    if s.heartbeat_misses < probes.heartbeat.misses_to_dead:
        return None
    why = f"heartbeat missed {s.heartbeat_misses}x in a row ({s.last_heartbeat_miss})"
    return Fire("heartbeat", why)


def probe_failure(
    state: State, kind: ProbeKind, s: Signals, probes: ProbesConfig, suspicion: Suspicion
) -> Fire | None:
    """A micro-inference or canary failed: on probation that fails it at once; otherwise a
    streak at its limit (cause micro_inference or canary), or any failure after first bytes
    were reported overdue twice (cause stalled)."""
    cause, label, streak, why = _probe(kind, s)
    if state is State.PROBATION:
        return Fire(cause, f"{label} failed during probation: {why}")
    micro = kind is ProbeKind.MICRO
    limit = probes.micro_inference.failures_to_eject if micro else probes.canary.failures_to_isolate
    if streak >= limit:
        return Fire(cause, f"{label} failed {streak}x: {why}")
    if suspicion.stalled:
        return Fire("stalled", f"{suspicion.words}, and {label} failed: {why}")
    return None


def probe_failure_words(kind: ProbeKind, s: Signals) -> str:
    """The last micro-inference or canary failure in words: 'canary failed 2x: timeout...'."""
    _, label, streak, why = _probe(kind, s)
    return f"{label} failed {streak}x: {why}"


def _probe(kind: ProbeKind, s: Signals) -> tuple[str, str, int, str]:
    """(cause, label, failures in a row, last failure) of a micro-inference or canary."""
    if kind is ProbeKind.MICRO:
        return "micro_inference", "micro-inference", s.micro_failures, s.last_micro_failure
    return "canary", "canary", s.canary_failures, s.last_canary_failure


def engine_down(p: ProbeResult) -> Fire:
    """The readiness probe was refused: nothing listens on the engine's port, so every request
    sent there fails - hard evidence at once, unlike a timeout (cause engine_down)."""
    return Fire("engine_down", f"engine refuses connections ({p.reason or 'connection refused'})")


def not_ready(state: State, reason: str) -> Fire:
    """The engine says it is not ready: cold, ready and degraded go to warming (out of
    rotation at once, R25); on probation that fails it."""
    event = Event.NOT_READY if allowed(state, Event.NOT_READY) else None
    return Fire("not_ready", f"engine not ready: {reason}", event)


def ready_seen(
    state: State, evidence: Evidence, s: Signals, health: HealthConfig, probes: ProbesConfig
) -> Fire | None:
    """Cold or warming, the engine ready with a micro-inference passed since any "not ready",
    and no hard evidence: ready."""
    if not allowed(state, Event.READY_SEEN) or not evidence.ready_to_serve:
        return None
    if conditions.hard_evidence(s, health, probes) is not None:
        return None
    return Fire("ready", "engine ready, micro-inference ok", Event.READY_SEEN)


# -- evaluations ------------------------------------------------------------------------------


def score_ejection(
    low_evals: int, score: float | None, inputs: ScoreInputs, health: HealthConfig
) -> Fire | None:
    """`health.eject_after` evaluations in a row with the score low (cause score)."""
    if low_evals < health.eject_after:
        return None
    why = (
        f"score {score:.0f} < {health.eject_below:g} for {low_evals} evaluations "
        f"({conditions.describe(inputs)})"
    )
    return Fire("score", why, Event.SCORE_LOW)


def degrade_or_recover(
    state: State,
    score: float | None,
    inputs: ScoreInputs,
    kv_cache: float | None,
    health: HealthConfig,
) -> Fire | None:
    """Ready with a degrade condition: degraded; degraded with every condition cleared (with
    hysteresis): ready."""
    if state is State.READY:
        reasons = conditions.degrade_reasons(score, inputs, kv_cache, health)
        return Fire("degraded", "; ".join(reasons), Event.DEGRADE) if reasons else None
    if conditions.recovered(score, inputs, kv_cache, health):
        return Fire("cleared", f"degraded conditions cleared (score {score:.0f})", Event.RECOVER)
    return None


def rejoin(
    good_evals: int,
    backoff_over: bool,
    blocker: str | None,
    ejected_s: float,
    probation_s: float,
    health: HealthConfig,
) -> Fire | None:
    """Ejected for `ejected_s`: the backoff over, `health.rejoin_after` evaluations in a row
    above `rejoin_above`, and nothing blocking (`conditions.rejoin_blocker`): probation."""
    if good_evals < health.rejoin_after or not backoff_over or blocker is not None:
        return None
    why = (
        f"score above {health.rejoin_above:g} for {good_evals} evaluations after "
        f"{ejected_s:.1f}s ejected; probation {probation_s:g}s"
    )
    return Fire("rejoin", why, Event.REJOIN_OK)


def probation_score(score: float | None, inputs: ScoreInputs, health: HealthConfig) -> Fire | None:
    """On probation, one evaluation with the score low fails it (cause score)."""
    if not conditions.score_low(score, inputs, health):
        return None
    why = f"score {score:.0f} < {health.eject_below:g} during probation"
    return Fire("score", why, Event.PROBATION_FAILED)


def probation_end(
    probation: Probation, latency_ratio: float | None, own_s: float | None, peers_s: float | None
) -> Fire:
    """The probation period is over: passed (ready, cause recovered) or failed (cause
    probation) as `Probation.shortfall` says."""
    shortfall = probation.shortfall(latency_ratio, own_s, peers_s)
    if shortfall is not None:
        return Fire("probation", shortfall, Event.PROBATION_FAILED)
    why = probation.summary(latency_ratio, own_s, peers_s)
    return Fire("recovered", why, Event.PROBATION_PASSED)
