"""The probe cadence on a `ManualClock`: delays by kind and state, the pause between rounds,
and the Prober's loops driven by the clock they are given. Nothing sleeps: time moves only
when the test advances the clock, and probes answer at once (no backend)."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from probe_kit import fast_probes

from pulsegate.clock import ManualClock
from pulsegate.config import BackendConfig, CanaryConfig, MicroInferenceConfig, ReadinessConfig
from pulsegate.health.observations import Observation, ProbeKind, ProbeResult
from pulsegate.probers import Prober
from pulsegate.probers.cadence import (
    JITTER,
    POKE_MIN_GAP_S,
    UNSTABLE_SPEEDUP,
    Kind,
    delays,
    pause,
)
from pulsegate.probers.micro import Inference
from pulsegate.probers.payload import Api
from pulsegate.probers.readiness import Readiness
from pulsegate.probers.scheduler import ProbeIO
from pulsegate.probers.waits import Wake

R, M, C = ProbeKind.READINESS, ProbeKind.MICRO, ProbeKind.CANARY


async def _turns(n: int = 10) -> None:
    """Let the loop run what is ready; no clock time passes."""
    for _ in range(n):
        await asyncio.sleep(0)


async def _walk(c: ManualClock, seconds: float, step: float = 0.03125) -> None:
    """Move the clock on by `seconds` in small steps, letting the loop run after each."""
    for _ in range(round(seconds / step)):
        c.advance(step)
        await _turns()


# -- delays -------------------------------------------------------------------------------


def test_delays_by_kind_stable_and_unstable() -> None:
    """Readiness uses its two intervals, micro and canary a third while unstable, metrics
    one; all jittered by +-10 % (micro by its own U(0, jitter))."""
    probes = fast_probes(
        readiness=ReadinessConfig(interval=10, interval_unstable=2, timeout=1),
        micro_inference=MicroInferenceConfig(interval=3, jitter=2, timeout=2),
        canary=CanaryConfig(interval=2, payload_bytes=6144, timeout=0.35),
        metrics_interval=1.0,
    )
    rng = random.Random(3)
    for _ in range(200):
        slow, fast = delays(probes, Kind.READINESS, rng)
        assert 10 * (1 - JITTER) <= slow <= 10 * (1 + JITTER)
        assert fast == pytest.approx(slow / 5)
        slow, fast = delays(probes, Kind.MICRO, rng)
        assert 3 <= slow <= 5 and fast == pytest.approx(slow / UNSTABLE_SPEEDUP)
        slow, fast = delays(probes, Kind.CANARY, rng)
        assert 2 * (1 - JITTER) <= slow <= 2 * (1 + JITTER)
        assert fast == pytest.approx(slow / UNSTABLE_SPEEDUP)
        slow, fast = delays(probes, Kind.METRICS, rng)
        assert 1 - JITTER <= slow <= 1 + JITTER and fast == slow


# -- the poke a pause waits on ------------------------------------------------------------


async def test_a_wake_waits_its_time_and_leaves_no_timer() -> None:
    c = ManualClock()
    w = Wake()
    task = asyncio.create_task(w.wait(c, 1.0))
    await _turns()
    c.advance(0.999)
    await _turns()
    assert not task.done()
    c.advance(0.002)
    await _turns()
    assert task.done() and task.result() is False
    assert c.pending() == 0


async def test_a_wake_set_while_waiting_ends_the_wait_at_once() -> None:
    c = ManualClock()
    w = Wake()
    task = asyncio.create_task(w.wait(c, 10.0))
    await _turns()
    w.set()
    await _turns()
    assert task.done() and task.result() is True
    assert c.pending() == 0  # its timer went with it


async def test_a_poke_before_the_wait_is_kept_until_cleared() -> None:
    """A poke that came during the probe ends the next wait without one; `clear` forgets it,
    and a wait of no time says only whether it is set."""
    c = ManualClock()
    w = Wake()
    w.set()
    assert await w.wait(c, 10.0) is True
    assert await w.wait(c, 0.0) is True and w.is_set()
    w.clear()
    assert await w.wait(c, 0.0) is False and not w.is_set()
    task = asyncio.create_task(w.wait(c, 10.0))
    await _turns()
    task.cancel()  # a cancelled wait (the loop closing) leaves nothing behind either
    await _turns()
    assert task.cancelled() and c.pending() == 0
    w.set()  # and a later poke finds no waiter to wake
    assert w.is_set()


# -- pause --------------------------------------------------------------------------------


def _pausing(
    c: ManualClock,
    wake: Wake,
    unstable: Callable[[], bool],
    *,
    failed: bool = False,
    slow: float = 1.0,
    fast: float = 0.25,
) -> asyncio.Task[None]:
    return asyncio.create_task(pause(c, wake, c.now(), slow, fast, failed, unstable))


async def test_stable_pause_lasts_the_slow_delay_asking_at_each_fast_mark() -> None:
    """Stable: the pause ends at the slow delay, and `unstable()` is asked at every fast
    mark before it."""
    c = ManualClock()
    t0 = c.now()
    asked: list[float] = []

    def unstable() -> bool:
        asked.append(c.now() - t0)
        return False

    task = _pausing(c, Wake(), unstable)
    for _ in range(3):
        await _turns()
        c.advance(0.25)
        await _turns()
        assert not task.done()
    c.advance(0.25)
    await _turns()
    assert task.done()
    assert asked == [0.25, 0.5, 0.75]
    assert c.pending() == 0


async def test_unstable_pause_lasts_the_fast_delay() -> None:
    """Unstable: the pause ends at the first fast mark."""
    c = ManualClock()
    task = _pausing(c, Wake(), lambda: True)
    await _turns()
    c.advance(0.2)
    await _turns()
    assert not task.done()
    c.advance(0.05)
    await _turns()
    assert task.done()


async def test_turning_unstable_mid_pause_ends_it_at_the_next_fast_mark() -> None:
    """A backend that turns unstable during a stable pause is probed within one fast delay."""
    c = ManualClock()
    state = {"unstable": False}
    task = _pausing(c, Wake(), lambda: state["unstable"])
    await _turns()
    await _walk(c, 0.375)
    state["unstable"] = True
    await _walk(c, 0.0625)
    assert not task.done()
    await _walk(c, 0.0625)  # the 0.5 s mark
    assert task.done()


async def test_a_failed_round_pauses_only_the_fast_delay() -> None:
    """Right after this loop's own probe failed, the next round comes at the fast delay,
    even while stable."""
    c = ManualClock()
    task = _pausing(c, Wake(), lambda: False, failed=True)
    await _turns()
    c.advance(0.25)
    await _turns()
    assert task.done()


async def test_a_poke_ends_the_pause_but_not_before_the_minimum_gap() -> None:
    """A poke ends the pause at once, yet never sooner than `POKE_MIN_GAP_S` after the
    previous probe started."""
    c = ManualClock()
    wake = Wake()
    task = _pausing(c, wake, lambda: False, slow=10.0, fast=5.0)
    await _turns()
    c.advance(0.05)
    wake.set()
    await _turns()
    assert not task.done()
    c.advance(POKE_MIN_GAP_S - 0.05 - 1e-3)
    await _turns()
    assert not task.done()
    c.advance(2e-3)
    await _turns()
    assert task.done()


async def test_a_poke_well_after_the_last_probe_ends_the_pause_at_once() -> None:
    """A poke more than `POKE_MIN_GAP_S` after the previous probe started ends the pause
    without the clock moving."""
    c = ManualClock()
    wake = Wake()
    started = c.now()
    c.advance(POKE_MIN_GAP_S + 0.5)
    task = asyncio.create_task(pause(c, wake, started, 10.0, 5.0, False, lambda: False))
    await _turns()
    assert not task.done()
    wake.set()
    await _turns()
    assert task.done()
    assert c.pending() == 0


# -- the Prober's loops on a ManualClock ---------------------------------------------------


class _Rounds:
    """Fake probes that answer at once, and what the Prober emitted, stamped with the
    (manual) clock time."""

    def __init__(self, c: ManualClock) -> None:
        self.clock = c
        self.t0 = c.now()
        self.ready = True
        self.seen: list[tuple[float, Observation]] = []

    def emit(self, name: str, obs: Observation) -> None:
        self.seen.append((self.clock.now() - self.t0, obs))

    def times(self, kind: ProbeKind) -> list[float]:
        return [t for t, o in self.seen if isinstance(o, ProbeResult) and o.kind is kind]

    async def readiness(self, *args: Any) -> Readiness:
        return Readiness(ProbeResult(R, True, 0.001, "" if self.ready else "warming", self.ready))

    async def inference(self, kind: ProbeKind, *args: Any) -> Inference:
        return Inference(ProbeResult(kind, True, 0.001), Api.COMPLETIONS)


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


@asynccontextmanager
async def _manual_prober(
    unstable: Callable[[str], bool],
) -> AsyncIterator[tuple[ManualClock, _Rounds]]:
    c = ManualClock()
    rounds = _Rounds(c)
    probes = fast_probes(
        readiness=ReadinessConfig(interval=10, interval_unstable=0.5, timeout=0.5),
        micro_inference=MicroInferenceConfig(interval=3, jitter=0, timeout=0.3),
        canary=CanaryConfig(interval=3, payload_bytes=4096, timeout=0.3),
    )
    b = BackendConfig(name="b", url="http://127.0.0.1:9", models=("m",))  # never contacted
    prober = Prober(
        [b],
        probes,
        emit=rounds.emit,
        unstable=unstable,
        set_models=lambda name, ids: None,
        rng=random.Random(5),
        clock=c,
        io=ProbeIO(readiness=rounds.readiness, inference=rounds.inference),
    )
    await prober.start()
    try:
        await _turns()
        yield c, rounds
    finally:
        await prober.close()


async def test_prober_readiness_cadence_is_picked_by_state() -> None:
    """On its clock, readiness runs every ~10 s while stable, every ~0.5 s once unstable(),
    and slow again after; each round when the clock says, never sooner."""
    state = {"unstable": False}
    async with _manual_prober(lambda name: state["unstable"]) as (c, rounds):
        assert rounds.times(R) == [0.0]  # the first round at once
        await _walk(c, 25.0)
        stable = _gaps(rounds.times(R))
        state["unstable"] = True
        flip = len(rounds.times(R))
        await _walk(c, 3.0)
        fast = _gaps(rounds.times(R)[flip:])
        first_fast = rounds.times(R)[flip] - 25.0
        state["unstable"] = False
        back = len(rounds.times(R))
        await _walk(c, 25.0)
        slow_again = _gaps(rounds.times(R)[back:])
    step = 0.03125  # `_walk`'s resolution
    assert len(stable) == 2 and all(9.0 <= g <= 11.0 + step for g in stable), stable
    assert 0 < first_fast <= 0.55 + step  # within one fast interval of turning unstable
    assert len(fast) >= 4 and all(0.45 <= g <= 0.55 + step for g in fast), fast
    assert slow_again and all(9.0 <= g <= 11.0 + step for g in slow_again[1:]), slow_again


async def test_prober_inference_probes_speed_up_threefold_while_unstable() -> None:
    """Micro-inference and canary rounds come every ~3 s while stable, ~1 s while unstable."""
    state = {"unstable": False}
    async with _manual_prober(lambda name: state["unstable"]) as (c, rounds):
        await _walk(c, 13.0)
        stable = [_gaps(rounds.times(k)) for k in (M, C)]
        state["unstable"] = True
        flip = [len(rounds.times(k)) for k in (M, C)]
        await _walk(c, 6.0)
        fast = [_gaps(rounds.times(k)[n:]) for k, n in zip((M, C), flip, strict=True)]
    step = 0.03125
    for gaps in stable:
        assert len(gaps) >= 3 and all(2.7 <= g <= 3.3 + step for g in gaps), stable
    for gaps in fast:
        assert len(gaps) >= 4 and all(0.9 <= g <= 1.1 + step for g in gaps), fast


async def test_prober_not_ready_engine_is_asked_again_at_the_fast_interval() -> None:
    """A readiness round that says "not ready" is followed at the fast interval while
    stable, and no inference is sent until the engine is ready."""
    async with _manual_prober(lambda name: False) as (c, rounds):
        rounds.ready = False
        await _walk(c, 11.5)  # the slow round after the first one says: not ready
        n = len(rounds.times(R))
        await _walk(c, 2.0)
        gaps = _gaps(rounds.times(R)[n - 1 :])
        inference_before = len(rounds.times(M)) + len(rounds.times(C))
        await _walk(c, 1.0)
        assert len(rounds.times(M)) + len(rounds.times(C)) == inference_before
    assert len(gaps) >= 3 and all(0.45 <= g <= 0.55 + 0.03125 for g in gaps), gaps
