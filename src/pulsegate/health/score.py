"""The 0-100 health score (R12) and the routing weight derived from it. Pure maths.

score = sum(weight_d x subscore_d) / sum(weight_d) over the dimensions d whose signal is known.
Default weights: latency 0.3, error rate 0.3, queue 0.2, free GPU memory 0.2. An unknown
dimension is left out and the others renormalised: never a made-up number.

Each sub-score is a piecewise-linear curve through a few knots (clamped at both ends):

  latency ratio (smoothed / own baseline): <=1.2 -> 100, 2 -> 73, 3 -> 40, 5 -> 29, >=10 -> 0
      (1.2 is a noise band: the baseline is a low estimate, so a healthy backend reads ~1.1)
  error rate: 0 -> 100, 1% -> 90, 5% -> 60, 20% -> 20, >=50% -> 0
  queue (waiting / capacity): 0 -> 100, 0.25 -> 90, 1 -> 50, >=4 -> 0
      (a queue as long as one full batch halves the sub-score: busy, not broken - R17)
  free GPU memory: >=30% -> 100, 10% -> 50, <=5% -> 0   (R5: under 5% is never picked)

Worked example: a backend slowed 3x, no errors, empty queue, 40% VRAM free:
  0.3 x 40 + 0.3 x 100 + 0.2 x 100 + 0.2 x 100 = 82.
Same backend without an engine metrics scrape (queue and VRAM unknown):
  (0.3 x 40 + 0.3 x 100) / 0.6 = 70.
A backend whose every request fails with the other dimensions fine scores 70: errors alone
never eject through the score, by design (R12's weights; R17: "error rate alone misjudges") -
the consecutive-failure and probe rules do. For the same reason the rules eject on the score
only when at least two dimensions are known (`known_dimensions`): with the error rate as the
only known signal the renormalised score is the error sub-score itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pulsegate.config import WeightsConfig

LATENCY_KNOTS: tuple[tuple[float, float], ...] = ((1.2, 100.0), (3.0, 40.0), (10.0, 0.0))
ERROR_KNOTS: tuple[tuple[float, float], ...] = (
    (0.0, 100.0),
    (0.01, 90.0),
    (0.05, 60.0),
    (0.20, 20.0),
    (0.50, 0.0),
)
QUEUE_KNOTS: tuple[tuple[float, float], ...] = ((0.0, 100.0), (0.25, 90.0), (1.0, 50.0), (4.0, 0.0))
GPU_FREE_KNOTS: tuple[tuple[float, float], ...] = ((0.05, 0.0), (0.10, 50.0), (0.30, 100.0))

# Latency below this multiple of the baseline is noise: no score or weight penalty.
LATENCY_BAND = LATENCY_KNOTS[0][0]
# Below this free-VRAM ratio a backend is never picked (R5).
GPU_FREE_MIN = 0.05


@dataclass(frozen=True, slots=True)
class ScoreInputs:
    """The four scored dimensions; None = unknown (left out of the score)."""

    latency_ratio: float | None = None
    error_rate: float | None = None
    queue_ratio: float | None = None
    gpu_free: float | None = None


def interpolate(x: float, knots: Sequence[tuple[float, float]]) -> float:
    """Piecewise-linear y(x) through `knots` (sorted by x), flat beyond the first and last."""
    x0, y0 = knots[0]
    if x <= x0:
        return y0
    for x1, y1 in knots[1:]:
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        x0, y0 = x1, y1
    return y0


def latency_subscore(ratio: float) -> float:
    """100 within 1.2x of the baseline, 40 at 3x, 0 from 10x."""
    return interpolate(ratio, LATENCY_KNOTS)


def error_subscore(rate: float) -> float:
    """100 with no errors, 60 at 5%, 20 at 20%, 0 from 50%."""
    return interpolate(rate, ERROR_KNOTS)


def queue_subscore(ratio: float) -> float:
    """100 with an empty queue, 50 with one batch waiting, 0 from four."""
    return interpolate(ratio, QUEUE_KNOTS)


def gpu_free_subscore(free: float) -> float:
    """100 from 30% free VRAM, 50 at 10%, 0 at 5% and below."""
    return interpolate(free, GPU_FREE_KNOTS)


def subscores(inputs: ScoreInputs) -> dict[str, float]:
    """The known dimensions' sub-scores by name (latency, error_rate, queue, gpu_free)."""
    out: dict[str, float] = {}
    if inputs.latency_ratio is not None:
        out["latency"] = latency_subscore(inputs.latency_ratio)
    if inputs.error_rate is not None:
        out["error_rate"] = error_subscore(inputs.error_rate)
    if inputs.queue_ratio is not None:
        out["queue"] = queue_subscore(inputs.queue_ratio)
    if inputs.gpu_free is not None:
        out["gpu_free"] = gpu_free_subscore(inputs.gpu_free)
    return out


def known_dimensions(inputs: ScoreInputs, weights: WeightsConfig) -> int:
    """How many dimensions with a positive weight the score rests on."""
    return sum(
        1
        for value, w in (
            (inputs.latency_ratio, weights.latency),
            (inputs.error_rate, weights.error_rate),
            (inputs.queue_ratio, weights.queue),
            (inputs.gpu_free, weights.gpu_free),
        )
        if value is not None and w > 0.0
    )


def score(inputs: ScoreInputs, weights: WeightsConfig) -> float | None:
    """Weighted mean of the known sub-scores, 0..100; None when nothing is known."""
    total = 0.0
    wsum = 0.0
    for value, w, curve in (
        (inputs.latency_ratio, weights.latency, latency_subscore),
        (inputs.error_rate, weights.error_rate, error_subscore),
        (inputs.queue_ratio, weights.queue, queue_subscore),
        (inputs.gpu_free, weights.gpu_free, gpu_free_subscore),
    ):
        if value is not None and w > 0.0:
            total += w * curve(value)
            wsum += w
    if wsum <= 0.0:
        return None
    return min(100.0, max(0.0, total / wsum))


def routing_weight(
    score: float | None, latency_ratio: float | None, error_rate: float | None
) -> float:
    """Relative share of new requests a backend should get, 0..1, before ramp and config weight.

    weight = (score / 100) ** 2 x speed x reliability, where
      speed       = min(1, 1.2 / latency_ratio): a backend 3x slower than its own normal
                    finishes a third of the work in the same time (Little's law), so it gets a
                    proportional share - the score alone moves only 30% for latency;
      reliability = (1 - error_rate) ** 2: each request sent there fails with that chance.
    Unknown inputs count as no evidence (factor 1).

    Worked example, three backends sampled by weight, one slowed 3x (score 82, see above):
      healthy: 1.0 x 1 x 1 = 1.0;  slow: 0.82**2 x (1.2 / 3) x 1 = 0.672 x 0.4 = 0.269
      share of the slow one: 0.269 / (1.0 + 1.0 + 0.269) = 11.9%  (< 15%).
    A backend failing 25% of requests: error sub-score 16.7, score 0.3 x 16.7 + 70 = 75
      -> 0.5625 x 0.5625 = 0.316: 13.7% of traffic among three, so 3.4% of all requests need
      a retry instead of 8.3% with equal shares.
    """
    w = 1.0 if score is None else (max(0.0, min(100.0, score)) / 100.0) ** 2
    if latency_ratio is not None and latency_ratio > LATENCY_BAND:
        w *= LATENCY_BAND / latency_ratio
    if error_rate is not None:
        ok = 1.0 - min(1.0, max(0.0, error_rate))
        w *= ok * ok
    return w
