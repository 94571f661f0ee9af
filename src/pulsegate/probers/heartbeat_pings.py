"""The heartbeat's pings in flight on one stream, and their deadlines (R2, R3).

A ping that no pong answers within ``cfg.timeout`` is a miss (``"late"``) the moment its
deadline passes, not when a pong finally comes. The deadline is pushed back by our own
stalls (`pulsegate.stall.look_again`), and a deadline timer that fires more than
`_LAG_TOLERANCE_S` late is looked at once more `stall.RECHECK_S` later, so a pong that
already sits in the socket is read first: a gateway pause must not eject every backend.

After a miss, confirmation pings go out ``timeout / 4`` apart (5 ms at least) while fewer
are outstanding than misses still needed to reach ``misses_to_dead`` (the timeline is in
`pulsegate.probers.heartbeat`'s docstring): a sick agent gets at most two extra pings.

No I/O of its own: pings are written through the `Sender` attached, and every deadline is
a timer on the `Clock` given, so the rules are tested on a `ManualClock`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pulsegate import stall
from pulsegate.agent.wire import pb
from pulsegate.clock import Clock, Handle
from pulsegate.config import HeartbeatConfig
from pulsegate.health.observations import Heartbeat, Observation

# A deadline timer that fires this late means our own loop was stalled: re-check first.
_LAG_TOLERANCE_S = 0.01
_PING = pb.Ping.PING


class Sender(Protocol):
    """Where pings are written: the heartbeat stream (`agent.grpc_lite.GrpcStream`)."""

    def send(self, payload: bytes) -> bool:
        """Write one message now; False (nothing written) under back-pressure."""
        ...


@dataclass(slots=True)
class _Pending:
    sent_at: float  # clock.now() when the ping was stamped
    handle: Handle  # its deadline
    extensions: int = 0  # times the deadline was pushed back for our own stall


class Pings:
    """The pings outstanding on the attached stream: deadlines, misses, confirmation.

    `emit(observation)` hears each ``"late"`` miss; a pong in time is the caller's to turn
    into a heartbeat (`answered` gives it the ping's send time). `next_seq()` numbers every
    message on the stream (shared with the micro-inference).
    """

    def __init__(
        self,
        cfg: HeartbeatConfig,
        clock: Clock,
        next_seq: Callable[[], int],
        emit: Callable[[Observation], None],
    ) -> None:
        self.cfg = cfg
        self._clock = clock
        self._next_seq = next_seq
        self._emit = emit
        self._fast = max(cfg.timeout / 4, 0.005)
        self._stream: Sender | None = None
        self._pending: dict[int, _Pending] = {}
        self._misses = 0  # consecutive "late" misses on this stream: drives confirmation
        self._last_sent = 0.0
        self._confirm_handle: Handle | None = None

    @property
    def outstanding(self) -> int:
        """Pings sent and neither answered nor missed yet."""
        return len(self._pending)

    def attach(self, stream: Sender) -> None:
        """A new stream: pings go out on it, and its misses count from zero."""
        self._stream = stream
        self._misses = 0

    def detach(self) -> int:
        """The stream is gone: forget every ping outstanding (their deadlines and any
        confirmation are cancelled) and say how many it swallowed."""
        self._stream = None
        n = len(self._pending)
        for p in self._pending.values():
            p.handle.cancel()
        self._pending.clear()
        if self._confirm_handle is not None:
            self._confirm_handle.cancel()
            self._confirm_handle = None
        return n

    def send(self, now: float) -> bool:
        """Send one ping at `now` (clock time) with its deadline; False when it could not be
        written (back-pressure, or no stream attached)."""
        stream = self._stream
        if stream is None:
            return False
        seq = self._next_seq()
        sent_at = self._clock.now()
        self._last_sent = now
        ping = pb.Ping(seq=seq, send_ns=int(sent_at * 1e9), kind=_PING)
        if not stream.send(ping.SerializeToString()):
            return False
        deadline = now + self.cfg.timeout
        handle = self._clock.call_at(deadline, self._late, seq, deadline)
        self._pending[seq] = _Pending(sent_at, handle)
        return True

    def answered(self, seq: int) -> float | None:
        """A pong for ping `seq`: its send time if it was still outstanding (in time: the
        miss count starts again), else None (already counted as a miss)."""
        p = self._pending.pop(seq, None)
        if p is None:
            return None
        p.handle.cancel()
        self._misses = 0
        return p.sent_at

    def _late(self, seq: int, deadline: float) -> None:
        p = self._pending.get(seq)
        if p is None:
            return
        # Time our own loop stood still since the ping does not count against the agent:
        # its pong may be sitting unread. Look again once that time has been made up.
        timeout = self.cfg.timeout
        clock = self._clock
        again = stall.look_again(
            clock, deadline - timeout, timeout, clock.now(), p.extensions, _LAG_TOLERANCE_S
        )
        if again is not None:
            p.extensions += 1
            p.handle = clock.call_at(again, self._late, seq, deadline)
            return
        del self._pending[seq]
        self._misses += 1
        self._emit(Heartbeat(None, reason="late"))
        if self._confirm_handle is None:
            self._confirm_handle = clock.call_later(0, self._confirm)

    def _confirm(self) -> None:
        """While suspicious, send confirmation pings `timeout / 4` apart until as many are
        outstanding as misses are still needed."""
        self._confirm_handle = None
        if self._stream is None:
            return
        needed = self.cfg.misses_to_dead - self._misses
        if self._misses == 0 or len(self._pending) >= needed:
            return
        clock = self._clock
        now = clock.now()
        due = self._last_sent + self._fast
        if now + 1e-4 < due:
            self._confirm_handle = clock.call_at(due, self._confirm)
            return
        if not self.send(now):
            return  # back-pressure: the regular tick reports it
        if len(self._pending) < self.cfg.misses_to_dead - self._misses:
            self._confirm_handle = clock.call_at(now + self._fast, self._confirm)
