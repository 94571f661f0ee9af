"""Suspicion: overdue first bytes make a backend suspect; twice, a failing probe proves a stall."""

from __future__ import annotations

from pulsegate.health.observations import FirstByteOverdue
from pulsegate.health.suspect import Suspicion


def test_suspect_then_stalled_then_cleared() -> None:
    """The first report makes suspect, the second makes a stall provable; clear resets both."""
    s = Suspicion()
    assert s.report(FirstByteOverdue(1, 2.0)) is True
    assert s.active and not s.stalled
    assert s.report(FirstByteOverdue(3, 3.5)) is False
    assert s.stalled
    assert s.words == "first byte overdue on 3 requests (oldest 3.5s)"
    assert s.clear() is True
    assert not s.active and not s.stalled and s.reports == 0
    assert s.clear() is False


def test_only_a_success_sooner_than_the_overdue_ones_clears() -> None:
    """The bar is the shortest overdue wait reported; unknown first-byte time clears."""
    s = Suspicion()
    assert not s.cleared_by(0.01)  # not suspect: nothing to clear
    s.report(FirstByteOverdue(1, 0.5))
    s.report(FirstByteOverdue(1, 0.2))
    assert not s.cleared_by(1.5) and not s.cleared_by(0.2)
    assert s.cleared_by(0.05) and s.cleared_by(None)
