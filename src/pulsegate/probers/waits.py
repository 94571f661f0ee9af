"""Pauses timed by a `Clock`, for the probers' cadences (not their deadlines).

`asyncio.sleep` and `asyncio.timeout` count on the event loop's own clock; these count on
the `Clock` the prober was given, so one time line drives the probe cadence, the heartbeat
backoff and every deadline, and a `ManualClock` moves them all in tests. A cadence is no
verdict on a backend, so unlike `pulsegate.stall.timeout` nothing here is pushed back by
our own stalls.
"""

from __future__ import annotations

import asyncio
import contextlib

from pulsegate import stall
from pulsegate.clock import Clock


async def sleep(clock: Clock, seconds: float) -> None:
    """Return after `seconds` of `clock` time."""
    done = asyncio.get_running_loop().create_future()
    handle = clock.call_later(seconds, _resolve, done)
    try:
        await done
    finally:
        handle.cancel()


async def wait_event(clock: Clock, event: asyncio.Event, seconds: float) -> bool:
    """True if `event` was set within `seconds` of `clock` time."""
    if seconds <= 0:
        return event.is_set()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(None) as cm:
            handle = clock.call_later(seconds, stall.expire, cm)
            try:
                await event.wait()
            finally:
                handle.cancel()
        return True
    return False


async def wait_future(clock: Clock, fut: asyncio.Future[None], seconds: float) -> None:
    """Return when `fut` is done or after `seconds` of `clock` time, whichever comes first;
    `fut` is left as it is."""
    timer = asyncio.get_running_loop().create_future()
    handle = clock.call_later(seconds, _resolve, timer)
    try:
        await asyncio.wait((fut, timer), return_when=asyncio.FIRST_COMPLETED)
    finally:
        handle.cancel()
        timer.cancel()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
