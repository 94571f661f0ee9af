"""`proxy.deadline.Deadline`: the per-try deadline, on a manual clock (no sleeping)."""

from __future__ import annotations

import asyncio

import pytest

from pulsegate.clock import ManualClock
from pulsegate.proxy.deadline import Deadline


async def _turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_the_deadline_cuts_the_wait_with_timeout_error_and_leaves_no_timer() -> None:
    async def main() -> None:
        clock = ManualClock()
        wait: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def attempt() -> str:
            async with Deadline(clock, 0.5) as d:
                await wait
            return "answered" if not d.expired else "expired yet answered"

        task = asyncio.create_task(attempt())
        await _turns()
        clock.advance(0.49)
        await _turns()
        assert not task.done()
        clock.advance(0.02)
        with pytest.raises(TimeoutError):
            await task
        assert clock.pending() == 0

    asyncio.run(main())


def test_an_answer_in_time_cancels_the_timer() -> None:
    async def main() -> None:
        clock = ManualClock()
        wait: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def attempt() -> str:
            async with Deadline(clock, 0.5):
                return await wait

        task = asyncio.create_task(attempt())
        await _turns()
        assert clock.pending() == 1
        wait.set_result("answer")
        assert await task == "answer"
        assert clock.pending() == 0
        clock.advance(1.0)  # nothing left to fire

    asyncio.run(main())


def test_expire_cuts_at_once_and_again_or_late_does_nothing() -> None:
    async def main() -> None:
        clock = ManualClock()
        wait: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        scopes: list[Deadline] = []

        async def attempt() -> None:
            async with Deadline(clock, 60.0) as d:
                scopes.append(d)
                await wait

        task = asyncio.create_task(attempt())
        await _turns()
        scopes[0].expire()  # an ejection of the backend
        scopes[0].expire()
        with pytest.raises(TimeoutError):
            await task
        scopes[0].expire()  # after the scope was left: no stray cancellation anywhere
        await _turns()
        assert clock.pending() == 0

    asyncio.run(main())


def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    """The client went away while the attempt waited: CancelledError, not TimeoutError, even
    when the deadline also came due before the task ran again."""

    async def main() -> None:
        clock = ManualClock()
        wait: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def attempt() -> None:
            async with Deadline(clock, 0.5):
                await wait

        plain = asyncio.create_task(attempt())
        await _turns()
        plain.cancel()
        with pytest.raises(asyncio.CancelledError):
            await plain
        both = asyncio.create_task(attempt())
        await _turns()
        both.cancel()
        clock.advance(1.0)  # its deadline came due too before the task ran again
        with pytest.raises(asyncio.CancelledError):
            await both
        assert clock.pending() == 0

    asyncio.run(main())
