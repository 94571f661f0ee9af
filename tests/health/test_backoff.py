"""Ejection backoff: base x n, capped, jittered, forgiven while healthy."""

from __future__ import annotations

import random

import pytest

from pulsegate.health.backoff import JITTER, Backoff


def test_backoff_grows_linearly_with_jitter() -> None:
    """Ejection n stays out base x n plus at most 10% jitter."""
    b = Backoff(5.0, 300.0, random.Random(7))
    for n in range(1, 6):
        d = b.eject(100.0)
        assert 5.0 * n <= d <= 5.0 * n * (1 + JITTER)
        assert b.until == pytest.approx(100.0 + d)
        assert b.n == n


def test_backoff_is_capped() -> None:
    """However many ejections, the backoff never exceeds the cap (+ jitter)."""
    b = Backoff(5.0, 12.0, random.Random(7))
    durations = [b.eject(0.0) for _ in range(10)]
    assert max(durations) <= 12.0 * (1 + JITTER)
    assert durations[-1] >= 12.0


def test_elapsed() -> None:
    """The backoff is over exactly at `until`."""
    b = Backoff(5.0, 300.0, random.Random(1))
    d = b.eject(10.0)
    assert not b.elapsed(10.0 + d - 0.001)
    assert b.elapsed(10.0 + d)


def test_n_decays_while_healthy() -> None:
    """One step of n is forgiven per 6 x base seconds of continuous health."""
    b = Backoff(5.0, 300.0, random.Random(1))
    for _ in range(3):
        b.eject(0.0)
    t = 100.0
    b.healthy(t)
    b.healthy(t + 29.0)
    assert b.n == 3
    b.healthy(t + 30.0)
    assert b.n == 2
    b.healthy(t + 60.0)
    b.healthy(t + 90.0)
    assert b.n == 0
    assert b.total == 3


def test_unhealthy_restarts_forgiveness() -> None:
    """A sick moment restarts the forgiveness clock."""
    b = Backoff(5.0, 300.0, random.Random(1))
    b.eject(0.0)
    b.healthy(10.0)
    b.unhealthy()
    b.healthy(35.0)
    b.healthy(60.0)
    assert b.n == 1
    b.healthy(65.0)
    assert b.n == 0
