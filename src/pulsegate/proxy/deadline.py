"""The per-try deadline of an attempt: swept, not a timer per request.

Every proxied request waits for its backend's first byte under a deadline (the attempt's
`retry.per_try_timeout`, cut short by what is left of `retry.request_timeout`), and an
ejection of that backend brings the deadline forward to now (`ProxyState.cut_ejected`).
`asyncio.timeout` did that with a uvloop timer armed and cancelled per request, inside a
general state machine: about 3-4 µs a request here (`bench/perf/deadline_cost.py`). A
`Deadline` arms nothing. It joins its backend's set of waiting attempts while its body
runs, and the proxy's watch loop, already awake every 50 ms for the first-byte watch
(`ProxyState.watch_first_bytes`), expires the overdue ones (`sweep`). A per-try deadline is
seconds long; being cut up to 50 ms late is the price.

The contract is `asyncio.timeout`'s:
- the deadline (or `expire()`) cancels the task that entered; the scope turns that
  cancellation into `TimeoutError` as it leaves;
- a cancellation from elsewhere meanwhile (the client went away) stays a cancellation: the
  scope counts the task's cancel requests at entry (`Task.cancelling`), as asyncio's does;
- `expire()` after the scope was left, or twice, does nothing.

`then` runs at the expiry itself, before the cut task runs again: the first-byte watch is
told there (`FirstByteWatch.seen`). It checks on the same 50 ms tick as the sweep, and a
wait whose deadline was cut on that tick is over, not overdue evidence against its
backend (with a timer per request it had always ended before the tick).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from types import TracebackType


class Deadline:
    """`async with Deadline(at, waiting):` raises TimeoutError when `sweep` (or `expire()`)
    finds the body still waiting at `at` (clock seconds). Member of `waiting` meanwhile."""

    __slots__ = ("_cancelling", "_task", "_then", "_waiting", "at", "expired")

    def __init__(
        self, at: float, waiting: set[Deadline], then: Callable[[], object] | None = None
    ) -> None:
        self.at = at
        self._waiting = waiting
        self._then = then
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self.expired = False

    async def __aenter__(self) -> Deadline:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Deadline must be entered inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._waiting.add(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._waiting.discard(self)
        task = self._task
        self._task = None  # a late expire() finds nothing to cancel
        if (
            self.expired
            and task is not None
            and task.uncancel() <= self._cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise TimeoutError from exc

    def expire(self) -> None:
        """Now: the body's wait is cut (its time is up, or its backend was ejected)."""
        task = self._task
        if task is None or self.expired:
            return
        self.expired = True
        task.cancel()
        if self._then is not None:
            self._then()


def sweep(waiting: Iterable[Deadline], now: float) -> int:
    """Expire the deadlines of `waiting` due by `now`; returns how many."""
    due = [d for d in waiting if d.at <= now]
    for d in due:
        d.expire()
    return len(due)
