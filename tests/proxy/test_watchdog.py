"""The stream watchdog and the first-byte watch on a ManualClock: no sleeping."""

from __future__ import annotations

from pulsegate.clock import ManualClock
from pulsegate.health.observations import FirstByteOverdue, Observation
from pulsegate.proxy.cuts import CutKind, Evidence
from pulsegate.proxy.firstbyte import OVERDUE_FLOOR_S, FirstByteWatch
from pulsegate.proxy.watchdog import EJECTED_STALL_S, Watchdog


class _Upstream:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_a_silent_stream_is_cut_after_the_stall_limit_and_not_before() -> None:
    """No byte for `stall` seconds: closed, with a `stalled` cut (suspect evidence)."""
    clock, up = ManualClock(), _Upstream()
    w = Watchdog(clock, up, 1.0)
    clock.advance(0.6)
    w.touch()  # a token arrived
    clock.advance(0.9)
    assert up.closed == 0 and w.cut_by is None
    clock.advance(0.2)
    assert up.closed == 1 and w.cut_by is not None
    assert w.cut_by.kind is CutKind.STALLED and w.cut_by.evidence is Evidence.SUSPECT
    assert "no token for 1000ms" in str(w.cut_by)
    assert clock.pending() == 0


def test_our_own_stall_is_not_the_engines_silence() -> None:
    """A 1.5 s stall of our loop past a 1 s limit: the stream gets its running time first."""
    clock, up = ManualClock(), _Upstream()
    w = Watchdog(clock, up, 1.0)
    clock.advance(0.2)
    clock.stall(1.5)
    assert up.closed == 0  # 0.2 s of running time only
    clock.advance(0.85)
    assert up.closed == 1 and w.cut_by is not None


def test_with_nowhere_to_go_a_slow_stream_waits_until_the_request_deadline() -> None:
    """may_cut False: never cut for a stall, only once the deadline has passed."""
    clock, up = ManualClock(), _Upstream()
    Watchdog(clock, up, 1.0, may_cut=lambda: False, deadline=clock.now() + 5.0)
    clock.advance(4.9)
    assert up.closed == 0
    clock.advance(0.2)
    assert up.closed == 1


def test_an_ejection_tightens_the_limit_whatever_may_cut_says() -> None:
    """Ejected backend: cut once idle EJECTED_STALL_S, kind `ejected` (no evidence)."""
    clock, up = ManualClock(), _Upstream()
    w = Watchdog(clock, up, 1.0, may_cut=lambda: False, deadline=clock.now() + 60)
    clock.advance(0.1)
    w.tighten(EJECTED_STALL_S, "backend ejected (canary)")
    clock.advance(EJECTED_STALL_S - 0.1 - 0.01)
    assert up.closed == 0
    clock.advance(0.02)
    assert up.closed == 1 and w.cut_by is not None
    assert w.cut_by.kind is CutKind.EJECTED and w.cut_by.evidence is Evidence.NONE
    assert str(w.cut_by).startswith("backend ejected (canary): no token for")


def test_a_slow_client_is_not_the_engines_silence() -> None:
    """While the relay is blocked writing to a slow client, a stall is never cut, however
    long; once the write is done the engine gets a full stall period again. An ejection
    still cuts."""
    clock, up = ManualClock(), _Upstream()
    w = Watchdog(clock, up, 1.0)
    w.holding = True
    clock.advance(5.0)
    assert up.closed == 0 and w.cut_by is None
    w.holding = False
    w.touch()
    clock.advance(0.9)
    assert up.closed == 0
    clock.advance(0.2)
    assert up.closed == 1 and w.cut_by is not None and w.cut_by.kind is CutKind.STALLED
    clock2, up2 = ManualClock(), _Upstream()
    w2 = Watchdog(clock2, up2, 1.0)
    w2.holding = True
    w2.tighten(EJECTED_STALL_S, "backend ejected")
    clock2.advance(EJECTED_STALL_S + 0.01)
    assert up2.closed == 1 and w2.cut_by is not None and w2.cut_by.kind is CutKind.EJECTED


def test_stop_cancels_the_timer() -> None:
    """A stream that ended leaves no timer behind."""
    clock, up = ManualClock(), _Upstream()
    w = Watchdog(clock, up, 1.0)
    w.stop()
    clock.advance(10)
    assert up.closed == 0 and clock.pending() == 0


def test_an_overdue_first_byte_is_reported_once_per_limit_period() -> None:
    """4x the usual TTFT (floor 0.5 s) past: one report with the count; our stall excused."""
    clock = ManualClock()
    seen: list[tuple[str, Observation]] = []
    watch = FirstByteWatch(["a"], clock, lambda name, now: 0.05, lambda n, o: seen.append((n, o)))
    t1 = watch.watch("a", clock.now())
    t2 = watch.watch("a", clock.now())
    clock.advance(OVERDUE_FLOOR_S - 0.01)
    watch.check(clock.now())
    assert seen == []
    clock.advance(0.02)
    watch.check(clock.now())
    assert len(seen) == 1 and seen[0][0] == "a"
    obs = seen[0][1]
    assert isinstance(obs, FirstByteOverdue) and obs.count == 2
    watch.check(clock.now())  # within the same limit period: nothing more
    assert len(seen) == 1
    watch.seen("a", t1)
    watch.seen("a", t2)
    watch.watch("a", clock.now())
    clock.stall(1.0)  # our own stall: not the backend's delay
    watch.check(clock.now())
    assert len(seen) == 1
    clock.advance(OVERDUE_FLOOR_S + 0.01)  # now the backend has had its running time
    watch.check(clock.now())
    assert len(seen) == 2
