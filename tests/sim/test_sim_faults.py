"""Fault values, validation and the decision table (no sockets)."""

from __future__ import annotations

import asyncio

import pytest

from pulsegate.sim.faults import (
    NO_FAULT,
    Action,
    Fault,
    FaultError,
    FaultState,
    Mode,
    engine_endpoint,
    on_admit,
    on_arrival,
    on_token,
    parse_fault,
    slowdown,
)


def test_defaults_per_mode() -> None:
    """Omitted parameters take documented defaults (stall 20 tokens, blackhole 1024 B...)."""
    assert parse_fault({"mode": "error"}).rate == 1.0
    assert parse_fault({"mode": "stall"}).after_tokens == 20
    assert parse_fault({"mode": "reset"}).after_tokens is None
    assert parse_fault({"mode": "blackhole"}).over_bytes == 1024
    assert parse_fault({"mode": "warming"}).seconds == 5.0
    assert parse_fault({"mode": "none"}) == NO_FAULT


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"mode": "explode"}, "unknown mode"),
        ({}, "unknown mode"),
        ([1], "JSON object"),
        ({"mode": 3}, "unknown mode"),
        ({"mode": "error", "rate": 1.5}, "'rate' must be in [0, 1]"),
        ({"mode": "error", "rate": "x"}, "'rate' must be a number"),
        ({"mode": "error", "rate": True}, "'rate' must be a number"),
        ({"mode": "stall", "after_tokens": -1}, "'after_tokens' must be in"),
        ({"mode": "stall", "after_tokens": 2.5}, "must be an integer"),
        ({"mode": "slow", "factor": 0.5}, "'factor' must be in [1, 1000]"),
        ({"mode": "warming", "seconds": 0}, "'seconds' must be in (0, 86400]"),
        ({"mode": "hang", "rate": 0.5}, "unknown parameter(s) ['rate'] for mode 'hang'"),
        ({"mode": "error", "factor": 2}, "(allowed: rate)"),
    ],
)
def test_validation_names_the_problem(body: object, needle: str) -> None:
    """Bad fault requests raise FaultError with a message naming what is wrong."""
    with pytest.raises(FaultError) as e:
        parse_fault(body)
    assert needle in str(e.value)


def test_arrival_blackhole_uses_content_length() -> None:
    """Blackhole swallows only requests whose declared length exceeds over_bytes."""
    f = Fault(Mode.BLACKHOLE, over_bytes=100)
    assert on_arrival(f, 101) is Action.HANG
    assert on_arrival(f, 100) is Action.PROCEED
    assert on_arrival(f, None) is Action.PROCEED  # chunked: size unknown, let it through
    assert on_arrival(Fault(Mode.CUDA_HANG), 10) is Action.HANG


def test_admit_table() -> None:
    """Each mode's verdict after the body is read."""
    assert on_admit(NO_FAULT, stream=True, draw=0.0) is Action.PROCEED
    assert on_admit(Fault(Mode.ERROR, rate=0.3), stream=False, draw=0.29) is Action.FAIL_ERROR
    assert on_admit(Fault(Mode.ERROR, rate=0.3), stream=False, draw=0.3) is Action.PROCEED
    assert on_admit(Fault(Mode.OOM), stream=True, draw=0.5) is Action.FAIL_OOM
    assert on_admit(Fault(Mode.WARMING, seconds=1), stream=True, draw=0) is Action.FAIL_WARMING
    assert on_admit(Fault(Mode.HANG), stream=True, draw=0) is Action.HANG
    assert on_admit(Fault(Mode.RESET), stream=True, draw=0) is Action.RESET
    assert on_admit(Fault(Mode.RESET, after_tokens=3), stream=True, draw=0) is Action.PROCEED
    assert on_admit(Fault(Mode.RESET, after_tokens=3), stream=False, draw=0) is Action.RESET
    assert on_admit(Fault(Mode.STALL), stream=True, draw=0) is Action.PROCEED


def test_token_table() -> None:
    """Stall and reset fire at token after_tokens for streams; stall hangs non-streams."""
    stall = Fault(Mode.STALL, after_tokens=3)
    assert [on_token(stall, i, stream=True) for i in (2, 3)] == [Action.PROCEED, Action.HANG]
    assert on_token(stall, 0, stream=False) is Action.HANG
    reset = Fault(Mode.RESET, after_tokens=2)
    assert [on_token(reset, i, stream=True) for i in (1, 2)] == [Action.PROCEED, Action.RESET]
    assert on_token(Fault(Mode.CUDA_HANG), 5, stream=True) is Action.HANG
    assert on_token(Fault(Mode.ERROR), 5, stream=True) is Action.PROCEED


def test_only_full_hang_silences_engine_endpoints() -> None:
    """/health, /metrics, /v1/models hang under `hang` but answer under `cuda_hang`."""
    assert engine_endpoint(Fault(Mode.HANG)) is Action.HANG
    assert engine_endpoint(Fault(Mode.CUDA_HANG)) is Action.PROCEED


def test_slowdown_only_for_slow() -> None:
    """Only `slow` stretches timing."""
    assert slowdown(Fault(Mode.SLOW, factor=4)) == 4
    assert slowdown(Fault(Mode.ERROR, factor=4)) == 1


async def test_warming_expires_and_set_wakes_waiters() -> None:
    """Warming ends by itself at since+seconds; any set() wakes hung waiters."""
    state = FaultState()
    state.set(parse_fault({"mode": "warming", "seconds": 2}), now=100.0)
    assert state.current(101.9).mode is Mode.WARMING
    assert state.describe(101.0)["remaining_s"] == 1.0
    assert state.current(102.0) is NO_FAULT
    waiter = asyncio.ensure_future(state.wait_change())
    await asyncio.sleep(0)
    assert not waiter.done()
    state.set(NO_FAULT, now=103.0)
    await asyncio.wait_for(waiter, 1)
