"""The micro-inference inside the heartbeat stream (R4): requested by the gateway, run by
the agent on its local engine, answered in a pong.

Every ``cfg.interval`` + U(0, ``cfg.jitter``) seconds (3-5 s by default) one request rides
along with the next regular ping; a round that comes while there is no stream is skipped
(the heartbeat misses already say it). The agent is given 90 % of ``cfg.timeout`` for the
engine, so its answer, with the engine's error, arrives before our own deadline; our
deadline is pushed back by our own stalls (`pulsegate.stall.look_again`): a gateway pause is
not the engine's slowness. Results become ``ProbeResult(MICRO, ...)``; nothing when the
engine was merely busy (R17) or the stream broke with the request in flight.

No I/O of its own: requests are written through the `Sender` given, timers run on the
`Clock` given, so the rules are tested on a `ManualClock`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from pulsegate import stall
from pulsegate.agent.wire import pb
from pulsegate.clock import Clock, Handle
from pulsegate.config import MicroInferenceConfig
from pulsegate.health.observations import Observation, ProbeKind, ProbeResult
from pulsegate.probers.heartbeat_pings import Sender

# The agent gives up on the engine a little before we give up on the agent, so its answer
# (with the engine's error) arrives before our own deadline.
_AGENT_TIMEOUT_SHARE = 0.9
MICRO = pb.Ping.MICRO_INFERENCE


@dataclass(slots=True)
class _Request:
    handle: Handle  # its deadline
    extensions: int = 0  # times the deadline was pushed back for our own stall


class StreamMicro:
    """The micro-inference rounds of one heartbeat client.

    `start()` arms the first round; when a round comes due, `due` turns True and the
    client calls `send(stream)` with its next regular ping. `stream_up()` says whether the
    client has a stream at all; `next_seq()` numbers every message on the stream (shared
    with the pings); `emit(observation)` hears each result.
    """

    def __init__(
        self,
        cfg: MicroInferenceConfig,
        clock: Clock,
        rng: random.Random,
        next_seq: Callable[[], int],
        emit: Callable[[Observation], None],
        stream_up: Callable[[], bool],
    ) -> None:
        self.cfg = cfg
        self._clock = clock
        self._rng = rng
        self._next_seq = next_seq
        self._emit = emit
        self._stream_up = stream_up
        self._pending: dict[int, _Request] = {}
        self._handle: Handle | None = None
        self.due = False  # a round came due: send it with the next regular ping

    @property
    def outstanding(self) -> int:
        """Requests sent and neither answered nor timed out yet."""
        return len(self._pending)

    def start(self) -> None:
        """Arm the first round."""
        self._schedule()

    def send(self, stream: Sender) -> None:
        """Send the round that is due (back-pressure skips it) and arm the next one."""
        self.due = False
        seq = self._next_seq()
        sent_at = self._clock.now()
        ping = pb.Ping(
            seq=seq,
            send_ns=int(sent_at * 1e9),
            kind=MICRO,
            timeout_ms=max(1, int(self.cfg.timeout * _AGENT_TIMEOUT_SHARE * 1e3)),
        )
        if stream.send(ping.SerializeToString()):
            start = self._clock.now()
            handle = self._clock.call_at(start + self.cfg.timeout, self._timeout, seq, start)
            self._pending[seq] = _Request(handle)
        # else: back-pressure is the heartbeat's to report; try again next round
        self._schedule()

    def on_pong(self, pong: pb.Pong) -> None:
        """The agent's answer to a micro-inference request."""
        p = self._pending.pop(pong.seq, None)
        if p is None:
            return  # timed out already
        p.handle.cancel()
        if pong.busy:
            return  # busy is not evidence either way (R17)
        latency = pong.latency_ms / 1e3 if pong.HasField("latency_ms") else None
        self._emit(ProbeResult(ProbeKind.MICRO, pong.ok, latency, pong.error))

    def drop(self) -> None:
        """The stream broke: requests in flight are dropped silently."""
        for p in self._pending.values():
            p.handle.cancel()
        self._pending.clear()

    def close(self) -> None:
        """No more rounds: drop what is in flight and disarm the next round."""
        self.drop()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _timeout(self, seq: int, start: float) -> None:
        p = self._pending.get(seq)
        if p is None:
            return
        clock = self._clock
        # Our own stall since the request is not the engine's slowness (pulsegate.stall).
        again = stall.look_again(clock, start, self.cfg.timeout, clock.now(), p.extensions)
        if again is not None:
            p.extensions += 1
            p.handle = clock.call_at(again, self._timeout, seq, start)
            return
        del self._pending[seq]
        reason = f"timeout after {self.cfg.timeout:.3g}s (no answer through the agent)"
        self._emit(ProbeResult(ProbeKind.MICRO, False, None, reason))

    def _schedule(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        delay = self.cfg.interval + self._rng.uniform(0.0, self.cfg.jitter)
        self._handle = self._clock.call_later(delay, self._fire)

    def _fire(self) -> None:
        self._handle = None
        if not self._stream_up():
            self._schedule()  # no stream: skip this round, the misses say it all
            return
        self.due = True  # sent with the next regular ping
