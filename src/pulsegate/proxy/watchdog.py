"""The stream watchdog: closes a silent upstream so the stream can go on elsewhere.

Runs on the injected clock (`pulsegate.clock`): on a `ManualClock` it is driven by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from pulsegate import stall
from pulsegate.clock import Clock, Handle, running
from pulsegate.proxy.cuts import Cut, CutKind

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

    One timer per stall period rather than one per chunk: `touch()` only stores a time.

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
        "cut_by",
        "holding",
        "last",
        "stall",
    )

    def __init__(
        self,
        clock: Clock,
        resp: Closable,
        stall: float,
        may_cut: Callable[[], bool] | None = None,
        deadline: float = math.inf,
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
        self._handle: Handle | None = clock.call_later(stall, self._check)

    def touch(self) -> None:
        self.last = self._clock.now()

    def _check(self) -> None:
        now = self._clock.now()
        idle = now - self.last
        if self.holding and self._kind is CutKind.STALLED:
            idle = 0.0  # waiting on our client, not on the engine
        elif idle >= self.stall:
            # Time our own loop stood still is not the engine's silence: its tokens may be
            # sitting unread (pulsegate.clock).
            idle = running(self._clock, self.last, now)
        if idle < self.stall:
            self._handle = self._clock.call_later(
                max(self.stall - idle, stall.RECHECK_S), self._check
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
            wait = min(self.stall, max(0.0, self._deadline - now))
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
