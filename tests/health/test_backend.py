"""The per-backend rules: readiness, blips, streaks, score ejection, degraded, suspect,
backoff, rejoin, probation, operator actions, transition records, cadence."""

from __future__ import annotations

import json

import pytest

from pulsegate.config import WeightsConfig
from pulsegate.health.cadence import Cadence
from pulsegate.health.machine import Event
from pulsegate.health.observations import (
    EngineFacts,
    FirstByteOverdue,
    Outcome,
    ProbeKind,
    ProbeResult,
    RequestResult,
)
from pulsegate.health.suspect import SUSPECT_FACTOR
from pulsegate.health.verdict import State

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

READINESS_DOWN = ProbeResult(ProbeKind.READINESS, ok=False, reason="connect error: timed out")
REFUSED = ProbeResult(ProbeKind.READINESS, ok=False, reason="connection refused", refused=True)


def routable_names(h: Harness) -> set[str]:
    return {v.name for v in h.fleet.routable("m")}


# -- cold, warming, ready ------------------------------------------------------------------


def test_cold_warming_ready() -> None:
    """Cold and warming never route (R25); ready routes."""
    h = Harness()
    assert h.state("a") is State.COLD
    assert routable_names(h) == set()
    h.obs("a", NOT_READY)
    assert h.state("a") is State.WARMING
    assert routable_names(h) == set()
    h.obs("a", MICRO_OK)
    h.obs("a", READY)
    assert h.state("a") is State.READY
    assert routable_names(h) == {"a"}
    assert [t.cause for t in h.log] == ["not_ready", "ready"]


def test_unreachable_engine_stays_cold() -> None:
    """A readiness probe that cannot reach the engine leaves a cold backend cold."""
    h = Harness()
    h.obs("a", READINESS_DOWN)
    assert h.state("a") is State.COLD


def test_ready_needs_a_micro_inference() -> None:
    """Readiness alone is not enough: a micro-inference must pass."""
    h = Harness()
    h.obs("a", READY)
    assert h.state("a") is State.COLD
    h.obs("a", MICRO_OK)
    assert h.state("a") is State.READY


def test_hard_evidence_blocks_ready() -> None:
    """An engine that says ready while its heartbeat is dead does not become ready."""
    h = Harness()
    h.obs("a", MICRO_OK)
    h.feed("a", MISS, 3)
    h.obs("a", READY)
    assert h.state("a") is State.COLD
    h.obs("a", PONG)
    h.obs("a", READY)
    assert h.state("a") is State.READY


def test_not_ready_while_ready_stops_traffic_at_once(ready3: Harness) -> None:
    """An engine reloading its model says not ready: warming, out of rotation at once."""
    h = ready3
    h.obs("a", NOT_READY)
    assert h.state("a") is State.WARMING
    assert "a" not in routable_names(h)
    h.obs("a", MICRO_OK)
    h.obs("a", READY)
    assert h.state("a") is State.READY


# -- blips and hard evidence -----------------------------------------------------------------


def test_one_blip_never_ejects(ready3: Harness) -> None:
    """One failed request, micro, canary, heartbeat miss or overdue report never ejects (R17)."""
    h = ready3
    h.obs("a", FAIL)
    h.obs("a", MICRO_FAIL)
    h.obs("a", CANARY_FAIL)
    h.feed("a", MISS, 2)
    h.obs("a", FirstByteOverdue(1, 2.0))
    h.obs("a", PONG)
    h.run(10.0, h.healthy_traffic())
    assert State.EJECTED not in {t.to_state for t in h.log}
    assert h.state("a") is State.READY


@pytest.mark.parametrize(
    ("obs", "n", "cause", "words"),
    [
        (MISS, 3, "heartbeat", "heartbeat missed 3x in a row (late)"),
        (CANARY_FAIL, 2, "canary", "canary failed 2x: timeout after 350ms"),
        (MICRO_FAIL, 2, "micro_inference", "micro-inference failed 2x: timeout after 2000ms"),
        (FAIL, 5, "consecutive_failures", "5 requests failed in a row (last: http_5xx 503)"),
        (REFUSED, 1, "engine_down", "engine refuses connections (connection refused)"),
    ],
)
def test_hard_evidence_ejects_at_once(
    ready3: Harness, obs: object, n: int, cause: str, words: str
) -> None:
    """A streak reaching its configured limit ejects on the spot, without waiting for a tick."""
    h = ready3
    assert h.feed("a", obs, n - 1) == []  # type: ignore[arg-type]
    out = h.obs("a", obs)  # type: ignore[arg-type]
    assert [(t.from_state, t.to_state, t.cause) for t in out] == [
        (State.READY, State.EJECTED, cause)
    ]
    assert out[0].reason.startswith(words)
    assert out[0].event is Event.HARD_FAILURE
    assert "a" not in routable_names(h)


def test_success_breaks_the_request_streak(ready3: Harness) -> None:
    """Four failures, a success, four failures: no ejection."""
    h = ready3
    h.feed("a", FAIL, 4)
    h.obs("a", OK)
    h.feed("a", FAIL, 4)
    assert h.state("a") is State.READY


def test_overload_and_client_errors_are_not_failures(ready3: Harness) -> None:
    """429s, client errors and cancels never eject: busy or the client's fault, not sick."""
    from pulsegate.health.observations import Outcome

    h = ready3
    for outcome in (Outcome.OVERLOADED, Outcome.CLIENT_ERROR, Outcome.CANCELLED):
        h.feed("a", RequestResult(outcome), 20)
    assert h.state("a") is State.READY
    assert h.snap("a")["signals"]["consecutive_failures"] == 0  # type: ignore[index]


# -- the score ---------------------------------------------------------------------------------


def _bad_step(h: Harness) -> None:
    """Errors (readiness cannot connect) and a queue 10x capacity; VRAM fine."""
    h.feed("a", READINESS_DOWN, 10)
    h.obs("a", EngineFacts(queue_waiting=40.0, capacity=4.0, gpu_free_ratio=0.5))


def test_eject_after_three_low_evaluations() -> None:
    """Score < 30 ejects on the third evaluation in a row, not before (cause score)."""
    h = Harness()
    h.make_ready("a")
    scores: list[float] = []
    for _ in range(10):
        h.now += 1.0
        _bad_step(h)
        h.tick()
        scores.append(float(h.snap("a")["score"]))  # type: ignore[arg-type]
        if h.state("a") is State.EJECTED:
            break
    assert h.state("a") is State.EJECTED
    assert all(s < 30 for s in scores[-3:])
    assert sum(1 for s in scores if s < 30) == 3
    ejection = h.log[-1]
    assert ejection.cause == "score"
    assert ejection.event is Event.SCORE_LOW
    assert "for 3 evaluations" in ejection.reason


def test_low_score_interrupted_by_a_good_evaluation_never_ejects() -> None:
    """Bad, good, bad, good...: never three low evaluations in a row, never ejected."""
    only_queue = WeightsConfig(latency=0.0, error_rate=0.0, queue=1.0, gpu_free=0.0)
    h = Harness(health=health_with(weights=only_queue, evaluate_interval=5.0))
    h.make_ready("a")
    lows = 0
    for i in range(12):
        h.now += 5.0
        waiting = 40.0 if i % 2 == 0 else 0.0
        h.obs("a", EngineFacts(queue_waiting=waiting, capacity=4.0))
        h.tick()
        s = float(h.snap("a")["score"])  # type: ignore[arg-type]
        lows += s < 30
    assert lows >= 5
    assert h.state("a") is not State.EJECTED
    assert "score" not in h.causes("a")


def test_error_rate_alone_never_ejects_through_the_score() -> None:
    """R17: with the error rate the only known signal, a bad score degrades but never ejects."""
    h = Harness()
    h.make_ready("a")
    flip = iter(range(10**6))
    h.run(60.0, lambda h: h.obs("a", FAIL if next(flip) % 2 == 0 else OK))
    assert float(h.snap("a")["score"]) < 30  # type: ignore[arg-type]
    assert h.state("a") is State.DEGRADED
    assert "score" not in h.causes("a")
    assert h.weight("a") < 0.05


def test_busy_backend_is_not_sick(ready3: Harness) -> None:
    """R17: deep queue, KV cache busy, long generations (normal TTFT): ready, never ejected."""
    h = ready3

    def busy(h: Harness) -> None:
        for n in ("a", "b", "c"):
            h.obs(n, OK)
        if int(h.now * 10) % 30 == 0:
            h.obs("a", MICRO_OK)
        h.obs(
            "a",
            EngineFacts(
                queue_waiting=32.0,
                running=8.0,
                capacity=8.0,
                kv_cache_usage=0.9,
                gpu_free_ratio=0.3,
            ),
        )

    h.run(120.0, busy)
    assert "a" not in {t.backend for t in h.log if t.to_state is State.EJECTED}
    assert h.state("a") is State.READY
    assert 0.0 < h.weight("a") < h.weight("b")


# -- degraded ----------------------------------------------------------------------------------


def test_degraded_on_vram_over_90_percent_used(ready3: Harness) -> None:
    """VRAM 92% used: degraded at the next evaluation, still routable; ready when it clears."""
    h = ready3
    h.obs("a", EngineFacts(gpu_free_ratio=0.08))
    h.run(1.0, h.healthy_traffic())
    assert h.state("a") is State.DEGRADED
    assert h.log[-1].reason == "VRAM 92% used"
    assert "a" in routable_names(h)
    assert 0.0 < h.weight("a") < h.weight("b")
    h.obs("a", EngineFacts(gpu_free_ratio=0.5))
    h.run(1.0, h.healthy_traffic())
    assert h.state("a") is State.READY
    assert h.log[-1].cause == "cleared"


def test_degraded_on_kv_cache_full(ready3: Harness) -> None:
    """KV cache 97% full: degraded; back to ready only under 92% (hysteresis)."""
    h = ready3
    h.obs("a", EngineFacts(kv_cache_usage=0.97))
    h.run(1.0, h.healthy_traffic())
    assert h.state("a") is State.DEGRADED
    h.obs("a", EngineFacts(kv_cache_usage=0.94))
    h.run(2.0, h.healthy_traffic())
    assert h.state("a") is State.DEGRADED
    h.obs("a", EngineFacts(kv_cache_usage=0.5))
    h.run(1.0, h.healthy_traffic())
    assert h.state("a") is State.READY


def test_degraded_by_vram_still_learns_latency() -> None:
    """An engine that reserves 92% of VRAM up front (degraded) still learns its baseline, so a
    later 3x slowdown shows in its latency ratio and weight."""
    h = Harness()
    h.make_ready()
    slow = {"on": False}

    def step(h: Harness) -> None:
        for n in ("a", "b"):
            h.obs(n, EngineFacts(gpu_free_ratio=0.08))
            ttft = 0.3 if slow["on"] and n == "b" else 0.1
            h.obs(n, RequestResult(OK.outcome, ttft_s=ttft))

    h.run(20.0, step)
    assert h.state("b") is State.DEGRADED
    slow["on"] = True
    h.run(20.0, step)
    ratio = h.snap("b")["signals"]["latency_ratio"]  # type: ignore[index]
    assert ratio == pytest.approx(3.0, rel=0.05)
    assert h.weight("b") < 0.5 * h.weight("a")


def test_under_5_percent_vram_is_never_picked_but_not_ejected(ready3: Harness) -> None:
    """R5: free VRAM < 5% drops the weight to 0 at once; the gauge alone does not eject."""
    h = ready3
    h.obs("a", EngineFacts(gpu_free_ratio=0.03))
    assert h.weight("a") == 0.0
    assert "a" not in routable_names(h)
    h.run(10.0, h.healthy_traffic())
    assert h.state("a") is State.DEGRADED
    assert h.fleet.backend("a").dead
    h.obs("a", EngineFacts(gpu_free_ratio=0.5))
    assert h.weight("a") > 0.0


# -- suspect (first byte overdue) --------------------------------------------------------------


def test_first_byte_overdue_makes_suspect_at_once(ready3: Harness) -> None:
    """Overdue first bytes: weight x 0.05 immediately, fast probing; an OK request clears it."""
    h = ready3
    before = h.weight("a")
    h.obs("a", FirstByteOverdue(3, 4.2))
    assert h.fleet.backend("a").suspect
    assert h.weight("a") == pytest.approx(before * SUSPECT_FACTOR)
    assert h.fleet.unstable("a", h.now)
    h.obs("a", OK)
    assert not h.fleet.backend("a").suspect
    assert h.weight("a") == pytest.approx(before)


def test_a_late_success_does_not_clear_suspicion(ready3: Harness) -> None:
    """Suspect for first bytes over 0.1 s (the hedge's report): a request answered with its
    first byte 1.5 s late succeeds, and the suspicion stays; one answered in 30 ms clears it."""
    h = ready3
    before = h.weight("a")
    h.obs("a", FirstByteOverdue(1, 0.1))
    h.obs("a", RequestResult(Outcome.OK, ttft_s=1.5))
    assert h.fleet.backend("a").suspect
    assert h.weight("a") == pytest.approx(before * SUSPECT_FACTOR)
    h.obs("a", RequestResult(Outcome.OK, ttft_s=0.03))
    assert not h.fleet.backend("a").suspect


def test_suspect_cleared_by_a_successful_probe(ready3: Harness) -> None:
    """A micro-inference that succeeds clears suspicion."""
    h = ready3
    h.obs("a", FirstByteOverdue(1, 1.0))
    h.obs("a", MICRO_OK)
    assert not h.fleet.backend("a").suspect


def test_repeated_overdue_plus_failing_probe_ejects(ready3: Harness) -> None:
    """Overdue twice and one failing probe: ejected at once (cause stalled); once is not enough."""
    h = ready3
    h.obs("b", FirstByteOverdue(2, 3.0))
    h.obs("b", MICRO_FAIL)
    assert h.state("b") is State.READY
    h.obs("a", FirstByteOverdue(2, 3.0))
    h.obs("a", FirstByteOverdue(3, 3.5))
    out = h.obs("a", CANARY_FAIL)
    assert [t.cause for t in out] == ["stalled"]
    assert "first byte overdue on 3 requests (oldest 3.5s)" in out[0].reason


# -- ejection, backoff, rejoin, probation ------------------------------------------------------


def _back_to_ready(h: Harness, name: str) -> None:
    h.fleet.drain(name, h.now)
    h.fleet.undrain(name, h.now)
    assert h.state(name) is State.READY


def test_backoff_grows_and_is_capped() -> None:
    """Ejection n keeps the backend out base x n (capped) plus at most 10% jitter."""
    h = Harness(health=health_with(ejection_base=5.0, ejection_max=12.0))
    h.make_ready("a")
    outs = []
    for _ in range(5):
        h.fleet.eject("a", h.now)
        snap = h.snap("a")
        outs.append(float(snap["ejected_until"]) - h.now)  # type: ignore[arg-type]
        _back_to_ready(h, "a")
    for n, out in enumerate(outs, start=1):
        low = min(5.0 * n, 12.0)
        assert low <= out <= low * 1.1
    assert h.snap("a")["ejections"] == 5


def _recovering(h: Harness) -> None:
    """An ejected backend gets no traffic: probes only (readiness, micro, canary each second)."""
    if abs(h.now - round(h.now)) < 1e-6:
        h.obs("a", READY)
        h.obs("a", MICRO_OK)
        h.obs("a", CANARY_OK)


def _eject_a(h: Harness) -> float:
    h.feed("a", MICRO_FAIL, 2)
    assert h.state("a") is State.EJECTED
    return h.now


def test_rejoin_waits_for_backoff_and_good_evaluations_then_probation(ready3: Harness) -> None:
    """Out for the backoff, then rejoin_after good evaluations, then probation, then ready."""
    h = ready3
    t_eject = _eject_a(h)
    until = float(h.snap("a")["ejected_until"])  # type: ignore[arg-type]
    h.run(30.0, _recovering)
    rejoin = [t for t in h.log if t.event is Event.REJOIN_OK]
    assert len(rejoin) == 1
    assert rejoin[0].at >= until
    assert rejoin[0].at - t_eject >= h.health.rejoin_after * h.health.evaluate_interval
    assert h.state("a") is State.PROBATION
    assert "a" in routable_names(h)
    h.run(61.0, _recovering)
    assert h.state("a") is State.READY
    assert h.log[-1].cause == "recovered"
    assert h.fleet.backend("a").ramp == 1.0


def test_probation_weight_ramps_in_steps(ready3: Harness) -> None:
    """During probation the verdict weight is the health weight x the ramp, growing in steps."""
    h = ready3
    _eject_a(h)
    while h.state("a") is State.EJECTED:
        h.run(0.1, _recovering)
    b = h.fleet.backend("a")
    ramps = []
    while h.state("a") is State.PROBATION:
        assert b.ramp < 1.0
        assert h.weight("a") <= b.ramp + 1e-9
        ramps.append(b.ramp)
        h.run(0.1, _recovering)
    assert ramps[0] == pytest.approx(0.01)
    assert ramps == sorted(ramps)
    assert len(set(ramps)) > 90
    assert h.state("a") is State.READY
    assert h.weight("a") > 0.9


def test_rejoin_blocked_while_canary_fails(ready3: Harness) -> None:
    """Hard evidence must be clear: a failing canary keeps the backend ejected."""
    h = ready3
    h.feed("a", CANARY_FAIL, 2)
    assert h.state("a") is State.EJECTED

    def canary_still_failing(h: Harness) -> None:
        if abs(h.now - round(h.now)) < 1e-6:
            h.obs("a", READY)
            h.obs("a", MICRO_OK)
            h.obs("a", MICRO_OK)
            h.obs("a", CANARY_FAIL)

    h.run(60.0, canary_still_failing)
    assert h.state("a") is State.EJECTED
    assert h.fleet.backend("a").dead


def test_probation_failure_ejects_with_longer_backoff(ready3: Harness) -> None:
    """Any failure during probation ejects again, with n + 1."""
    h = ready3
    _eject_a(h)
    h.run(30.0, _recovering)
    assert h.state("a") is State.PROBATION
    out = h.obs("a", FAIL)
    assert [(t.event, t.cause) for t in out] == [(Event.PROBATION_FAILED, "request_failure")]
    snap = h.snap("a")
    assert snap["ejection_multiplier"] == 2
    assert float(snap["ejected_until"]) - h.now >= 10.0  # type: ignore[arg-type]


def test_probation_fails_when_latency_stays_high(ready3: Harness) -> None:
    """Probation passes only with latency back under baseline x 1.5 (R8)."""
    h = ready3
    _eject_a(h)
    slow = ProbeResult(ProbeKind.MICRO, ok=True, latency_s=0.15)

    def slow_recovery(h: Harness) -> None:
        if abs(h.now - round(h.now)) < 1e-6:
            h.obs("a", READY)
            h.obs("a", slow)

    h.run(100.0, slow_recovery)
    fails = [t for t in h.log if t.event is Event.PROBATION_FAILED]
    assert fails
    assert fails[0].cause == "probation"
    assert "latency still 3.0x baseline" in fails[0].reason


def test_probation_passes_when_the_whole_pool_is_as_slow(ready3: Harness) -> None:
    """3x its own baseline, but so are its peers serving meanwhile: the slowdown is shared
    (load, a common network path), and this backend is no worse than what already serves.
    The same 3x with fast peers fails (the test above)."""
    h = ready3
    _eject_a(h)
    slow = ProbeResult(ProbeKind.MICRO, ok=True, latency_s=0.15)

    def everyone_slow(h: Harness) -> None:
        if abs(h.now - round(h.now)) < 1e-6:
            for name in ("a", "b", "c"):
                h.obs(name, READY)
                h.obs(name, slow)

    h.run(100.0, everyone_slow)
    assert not [t for t in h.log if t.event is Event.PROBATION_FAILED]
    passed = [t for t in h.log if t.event is Event.PROBATION_PASSED]
    assert len(passed) == 1
    assert "3.00x baseline but 150 ms against its peers' 150 ms" in passed[0].reason
    assert "the slowdown is shared" in passed[0].reason
    assert h.state("a") is State.READY


def test_probation_fails_when_slower_than_its_slow_peers(ready3: Harness) -> None:
    """Peers slowed to 1.5x their baselines (75 ms); this one at 3x (150 ms) is 2x slower
    than they are: its slowness is its own."""
    h = ready3
    _eject_a(h)
    own = ProbeResult(ProbeKind.MICRO, ok=True, latency_s=0.15)
    peers = ProbeResult(ProbeKind.MICRO, ok=True, latency_s=0.075)

    def pool_slow_a_slower(h: Harness) -> None:
        if abs(h.now - round(h.now)) < 1e-6:
            h.obs("a", READY)
            h.obs("a", own)
            for name in ("b", "c"):
                h.obs(name, peers)

    h.run(100.0, pool_slow_a_slower)
    fails = [t for t in h.log if t.event is Event.PROBATION_FAILED]
    assert fails
    assert "latency still 3.0x baseline" in fails[0].reason
    assert "its peers answer in 75 ms" in fails[0].reason


def test_heartbeat_death_during_probation_fails_it(ready3: Harness) -> None:
    """A dead heartbeat during probation ejects again."""
    h = ready3
    _eject_a(h)
    h.run(30.0, _recovering)
    out = h.feed("a", MISS, 3)
    assert [t.event for t in out] == [Event.PROBATION_FAILED]


def test_not_ready_while_ejected_stays_ejected(ready3: Harness) -> None:
    """An ejected engine that restarts (not ready) stays ejected: it must earn probation."""
    h = ready3
    _eject_a(h)
    h.obs("a", NOT_READY)
    assert h.state("a") is State.EJECTED
    h.run(20.0, lambda h: h.obs("a", MICRO_OK))
    assert h.state("a") is State.EJECTED


# -- operator ----------------------------------------------------------------------------------


def test_drain_undrain_eject(ready3: Harness) -> None:
    """Drain and undrain are idempotent; undrain re-checks readiness; admin eject ejects."""
    h = ready3
    out = h.fleet.drain("a", h.now)
    assert [(t.to_state, t.cause) for t in out] == [(State.DRAINED, "drain")]
    assert h.fleet.drain("a", h.now) == []
    assert "a" not in routable_names(h)
    out = h.fleet.undrain("a", h.now)
    assert [t.to_state for t in out] == [State.COLD, State.READY]
    assert h.fleet.undrain("a", h.now) == []
    out = h.fleet.eject("a", h.now)
    assert [(t.to_state, t.cause, t.reason.split(";")[0]) for t in out] == [
        (State.EJECTED, "admin", "ejected by operator")
    ]
    assert h.fleet.eject("a", h.now) == []


def test_undrain_not_ready_engine_goes_warming(ready3: Harness) -> None:
    """Undraining a backend whose engine says not ready lands in warming."""
    h = ready3
    h.fleet.drain("a", h.now)
    h.obs("a", NOT_READY)
    assert h.state("a") is State.DRAINED
    out = h.fleet.undrain("a", h.now)
    assert [t.to_state for t in out] == [State.COLD, State.WARMING]


# -- records and cadence -----------------------------------------------------------------------


def test_transition_record(ready3: Harness) -> None:
    """A transition names backend, states, event, cause, words, time, score and signals."""
    h = ready3
    h.now += 0.5
    t = h.feed("a", CANARY_FAIL, 2)[0]
    assert t.backend == "a"
    assert (t.from_state, t.to_state) == (State.READY, State.EJECTED)
    assert t.is_ejection
    assert t.at == h.now
    assert t.score is not None
    for key in ("rtt_ms", "latency_ms", "ttft_ms", "error_rate", "heartbeat_misses"):
        assert key in t.signals
    record = json.loads(json.dumps(t.as_dict()))
    assert record["from"] == "ready"
    assert record["to"] == "ejected"
    assert record["cause"] == "canary"


def test_cadence_follows_stability(ready3: Harness) -> None:
    """Slow probing while ready and quiet; fast after a failure (30 s), while degraded or out."""
    h = ready3
    assert h.fleet.cadence("a", h.now) is Cadence.STABLE
    h.obs("a", FAIL)
    assert h.fleet.cadence("a", h.now) is Cadence.UNSTABLE
    h.run(31.0, h.healthy_traffic())
    assert h.fleet.cadence("a", h.now) is Cadence.STABLE
    _eject_a(h)
    assert h.fleet.unstable("a", h.now)
    h.fleet.drain("b", h.now)
    assert h.fleet.cadence("b", h.now) is Cadence.STABLE


def test_next_due_is_the_next_evaluation_or_ramp_step(ready3: Harness) -> None:
    """next_tick says when tick has work: the next evaluation, or sooner in probation."""
    h = ready3
    assert h.now < h.fleet.next_tick(h.now) <= h.now + h.health.evaluate_interval
    _eject_a(h)
    h.run(30.0, _recovering)
    assert h.state("a") is State.PROBATION
    assert h.fleet.next_tick(h.now) <= h.now + 0.6 + 1e-9


def test_ejection_forgets_the_sick_spells_ttft(ready3: Harness) -> None:
    """Client TTFT is only measured while clients are sent: after an ejection the old samples
    (of the sick spell) must not weigh the backend down into probation; probes keep theirs."""
    h = ready3
    h.feed("a", RequestResult(OK.outcome, ttft_s=0.9), 5)
    assert h.snap("a")["signals"]["ttft_ms"] > 500  # type: ignore[index,operator]
    micro_before = h.snap("a")["signals"]["latency_ms"]  # type: ignore[index]
    h.feed("a", FAIL, 5)
    assert h.state("a") is State.EJECTED
    signals = h.snap("a")["signals"]
    assert signals["ttft_ms"] is None  # type: ignore[index]
    assert signals["latency_ms"] == micro_before  # type: ignore[index]


def test_a_readiness_timeout_is_an_error_not_an_ejection(ready3: Harness) -> None:
    """Only a refused connection is hard evidence: a busy engine's /health may time out."""
    h = ready3
    h.feed("a", READINESS_DOWN, 3)
    assert h.state("a") is State.READY


def test_refused_while_cold_says_why() -> None:
    h = Harness(("a", "b"))
    h.obs("a", REFUSED)
    assert h.state("a") is State.COLD
    assert "refuses connections" in str(h.snap("a")["last_reason"])


def test_a_restarted_engine_starts_its_error_counts_afresh(ready3: Harness) -> None:
    """Failures counted while nothing listened describe the outage, not the new process:
    without this a restart after a long outage waited 30-40 s for the error rate to decay."""
    h = ready3
    h.obs("a", REFUSED)
    assert h.state("a") is State.EJECTED
    for _ in range(20):  # the outage: probes keep failing
        h.obs("a", REFUSED)
        h.obs("a", MICRO_FAIL)
        h.tick(0.5)
    during = h.snap("a")["signals"]
    assert during["error_rate"] > 0.2  # type: ignore[index,operator]
    h.obs("a", READY)
    after = h.snap("a")["signals"]
    assert after["error_rate"] is None or after["error_rate"] < 0.1  # type: ignore[index,operator]
    assert after["micro_failures"] == 0  # type: ignore[index]


def test_a_timed_out_readiness_keeps_the_error_counts(ready3: Harness) -> None:
    """Only a refused port proves the old process is gone; a timeout may be the same one."""
    h = ready3
    h.feed("a", READINESS_DOWN, 10)
    before = h.snap("a")["signals"]["error_rate"]
    h.obs("a", READY)
    assert h.snap("a")["signals"]["error_rate"] == pytest.approx(before, abs=0.05)  # type: ignore[index]
