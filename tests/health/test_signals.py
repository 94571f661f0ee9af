"""Per-backend signals: own-baseline latency, error rate, queue, GPU gauges, heartbeat."""

from __future__ import annotations

import pytest

from pulsegate.health.observations import (
    EngineFacts,
    Heartbeat,
    Outcome,
    ProbeKind,
    ProbeResult,
)
from pulsegate.health.signals import (
    BASELINE_MIN_SAMPLES,
    STALE_S,
    LatencyTracker,
    Signals,
)


def micro(latency: float, ok: bool = True) -> ProbeResult:
    return ProbeResult(ProbeKind.MICRO, ok=ok, latency_s=latency if ok else None, reason="boom")


def test_everything_unknown_at_first() -> None:
    """A fresh backend has no numbers: every signal is None, never a default."""
    s = Signals(0.2)
    snap = s.snapshot(0.0)
    for key in (
        "rtt_ms",
        "latency_ms",
        "ttft_ms",
        "error_rate",
        "queue",
        "running",
        "gpu_free",
        "gpu_used_mb",
        "gpu_total_mb",
        "gpu_temp_c",
        "kv_cache_usage",
        "prefix_cache_hit_rate",
        "heartbeat_misses",
    ):
        assert snap[key] is None, key
    assert snap["consecutive_failures"] == 0
    inputs = s.score_inputs(0.0)
    assert (inputs.latency_ratio, inputs.error_rate, inputs.queue_ratio, inputs.gpu_free) == (
        None,
        None,
        None,
        None,
    )


def test_baseline_needs_five_samples() -> None:
    """A brand-new backend is not judged on one sample: no ratio before 5 samples."""
    t = LatencyTracker(0.2)
    for i in range(BASELINE_MIN_SAMPLES - 1):
        t.record(0.1, float(i))
        t.learn(float(i))
        assert t.ratio(float(i)) is None
    t.record(0.1, 10.0)
    t.learn(10.0)
    assert t.ratio(10.0) == pytest.approx(1.0)


def test_baseline_floor_10ms() -> None:
    """Ratios are taken against at least 10 ms: 0.4 ms vs a 0.1 ms baseline is not '4x'."""
    t = LatencyTracker(1.0)
    for i in range(6):
        t.record(0.0001, float(i))
        t.learn(float(i))
    t.record(0.0004, 7.0)
    assert t.ratio(7.0) == pytest.approx(0.04)


def test_baseline_follows_down_at_once_and_never_learns_a_3x_slowdown() -> None:
    """Faster is taken at once; 3x slower, learned for 10 minutes, still reads 3x."""
    t = LatencyTracker(1.0)
    for i in range(6):
        t.record(0.1, float(i))
        t.learn(float(i))
    t.record(0.08, 6.0)
    t.learn(6.0)
    assert t.baseline == pytest.approx(0.08)
    now = 7.0
    while now < 600.0:
        t.record(0.24, now)
        t.learn(now)
        now += 1.0
    assert t.ratio(now) == pytest.approx(3.0)


def test_baseline_drifts_up_slowly_within_ceiling() -> None:
    """A 1.2x rise is learned with a 2-minute half-life: halfway after 120 s."""
    t = LatencyTracker(1.0)
    for i in range(6):
        t.record(0.1, float(i))
        t.learn(float(i))
    now = 6.0
    while now <= 126.0:
        t.record(0.12, now)
        t.learn(now)
        now += 1.0
    assert t.baseline == pytest.approx(0.11, abs=0.001)


def test_ttft_drives_latency_not_total_time() -> None:
    """R17: only time to first byte counts; an OK request of any length reads as its TTFT."""
    s = Signals(0.2)
    for i in range(10):
        s.record_request_ok(0.2, float(i))
        s.learn(float(i))
    assert s.latency_ratio(10.0) == pytest.approx(1.0)
    assert s.rtt_s(10.0) == pytest.approx(0.2)


def test_latency_ratio_is_the_worst_source() -> None:
    """The latency ratio is the worst of micro, canary and TTFT."""
    s = Signals(1.0)
    for i in range(6):
        s.record_probe(micro(0.05), float(i))
        s.record_request_ok(0.1, float(i))
        s.learn(float(i))
    s.record_probe(micro(0.15), 7.0)
    assert s.latency_ratio(7.0) == pytest.approx(3.0)


def test_error_rate_counts_requests_and_probes_only_real_failures() -> None:
    """Failures of requests and probes count; overload, client errors and cancels do not."""
    s = Signals(0.2)
    s.record_request_failure(Outcome.HTTP_5XX, 503, 0.0)
    s.record_probe(micro(0.0, ok=False), 0.0)
    s.record_probe(ProbeResult(ProbeKind.CANARY, ok=False, reason="t"), 0.0)
    s.record_probe(ProbeResult(ProbeKind.READINESS, ok=False, reason="refused"), 0.0)
    assert s.errors.volume(0.0) == pytest.approx(4.0)
    assert s.error_rate(0.0) == pytest.approx(4 / 7)
    assert s.micro_failures == 1
    assert s.canary_failures == 1
    assert s.request_failures == 1
    assert s.last_request_failure == "http_5xx 503"


def test_not_ready_answer_is_neither_success_nor_failure() -> None:
    """A readiness 'not ready' (engine loading) does not count in the error rate."""
    s = Signals(0.2)
    s.record_probe(ProbeResult(ProbeKind.READINESS, ok=True, ready=False), 0.0)
    assert s.error_rate(0.0) is None


def test_success_resets_its_own_streak_only() -> None:
    """A micro success ends the micro streak but not the canary one."""
    s = Signals(0.2)
    s.record_probe(micro(0.0, ok=False), 0.0)
    s.record_probe(ProbeResult(ProbeKind.CANARY, ok=False), 0.0)
    s.record_probe(micro(0.05), 1.0)
    assert s.micro_failures == 0
    assert s.canary_failures == 1


def test_queue_ratio_uses_capacity_then_running() -> None:
    """Queue depth is relative: waiting / capacity, else / running, else unknown."""
    s = Signals(0.2)
    s.record_facts(EngineFacts(queue_waiting=8.0), 0.0)
    assert s.queue_ratio(0.0) is None
    s.record_facts(EngineFacts(queue_waiting=8.0, running=4.0), 1.0)
    assert s.queue_ratio(1.0) == pytest.approx(2.0)
    s2 = Signals(0.2)
    s2.record_facts(EngineFacts(queue_waiting=4.0, running=2.0, capacity=16.0), 0.0)
    assert s2.queue_ratio(0.0) == pytest.approx(0.25)
    s3 = Signals(0.2)
    s3.record_facts(EngineFacts(queue_waiting=0.0), 0.0)
    assert s3.queue_ratio(0.0) == 0.0


def test_gpu_free_derived_from_used_and_total() -> None:
    """Free VRAM ratio comes from the gauge, or from used/total when only those are known."""
    s = Signals(0.2)
    s.record_facts(EngineFacts(gpu_used_mb=72000.0, gpu_total_mb=80000.0), 0.0)
    assert s.gpu_free(0.0) == pytest.approx(0.1)


def test_signals_go_stale() -> None:
    """A gauge or latency not refreshed for 30 s reads as unknown."""
    s = Signals(0.2)
    s.record_facts(EngineFacts(gpu_free_ratio=0.5, kv_cache_usage=0.3), 0.0)
    s.record_probe(micro(0.05), 0.0)
    assert s.gpu_free(STALE_S) == 0.5
    assert s.gpu_free(STALE_S + 0.1) is None
    assert s.kv_cache_usage(STALE_S + 0.1) is None
    assert s.latency_s(STALE_S + 0.1) is None


def test_heartbeat_rtt_ewma_and_misses() -> None:
    """Heartbeat RTT is an alpha-0.2 EWMA; misses count up and a pong resets them."""
    s = Signals(0.2)
    s.record_heartbeat(Heartbeat(0.010), 0.0)
    s.record_heartbeat(Heartbeat(0.020), 0.1)
    assert s.rtt.value == pytest.approx(0.012)
    s.record_heartbeat(Heartbeat(None, reason="backpressure"), 0.2)
    s.record_heartbeat(Heartbeat(None), 0.3)
    assert s.heartbeat_misses == 2
    assert s.last_heartbeat_miss == "late"
    s.record_heartbeat(Heartbeat(0.01, facts=EngineFacts(gpu_free_ratio=0.4)), 0.4)
    assert s.heartbeat_misses == 0
    assert s.gpu_free(0.4) == 0.4
    assert s.snapshot(0.4)["heartbeat_misses"] == 0
