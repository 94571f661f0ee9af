"""The micro-inference inside the heartbeat stream (`heartbeat_micro.StreamMicro`) on a
`ManualClock`, writing to a fake stream: rounds, the timeout, our own stalls, answers. No
network, no sleeping."""

from __future__ import annotations

import itertools
import random

from probe_kit import FakeStream

from pulsegate.agent.wire import pb
from pulsegate.clock import ManualClock
from pulsegate.config import MicroInferenceConfig
from pulsegate.health.observations import Observation, ProbeKind, ProbeResult
from pulsegate.probers.heartbeat_micro import StreamMicro

MICRO = MicroInferenceConfig(interval=3.0, jitter=2.0, timeout=2.0)
TIMEOUT_REASON = "timeout after 2s (no answer through the agent)"


class _Harness:
    def __init__(self, seed: int = 1) -> None:
        self.clock = ManualClock()
        self.seen: list[Observation] = []
        self.up = True
        self.stream = FakeStream()
        self.micro = StreamMicro(
            MICRO,
            self.clock,
            random.Random(seed),
            itertools.count(1).__next__,
            self.seen.append,
            lambda: self.up,
        )

    def sent(self) -> pb.Ping:
        """Send the round and return the request written."""
        self.micro.send(self.stream)
        return self.stream.sent[-1]


def test_a_round_comes_due_after_interval_plus_jitter() -> None:
    """The first round is due `interval + U(0, jitter)` after start, drawn from the rng."""
    h = _Harness(seed=4)
    delay = MICRO.interval + random.Random(4).uniform(0.0, MICRO.jitter)
    h.micro.start()
    h.clock.advance(delay - 1e-3)
    assert not h.micro.due
    h.clock.advance(2e-3)
    assert h.micro.due


def test_no_round_is_due_while_there_is_no_stream() -> None:
    """A round that comes while there is no stream is skipped and the next one armed."""
    h = _Harness()
    h.up = False
    h.micro.start()
    h.clock.advance(MICRO.interval + MICRO.jitter + 1e-3)
    assert not h.micro.due and h.clock.pending() == 1
    h.up = True
    h.clock.advance(MICRO.interval + MICRO.jitter + 1e-3)
    assert h.micro.due


def test_send_asks_the_agent_with_90_percent_of_the_timeout() -> None:
    """The request is a MICRO_INFERENCE ping giving the agent 90 % of our timeout; the next
    round is armed and this one is no longer due."""
    h = _Harness()
    h.micro.start()
    h.clock.advance(MICRO.interval + MICRO.jitter + 1e-3)
    ping = h.sent()
    assert (ping.kind, ping.timeout_ms) == (pb.Ping.MICRO_INFERENCE, 1800)
    assert not h.micro.due and h.micro.outstanding == 1
    assert h.clock.pending() == 2  # its deadline and the next round


def test_no_answer_within_the_timeout_is_a_failed_micro_probe() -> None:
    """The micro-inference timeout: silence for `timeout` is a named failure, emitted when
    the deadline passes; an answer after it is ignored."""
    h = _Harness()
    ping = h.sent()
    h.clock.advance(MICRO.timeout - 1e-3)
    assert h.seen == []
    h.clock.advance(2e-3)
    assert h.seen == [ProbeResult(ProbeKind.MICRO, False, None, TIMEOUT_REASON)]
    h.micro.on_pong(pb.Pong(seq=ping.seq, kind=pb.Ping.MICRO_INFERENCE, ok=True))
    assert len(h.seen) == 1


def test_our_stall_pushes_the_micro_deadline_back() -> None:
    """A stall of ours during the request is not the engine's slowness: the deadline moves
    back by it, then expires."""
    h = _Harness()
    h.sent()
    h.clock.advance(0.5)
    h.clock.stall(3.0)  # the 2 s deadline came due while we stood still: 1.5 s still owed
    h.clock.advance(1.49)
    assert h.seen == []
    h.clock.advance(0.02)
    assert h.seen == [ProbeResult(ProbeKind.MICRO, False, None, TIMEOUT_REASON)]


def test_an_answer_in_time_is_the_engine_verdict_and_busy_is_none() -> None:
    """An answer carries the agent's verdict and engine latency; a busy engine emits
    nothing (R17); either way the deadline is disarmed."""
    h = _Harness()
    ok = h.sent()
    h.micro.on_pong(pb.Pong(seq=ok.seq, kind=pb.Ping.MICRO_INFERENCE, ok=True, latency_ms=12))
    failed = h.sent()
    h.micro.on_pong(
        pb.Pong(seq=failed.seq, kind=pb.Ping.MICRO_INFERENCE, ok=False, error="HTTP 500: x")
    )
    busy = h.sent()
    h.micro.on_pong(pb.Pong(seq=busy.seq, kind=pb.Ping.MICRO_INFERENCE, busy=True))
    h.clock.advance(MICRO.timeout * 2)
    assert h.seen == [
        ProbeResult(ProbeKind.MICRO, True, 0.012, ""),
        ProbeResult(ProbeKind.MICRO, False, None, "HTTP 500: x"),
    ]
    assert h.micro.outstanding == 0


def test_a_broken_stream_drops_requests_silently_and_close_disarms_all() -> None:
    """`drop` forgets the requests in flight without a verdict; `close` also disarms the
    next round."""
    h = _Harness()
    h.micro.start()
    h.sent()
    h.micro.drop()
    h.clock.advance(MICRO.timeout * 2)
    assert h.seen == [] and h.micro.outstanding == 0
    h.micro.close()
    assert h.clock.pending() == 0


def test_back_pressure_skips_the_round() -> None:
    """A request that cannot be written has no deadline; the next round is armed."""
    h = _Harness()
    h.stream.accept = False
    h.micro.send(h.stream)
    assert h.micro.outstanding == 0 and h.clock.pending() == 1
