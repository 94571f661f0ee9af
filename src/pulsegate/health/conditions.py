"""The conditions the rules test, as pure predicates over one backend's numbers.

Kept apart from `backend.py` so each threshold, with its hysteresis, reads in one place:

- hard evidence: a failure streak at its configured limit (heartbeat misses, micro-inference,
  canary, real requests) - ejects a routable backend at once and keeps any backend out of
  panic routing and out of `ready`;
- score low: under `eject_below` and resting on at least two known dimensions;
- degraded: score under the degrade line, VRAM more than 90% used (R24), KV cache more than
  95% full; cleared 5 score points above the line, at 12% free VRAM and 92% KV cache, so a
  gauge hovering on a line does not flip the state every evaluation;
- clear to rejoin: the last heartbeat, micro-inference and canary answered, the engine not
  saying "not ready", a micro-inference passed since the ejection (`evidence`), VRAM at least
  5% free (R5).
"""

from __future__ import annotations

from pulsegate.config import HealthConfig, ProbesConfig
from pulsegate.health.evidence import Evidence
from pulsegate.health.score import GPU_FREE_MIN, ScoreInputs, known_dimensions
from pulsegate.health.signals import Signals

DEGRADE_GPU_FREE = 0.10  # VRAM more than 90% used (R24)
RECOVER_GPU_FREE = 0.12
DEGRADE_KV = 0.95
RECOVER_KV = 0.92
RECOVER_MARGIN = 5.0  # score points above the degrade line to count as recovered
MIN_DIMENSIONS_TO_EJECT = 2  # one signal alone (say, the error rate) never ejects via the score


def hard_evidence(s: Signals, health: HealthConfig, probes: ProbesConfig) -> str | None:
    """The cause code of a failure streak at its limit now, or None."""
    if s.heartbeat_misses >= probes.heartbeat.misses_to_dead:
        return "heartbeat"
    if s.micro_failures >= probes.micro_inference.failures_to_eject:
        return "micro_inference"
    if s.canary_failures >= probes.canary.failures_to_isolate:
        return "canary"
    if s.request_failures >= health.consecutive_failures:
        return "consecutive_failures"
    return None


def score_low(score: float | None, inputs: ScoreInputs, health: HealthConfig) -> bool:
    """The score is under `eject_below` and rests on at least two known dimensions: with the
    error rate as the only signal the renormalised score is the error sub-score, and R17 says
    error rate alone misjudges."""
    return (
        score is not None
        and score < health.eject_below
        and known_dimensions(inputs, health.weights) >= MIN_DIMENSIONS_TO_EJECT
    )


def quiet(s: Signals, suspect: bool, now: float, interval: float) -> bool:
    """No failure within the last evaluation interval, and not suspect."""
    last = s.last_failure_at
    return not suspect and (last is None or now - last > interval)


def rejoin_blocker(s: Signals, now: float, evidence: Evidence) -> str | None:
    """Why an ejected backend may not rejoin yet (in words), or None when evidence is clear."""
    if s.heartbeats_seen and s.heartbeat_misses > 0:
        return "heartbeat not answered"
    if s.micro_failures:
        return "last micro-inference failed"
    if s.canary_failures:
        return "last canary failed"
    if evidence.not_ready:
        return "engine not ready"
    if not evidence.micro_ok_since_eject:
        return "no micro-inference succeeded since the ejection"
    gf = s.memory_free(now)
    if gf is not None and gf < GPU_FREE_MIN:
        return "memory (KV cache or VRAM) under 5% free"
    return None


def degrade_line(health: HealthConfig) -> float:
    """The score under which a backend is degraded (never below the ejection line)."""
    return max(health.degrade_below, health.eject_below)


def degrade_reasons(
    score: float | None, inputs: ScoreInputs, kv_cache: float | None, health: HealthConfig
) -> list[str]:
    """Each reason to call the backend degraded, in words; empty when none holds."""
    out: list[str] = []
    line = degrade_line(health)
    if score is not None and score < line:
        out.append(f"score {score:.0f} < {line:g} ({describe(inputs)})")
    # inputs.gpu_free is the memory headroom: 1 - KV usage when the engine reports its KV
    # cache (then the KV rule below judges memory), else free VRAM (R24's 90%-used rule).
    gf = inputs.gpu_free
    if kv_cache is None and gf is not None and gf < DEGRADE_GPU_FREE:
        out.append(f"VRAM {(1.0 - gf) * 100:.0f}% used")
    if kv_cache is not None and kv_cache > DEGRADE_KV:
        out.append(f"KV cache {kv_cache * 100:.0f}% full")
    return out


def recovered(
    score: float | None, inputs: ScoreInputs, kv_cache: float | None, health: HealthConfig
) -> bool:
    """Whether every degrade condition has cleared, with hysteresis."""
    gf = inputs.gpu_free
    return (
        (score is None or score >= degrade_line(health) + RECOVER_MARGIN)
        and (kv_cache is not None or gf is None or gf >= RECOVER_GPU_FREE)
        and (kv_cache is None or kv_cache <= RECOVER_KV)
    )


def describe(inputs: ScoreInputs) -> str:
    """The scored dimensions in words: 'latency 3.0x baseline, errors 12%, ...'."""
    parts: list[str] = []
    if inputs.latency_ratio is not None:
        parts.append(f"latency {inputs.latency_ratio:.1f}x baseline")
    if inputs.error_rate is not None:
        parts.append(f"errors {inputs.error_rate * 100:.0f}%")
    if inputs.queue_ratio is not None:
        parts.append(f"queue {inputs.queue_ratio:.1f}x capacity")
    if inputs.gpu_free is not None:
        parts.append(f"memory {inputs.gpu_free * 100:.0f}% free")
    return ", ".join(parts) or "no signals"
