"""Deadlines that count only the time our own loop was running.

A deadline that judges a backend (a probe's timeout, a heartbeat's, the agent's
micro-inference, the stream watchdog, the first-byte watch) must not expire because *we*
stood still: the clock (`pulsegate.clock`) records the process's stalls, and a deadline that
comes due after one is pushed back by it (at most `MAX_EXTENSIONS` times), so the backend
gets the time it was promised and the answer that arrived meanwhile is read first.

- `look_again`: that rule for a timer callback (the heartbeat's deadlines);
- `timeout(clock, seconds)`: the same for `async with` (probes);
- `clock.running(clock, since, now)`: the time since an instant less our stalls (stream
  watchdog, first-byte watch).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator

from pulsegate.clock import Clock, Handle, running

# A deadline is pushed back at most this many times: a gateway that is stalled more than it
# runs still reaches its verdicts, later.
MAX_EXTENSIONS = 3
# A deadline pushed back is looked at again no sooner than this: uvloop runs due timers
# before it polls sockets, so the answer that came during the stall is read in between.
RECHECK_S = 0.002


def look_again(
    clock: Clock,
    start: float,
    seconds: float,
    now: float,
    extensions: int,
    late_s: float = math.inf,
) -> float | None:
    """When to look again at a deadline of `seconds` from `start` that came due at `now`,
    or None: it has expired. The time our loop stood still since `start` does not count, so
    the deadline is pushed back by it, at most `MAX_EXTENSIONS` times (the caller counts
    `extensions`). With `late_s`, a timer that fired more than that late is looked at once
    more `RECHECK_S` later too: a stall too short to be recorded may still hide an unread
    answer."""
    if extensions >= MAX_EXTENSIONS:
        return None
    left = seconds - running(clock, start, now)
    if left > 1e-3 or now - (start + seconds) > late_s:
        # At least a loop turn away: data already in the socket is read first.
        return now + max(left, RECHECK_S)
    return None


def expire(cm: asyncio.Timeout) -> None:
    """Make `cm` expire on the loop's next turn. `reschedule` takes loop time; any instant
    in the past means "now", so no reading of the loop's own clock is needed."""
    with contextlib.suppress(RuntimeError):  # already expiring or done
        cm.reschedule(0.0)


class _Expiry:
    """The timer behind `timeout`: pushes the deadline back by our own stalls, then expires."""

    __slots__ = ("_clock", "_cm", "_seconds", "_start", "extensions", "handle")

    def __init__(self, clock: Clock, cm: asyncio.Timeout, seconds: float) -> None:
        self._clock, self._cm, self._seconds = clock, cm, seconds
        self._start = clock.now()
        self.extensions = 0
        self.handle: Handle = clock.call_at(self._start + seconds, self._fire)

    def _fire(self) -> None:
        now = self._clock.now()
        again = look_again(self._clock, self._start, self._seconds, now, self.extensions)
        if again is not None:
            self.extensions += 1
            self.handle = self._clock.call_at(again, self._fire)
            return
        expire(self._cm)


@contextlib.asynccontextmanager
async def timeout(clock: Clock, seconds: float) -> AsyncIterator[None]:
    """`asyncio.timeout(seconds)` counted in time the loop was running: when it expires
    after a stall of ours, it is pushed back by the stall (up to `MAX_EXTENSIONS` times), so
    what the awaited peer sent meanwhile is read before we judge it. Raises TimeoutError
    like `asyncio.timeout`."""
    async with asyncio.timeout(None) as cm:
        expiry = _Expiry(clock, cm, seconds)
        try:
            yield
        finally:
            expiry.handle.cancel()
