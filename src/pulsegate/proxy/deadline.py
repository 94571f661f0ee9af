"""The per-try deadline of an attempt: `asyncio.timeout` without its state machine.

Every proxied request waits for its backend's first byte under a deadline (the attempt's
`retry.per_try_timeout`, cut short by what is left of `retry.request_timeout`), and an
ejection of that backend brings the deadline forward to now (`ProxyState.cut_ejected`).
`asyncio.timeout` did that at about 3 µs a request here (a `Timeout` with its state enum,
a reschedulable timer, the checks of a general tool); `Deadline` does only this job: one
timer armed on entry on the gateway's clock, cancelled on exit, and the same contract.

- The deadline (or `expire()`) cancels the task that entered; the scope turns that
  cancellation into `TimeoutError` as it leaves.
- A cancellation from elsewhere meanwhile (the client went away) stays a cancellation: the
  scope counts the task's cancel requests at entry (`Task.cancelling`), as asyncio's does.
- `expire()` after the scope was left, or twice, does nothing.

Measured with `bench/perf/deadline_cost.py` (the two beside each other in one run).
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from pulsegate.clock import Clock, Handle


class Deadline:
    """`async with Deadline(clock, seconds):` raises TimeoutError when the body is still
    waiting after `seconds` (or after `expire()`)."""

    __slots__ = ("_cancelling", "_clock", "_handle", "_seconds", "_task", "expired")

    def __init__(self, clock: Clock, seconds: float) -> None:
        self._clock = clock
        self._seconds = seconds
        self._task: asyncio.Task[object] | None = None
        self._handle: Handle | None = None
        self._cancelling = 0
        self.expired = False

    async def __aenter__(self) -> Deadline:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Deadline must be entered inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._handle = self._clock.call_later(self._seconds, self.expire)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task = self._task
        self._task = None  # a late expire() finds nothing to cancel
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if (
            self.expired
            and task is not None
            and task.uncancel() <= self._cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise TimeoutError from exc

    def expire(self) -> None:
        """Now: the body's wait is cut (the timer, or an ejection of the backend)."""
        task = self._task
        if task is None or self.expired:
            return
        self.expired = True
        task.cancel()
