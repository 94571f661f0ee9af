"""EWMA, time-decayed EWMA and the decayed error rate."""

from __future__ import annotations

import pytest

from pulsegate.health.ewma import DecayingEwma, ErrorRate, Ewma, decay


def test_decay_halves_per_half_life() -> None:
    """decay is 1 now, 0.5 after one half-life, 0.25 after two, and 1 for negative elapsed."""
    assert decay(0.0, 10.0) == 1.0
    assert decay(10.0, 10.0) == pytest.approx(0.5)
    assert decay(20.0, 10.0) == pytest.approx(0.25)
    assert decay(-3.0, 10.0) == 1.0


def test_ewma_first_sample_then_alpha() -> None:
    """The first sample is taken as is; each next one moves the value alpha of the way."""
    e = Ewma(0.2)
    assert e.value is None
    e.update(10.0, 1.0)
    assert e.value == 10.0
    e.update(20.0, 2.0)
    assert e.value == pytest.approx(12.0)
    assert e.count == 2
    assert e.at == 2.0


def test_ewma_step_absorbed_67_percent_after_5_samples() -> None:
    """R2's alpha 0.2: a step change is 1 - 0.8**5 = 67% absorbed after five samples."""
    e = Ewma(0.2)
    e.update(0.0, 0.0)
    for i in range(5):
        e.update(1.0, float(i + 1))
    assert e.value == pytest.approx(1 - 0.8**5)


def test_ewma_reads_never_mutate_and_fresh_expires() -> None:
    """Reading is pure; `fresh` returns None once the last sample is older than max_age."""
    e = Ewma(0.2)
    e.update(5.0, 100.0)
    for _ in range(3):
        assert e.value == 5.0
        assert e.fresh(120.0, 30.0) == 5.0
    assert e.fresh(131.0, 30.0) is None
    assert e.value == 5.0


def test_ewma_rejects_bad_alpha() -> None:
    """Alpha outside (0, 1] is a programming error."""
    with pytest.raises(ValueError, match="alpha"):
        Ewma(0.0)


def test_decaying_ewma_weights_by_time() -> None:
    """A sample one half-life after the last lands halfway; one long after replaces it."""
    d = DecayingEwma(2.0)
    d.update(0.0, 0.0)
    d.update(10.0, 2.0)
    assert d.value == pytest.approx(5.0)
    d.update(10.0, 100.0)
    assert d.value == pytest.approx(10.0, abs=1e-6)


def test_decaying_ewma_same_instant_keeps_old_value() -> None:
    """Two samples at the same instant: the old value keeps all its weight (no time passed)."""
    d = DecayingEwma(2.0)
    d.update(4.0, 1.0)
    d.update(100.0, 1.0)
    assert d.value == pytest.approx(4.0)


def test_error_rate_unknown_before_any_outcome() -> None:
    """No outcome yet: the rate is unknown, not zero."""
    assert ErrorRate(10.0).rate(0.0) is None


def test_error_rate_one_blip_does_not_dominate() -> None:
    """One failure on an idle backend reads 25% (prior of 3 successes), not 100%."""
    r = ErrorRate(10.0, prior=3.0)
    r.record(False, 0.0)
    assert r.rate(0.0) == pytest.approx(0.25)


def test_error_rate_real_outage_reads_high() -> None:
    """Twenty failures in a row read 20/23 = 87%."""
    r = ErrorRate(10.0)
    for i in range(20):
        r.record(False, i * 0.01)
    assert r.rate(0.2) == pytest.approx(20 / 23, rel=0.01)


def test_error_rate_decays_without_mutating() -> None:
    """Old failures fade with the half-life; reading at a later time changes nothing."""
    r = ErrorRate(10.0)
    for _ in range(10):
        r.record(False, 0.0)
    late = r.rate(30.0)
    assert late is not None
    assert late == pytest.approx(1.25 / (1.25 + 3.0))
    assert r.rate(0.0) == pytest.approx(10 / 13)
    assert r.volume(10.0) == pytest.approx(5.0)


def test_error_rate_busy_backend_converges_to_true_rate() -> None:
    """With hundreds of outcomes per half-life the prior vanishes: 10% failures read ~10%."""
    r = ErrorRate(10.0)
    t = 0.0
    for i in range(2000):
        r.record(i % 10 != 0, t)
        t += 0.01
    rate = r.rate(t)
    assert rate is not None
    assert rate == pytest.approx(0.1, abs=0.01)
