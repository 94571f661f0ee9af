"""Per-backend signals: observations in, smoothed numbers out. No rules live here.

What is tracked, and why this way:

- Latency, each source against the backend's OWN baseline (`LatencyTracker`): micro-inference
  and canary probe latency, and time-to-first-token of real traffic. Never total request time:
  a 2-minute legitimate generation says nothing about health (R17). A ratio of 3.0 means
  "three times slower than this backend usually is"; comparing backends with each other is
  the balancer's job (it gets `rtt_s`).
- The baseline is a slow-moving low estimate: it follows the smoothed latency down at once and
  drifts up with a 2-minute half-life, and only while the backend is quiet (`learn`, called by
  the rules while ready or degraded with no recent failure) and only toward values under 1.5x
  itself - so a backend that turns
  3x slow never teaches us that 3x is normal. It is unknown until 5 samples have been seen
  (a brand new backend is not judged on one sample) and floored at 10 ms, so 0.4 ms against a
  0.1 ms loopback baseline does not read as "4x slower".
- Error rate (`ErrorRate`, 10 s half-life, prior of 3 successes): failed real requests plus
  failed micro-inference, canary and readiness probes.
- Queue depth relative to capacity: waiting / capacity (engine batch size) or else / running,
  time-smoothed (2 s half-life) because the gauge is spiky.
- GPU and KV-cache gauges: latest value, so an OOM shows at once.
- Heartbeat: RTT EWMA with alpha 0.2 (R2) and consecutive misses (R3).
- Consecutive failure counters for the hard-evidence rules (real traffic, micro, canary).

Any signal not refreshed for 30 s reads as unknown (None): a dead metrics scrape must not
freeze a backend's score at its last good value, and unknown dimensions leave the score.
"""

from __future__ import annotations

from pulsegate.health.ewma import DecayingEwma, ErrorRate, Ewma, decay
from pulsegate.health.observations import (
    EngineFacts,
    Heartbeat,
    Outcome,
    ProbeKind,
    ProbeResult,
)
from pulsegate.health.score import ScoreInputs

STALE_S = 30.0  # a signal older than this is unknown
BASELINE_MIN_SAMPLES = 5  # samples before a latency baseline exists
LATENCY_FLOOR_S = 0.010  # ratios are taken against max(baseline, 10 ms)
BASELINE_DRIFT_HALF_LIFE_S = 120.0  # how slowly the baseline creeps up while healthy
BASELINE_LEARN_CEILING = 1.5  # latency above 1.5x baseline is never learned as normal
ERROR_HALF_LIFE_S = 10.0
ERROR_PRIOR = 3.0
QUEUE_HALF_LIFE_S = 2.0

SignalValue = float | int | None


class LatencyTracker:
    """One latency source: EWMA of its samples and a slow, low baseline learned while healthy."""

    __slots__ = ("_learned_at", "baseline", "ewma", "last")

    def __init__(self, alpha: float) -> None:
        self.ewma = Ewma(alpha)
        self.baseline: float | None = None
        self._learned_at: float | None = None
        self.last: float | None = None  # the last sample itself (`slowness` reads it)

    def record(self, seconds: float, now: float) -> None:
        """Fold one latency sample in (negative values are clamped to zero)."""
        self.last = seconds if seconds > 0.0 else 0.0
        self.ewma.update(self.last, now)

    def value(self, now: float) -> float | None:
        """Smoothed latency in seconds, None if unknown or stale."""
        return self.ewma.fresh(now, STALE_S)

    def ratio(self, now: float) -> float | None:
        """Smoothed latency / max(baseline, 10 ms); None until a baseline exists."""
        v = self.value(now)
        b = self.baseline
        if v is None or b is None:
            return None
        return v / max(b, LATENCY_FLOOR_S)

    def learn(self, now: float) -> None:
        """Move the baseline toward the current smoothed latency (call only while healthy).

        Worked example: baseline 100 ms, EWMA 120 ms, called once a second. Each call moves the
        baseline 1 - 0.5 ** (1 / 120) = 0.58% of the gap: it reaches 110 ms after 2 minutes. An
        EWMA of 300 ms (3x) is above the 1.5x ceiling and moves nothing; 80 ms is taken at once.
        """
        v = self.value(now)
        last = self._learned_at
        self._learned_at = now
        if v is None or self.ewma.count < BASELINE_MIN_SAMPLES:
            return
        b = self.baseline
        if b is None or v <= b:
            self.baseline = v
        elif v < b * BASELINE_LEARN_CEILING and last is not None:
            step = 1.0 - decay(now - last, BASELINE_DRIFT_HALF_LIFE_S)
            self.baseline = b + step * (v - b)


class Gauge:
    """The latest value of one engine/GPU gauge and when it was reported."""

    __slots__ = ("at", "value")

    def __init__(self) -> None:
        self.value: float | None = None
        self.at: float | None = None

    def set(self, value: float | None, now: float) -> None:
        """Record a reported value; None (not reported this time) leaves the old one."""
        if value is not None:
            self.value = value
            self.at = now

    def fresh(self, now: float) -> float | None:
        """The value if reported within the last 30 s, else None."""
        if self.at is None or now - self.at > STALE_S:
            return None
        return self.value


class Signals:
    """Everything known about one backend, as numbers. Mutated only by the `record_*` methods."""

    def __init__(self, alpha: float) -> None:
        self.micro = LatencyTracker(alpha)
        self.canary = LatencyTracker(alpha)
        self.ttft = LatencyTracker(alpha)
        self.rtt = Ewma(alpha)
        self.errors = ErrorRate(ERROR_HALF_LIFE_S, ERROR_PRIOR)
        self.queue_ratio_ewma = DecayingEwma(QUEUE_HALF_LIFE_S)
        self.queue = Gauge()
        self.running = Gauge()
        self.capacity = Gauge()
        self.kv_cache = Gauge()
        self.prefix_hit = Gauge()
        self.gpu_free_ratio = Gauge()
        self.gpu_used_mb = Gauge()
        self.gpu_total_mb = Gauge()
        self.gpu_temp_c = Gauge()
        self.gpu_util = Gauge()
        # Consecutive-failure counters (reset by a success of the same kind).
        self.heartbeat_misses = 0
        self.heartbeats_seen = False
        self.request_failures = 0
        self.micro_failures = 0
        self.canary_failures = 0
        # Last failure descriptions, for transition reasons.
        self.last_request_failure = ""
        self.last_micro_failure = ""
        self.last_canary_failure = ""
        self.last_heartbeat_miss = ""
        self.last_failure_at: float | None = None

    def reconfigure(self, alpha: float) -> None:
        """A reloaded `ewma_alpha`: the latency and RTT averages weigh new samples with it and
        keep their values, counts and baselines. (The error rate and queue use fixed half-lives.)"""
        for e in (self.micro.ewma, self.canary.ewma, self.ttft.ewma, self.rtt):
            e.set_alpha(alpha)

    # -- recording -------------------------------------------------------------------------

    def record_request_ok(self, ttft_s: float | None, now: float) -> None:
        """A real request got its response (the OK path: no allocation beyond floats)."""
        if ttft_s is not None:
            self.ttft.record(ttft_s, now)
        self.errors.record(True, now)
        self.request_failures = 0

    def record_request_failure(self, outcome: Outcome, status: int | None, now: float) -> None:
        """A real request failed in a way that counts against the backend."""
        self.errors.record(False, now)
        self.request_failures += 1
        self.last_request_failure = outcome.value if status is None else f"{outcome.value} {status}"
        self.last_failure_at = now

    def record_probe(self, probe: ProbeResult, now: float) -> None:
        """An active probe: latency on success, counters and error rate either way."""
        kind = probe.kind
        if kind is ProbeKind.READINESS:
            if not probe.ok:
                self.errors.record(False, now)
                self.last_failure_at = now
            elif probe.ready is not False:
                self.errors.record(True, now)
            # ok and not ready: the engine answered "loading". Neither success nor failure.
            return
        tracker = self.micro if kind is ProbeKind.MICRO else self.canary
        if probe.ok:
            if probe.latency_s is not None:
                tracker.record(probe.latency_s, now)
            self.errors.record(True, now)
            if kind is ProbeKind.MICRO:
                self.micro_failures = 0
            else:
                self.canary_failures = 0
            return
        # A failed probe's latency (often the timeout) is not a latency sample: it is a lower
        # bound at best, and ~0 for "connection refused", which would flatter the backend.
        self.errors.record(False, now)
        self.last_failure_at = now
        why = probe.reason or "failed"
        if kind is ProbeKind.MICRO:
            self.micro_failures += 1
            self.last_micro_failure = why
        else:
            self.canary_failures += 1
            self.last_canary_failure = why

    def record_facts(self, facts: EngineFacts, now: float) -> None:
        """Engine and GPU gauges; fields that are None keep their previous value."""
        self.queue.set(facts.queue_waiting, now)
        self.running.set(facts.running, now)
        self.capacity.set(facts.capacity, now)
        self.kv_cache.set(facts.kv_cache_usage, now)
        self.prefix_hit.set(facts.prefix_cache_hit_rate, now)
        self.gpu_used_mb.set(facts.gpu_used_mb, now)
        self.gpu_total_mb.set(facts.gpu_total_mb, now)
        self.gpu_temp_c.set(facts.gpu_temp_c, now)
        self.gpu_util.set(facts.gpu_util, now)
        free = facts.gpu_free_ratio
        if free is None and facts.gpu_used_mb is not None and facts.gpu_total_mb:
            free = 1.0 - facts.gpu_used_mb / facts.gpu_total_mb
        if free is not None:
            self.gpu_free_ratio.set(min(1.0, max(0.0, free)), now)
        waiting = facts.queue_waiting
        if waiting is not None:
            if waiting <= 0.0:
                self.queue_ratio_ewma.update(0.0, now)
            else:
                # Capacity (batch size) if known, else what is running now: 8 waiting behind 8
                # running means each newcomer waits about one full generation.
                den = self.capacity.fresh(now)
                if den is None:
                    den = self.running.fresh(now)
                if den is not None:
                    self.queue_ratio_ewma.update(waiting / max(den, 1.0), now)

    def record_heartbeat(self, hb: Heartbeat, now: float) -> None:
        """One heartbeat ping: a pong in time (RTT) or a miss."""
        self.heartbeats_seen = True
        if hb.rtt_s is not None:
            self.rtt.update(hb.rtt_s, now)
            self.heartbeat_misses = 0
        else:
            self.heartbeat_misses += 1
            self.last_heartbeat_miss = hb.reason or "late"
            self.last_failure_at = now
        if hb.facts is not None:
            self.record_facts(hb.facts, now)

    def forget_outage(self) -> None:
        """The engine restarted: start its error rate and failure streaks afresh."""
        self.errors = ErrorRate(ERROR_HALF_LIFE_S, ERROR_PRIOR)
        self.micro_failures = 0
        self.canary_failures = 0
        self.request_failures = 0

    def forget_ttft(self) -> None:
        """Drop the smoothed time to first token (its baseline stays)."""
        self.ttft.ewma.reset()

    def reset_request_failures(self) -> None:
        """Forget the real-traffic failure streak (on ejection: no traffic will come to end it)."""
        self.request_failures = 0

    # -- reading (never mutates) -----------------------------------------------------------

    def latency_ratio(self, now: float) -> float | None:
        """The worst own-baseline ratio among micro, canary and TTFT; None if none is known."""
        worst: float | None = None
        for tracker in (self.micro, self.canary, self.ttft):
            r = tracker.ratio(now)
            if r is not None and (worst is None or r > worst):
                worst = r
        return worst

    def latency_s(self, now: float) -> float | None:
        """Smoothed active-probe latency: micro-inference, else canary."""
        v = self.micro.value(now)
        return v if v is not None else self.canary.value(now)

    def rtt_s(self, now: float) -> float | None:
        """The latency the balancer should weigh: TTFT, else probe latency, else heartbeat RTT."""
        v = self.ttft.value(now)
        if v is None:
            v = self.latency_s(now)
        if v is None:
            v = self.rtt.fresh(now, STALE_S)
        return v

    def error_rate(self, now: float) -> float | None:
        """Decayed failure share of real requests and probes, None before any outcome."""
        return self.errors.rate(now)

    def queue_ratio(self, now: float) -> float | None:
        """Smoothed waiting / capacity, None if unknown or stale."""
        return self.queue_ratio_ewma.fresh(now, STALE_S)

    def gpu_free(self, now: float) -> float | None:
        """Free framebuffer memory ratio 0..1, None if unknown or stale."""
        return self.gpu_free_ratio.fresh(now)

    def memory_free(self, now: float) -> float | None:
        """Memory headroom 0..1 for decisions (score, degraded, never-pick under 5%).

        vLLM, SGLang and TGI reserve most of the GPU at start (vLLM: 90%), so free
        framebuffer memory is flat and says nothing there; the KV cache is where their
        memory fills up. So: 1 - KV-cache usage when the engine reports it, else free VRAM.
        """
        kv = self.kv_cache.fresh(now)
        if kv is not None:
            return max(0.0, 1.0 - kv)
        return self.gpu_free(now)

    def kv_cache_usage(self, now: float) -> float | None:
        """KV-cache usage 0..1, None if unknown or stale."""
        return self.kv_cache.fresh(now)

    def prefix_cache_hit_rate(self, now: float) -> float | None:
        """Prefix-cache hit rate 0..1, None if unknown or stale."""
        return self.prefix_hit.fresh(now)

    def score_inputs(self, now: float) -> ScoreInputs:
        """The four scored dimensions at `now`."""
        return ScoreInputs(
            latency_ratio=self.latency_ratio(now),
            error_rate=self.error_rate(now),
            queue_ratio=self.queue_ratio(now),
            gpu_free=self.memory_free(now),
        )

    def learn(self, now: float) -> None:
        """Let each latency baseline learn from now (the caller vouches the backend is healthy)."""
        self.micro.learn(now)
        self.canary.learn(now)
        self.ttft.learn(now)

    def snapshot(self, now: float) -> dict[str, SignalValue]:
        """The signals for the admin API and transition records; None where unknown."""
        return {
            "rtt_ms": _ms(self.rtt.fresh(now, STALE_S)),
            "latency_ms": _ms(self.latency_s(now)),
            "ttft_ms": _ms(self.ttft.value(now)),
            "canary_ms": _ms(self.canary.value(now)),
            "latency_ratio": _round(self.latency_ratio(now), 3),
            "error_rate": _round(self.error_rate(now), 4),
            "queue": self.queue.fresh(now),
            "queue_ratio": _round(self.queue_ratio(now), 3),
            "running": self.running.fresh(now),
            "gpu_free": _round(self.gpu_free(now), 4),
            "memory_free": _round(self.memory_free(now), 4),
            "gpu_used_mb": self.gpu_used_mb.fresh(now),
            "gpu_total_mb": self.gpu_total_mb.fresh(now),
            "gpu_temp_c": self.gpu_temp_c.fresh(now),
            "gpu_util": self.gpu_util.fresh(now),
            # 6 digits: a small model's cache in use is ~1e-5 of vLLM's; never shown as 0.
            "kv_cache_usage": _round(self.kv_cache_usage(now), 6),
            "prefix_cache_hit_rate": _round(self.prefix_cache_hit_rate(now), 4),
            "heartbeat_misses": self.heartbeat_misses if self.heartbeats_seen else None,
            "consecutive_failures": self.request_failures,
            "micro_failures": self.micro_failures,
            "canary_failures": self.canary_failures,
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)
