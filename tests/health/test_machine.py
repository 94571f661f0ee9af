"""The state table: every legal move works, every other pair raises, no dead ends."""

from __future__ import annotations

import itertools

import pytest

from pulsegate.health.machine import (
    FAILURE_EVENTS,
    TRANSITIONS,
    Event,
    IllegalTransition,
    allowed,
    edges,
    failure_event,
    mermaid,
    transition,
)
from pulsegate.health.verdict import ROUTABLE, State

LEGAL = edges()
ILLEGAL = [(s, e) for s, e in itertools.product(State, Event) if e not in TRANSITIONS[s]]


def test_every_state_has_a_row() -> None:
    """The table has a row for every state."""
    assert set(TRANSITIONS) == set(State)


@pytest.mark.parametrize(("frm", "event", "to"), LEGAL, ids=lambda x: getattr(x, "name", x))
def test_legal_moves(frm: State, event: Event, to: State) -> None:
    """Each (state, event) in the table moves to the state the table names."""
    assert transition(frm, event) is to
    assert allowed(frm, event)


@pytest.mark.parametrize(("frm", "event"), ILLEGAL, ids=lambda x: getattr(x, "name", x))
def test_illegal_moves_raise(frm: State, event: Event) -> None:
    """Every pair missing from the table raises IllegalTransition naming both."""
    assert not allowed(frm, event)
    with pytest.raises(IllegalTransition) as info:
        transition(frm, event)
    assert info.value.state is frm
    assert info.value.event is event
    assert frm.name in str(info.value)


def test_table_is_read_only() -> None:
    """The public table cannot be edited by accident."""
    with pytest.raises(TypeError):
        TRANSITIONS[State.READY][Event.UNDRAIN] = State.READY  # type: ignore[index]


def _reachable(start: State) -> set[State]:
    seen = {start}
    todo = [start]
    while todo:
        for to in TRANSITIONS[todo.pop()].values():
            if to not in seen:
                seen.add(to)
                todo.append(to)
    return seen


def test_every_state_reachable_from_cold() -> None:
    """A new backend (cold) can reach every state."""
    assert _reachable(State.COLD) == set(State)


@pytest.mark.parametrize("state", list(State))
def test_every_state_can_get_back_to_ready(state: State) -> None:
    """No dead ends: from any state some path leads back to ready."""
    assert State.READY in _reachable(state)


def test_ejected_only_returns_through_probation() -> None:
    """Half-open (R8): the only automatic way out of ejected is probation."""
    assert dict(TRANSITIONS[State.EJECTED]) == {
        Event.REJOIN_OK: State.PROBATION,
        Event.DRAIN: State.DRAINED,
    }


def test_cold_and_warming_never_enter_routable_except_through_ready_seen() -> None:
    """R25: cold and warming become routable only by READY_SEEN."""
    for s in (State.COLD, State.WARMING):
        for e, to in TRANSITIONS[s].items():
            if to in ROUTABLE:
                assert e is Event.READY_SEEN


@pytest.mark.parametrize("state", list(State))
def test_hard_failure_ejects_exactly_the_routable_states(state: State) -> None:
    """A hard failure ejects ready, degraded (HARD_FAILURE) and probation (PROBATION_FAILED)
    backends, each by a legal move; in any other state it fires nothing."""
    event = failure_event(state)
    if state in ROUTABLE:
        assert event is FAILURE_EVENTS[state]
        assert event is (Event.PROBATION_FAILED if state is State.PROBATION else Event.HARD_FAILURE)
        assert transition(state, event) is State.EJECTED
    else:
        assert event is None


def test_mermaid_draws_every_edge() -> None:
    """The docs' diagram is drawn from the table: one line per legal move."""
    text = mermaid()
    assert text.startswith("stateDiagram-v2")
    for frm, event, to in LEGAL:
        assert f"{frm.value} --> {to.value}: {event.name}" in text
