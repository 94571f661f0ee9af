"""Properties over random observation sequences (hypothesis): routing safety, rejoin
discipline, flapping, and the probation ramp."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pulsegate.config import ProbationConfig
from pulsegate.health.machine import Event
from pulsegate.health.observations import (
    EngineFacts,
    FirstByteOverdue,
    Observation,
    Outcome,
    ProbeKind,
    ProbeResult,
    RequestResult,
)
from pulsegate.health.verdict import ROUTABLE, State

from .harness import (
    CANARY_FAIL,
    CANARY_OK,
    FAIL,
    MICRO_FAIL,
    MICRO_OK,
    MISS,
    NOT_READY,
    OK,
    PONG,
    READY,
    Harness,
    health_with,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

OBSERVATIONS: list[Observation] = [
    OK,
    OK,
    OK,
    FAIL,
    RequestResult(Outcome.TIMEOUT),
    RequestResult(Outcome.OVERLOADED, status=429),
    MICRO_OK,
    MICRO_FAIL,
    CANARY_OK,
    CANARY_FAIL,
    PONG,
    MISS,
    READY,
    NOT_READY,
    ProbeResult(ProbeKind.READINESS, ok=False, reason="refused"),
    EngineFacts(gpu_free_ratio=0.5, queue_waiting=2.0, capacity=8.0, kv_cache_usage=0.5),
    EngineFacts(gpu_free_ratio=0.03),
    EngineFacts(gpu_free_ratio=0.08, kv_cache_usage=0.97),
    EngineFacts(queue_waiting=64.0, running=8.0),
    FirstByteOverdue(2, 3.0),
]
ADMIN = ["drain", "undrain", "eject"]

steps = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.one_of(
            st.sampled_from(OBSERVATIONS),
            st.sampled_from(ADMIN),
            st.just("tick"),
        ),
        st.sampled_from([0.0, 0.05, 0.3, 1.0, 5.0]),
    ),
    min_size=1,
    max_size=150,
)


def _check_routable(h: Harness) -> None:
    fleet = h.fleet
    verdicts = fleet.routable("m")
    names = [v.name for v in verdicts]
    assert len(names) == len(set(names))
    for v in verdicts:
        b = fleet.backend(v.name)
        assert v.state is b.state  # the cache never serves a stale state
        assert v.weight > 0.0
        if v.panic:
            assert fleet.panic
            assert v.state is State.EJECTED
            assert not b.dead
        else:
            assert v.state in ROUTABLE
    if not fleet.panic:
        assert not any(v.panic for v in verdicts)
    for name in fleet.names():
        b = fleet.backend(name)
        if b.state in ROUTABLE and b.weight > 0.0:
            assert name in names  # and nothing routable is forgotten


@SETTINGS
@given(steps)
def test_nothing_unroutable_is_routed_outside_panic(
    ops: list[tuple[str, Observation | str, float]],
) -> None:
    """Whatever happens, routable verdicts are ready/degraded/probation with weight > 0,
    or - only in panic - ejected backends that are not dead; never cold, warming, drained."""
    h = Harness()
    h.make_ready()
    for name, op, dt in ops:
        h.now += dt
        if op == "tick":
            h.tick()
        elif op == "drain":
            h.fleet.drain(name, h.now)
        elif op == "undrain":
            h.fleet.undrain(name, h.now)
        elif op == "eject":
            h.fleet.eject(name, h.now)
        else:
            assert not isinstance(op, str)
            h.obs(name, op)
        _check_routable(h)


ROUND = {
    "good": (READY, MICRO_OK, CANARY_OK, PONG, OK),
    "bad": (MICRO_FAIL, FAIL, FAIL, CANARY_FAIL),
    "blip": (READY, MICRO_OK, FAIL, FAIL, OK),
    "quiet": (),
}
phases = st.lists(
    st.tuples(st.sampled_from(sorted(ROUND)), st.integers(min_value=1, max_value=15)),
    min_size=1,
    max_size=8,
)


@SETTINGS
@given(phases)
def test_rejoin_needs_rejoin_after_good_evaluations(plan: list[tuple[str, int]]) -> None:
    """Every rejoin follows at least rejoin_after evaluations in a row, all while ejected and
    all with a score above rejoin_above, and comes no earlier than the backoff allows."""
    h = Harness(health=health_with(evaluate_interval=1.0))
    h.make_ready("a")
    rounds: list[tuple[State, float | None]] = []  # per evaluation: state before, score after
    until = float("-inf")
    rejoins = 0
    for kind, length in [("bad", 3), *plan, ("good", 90)]:
        for _ in range(length):
            h.now += 1.0
            for o in ROUND[kind]:
                h.obs("a", o)
            if h.state("a") is State.EJECTED:
                until = float(h.snap("a")["ejected_until"])  # type: ignore[arg-type]
            before = h.state("a")
            out = h.tick()
            rounds.append((before, h.fleet.backend("a").score))
            for t in out:
                if t.event is not Event.REJOIN_OK:
                    continue
                rejoins += 1
                assert h.now >= until
                need = h.health.rejoin_after
                window = rounds[-need:]
                assert len(window) == need
                for state, s in window:
                    assert state is State.EJECTED
                    assert s is not None
                    assert s > h.health.rejoin_above
    assert rejoins >= 1  # the final 90 good seconds always bring it back


@SETTINGS
@given(
    st.lists(st.floats(min_value=0.05, max_value=2.0), min_size=20, max_size=120),
    st.booleans(),
)
def test_flapping_backend_never_reaches_full_weight(gaps: list[float], probes: bool) -> None:
    """Good and bad alternating: weight stays below full once evaluated, well below after 20 s,
    and the backend is never ejected (no streak)."""
    h = Harness()
    h.make_ready()
    bad: Observation = MICRO_FAIL if probes else FAIL
    good: Observation = MICRO_OK if probes else OK
    first_failure = h.now
    for i, gap in enumerate(gaps):
        h.now += gap
        h.obs("a", bad if i % 2 == 0 else good)
        h.obs("b", OK)
        h.tick()
        evaluated = h.now - first_failure >= h.health.evaluate_interval
        if evaluated:
            assert h.weight("a") < 1.0
        if h.now - first_failure >= 20.0:
            assert h.weight("a") < 0.5
        assert h.state("a") is not State.EJECTED


@SETTINGS
@given(
    st.floats(min_value=1.0, max_value=120.0),
    st.sampled_from([0.01, 0.05, 0.1, 0.25, 0.5]),
    st.lists(st.floats(min_value=0.01, max_value=3.0), min_size=10, max_size=200),
)
def test_probation_ramp_monotone_full_only_after_duration(
    duration: float, step: float, gaps: list[float]
) -> None:
    """In probation the ramp never falls and stays under 1.0; passing comes only after
    probation.duration, and leaves the backend at ramp 1.0."""
    cfg = health_with(probation=ProbationConfig(duration=duration, ramp_step=step))
    h = Harness(health=cfg)
    h.make_ready("a")
    h.fleet.eject("a", h.now)
    while h.state("a") is State.EJECTED:
        h.now += 1.0
        for o in (READY, MICRO_OK, CANARY_OK):
            h.obs("a", o)
        h.tick()
    start = h.now
    b = h.fleet.backend("a")
    prev = 0.0
    for gap in gaps:
        assert b.ramp >= prev
        prev = b.ramp
        if h.state("a") is not State.PROBATION:
            break
        assert b.ramp < 1.0
        assert h.weight("a") <= b.ramp * 1.0 + 1e-12
        h.now += gap
        h.obs("a", MICRO_OK)
        h.tick()
    passed = [t for t in h.log if t.event is Event.PROBATION_PASSED]
    if passed:
        assert passed[0].at >= start + duration
        assert b.ramp == 1.0
