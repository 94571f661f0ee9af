"""The per-backend state machine, as a table (after h11's `_state.py`).

`TRANSITIONS[state][event]` is the state a backend moves to; a pair missing from the table is
an illegal move and `transition` raises `IllegalTransition`. The rules that decide *when* an
event fires live in `rules.py` and `evaluation.py` (applied by `backend.py`); this module says
which moves exist, and which event hard failure evidence fires in each state
(`FAILURE_EVENTS`: one place, not one copy per rule).
Docs draw the diagram from the same table (`mermaid()`), and the tests enumerate it.

    cold ──READY_SEEN──▶ ready ◀──RECOVER── degraded
      │ NOT_READY          │ DEGRADE ─────────▶ │
      ▼                    │ SCORE_LOW / HARD_FAILURE (ready or degraded)
    warming ─READY_SEEN─▶  ▼
                         ejected ──REJOIN_OK──▶ probation ──PROBATION_PASSED──▶ ready
                           ▲                        │
                           └──PROBATION_FAILED──────┘
    any but drained ──DRAIN──▶ drained ──UNDRAIN──▶ cold (readiness is then re-checked)
    any routable or not-yet-ready state ──ADMIN_EJECT──▶ ejected
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

from pulsegate.health.verdict import State


class Event(enum.Enum):
    """Something that moves a backend between states. Values are stable (logged, documented)."""

    READY_SEEN = "ready_seen"  # readiness ok and a micro-inference ok
    NOT_READY = "not_ready"  # the engine answered "not ready" (loading, reloading)
    DEGRADE = "degrade"  # score under the degrade line, VRAM > 90% used, or KV cache > 95%
    RECOVER = "recover"  # the degrade conditions cleared
    SCORE_LOW = "score_low"  # score < eject_below for eject_after evaluations in a row
    HARD_FAILURE = "hard_failure"  # heartbeat dead, engine down, canary/micro/request streaks
    REJOIN_OK = "rejoin_ok"  # backoff over, score > rejoin_above rejoin_after times, evidence clear
    PROBATION_PASSED = "probation_passed"
    PROBATION_FAILED = "probation_failed"  # any failure while on probation
    DRAIN = "drain"  # operator
    UNDRAIN = "undrain"  # operator
    ADMIN_EJECT = "admin_eject"  # operator


class IllegalTransition(Exception):
    """`event` is not allowed in `state` (a bug in the rules, never a runtime condition)."""

    def __init__(self, state: State, event: Event) -> None:
        self.state = state
        self.event = event
        super().__init__(f"illegal transition: {event.name} in state {state.name}")


S, E = State, Event

_TABLE: dict[State, dict[Event, State]] = {
    S.COLD: {
        E.READY_SEEN: S.READY,
        E.NOT_READY: S.WARMING,
        E.DRAIN: S.DRAINED,
        E.ADMIN_EJECT: S.EJECTED,
    },
    S.WARMING: {
        E.READY_SEEN: S.READY,
        E.DRAIN: S.DRAINED,
        E.ADMIN_EJECT: S.EJECTED,
    },
    S.READY: {
        E.DEGRADE: S.DEGRADED,
        E.NOT_READY: S.WARMING,
        E.SCORE_LOW: S.EJECTED,
        E.HARD_FAILURE: S.EJECTED,
        E.DRAIN: S.DRAINED,
        E.ADMIN_EJECT: S.EJECTED,
    },
    S.DEGRADED: {
        E.RECOVER: S.READY,
        E.NOT_READY: S.WARMING,
        E.SCORE_LOW: S.EJECTED,
        E.HARD_FAILURE: S.EJECTED,
        E.DRAIN: S.DRAINED,
        E.ADMIN_EJECT: S.EJECTED,
    },
    S.EJECTED: {
        E.REJOIN_OK: S.PROBATION,
        E.DRAIN: S.DRAINED,
    },
    S.PROBATION: {
        E.PROBATION_PASSED: S.READY,
        E.PROBATION_FAILED: S.EJECTED,
        E.DRAIN: S.DRAINED,
        E.ADMIN_EJECT: S.EJECTED,
    },
    S.DRAINED: {
        E.UNDRAIN: S.COLD,
        E.ADMIN_EJECT: S.EJECTED,
    },
}

del S, E

TRANSITIONS: Mapping[State, Mapping[Event, State]] = MappingProxyType(
    {state: MappingProxyType(moves) for state, moves in _TABLE.items()}
)
"""The whole machine: TRANSITIONS[from_state][event] -> to_state. Read-only."""

FAILURE_EVENTS: Mapping[State, Event] = MappingProxyType(
    {
        State.READY: Event.HARD_FAILURE,
        State.DEGRADED: Event.HARD_FAILURE,
        State.PROBATION: Event.PROBATION_FAILED,
    }
)
"""The event hard failure evidence (a heartbeat death, a refused port, a failure streak, the
engine saying "not ready" on probation...) fires, by state: routable backends are ejected,
probation fails. Every other state is out of service already: nothing to eject."""


def transition(state: State, event: Event) -> State:
    """The state after `event` in `state`; raises IllegalTransition for a move not in the table."""
    try:
        return TRANSITIONS[state][event]
    except KeyError:
        raise IllegalTransition(state, event) from None


def failure_event(state: State) -> Event | None:
    """The event a hard failure fires in `state` (FAILURE_EVENTS), or None: nothing to eject."""
    return FAILURE_EVENTS.get(state)


def allowed(state: State, event: Event) -> bool:
    """Whether `event` is a legal move in `state`."""
    return event in TRANSITIONS[state]


def edges() -> list[tuple[State, Event, State]]:
    """Every legal move as (from, event, to), in table order."""
    return [(s, e, t) for s, moves in TRANSITIONS.items() for e, t in moves.items()]


def mermaid() -> str:
    """The state diagram in Mermaid syntax, drawn from the table (for the docs)."""
    lines = ["stateDiagram-v2", "    [*] --> cold"]
    lines += [f"    {s.value} --> {t.value}: {e.name}" for s, e, t in edges()]
    return "\n".join(lines)
