"""The stream watchdog: closes a silent upstream so the stream can go on elsewhere.

Runs on the injected clock (`pulsegate.clock`): on a `ManualClock` it is driven by hand.
With a rhythm (`rhythm.py`) the limit follows the stream once its first token is out:
max(floor, factor x the backend's recent inter-token p99 or the stream's longest gap),
at most `stall` (`streaming.stall_timeout`); before it (a prefill) the limit is `stall`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from pulsegate import stall
from pulsegate.clock import Clock, Handle, running
from pulsegate.proxy.cuts import Cut, CutKind
from pulsegate.proxy.rhythm import MIN_OWN_GAPS, Quantiles, stall_limit

# Once its backend is ejected, a stream idle this long is cut and resumed elsewhere.
EJECTED_STALL_S = 0.25


class Closable(Protocol):
    """What the watchdog needs of an upstream response: closing it wakes the pending read."""

    def close(self) -> None: ...


class Watchdog:
    """Closes the upstream when no bytes arrived for `stall` seconds - if the stream can go on.

    A cut stream is continued on another backend; with none to continue on (the only engine
    left is slow, or the request cannot be resumed), a cut turns a slow stream into a client
    error. So the cut happens only when `may_cut()` says a continuation can be had, or once
    `deadline` (the request's own `retry.request_timeout`, on the clock) has passed;
    otherwise the stream keeps waiting and the check repeats every `stall` seconds. Time our
    own loop stood still does not count as the engine's silence.

    One timer per stall period (once the stream has begun, at most `floor` apart) rather
    than one per chunk: `beat()` and `touch()` store a time and feed the rhythm.

    While `holding` is set the relay is blocked writing to a slow client and reads nothing
    from the upstream: its silence is ours, and a stall is not cut (a client reading slowly
    made the landed code blame a healthy backend, cut it and resume elsewhere: a client
    could make three backends generate for one request). An ejection still cuts."""

    __slots__ = (
        "_clock",
        "_deadline",
        "_handle",
        "_hint",
        "_kind",
        "_may_cut",
        "_resp",
        "_rhythm",
        "armed",
        "cut_by",
        "factor",
        "floor",
        "gaps",
        "holding",
        "last",
        "own",
        "stall",
        "tokens_from",
    )

    def __init__(
        self,
        clock: Clock,
        resp: Closable,
        stall: float,
        may_cut: Callable[[], bool] | None = None,
        deadline: float = math.inf,
        rhythm: Quantiles | None = None,
        floor: float = 0.15,
        factor: float = 4.0,
    ) -> None:
        self._clock = clock
        self._resp = resp
        self.stall = stall
        self._may_cut = may_cut
        self._deadline = deadline
        self.last = clock.now()
        self.cut_by: Cut | None = None  # why the watchdog (or an ejection, a shutdown) cut
        self.holding = False  # the relay is writing to the client (see the class doc)
        self._hint = "stalled"
        self._kind = CutKind.STALLED
        # The rhythm (`rhythm.py`): the backend's gaps, fed here; off with None.
        self._rhythm = rhythm
        self.floor, self.factor = floor, factor
        self.tokens_from = 0  # the stream's tokens out when this upstream began
        self.armed = False  # its first token is out: the limit follows the rhythm
        self.gaps = 0  # gaps seen since then
        self.own = 0.0  # the stream's longest gap
        self._handle: Handle | None = clock.call_later(stall, self._check)

    def touch(self, tokens: int = 0) -> None:
        """The relay wrote to its client: what follows is the engine's time again. Once
        the stream's `tokens` out pass `tokens_from`, this upstream has begun (`arm`)."""
        self.last = self._clock.now()
        if tokens > self.tokens_from and not self.armed:
            self.arm()

    def beat(self) -> None:
        """Bytes came from the upstream. Once the stream has begun, the gap since the last
        ones is part of its rhythm: the hot path, one per upstream read."""
        now = self._clock.now()
        rhythm = self._rhythm
        if self.armed and rhythm is not None:
            gap = now - self.last
            self.gaps += 1
            if gap > self.own:
                self.own = gap
            rhythm.add(gap)
        self.last = now

    def arm(self) -> None:
        """The stream's first token went out: from now on the limit follows its rhythm, and
        the next look is within `floor`, not at `stall`."""
        if self.armed:
            return
        self.armed = True
        if self._rhythm is not None and self._handle is not None:
            self._handle.cancel()
            self._handle = self._clock.call_later(self._next(self.limit()), self._check)

    def limit(self) -> float:
        """Seconds of silence that cut the stream now."""
        rhythm = self._rhythm
        if not self.armed or rhythm is None:
            return self.stall
        own = self.own if self.gaps >= MIN_OWN_GAPS else None
        p99 = rhythm.quantile(0.99)
        return stall_limit(self.stall, self.floor, self.factor, p99, own)

    def _next(self, delay: float) -> float:
        """When to look again: a stream that has begun is looked at within `floor`, since
        its limit may fall meanwhile (its own gaps, or its backend's p99, become known)."""
        if self.armed and self._rhythm is not None and self.floor > 0:
            return min(delay, self.floor)
        return delay

    def _check(self) -> None:
        now = self._clock.now()
        limit = self.limit()
        idle = now - self.last
        if self.holding and self._kind is CutKind.STALLED:
            idle = 0.0  # waiting on our client, not on the engine
        elif idle >= limit:
            # Time our own loop stood still is not the engine's silence: its tokens may be
            # sitting unread (pulsegate.clock).
            idle = running(self._clock, self.last, now)
        if idle < limit:
            self._handle = self._clock.call_later(
                max(self._next(limit - idle), stall.RECHECK_S), self._check
            )
        elif self._may_cut is None or self._may_cut():
            self.cut(Cut(self._kind, f"{self._hint}: no token for {idle * 1000:.0f}ms"))
        elif now >= self._deadline:
            self.cut(
                Cut(
                    self._kind,
                    f"{self._hint}: no token for {idle * 1000:.0f}ms, request deadline reached",
                )
            )
        else:
            # Nowhere to continue: keep waiting for the slow stream, within the deadline.
            wait = min(self._next(limit), max(0.0, self._deadline - now))
            self._handle = self._clock.call_later(wait, self._check)

    def tighten(self, stall: float, reason: str) -> None:
        """The backend was ejected: cut the stream if it idles `stall` seconds, whether or
        not it can be continued elsewhere. The health core judged the engine sick: an idle
        stream on it is not "slow but alive", and must not hold its client until the
        request's deadline (minutes) for want of another backend."""
        self._hint = reason
        self._kind = CutKind.EJECTED
        self._may_cut = None
        if stall < self.stall and self.cut_by is None:
            self.stall = stall
            if self._handle is not None:
                self._handle.cancel()
            self._handle = self._clock.call_later(0.0, self._check)

    def cut(self, why: Cut) -> None:
        if self.cut_by is None:
            self.cut_by = why
        self.stop()
        self._resp.close()  # wakes the pending read with ClientConnectionError

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
