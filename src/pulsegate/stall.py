"""The gateway's own stalls: how long this process's event loop stood still, so that a
deadline missed while *we* were not running is never held against a backend.

A gateway that is descheduled (CPU starved by a neighbour, throttled by its container's CPU
quota, paused by a long garbage collection or a debugger) wakes up with every deadline it
armed in the past: each probe in flight "timed out", each heartbeat is "late", each stream
looks stalled - on every backend at once. Counting those would eject a healthy fleet into
panic mode because of the gateway's own hiccup (docs/real-engines.md, findings 8 and 12).

`LoopWatch` is one repeating timer per event loop (every `TICK_S`), started by
`Gateway.start` in the gateway and in each proxy worker (else on first use): each tick that
fires more than `STALL_MIN_S` after it was due records a stall, `[due, fired]`.
`stalled(since)` says how many seconds of stall overlap `[since, now]`, including one still
in progress (our own tick overdue right now: the loop has just woken, and the callback
asking may run before our tick does). A deadline that judges a backend counts only the time
the loop was running: when it expires after a stall of ours it is pushed back by the stall
(at most `MAX_EXTENSIONS` times), so the backend gets the time it was promised, and the
answer that arrived meanwhile is read first. `look_again` is that rule for a timer callback
(the heartbeat's deadlines), `timeout(seconds)` the same for `async with` (probes);
`running` is the time since an instant less our stalls (stream watchdog, first-byte watch).

Cost: one timer callback every 20 ms (~50 per second, a few microseconds each) and a
bounded deque; asking is O(stalls recorded in the last minute), normally zero.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
from collections.abc import AsyncIterator

log = logging.getLogger("pulsegate.stall")

TICK_S = 0.02
# A tick later than this is a stall: far above timer jitter (~1 ms) and uvloop's 1 ms
# timer resolution, below every deadline the gateway arms (heartbeat timeout 80 ms).
STALL_MIN_S = 0.04
# Stalls are remembered this long: longer than any probe or first-byte deadline.
KEEP_S = 60.0
MAX_KEPT = 256
# A deadline is pushed back at most this many times: a gateway that is stalled more than it
# runs still reaches its verdicts, later.
MAX_EXTENSIONS = 3
# A deadline pushed back is looked at again no sooner than this: uvloop runs due timers
# before it polls sockets, so the answer that came during the stall is read in between.
RECHECK_S = 0.002
# Log a stall this long (at most once per LOG_EVERY_S): operators should know.
LOG_MIN_S = 0.25
LOG_EVERY_S = 10.0


class LoopWatch:
    """Stalls of the running event loop, measured by the lateness of a repeating timer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._stalls: collections.deque[tuple[float, float]] = collections.deque(maxlen=MAX_KEPT)
        self.count = 0  # stalls seen since start
        self.total_s = 0.0  # their summed length
        self.longest_s = 0.0
        self._due = loop.time() + TICK_S
        self._handle: asyncio.TimerHandle | None = loop.call_at(self._due, self._tick)
        self._logged_at = -1e9
        self._unlogged = 0

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        now = self._loop.time()
        late = now - self._due
        if late > STALL_MIN_S:
            self._record(self._due, now)
        self._due = now + TICK_S
        self._handle = self._loop.call_at(self._due, self._tick)

    def _record(self, start: float, end: float) -> None:
        length = end - start
        self._stalls.append((start, end))
        self.count += 1
        self.total_s += length
        self.longest_s = max(self.longest_s, length)
        while self._stalls and self._stalls[0][1] < end - KEEP_S:
            self._stalls.popleft()
        if length >= LOG_MIN_S:
            if end - self._logged_at >= LOG_EVERY_S:
                n = self._unlogged
                more = f" (and {n} more since the last report)" if n else ""
                log.warning(
                    "this gateway's event loop stood still for %.0f ms%s: deadlines that "
                    "passed meanwhile are not held against backends (CPU starvation or "
                    "throttling of the gateway's own process?)",
                    length * 1000,
                    more,
                )
                self._logged_at = end
                self._unlogged = 0
            else:
                self._unlogged += 1

    def stalled(self, since: float, now: float | None = None) -> float:
        """Seconds of stall within `[since, now]` (loop time), one in progress included."""
        if now is None:
            now = self._loop.time()
        total = 0.0
        for start, end in reversed(self._stalls):
            if end <= since:
                break
            total += end - max(start, since)
        if self._handle is not None and now - self._due > STALL_MIN_S:
            total += now - max(self._due, since)  # our own tick is overdue: still stalled
        return total

    def excuse(self, since: float, now: float | None = None) -> float:
        """The stall time since `since` if it counts (over `STALL_MIN_S`), else 0."""
        s = self.stalled(since, now)
        return s if s > STALL_MIN_S else 0.0


_watches: dict[asyncio.AbstractEventLoop, LoopWatch] = {}


def watch() -> LoopWatch:
    """The running loop's `LoopWatch`, started on first use."""
    loop = asyncio.get_running_loop()
    w = _watches.get(loop)
    if w is None or w._handle is None:
        if loop.is_closed():  # pragma: no cover - asked from a dying loop
            raise RuntimeError("event loop is closed")
        w = _watches[loop] = LoopWatch(loop)
        for other in [lp for lp in _watches if lp.is_closed()]:
            del _watches[other]
    return w


def excuse(since: float) -> float:
    """`watch().excuse(since)` for the running loop."""
    return watch().excuse(since)


def running(since: float, now: float) -> float:
    """Seconds in `[since, now]` (loop time) during which the running loop was not stalled."""
    return (now - since) - watch().stalled(since, now)


def look_again(
    start: float, seconds: float, now: float, extensions: int, late_s: float = math.inf
) -> float | None:
    """When to look again at a deadline of `seconds` from `start` (loop time) that came due
    at `now`, or None: it has expired. The time our loop stood still since `start` does not
    count, so the deadline is pushed back by it, at most `MAX_EXTENSIONS` times (the caller
    counts `extensions`). With `late_s`, a timer that fired more than that late is looked at
    once more `RECHECK_S` later too: a stall too short to be recorded may still hide an
    unread answer."""
    if extensions >= MAX_EXTENSIONS:
        return None
    left = seconds - running(start, now)
    if left > 1e-3 or now - (start + seconds) > late_s:
        # At least a loop turn away: data already in the socket is read first.
        return now + max(left, RECHECK_S)
    return None


class _Expiry:
    """The timer behind `timeout`: pushes the deadline back by our own stalls, then expires."""

    __slots__ = ("_cm", "_loop", "_seconds", "_start", "extensions", "handle")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, cm: asyncio.Timeout, seconds: float
    ) -> None:
        self._loop, self._cm, self._seconds = loop, cm, seconds
        watch()  # measuring from now on, if nothing started it yet
        self._start = loop.time()
        self.extensions = 0
        self.handle = loop.call_at(self._start + seconds, self._fire)

    def _fire(self) -> None:
        now = self._loop.time()
        again = look_again(self._start, self._seconds, now, self.extensions)
        if again is not None:
            self.extensions += 1
            self.handle = self._loop.call_at(again, self._fire)
            return
        self._cm.reschedule(now)


@contextlib.asynccontextmanager
async def timeout(seconds: float) -> AsyncIterator[None]:
    """`asyncio.timeout(seconds)` counted in time the loop was running: when it expires
    after a stall of ours, it is pushed back by the stall (up to `MAX_EXTENSIONS` times), so
    what the awaited peer sent meanwhile is read before we judge it. Raises TimeoutError
    like `asyncio.timeout`."""
    async with asyncio.timeout(None) as cm:
        expiry = _Expiry(asyncio.get_running_loop(), cm, seconds)
        try:
            yield
        finally:
            expiry.handle.cancel()
