"""Folding a peer's message into this replica's health core: shared evidence, local judgement.

A peer's probe result becomes an observation, exactly as if this replica's own prober had
run it, so the same rules reach the same verdict on every replica; a peer's ejection ejects
here too (unless this replica already has it out), its drain and undrain are the operator's
and are done here too. Whatever this replica decides while folding is marked as such
(`folding`): the publisher never sends it on, so one fact travels once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from pulsegate.config import Config
from pulsegate.health.events import Transition
from pulsegate.health.fleet import Fleet
from pulsegate.health.observations import Observation
from pulsegate.health.verdict import State
from pulsegate.replicas.codec import Message, probe_result

log = logging.getLogger("pulsegate.replicas")

# A peer's ejection changes nothing here in these states: already out, or out by hand (the
# state machine has no drained -> ejected move).
_KEEP = frozenset({State.EJECTED, State.DRAINED})


class Health(Protocol):
    """What replicas need of the health service (`control.service.HealthService`)."""

    config: Config
    fleet: Fleet
    on_change: list[Callable[[], None]]
    on_transitions: list[Callable[[Sequence[Transition]], None]]

    def report(self, name: str, obs: Observation) -> None: ...

    def act(self, name: str, verb: str) -> bool: ...

    def emit(self, transitions: Sequence[Transition]) -> None: ...


class Folder:
    def __init__(self, health: Health, now: Callable[[], float]) -> None:
        self._health = health
        self._now = now
        self.folding = False  # True while a peer's fact is being applied here

    def fold(self, m: Message) -> bool:
        """Apply `m`; False when it names a backend this replica does not have, or is
        malformed (nothing changed)."""
        h = self._health
        if m.backend not in h.fleet.names():
            return False
        self.folding = True
        try:
            if m.kind == "probe":
                r = probe_result(m)
                if r is None:
                    return False
                h.report(m.backend, r)
            elif m.kind == "eject":
                self._eject(m)
            elif m.kind in ("drain", "undrain"):
                h.act(m.backend, m.kind)
            return True
        finally:
            self.folding = False

    def _eject(self, m: Message) -> None:
        h = self._health
        if h.fleet.state(m.backend) in _KEEP:
            return  # the same evidence got here first (a shared probe result), or drained
        cause = str(m.fields.get("cause", ""))[:40]
        why = str(m.fields.get("reason", ""))[:200]
        transitions = h.fleet.eject(
            m.backend, self._now(), f"replica {m.replica} saw {cause}: {why}"
        )
        if transitions:
            h.emit(transitions)
        for f in h.on_change:
            f()
