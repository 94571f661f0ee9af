"""`proxy.deadline`: the per-try deadline, swept (time is passed in; nothing sleeps)."""

from __future__ import annotations

import asyncio

import pytest

from pulsegate.proxy.deadline import Deadline, sweep


async def _turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_sweep_past_the_deadline_cuts_the_wait_with_timeout_error() -> None:
    async def main() -> None:
        waiting: set[Deadline] = set()
        wait: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def attempt() -> None:
            async with Deadline(10.5, waiting):
                await wait

        task = asyncio.create_task(attempt())
        await _turns()
        assert len(waiting) == 1
        assert sweep(waiting, 10.49) == 0
        await _turns()
        assert not task.done()
        assert sweep(waiting, 10.5) == 1
        with pytest.raises(TimeoutError):
            await task
        assert waiting == set()

    asyncio.run(main())


def test_an_answer_in_time_leaves_the_set_and_no_sweep_reaches_it() -> None:
    async def main() -> None:
        waiting: set[Deadline] = set()
        wait: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        scopes: list[Deadline] = []

        async def attempt() -> str:
            async with Deadline(10.5, waiting) as d:
                scopes.append(d)
                return await wait

        task = asyncio.create_task(attempt())
        await _turns()
        wait.set_result("answer")
        assert await task == "answer"
        assert waiting == set()
        scopes[0].expire()  # an ejection that comes after the scope: nothing is cancelled
        await _turns()
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]

    asyncio.run(main())


def test_expire_cuts_at_once_tells_then_and_a_second_expire_changes_nothing() -> None:
    async def main() -> None:
        waiting: set[Deadline] = set()
        wait: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        told: list[str] = []  # `then`: the first-byte watch, told at the expiry itself

        async def attempt() -> None:
            async with Deadline(1e9, waiting, lambda: told.append("seen")):
                await wait

        task = asyncio.create_task(attempt())
        await _turns()
        (d,) = waiting
        d.expire()  # an ejection of the backend
        assert told == ["seen"] and not task.done()  # before the cut task runs again
        d.expire()
        with pytest.raises(TimeoutError):
            await task
        assert task.cancelling() == 0
        d.expire()
        assert told == ["seen"]

    asyncio.run(main())


def test_a_cancellation_from_outside_stays_a_cancellation() -> None:
    """The client went away while the attempt waited: CancelledError, not TimeoutError, even
    when the deadline also came due before the task ran again."""

    async def main() -> None:
        waiting: set[Deadline] = set()
        loop = asyncio.get_running_loop()

        async def attempt() -> None:
            async with Deadline(10.5, waiting):
                await loop.create_future()  # never answered

        plain = asyncio.create_task(attempt())
        await _turns()
        plain.cancel()
        with pytest.raises(asyncio.CancelledError):
            await plain
        both = asyncio.create_task(attempt())
        await _turns()
        both.cancel()
        assert sweep(waiting, 11.0) == 1  # its deadline came due too before it ran again
        with pytest.raises(asyncio.CancelledError):
            await both
        assert waiting == set()

    asyncio.run(main())
