"""The capacity queue: when every candidate backend is at its concurrency limit, wait (R24, R25).

One FIFO per model, bounded in total by `routing.queue_max`. A released slot wakes the
longest-waiting request among the models its backend serves; nobody else is woken, so a
release costs one wake-up, not a thundering herd. Order is kept two ways:

- a request arriving while others already wait for the same model joins the end of the
  queue instead of taking the next free slot before them (`ahead`): without this, under a
  steady flood the newcomers that happen to run between a release and the woken waiter's
  turn overtake it, and a queued request can starve until its deadline;
- a woken waiter that finds no slot after all (a retry or a resumed stream, which do not
  queue, took it) keeps its place in line instead of going to the back.

A waiter that gets a slot wakes the next in line when there is room for it too (several
slots freed at once, or a backend came back); a waiter woken just as its deadline passed
hands its wake-up on. Nothing here
decides which backend: the caller's `pick` does.

A newcomer that could not be served in time is refused at once, not after waiting its whole
`within` for nothing: per model the queue keeps the interval between the waiters it served
(an EWMA), and with `n` waiting ahead the wait is about `n` x that interval (or x the time
since the last one was served, when that is longer: backends that stopped freeing slots).
Beyond `ADMIT_MARGIN` of `within` the answer is None at once (a 503 with Retry-After).
Measured at 5x the fleet's capacity (`bench/overload.py`): before this, every refusal
waited the full 2 s (`routing.queue_timeout`); only past `queue_max` (1,024) waiters was
one refused at once.

An `urgent` waiter is work the gateway already took on: a retry, or the continuation of a
stream whose backend died (the client holds part of the answer). It goes ahead of every
newcomer and is never refused for the expected wait, only by a full queue or its `within`:
when two of three backends were SIGKILLed with the survivor at its `max_inflight`, the
broken streams used to end with an error at once, and the retries could be refused behind
a queue of newcomers (`chaos/fleet.py`, `two_lost`); newcomers get the 503 instead.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Iterable
from typing import TypeVar

from pulsegate import clock

T = TypeVar("T")

_Entry = tuple[float, "asyncio.Future[None]"]


class CapacityQueue:
    def __init__(self, limit: int, now: Callable[[], float] = clock.monotonic) -> None:
        self.limit = limit
        self._now = now  # the gateway's clock (`pulsegate.clock`)
        self._queues: dict[str, collections.deque[_Entry]] = {}
        # Waiters per model, counted from entry to exit (woken or not), for `ahead`.
        self._inside: collections.Counter[str] = collections.Counter()
        self.depth = 0
        # Per model: when a waiter was last served, and the EWMA of the interval between two.
        self._served_at: dict[str, float] = {}
        self._interval: dict[str, float] = {}

    def ahead(self, model: str) -> bool:
        """Requests for `model` are waiting: a newcomer must queue behind them."""
        return self.depth > 0 and self._inside[model] > 0

    def wake_for(self, models: Iterable[str]) -> None:
        """A slot freed on a backend serving `models`: wake the longest waiter among them."""
        if not self.depth:
            return
        best: collections.deque[_Entry] | None = None
        for m in models:
            q = self._queues.get(m)
            while q and q[0][1].done():  # timed out or cancelled: already gone
                q.popleft()
            if q and (best is None or q[0][0] < best[0][0]):
                best = q
        if best is not None:
            best.popleft()[1].set_result(None)

    def _wake_model(self, model: str) -> None:
        self.wake_for((model,))

    async def wait(
        self,
        model: str,
        within: float,
        pick: Callable[[], T | None],
        has_room: Callable[[], bool],
        *,
        urgent: bool = False,
    ) -> T | None:
        """Wait in `model`'s queue until `pick()` finds a backend, at most `within` seconds.
        `has_room()` says whether another request for `model` would find one now. `urgent`:
        already admitted (a retry, a stream's continuation): ahead of every newcomer, never
        refused for the expected wait. None: the queue is full or the wait timed out."""
        if self.depth >= self.limit:
            return None
        now = self._now
        since = now()
        ahead = self._inside[model]
        if (
            not urgent
            and ahead
            and self._expected_wait(model, ahead, since) > within * ADMIT_MARGIN
        ):
            return None
        place = URGENT if urgent else since  # the position in line
        loop = asyncio.get_running_loop()
        deadline = since + within
        q = self._queues.setdefault(model, collections.deque())
        self.depth += 1
        self._inside[model] += 1
        first = True
        try:
            while True:
                left = deadline - now()
                if left <= 0:
                    return None
                fut: asyncio.Future[None] = loop.create_future()
                if first and not urgent:
                    q.append((place, fut))
                else:
                    _reinsert(q, (place, fut))  # keep our place in line (urgent: the head)
                first = False
                try:
                    async with asyncio.timeout(left):
                        await fut
                except TimeoutError:
                    if fut.done() and not fut.cancelled():
                        self._wake_model(model)  # woken as time ran out: pass it on
                    return None
                finally:
                    if not fut.done():
                        fut.cancel()
                found = pick()
                if found is not None:
                    self._served(model, since, now())
                    if q and has_room():
                        self._wake_model(model)  # more slots freed at once: next in line
                    return found
        finally:
            self.depth -= 1
            self._inside[model] -= 1
            if not self._inside[model]:
                del self._inside[model]

    def _served(self, model: str, since: float, t: float) -> None:
        """A waiter that arrived at `since` got its slot at `t`: the interval since the one
        before (or since its own arrival, if it came after: the queue was idle)."""
        last = self._served_at.get(model)
        sample = t - (since if last is None or since > last else last)
        old = self._interval.get(model)
        self._interval[model] = sample if old is None else old + SERVED_ALPHA * (sample - old)
        self._served_at[model] = t

    def _expected_wait(self, model: str, ahead: int, t: float) -> float:
        """About how long a newcomer behind `ahead` waiters of `model` waits (0: unknown)."""
        interval = self._interval.get(model)
        if interval is None:
            return 0.0
        # The time nothing was served counts only while someone waited: after an idle
        # queue, from the arrival of its longest waiter.
        start = self._served_at[model]
        q = self._queues.get(model)
        if q and q[0][0] > start:
            start = q[0][0]
        return ahead * max(interval, t - start)


# An urgent waiter's place in line: before every newcomer (after the urgent ones already in).
URGENT = float("-inf")
# Weight of one served waiter in the interval's EWMA: ~10 waiters of memory.
SERVED_ALPHA = 0.1
# The expected wait is an estimate (slots free in bursts, streams end at random): a newcomer
# is queued only when it would be served within this part of its `within`. At 1.0, 1% of a
# 5x stream overload's refusals still came after the full 2 s wait (bench/overload.py).
ADMIT_MARGIN = 0.75


def _reinsert(q: collections.deque[_Entry], entry: _Entry) -> None:
    """Put a waiter back where its arrival time says (usually the front)."""
    i = 0
    for since, _ in q:
        if since > entry[0]:
            break
        i += 1
    q.insert(i, entry)
