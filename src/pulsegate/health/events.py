"""What the health core reports when something changes: one record per change, loggable as
one JSON line (`as_dict`), countable by `cause` (the `reason` label of
`pulsegate_ejections_total`), readable by people (`reason`: "canary failed 2x: timeout after
350ms; out for at least 5.2s").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pulsegate.health.machine import Event
from pulsegate.health.signals import SignalValue
from pulsegate.health.verdict import State


@dataclass(frozen=True, slots=True)
class Transition:
    """A backend moved from one state to another.

    `cause` is a short, stable code naming why (use it as the metrics label):
      to ejected:  heartbeat, canary, micro_inference, consecutive_failures, stalled,
                   engine_down, score, admin; from probation also request_failure, not_ready,
                   probation (ended with latency too high or no micro-inference)
      other moves: ready, not_ready, degraded, cleared (degraded -> ready), rejoin
                   (ejected -> probation), recovered (probation -> ready), drain, undrain
    `reason` says the same in words, with the numbers ("canary failed 2x: timeout after
    350ms; out for at least 5.2s").
    """

    backend: str
    from_state: State
    to_state: State
    event: Event
    cause: str
    reason: str
    at: float  # monotonic seconds (the `now` the core was given)
    score: float | None
    signals: Mapping[str, SignalValue]

    @property
    def is_ejection(self) -> bool:
        """The backend just left rotation because of detected or operator-declared trouble."""
        return self.to_state is State.EJECTED

    def as_dict(self) -> dict[str, object]:
        """One JSON-ready record (for the event log, alerts and /admin/events)."""
        return {
            "type": "transition",
            "backend": self.backend,
            "from": self.from_state.value,
            "to": self.to_state.value,
            "event": self.event.value,
            "cause": self.cause,
            "reason": self.reason,
            "at": self.at,
            "score": None if self.score is None else round(self.score, 1),
            "signals": dict(self.signals),
        }


@dataclass(frozen=True, slots=True)
class PanicChange:
    """A model entered or left panic mode: too many of its backends ejected, so the balancer
    also gets the least-bad ejected ones that are not dead (Envoy's panic threshold)."""

    model: str
    active: bool
    at: float
    ejected: int
    total: int
    reason: str
    cause: str = "panic"

    def as_dict(self) -> dict[str, object]:
        """One JSON-ready record."""
        return {
            "type": "panic",
            "model": self.model,
            "active": self.active,
            "cause": self.cause,
            "reason": self.reason,
            "at": self.at,
            "ejected": self.ejected,
            "total": self.total,
        }


HealthEvent = Transition | PanicChange
