"""Probation ramp and pass conditions (R8)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pulsegate.health.probation import Probation


def test_ramp_worked_example() -> None:
    """60 s, 1% steps: 1% at start, 2% at 1.2 s, 50% at 30 s, 99% at 59.4 s, 100% at 60 s."""
    p = Probation(60.0, 0.01)
    p.start(100.0)
    assert p.ramp(100.0) == pytest.approx(0.01)
    assert p.ramp(100.7) == pytest.approx(0.01)
    assert p.ramp(101.2) == pytest.approx(0.02)
    assert p.ramp(130.0) == pytest.approx(0.50)
    assert p.ramp(159.4) == pytest.approx(0.99)
    assert p.ramp(159.999) == pytest.approx(0.99)
    assert p.ramp(160.0) == 1.0
    assert p.progress(130.0) == pytest.approx(0.5)


def test_next_step_at() -> None:
    """The next ramp change is one step (duration x ramp_step) later, the end at the latest."""
    p = Probation(60.0, 0.01)
    p.start(0.0)
    assert p.next_step_at(0.0) == pytest.approx(0.6)
    assert p.next_step_at(59.9) == pytest.approx(60.0)


def test_shortfall_requires_a_micro_inference() -> None:
    """A probation without a single micro-inference success cannot pass."""
    p = Probation(60.0, 0.01)
    p.start(0.0)
    assert p.shortfall(1.0) is not None
    p.micro_passed()
    assert p.shortfall(1.0) is None


def test_shortfall_latency_tolerance() -> None:
    """Latency must be back under 1.5x baseline; unknown latency is no evidence against."""
    p = Probation(60.0, 0.01)
    p.start(0.0)
    p.micro_passed()
    assert p.shortfall(1.4) is None
    assert p.shortfall(None) is None
    why = p.shortfall(2.0)
    assert why is not None
    assert "2.0x" in why


def test_zero_duration_passes_at_once() -> None:
    """A zero-length probation is full ramp at once."""
    p = Probation(0.0, 0.01)
    p.start(5.0)
    assert p.done(5.0)
    assert p.ramp(5.0) == 1.0


@given(
    duration=st.floats(min_value=0.5, max_value=600.0),
    step=st.floats(min_value=0.0001, max_value=0.99),  # 1.0 means "no ramp"
    times=st.lists(st.floats(min_value=0.0, max_value=1200.0), min_size=1, max_size=60),
)
def test_ramp_monotone_and_full_only_after_duration(
    duration: float, step: float, times: list[float]
) -> None:
    """The ramp never decreases, starts at ramp_step, and is 1.0 only once duration has passed."""
    p = Probation(duration, step)
    p.start(0.0)
    prev = 0.0
    for t in sorted(times):
        r = p.ramp(t)
        assert r >= prev
        assert r >= step - 1e-12
        if t < duration:
            assert r < 1.0
        else:
            assert r == 1.0
        prev = r


def test_shortfall_forgives_a_slowdown_its_peers_share() -> None:
    p = Probation(duration=1.0, ramp_step=0.1)
    p.micro_passed()
    # 3x its own baseline, at 150 ms: peers at 120 ms excuse it, peers at 90 ms do not.
    assert p.shortfall(3.0, 0.15, 0.12) is None
    assert p.excused_by_peers(3.0, 0.15, 0.12)
    why = p.shortfall(3.0, 0.15, 0.09)
    assert why is not None and "3.0x baseline" in why and "peers answer in 90 ms" in why
    # No peer, or no own latency: the own baseline alone decides.
    assert p.shortfall(3.0, 0.15, None) is not None
    assert p.shortfall(3.0, None, 0.2) is not None
    # Under the tolerance there is nothing to excuse.
    assert p.shortfall(1.2, 0.5, 0.1) is None
    assert not p.excused_by_peers(1.2, 0.5, 0.1)
