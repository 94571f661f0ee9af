"""The gateway's one time source, passed in: the only module that reads the real clock.

Everything that needs the time takes a `Clock` (the shells: probers, heartbeat client,
stream watchdog, first-byte watch, scheduler, health service) or a plain `now` argument (the
pure core). `now()` is monotonic seconds and timers are armed on the same time line, so no
caller ever converts between two clocks.

A clock also knows the gateway's own stalls: how long this process's event loop stood still
(CPU starvation, a CPU quota, a long garbage collection, SIGSTOP). A deadline that judges a
backend counts only time the loop was running (`pulsegate.stall`), else a gateway that wakes
up from a stall would find every probe timed out, every heartbeat late and every stream
stalled, on every backend at once (docs/real-engines.md, findings 8 and 12).

- `SystemClock(loop)`: the real one. `time.monotonic` (nanosecond resolution, unlike
  uvloop's cached millisecond `loop.time()`), timers on `loop`, and stalls measured by one
  repeating 20 ms timer: each tick that fires more than `STALL_MIN_S` late records a stall
  `[due, fired]`. One per process, made by `pulsegate.runtime`.
- `ManualClock`: the test mode, designed in. Time moves only when the test says
  (`advance`, `stall`), and due timers then run in order, so watchdogs, cadences and
  heartbeat deadlines are tested without sleeping.

Cost of `SystemClock`: one timer callback every 20 ms (~50 per second, a few microseconds
each) and a bounded deque; asking is O(stalls recorded in the last minute), normally zero.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger("pulsegate.stall")

TICK_S = 0.02
# A tick later than this is a stall: far above timer jitter (~1 ms) and uvloop's 1 ms timer
# resolution, below every deadline the gateway arms (heartbeat timeout 80 ms).
STALL_MIN_S = 0.04
# Stalls are remembered this long: longer than any probe or first-byte deadline.
KEEP_S = 60.0
MAX_KEPT = 256
# Log a stall this long (at most once per LOG_EVERY_S): operators should know.
LOG_MIN_S = 0.25
LOG_EVERY_S = 10.0


# For the processes without a gateway clock (the sim, the agent, the status CLI): plain reads.
monotonic = time.monotonic
wall = time.time


class Handle(Protocol):
    """A timer armed on a clock."""

    def cancel(self) -> None: ...


class Clock(Protocol):
    """Monotonic time, timers on it, and the process's own stalls."""

    def now(self) -> float:
        """Monotonic seconds."""
        ...

    def wall(self) -> float:
        """Unix time, for timestamps people read (events, alerts)."""
        ...

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> Handle: ...

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> Handle: ...

    def stalled(self, since: float, now: float) -> float:
        """Seconds of our own stall within `[since, now]`, one in progress included."""
        ...

    @property
    def stall_total_s(self) -> float:
        """All stall time recorded since start (the metric)."""
        ...


def running(clock: Clock, since: float, now: float) -> float:
    """Seconds in `[since, now]` during which the process's loop was not stalled."""
    return (now - since) - clock.stalled(since, now)


def excuse(clock: Clock, since: float, now: float) -> float:
    """Our stall time since `since` if it counts (over `STALL_MIN_S`), else 0."""
    s = clock.stalled(since, now)
    return s if s > STALL_MIN_S else 0.0


class StallLog:
    """Stalls recorded as `[start, end]` intervals; pure (times are passed in)."""

    __slots__ = ("_logged_at", "_stalls", "_unlogged", "count", "longest_s", "total_s")

    def __init__(self) -> None:
        self._stalls: collections.deque[tuple[float, float]] = collections.deque(maxlen=MAX_KEPT)
        self.count = 0  # stalls seen since start
        self.total_s = 0.0  # their summed length
        self.longest_s = 0.0
        self._logged_at = -1e9
        self._unlogged = 0

    def record(self, start: float, end: float) -> None:
        length = end - start
        self._stalls.append((start, end))
        self.count += 1
        self.total_s += length
        self.longest_s = max(self.longest_s, length)
        while self._stalls and self._stalls[0][1] < end - KEEP_S:
            self._stalls.popleft()
        if length < LOG_MIN_S:
            return
        if end - self._logged_at < LOG_EVERY_S:
            self._unlogged += 1
            return
        n = self._unlogged
        more = f" (and {n} more since the last report)" if n else ""
        log.warning(
            "this gateway's event loop stood still for %.0f ms%s: deadlines that passed "
            "meanwhile are not held against backends (CPU starvation or throttling of the "
            "gateway's own process?)",
            length * 1000,
            more,
        )
        self._logged_at = end
        self._unlogged = 0

    def stalled(self, since: float, now: float, overdue_from: float | None = None) -> float:
        """Seconds of stall within `[since, now]`; `overdue_from`: a stall still in progress
        since then (the measuring tick is overdue right now)."""
        total = 0.0
        for start, end in reversed(self._stalls):
            if end <= since:
                break
            total += end - max(start, since)
        if overdue_from is not None:
            total += now - max(overdue_from, since)
        return total


class SystemClock:
    """The real clock: `time.monotonic`, timers on `loop`, stalls measured by a 20 ms tick."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.stalls = StallLog()
        self._due = time.monotonic() + TICK_S
        self._handle: asyncio.TimerHandle | None = loop.call_later(TICK_S, self._tick)

    now = staticmethod(time.monotonic)
    wall = staticmethod(time.time)

    @property
    def stall_total_s(self) -> float:
        return self.stalls.total_s

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> Handle:
        return self._loop.call_later(when - time.monotonic(), callback, *args)

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> Handle:
        return self._loop.call_later(delay, callback, *args)

    def stalled(self, since: float, now: float) -> float:
        overdue = self._handle is not None and now - self._due > STALL_MIN_S
        return self.stalls.stalled(since, now, self._due if overdue else None)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _tick(self) -> None:
        now = time.monotonic()
        if now - self._due > STALL_MIN_S:
            self.stalls.record(self._due, now)
        self._due = now + TICK_S
        self._handle = self._loop.call_later(TICK_S, self._tick)


class _ManualHandle:
    __slots__ = ("args", "callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[..., object], args: tuple[Any, ...]):
        self.when, self.callback, self.args = when, callback, args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """A clock that moves only when told: `advance(dt)` runs the timers that came due, in
    order of their time (each sees `now()` at its own due time); `stall(dt)` advances while
    recording the time as our own stall, as if the process had been descheduled."""

    def __init__(self, start: float = 1000.0, wall_offset: float = 1.7e9) -> None:
        self._now = start
        self._wall_offset = wall_offset
        self._timers: list[tuple[float, int, _ManualHandle]] = []
        self._seq = itertools.count()
        self.stalls = StallLog()

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._wall_offset

    @property
    def stall_total_s(self) -> float:
        return self.stalls.total_s

    def call_at(self, when: float, callback: Callable[..., object], *args: Any) -> Handle:
        h = _ManualHandle(when, callback, args)
        heapq.heappush(self._timers, (when, next(self._seq), h))
        return h

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> Handle:
        return self.call_at(self._now + delay, callback, *args)

    def stalled(self, since: float, now: float) -> float:
        return self.stalls.stalled(since, now)

    def pending(self) -> int:
        """Timers armed and not cancelled."""
        return sum(1 for _, _, h in self._timers if not h.cancelled)

    def advance(self, seconds: float) -> None:
        """Move time forward by `seconds`, running every timer due meanwhile."""
        end = self._now + seconds
        while self._timers and self._timers[0][0] <= end:
            when, _, h = heapq.heappop(self._timers)
            if h.cancelled:
                continue
            self._now = max(self._now, when)
            h.callback(*h.args)
        self._now = end

    def stall(self, seconds: float) -> None:
        """Our own loop stands still for `seconds`: time passes and nothing runs; then the
        timers that came due meanwhile run, late, as they would after a real stall."""
        start = self._now
        self._now += seconds
        self.stalls.record(start, self._now)
        self.advance(0.0)
