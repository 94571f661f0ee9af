"""The deadline rules of `pulsegate.stall` on a `ManualClock`: our own stalls are recorded by
`ManualClock.stall`, time moves only when the test says, and nothing sleeps."""

from __future__ import annotations

import asyncio

import pytest

from pulsegate import stall
from pulsegate.clock import STALL_MIN_S, ManualClock, excuse, running


async def _turns(n: int = 10) -> None:
    """Let the loop run what is ready (no time passes on any clock that matters here)."""
    for _ in range(n):
        await asyncio.sleep(0)


# -- clock.running / clock.excuse ---------------------------------------------------------


def test_running_is_the_elapsed_time_less_our_stalls() -> None:
    """`running` takes out exactly the part of a recorded stall inside its window."""
    c = ManualClock()
    t0 = c.now()
    c.advance(1.0)
    c.stall(0.5)  # [t0 + 1.0, t0 + 1.5]
    c.advance(0.25)
    now = c.now()
    assert running(c, t0, now) == pytest.approx(1.25)
    assert running(c, t0 + 1.25, now) == pytest.approx(0.25)  # half the stall in the window
    assert running(c, t0 + 1.5, now) == pytest.approx(0.25)  # the stall was over by then


def test_excuse_ignores_a_stall_too_short_to_count() -> None:
    """A stall counts as an excuse only when it is over `STALL_MIN_S`."""
    c = ManualClock()
    t0 = c.now()
    c.stall(STALL_MIN_S / 2)
    assert excuse(c, t0, c.now()) == 0.0
    c.stall(0.3)
    assert excuse(c, t0, c.now()) == pytest.approx(0.3 + STALL_MIN_S / 2)


# -- stall.look_again ---------------------------------------------------------------------


def test_a_deadline_with_no_stall_expires_when_due() -> None:
    """No stall since the start: a deadline that came due has expired."""
    c = ManualClock()
    start = c.now()
    c.advance(0.1)
    assert stall.look_again(c, start, 0.1, c.now(), 0) is None


def test_a_deadline_is_pushed_back_by_our_stall_then_expires() -> None:
    """A stall inside the window pushes the deadline back by exactly the time not run."""
    c = ManualClock()
    start = c.now()
    c.advance(0.02)
    c.stall(0.3)  # the 0.1 s deadline comes due while we stand still
    again = stall.look_again(c, start, 0.1, c.now(), 0)
    assert again is not None
    assert again == pytest.approx(c.now() + 0.08)
    c.advance(again - c.now())
    assert stall.look_again(c, start, 0.1, c.now(), 1) is None


def test_a_deadline_is_pushed_back_at_most_max_extensions_times() -> None:
    """However much we stalled, the `MAX_EXTENSIONS`-th look is the verdict."""
    c = ManualClock()
    start = c.now()
    c.stall(5.0)
    assert stall.look_again(c, start, 0.1, c.now(), stall.MAX_EXTENSIONS - 1) is not None
    assert stall.look_again(c, start, 0.1, c.now(), stall.MAX_EXTENSIONS) is None


def test_a_late_timer_is_looked_at_once_more_recheck_s_later() -> None:
    """With `late_s`, a timer firing later than that is re-checked `RECHECK_S` later even
    with no stall recorded (one too short to record may hide an unread answer)."""
    c = ManualClock()
    start = c.now()
    c.advance(0.1 + 0.02)  # fired 20 ms late, nothing recorded
    assert stall.look_again(c, start, 0.1, c.now(), 0) is None
    assert stall.look_again(c, start, 0.1, c.now(), 0, late_s=0.01) == pytest.approx(
        c.now() + stall.RECHECK_S
    )
    assert stall.look_again(c, start, 0.1, c.now(), 0, late_s=0.05) is None


# -- stall.timeout ------------------------------------------------------------------------


async def test_stall_timeout_on_a_manual_clock_counts_only_running_time() -> None:
    """`stall.timeout(clock, s)` expires once `s` of running time has passed on its clock:
    a stall of ours pushes it back, and loop time alone never expires it."""
    c = ManualClock()
    never: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def waiter() -> None:
        async with stall.timeout(c, 0.1):
            await never

    task = asyncio.create_task(waiter())
    await _turns()
    c.advance(0.05)
    c.stall(1.0)  # the deadline came due during our stall: 0.05 s of it still owed
    await _turns()
    assert not task.done()
    c.advance(0.04)
    await _turns()
    assert not task.done()
    c.advance(0.02)
    await _turns()
    assert task.done()
    with pytest.raises(TimeoutError):
        task.result()
    assert c.pending() == 0


async def test_stall_timeout_met_in_time_leaves_no_timer() -> None:
    """A block done before its deadline raises nothing and leaves nothing armed."""
    c = ManualClock()
    async with stall.timeout(c, 0.1):
        c.advance(0.05)
    assert c.pending() == 0
    c.advance(1.0)  # nothing fires later either
