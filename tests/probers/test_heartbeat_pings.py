"""The heartbeat's ping deadlines (`heartbeat_pings.Pings`) on a `ManualClock`, writing to a
fake stream: misses the moment a deadline passes, confirmation pings, our own stalls not
held against the agent. No network, no sleeping."""

from __future__ import annotations

import itertools

import pytest
from probe_kit import FakeStream

from pulsegate import stall
from pulsegate.agent.wire import pb
from pulsegate.clock import ManualClock
from pulsegate.config import HeartbeatConfig
from pulsegate.health.observations import Heartbeat, Observation
from pulsegate.probers.heartbeat_pings import Pings

HB = HeartbeatConfig(interval=0.1, timeout=0.08, misses_to_dead=3)


def _pings(c: ManualClock) -> tuple[Pings, FakeStream, list[Observation]]:
    seen: list[Observation] = []
    pings = Pings(HB, c, itertools.count(1).__next__, seen.append)
    stream = FakeStream()
    pings.attach(stream)
    return pings, stream, seen


def _late(seen: list[Observation]) -> int:
    return sum(isinstance(o, Heartbeat) and o.reason == "late" for o in seen)


def test_a_pong_in_time_is_no_miss_and_disarms_the_deadline() -> None:
    """A pong before the deadline returns the ping's send time; nothing fires later."""
    c = ManualClock()
    pings, stream, seen = _pings(c)
    t0 = c.now()
    assert pings.send(t0)
    ping = stream.sent[0]
    assert (ping.seq, ping.kind, ping.send_ns) == (1, pb.Ping.PING, int(t0 * 1e9))
    c.advance(0.05)
    assert pings.answered(ping.seq) == t0
    c.advance(1.0)
    assert seen == [] and pings.outstanding == 0 and c.pending() == 0


def test_no_pong_is_a_late_miss_exactly_at_the_deadline() -> None:
    """The miss is emitted when the timeout passes, not later; a pong after it is ignored."""
    c = ManualClock()
    pings, stream, seen = _pings(c)
    pings.send(c.now())
    c.advance(HB.timeout - 1e-3)
    assert seen == []
    c.advance(2e-3)
    assert seen[0] == Heartbeat(None, reason="late")
    assert pings.answered(stream.sent[0].seq) is None


def test_a_miss_brings_confirmation_pings_and_three_misses_by_180_ms() -> None:
    """After the first miss two confirmation pings go out timeout/4 apart, so a silent
    agent has its third miss 180 ms after the first ping (the module's timeline)."""
    c = ManualClock()
    t0 = c.now()
    pings, stream, seen = _pings(c)
    pings.send(t0)
    misses: list[float] = []
    for _ in range(200):  # 200 ms in 1 ms steps
        c.advance(0.001)
        while len(misses) < _late(seen):
            misses.append(c.now() - t0)
    sent = [p.send_ns / 1e9 - t0 for p in stream.sent]
    assert sent == pytest.approx([0.0, 0.08, 0.10], abs=1e-6)
    assert misses == pytest.approx([0.08, 0.16, 0.18], abs=1.5e-3)
    assert pings.outstanding == 0 and c.pending() == 0  # no more pings once dead


def test_our_stall_pushes_a_ping_deadline_back_then_it_expires() -> None:
    """A stall of ours that spans the deadline does not count: the agent still gets its
    80 ms of our running time, then the miss comes (after the re-checks a late timer gets:
    `RECHECK_S` apart, up to `MAX_EXTENSIONS` looks in all)."""
    c = ManualClock()
    pings, _, seen = _pings(c)
    pings.send(c.now())
    c.advance(0.03)
    c.stall(0.2)  # the deadline came due while we stood still: 50 ms still owed
    assert seen == []
    c.advance(0.049)
    assert seen == []
    c.advance(0.001 + stall.MAX_EXTENSIONS * stall.RECHECK_S)
    assert _late(seen) == 1


def test_a_pong_read_after_our_stall_is_in_time() -> None:
    """A pong that waited in the socket during our stall is answered, never a miss."""
    c = ManualClock()
    pings, stream, seen = _pings(c)
    t0 = c.now()
    pings.send(t0)
    c.stall(0.5)
    assert pings.answered(stream.sent[0].seq) == t0
    c.advance(1.0)
    assert seen == []


def test_back_pressure_sends_nothing_and_arms_nothing() -> None:
    """A ping that cannot be written is reported False and has no deadline."""
    c = ManualClock()
    pings, stream, _ = _pings(c)
    stream.accept = False
    assert not pings.send(c.now())
    assert pings.outstanding == 0 and c.pending() == 0


def test_detach_counts_the_swallowed_pings_and_disarms_everything() -> None:
    """A broken stream: `detach` says how many pings it swallowed; no miss follows, and
    no ping goes out until a stream is attached again."""
    c = ManualClock()
    pings, stream, seen = _pings(c)
    pings.send(c.now())
    c.advance(HB.timeout + 1e-3)  # one miss: a confirmation ping is out
    pings.send(c.now())
    assert pings.detach() == 2
    c.advance(1.0)
    assert _late(seen) == 1 and c.pending() == 0
    assert not pings.send(c.now())
    pings.attach(stream)
    assert pings.send(c.now())
