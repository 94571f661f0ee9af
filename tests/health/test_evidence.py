"""Readiness and rejoin evidence: what must have passed since "not ready" and since ejection."""

from __future__ import annotations

from pulsegate.health.conditions import rejoin_blocker
from pulsegate.health.evidence import Evidence
from pulsegate.health.signals import Signals


def test_ready_needs_a_micro_inference_after_not_ready() -> None:
    """Ready to serve: the engine says ready and a micro-inference passed since "not ready"."""
    e = Evidence()
    assert not e.ready_to_serve and not e.not_ready
    e.on_ready()
    assert not e.ready_to_serve
    e.on_micro(True)
    assert e.ready_to_serve
    e.on_not_ready("")
    assert e.not_ready and e.ready_reason == "loading"
    e.on_ready()
    assert not e.ready_to_serve, "the micro-inference before 'not ready' no longer counts"
    e.on_micro(True)
    e.on_micro(False)
    assert not e.ready_to_serve, "the last micro-inference failed"


def test_ready_after_refused_is_a_restart() -> None:
    """`on_ready` says True exactly once after the port refused: a new process answers."""
    e = Evidence()
    assert e.on_ready() is False
    e.on_refused()
    assert e.on_ready() is True
    assert e.on_ready() is False


def test_rejoin_needs_a_micro_inference_since_the_ejection() -> None:
    """An ejection clears the micro-inference evidence; the engine saying not ready blocks."""
    s = Signals(0.3)
    e = Evidence()
    e.on_ready()
    e.on_micro(True)
    assert rejoin_blocker(s, 0.0, e) is None
    e.on_eject()
    assert rejoin_blocker(s, 0.0, e) == "no micro-inference succeeded since the ejection"
    e.on_micro(True)
    assert rejoin_blocker(s, 0.0, e) is None
    e.on_not_ready("reloading")
    assert rejoin_blocker(s, 0.0, e) == "engine not ready"
