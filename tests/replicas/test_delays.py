"""Propagation delay quantiles (pure)."""

from __future__ import annotations

from pulsegate.replicas.delays import Delays


def test_quantiles_by_nearest_rank() -> None:
    """1..100 ms: p50 is 50 ms, p99 is 99 ms."""
    d = Delays()
    for i in range(1, 101):
        d.add(i / 1000)
    assert d.summary_ms() == {"count": 100, "p50_ms": 50.0, "p99_ms": 99.0}


def test_empty_and_negative() -> None:
    """No value: None; a negative delay (clock skew between hosts) counts as 0."""
    d = Delays()
    assert d.quantile(0.5) is None
    d.add(-0.5)
    assert d.quantile(0.99) == 0.0
