"""The 0-100 score: sub-score curves, weights, renormalisation, and the routing weight."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pulsegate.config import WeightsConfig
from pulsegate.health.score import (
    ScoreInputs,
    error_subscore,
    gpu_free_subscore,
    known_dimensions,
    latency_subscore,
    queue_subscore,
    routing_weight,
    score,
    subscores,
)

W = WeightsConfig()


@pytest.mark.parametrize(
    ("ratio", "expected"),
    [
        (0.5, 100.0),
        (1.0, 100.0),
        (1.2, 100.0),
        (2.0, 73.33),
        (3.0, 40.0),
        (5.0, 28.57),
        (10.0, 0.0),
    ],
)
def test_latency_curve_worked_examples(ratio: float, expected: float) -> None:
    """Latency vs own baseline: 1x -> 100, 3x -> 40, 10x -> 0 (noise band to 1.2x)."""
    assert latency_subscore(ratio) == pytest.approx(expected, abs=0.01)


@pytest.mark.parametrize(
    ("rate", "expected"), [(0.0, 100.0), (0.01, 90.0), (0.05, 60.0), (0.2, 20.0), (0.5, 0.0)]
)
def test_error_curve_worked_examples(rate: float, expected: float) -> None:
    """Error rate: 0 -> 100, 5% -> 60, 20% -> 20, 50%+ -> 0."""
    assert error_subscore(rate) == pytest.approx(expected)


@pytest.mark.parametrize(("ratio", "expected"), [(0.0, 100.0), (1.0, 50.0), (4.0, 0.0), (9.0, 0.0)])
def test_queue_curve_worked_examples(ratio: float, expected: float) -> None:
    """Queue: empty -> 100, one batch waiting -> 50, four -> 0."""
    assert queue_subscore(ratio) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("free", "expected"), [(0.0, 0.0), (0.05, 0.0), (0.10, 50.0), (0.30, 100.0), (0.9, 100.0)]
)
def test_gpu_free_curve_worked_examples(free: float, expected: float) -> None:
    """Free VRAM: 30%+ -> 100, 10% -> 50, 5% or less -> 0."""
    assert gpu_free_subscore(free) == pytest.approx(expected)


def test_score_is_the_weighted_sum() -> None:
    """3x slow, no errors, empty queue, 40% VRAM free: 0.3x40 + 0.3x100 + 0.2x100 + 0.2x100 = 82."""
    assert score(ScoreInputs(3.0, 0.0, 0.0, 0.4), W) == pytest.approx(82.0)


def test_score_all_healthy_is_100_and_all_bad_is_0() -> None:
    """The score spans 0..100."""
    assert score(ScoreInputs(1.0, 0.0, 0.0, 0.5), W) == pytest.approx(100.0)
    assert score(ScoreInputs(20.0, 1.0, 10.0, 0.0), W) == pytest.approx(0.0)


def test_missing_dimensions_are_left_out_and_weights_renormalised() -> None:
    """Without queue and VRAM: (0.3 x 40 + 0.3 x 100) / 0.6 = 70; never a made-up number."""
    assert score(ScoreInputs(latency_ratio=3.0, error_rate=0.0), W) == pytest.approx(70.0)
    assert score(ScoreInputs(error_rate=0.05), W) == pytest.approx(60.0)


def test_nothing_known_is_no_score() -> None:
    """With no dimension known the score is None."""
    assert score(ScoreInputs(), W) is None
    assert subscores(ScoreInputs()) == {}


def test_known_dimensions_counts_weighted_known_signals() -> None:
    """known_dimensions counts the known dimensions that carry weight."""
    assert known_dimensions(ScoreInputs(), W) == 0
    assert known_dimensions(ScoreInputs(error_rate=0.5), W) == 1
    assert known_dimensions(ScoreInputs(1.0, 0.5, None, 0.3), W) == 3
    no_queue = WeightsConfig(queue=0.0)
    assert known_dimensions(ScoreInputs(1.0, 0.5, 2.0, 0.3), no_queue) == 3


def test_configured_weights_apply() -> None:
    """Weights come from WeightsConfig; a zero weight drops the dimension."""
    only_queue = WeightsConfig(latency=0.0, error_rate=0.0, queue=1.0, gpu_free=0.0)
    assert score(ScoreInputs(10.0, 1.0, 1.0, 0.0), only_queue) == pytest.approx(50.0)
    assert score(ScoreInputs(latency_ratio=10.0), only_queue) is None


def test_subscores_names_known_dimensions() -> None:
    """subscores lists only the known dimensions, by name."""
    assert subscores(ScoreInputs(latency_ratio=3.0, gpu_free=0.1)) == {
        "latency": pytest.approx(40.0),
        "gpu_free": pytest.approx(50.0),
    }


def test_a_3x_slow_backend_gets_under_15_percent_among_three() -> None:
    """Worked example: weights 1, 1 and 0.269 -> the slow one gets 11.9% when sampled by weight."""
    healthy = routing_weight(score(ScoreInputs(1.0, 0.0, 0.0, 0.4), W), 1.0, 0.0)
    slow = routing_weight(score(ScoreInputs(3.0, 0.0, 0.0, 0.4), W), 3.0, 0.0)
    assert healthy == pytest.approx(1.0)
    assert slow == pytest.approx(0.269, abs=0.001)
    assert slow / (2 * healthy + slow) < 0.15


def test_routing_weight_unknown_inputs_are_neutral() -> None:
    """Unknown score, latency or error rate count as no evidence (factor 1)."""
    assert routing_weight(None, None, None) == 1.0
    assert routing_weight(100.0, 1.1, 0.0) == 1.0


def test_routing_weight_error_rate_example() -> None:
    """25% errors: score 75, weight 0.5625 x 0.5625 = 0.316."""
    s = score(ScoreInputs(1.0, 0.25, 0.0, 0.4), W)
    assert s == pytest.approx(75.0)
    assert routing_weight(s, 1.0, 0.25) == pytest.approx(0.316, abs=0.001)


ratios = st.floats(min_value=0.0, max_value=100.0, allow_nan=False)
rates = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


@given(ratios, rates, ratios, rates)
def test_score_in_range(lat: float, err: float, q: float, free: float) -> None:
    """Any inputs give a score within 0..100 and a weight within 0..1."""
    s = score(ScoreInputs(lat, err, q, free), W)
    assert s is not None
    assert 0.0 <= s <= 100.0
    assert 0.0 <= routing_weight(s, lat, err) <= 1.0


@given(ratios, ratios, rates)
def test_worse_latency_never_scores_higher(a: float, b: float, err: float) -> None:
    """The score is monotone: a slower backend never scores above a faster one."""
    lo, hi = sorted((a, b))
    s_fast = score(ScoreInputs(lo, err), W)
    s_slow = score(ScoreInputs(hi, err), W)
    assert s_fast is not None
    assert s_slow is not None
    assert s_slow <= s_fast + 1e-9
