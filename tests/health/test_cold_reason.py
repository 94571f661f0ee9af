"""A backend that never became ready says why in its view (docs/real-engines.md, finding 10)."""

from __future__ import annotations

from pulsegate.health.verdict import State

from .harness import MICRO_FAIL, MICRO_OK, READY, Harness


def test_cold_backend_failing_micro_inference_names_it() -> None:
    """Ready by /health but failing its micro-inference: still cold, and the reason says so;
    the next transition's reason replaces it."""
    h = Harness()
    h.obs("a", READY)
    h.obs("a", MICRO_FAIL)
    assert h.state("a") is State.COLD
    assert h.snap("a")["last_reason"] == "micro-inference failed 1x: timeout after 2000ms"
    h.obs("a", MICRO_OK)
    assert h.state("a") is State.READY
    assert h.snap("a")["last_reason"] == "engine ready, micro-inference ok"
