"""The gateway's heartbeat client against real agent processes on loopback: heartbeats with
facts, misses the moment they happen (frozen, killed, unreachable agent), reconnection,
micro-inference inside the stream, and the fault-to-third-miss latency over 20 trials; and
its cadence on a `ManualClock`. (The deadline rules without a network:
test_heartbeat_pings.py, test_heartbeat_micro.py.)"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import signal
import statistics
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pulsegate.clock import ManualClock, SystemClock
from pulsegate.config import HeartbeatConfig, MicroInferenceConfig
from pulsegate.health.observations import Heartbeat, Observation, ProbeKind, ProbeResult
from pulsegate.probers.heartbeat import HeartbeatClient
from support import Proc, Sim

HB = HeartbeatConfig(interval=0.1, timeout=0.08, misses_to_dead=3)
NO_MICRO = MicroInferenceConfig(interval=3600.0, jitter=0.0, timeout=2.0)


@dataclass
class Recorder:
    """Every observation with its arrival time (time.monotonic, the SystemClock's `now`)."""

    seen: list[tuple[float, str, Observation]] = field(default_factory=list)

    def emit(self, name: str, obs: Observation) -> None:
        self.seen.append((time.monotonic(), name, obs))

    def beats(self, name: str, since: float = 0.0) -> list[tuple[float, Heartbeat]]:
        return [
            (t, o) for t, n, o in self.seen if n == name and t >= since and isinstance(o, Heartbeat)
        ]

    def probes(self, kind: ProbeKind, since: float = 0.0) -> list[ProbeResult]:
        return [
            o
            for t, _, o in self.seen
            if t >= since and isinstance(o, ProbeResult) and o.kind is kind
        ]

    def misses_in_a_row(self, name: str, since: float, n: int) -> list[tuple[float, Heartbeat]]:
        """The first `n` consecutive misses after `since` (fewer if not there yet)."""
        run: list[tuple[float, Heartbeat]] = []
        for t, hb in self.beats(name, since):
            if hb.rtt_s is None:
                run.append((t, hb))
                if len(run) == n:
                    break
            else:
                run = []
        return run

    async def until(self, cond: Callable[[], object], within: float, what: str) -> None:
        deadline = time.monotonic() + within
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {within}s waiting for {what}")
            await asyncio.sleep(0.005)


@asynccontextmanager
async def running(
    rec: Recorder,
    target: str,
    *,
    name: str = "a",
    micro: MicroInferenceConfig = NO_MICRO,
) -> AsyncIterator[HeartbeatClient]:
    """A HeartbeatClient running in this loop (on a `SystemClock` of it) for the block,
    closed after it."""
    clock = SystemClock(asyncio.get_running_loop())
    client = HeartbeatClient(name, target, HB, micro, rec.emit, rng=random.Random(7), clock=clock)
    task = asyncio.create_task(client.run())
    try:
        yield client
    finally:
        await client.close()
        await task
        clock.close()


def agent_for(tmp: Path, engine: str, n: int, listen: str = "127.0.0.1:0") -> Proc:
    return Proc(
        ["agent", "--engine", engine, "--listen", listen, "--gpu", "engine"],
        tmp / f"agent-{n}-{time.monotonic_ns()}.log",
    )


@pytest.fixture
def agents(tmp_path: Path, procs: list[Proc]) -> Callable[..., Proc]:
    """`agents(engine_url, listen=...)` starts an agent process, stopped by PID afterwards."""

    def start(engine: str, listen: str = "127.0.0.1:0") -> Proc:
        p = agent_for(tmp_path, engine, len(procs), listen)
        procs.append(p)
        return p

    return start


async def test_pongs_in_time_are_heartbeats_with_facts(
    start_sim: Callable[..., Sim], agents: Callable[..., Proc]
) -> None:
    """Pongs within the timeout become Heartbeats with RTT and the engine's facts."""
    agent = agents(start_sim("hb").url)
    rec = Recorder()
    async with running(rec, f"127.0.0.1:{agent.port}"):
        await rec.until(lambda: len(rec.beats("a")) >= 8, 3.0, "8 heartbeats")
    beats = [hb for _, hb in rec.beats("a")]
    assert all(hb.rtt_s is not None and 0 <= hb.rtt_s < HB.timeout for hb in beats), beats
    facts = beats[-1].facts
    assert facts is not None and facts.gpu_total_mb == 81920 and facts.queue_waiting == 0
    assert facts.source == "agent:engine"
    ready = rec.probes(ProbeKind.READINESS)
    assert len(ready) == 1 and ready[0].ok and ready[0].ready is True


async def test_frozen_agent_gives_three_misses_fast_then_recovers(
    start_sim: Callable[..., Sim], agents: Callable[..., Proc]
) -> None:
    """SIGSTOP: three consecutive 'late' misses within ~300 ms; SIGCONT: heartbeats again."""
    agent = agents(start_sim("stop").url)
    rec = Recorder()
    async with running(rec, f"127.0.0.1:{agent.port}"):
        await rec.until(lambda: len(rec.beats("a")) >= 3, 3.0, "first heartbeats")
        agent.signal(signal.SIGSTOP)
        t_fault = time.monotonic()
        try:
            await rec.until(
                lambda: len(rec.misses_in_a_row("a", t_fault, 3)) == 3, 2.0, "three misses"
            )
        finally:
            agent.signal(signal.SIGCONT)
        misses = rec.misses_in_a_row("a", t_fault, 3)
        assert misses[-1][0] - t_fault < 0.45
        assert {hb.reason for _, hb in misses} == {"late"}
        t_resume = time.monotonic()
        await rec.until(
            lambda: any(hb.rtt_s is not None for _, hb in rec.beats("a", t_resume)),
            2.0,
            "a heartbeat after SIGCONT",
        )


async def test_killed_agent_misses_then_reconnects_after_restart(
    start_sim: Callable[..., Sim], agents: Callable[..., Proc]
) -> None:
    """SIGKILL: a miss at once, then one per interval; a restarted agent is picked up."""
    sim = start_sim("kill")
    agent = agents(sim.url)
    rec = Recorder()
    async with running(rec, f"127.0.0.1:{agent.port}"):
        await rec.until(lambda: len(rec.beats("a")) >= 3, 3.0, "first heartbeats")
        agent.kill()
        t_fault = time.monotonic()
        await rec.until(lambda: len(rec.misses_in_a_row("a", t_fault, 6)) == 6, 2.0, "6 misses")
        misses = rec.misses_in_a_row("a", t_fault, 6)
        assert misses[0][1].reason == "stream_broken" and misses[0][0] - t_fault < 0.05
        assert {hb.reason for _, hb in misses[1:]} == {"disconnected"}
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(misses[1:])]
        assert all(0.03 < g < 0.3 for g in gaps), gaps  # the heartbeat cadence, not a burst
        await asyncio.to_thread(agents, sim.url, f"127.0.0.1:{agent.port}")
        t_restart = time.monotonic()
        await rec.until(
            lambda: sum(hb.rtt_s is not None for _, hb in rec.beats("a", t_restart)) >= 3,
            5.0,
            "heartbeats from the restarted agent",
        )


async def test_killed_engine_is_reported_refused_by_its_agent(
    start_sim: Callable[..., Sim], agents: Callable[..., Proc]
) -> None:
    """The agent stays up while its engine dies: its pongs say the engine's port refuses
    connections, which the health core takes as hard evidence (cause engine_down)."""
    sim = start_sim("dies")
    agent = agents(sim.url)
    rec = Recorder()
    async with running(rec, f"127.0.0.1:{agent.port}"):
        await rec.until(
            lambda: any(p.ok and p.ready for p in rec.probes(ProbeKind.READINESS)),
            5.0,
            "the agent's first readiness",
        )
        sim.kill()
        t_kill = time.monotonic()
        await rec.until(
            lambda: any(p.refused for p in rec.probes(ProbeKind.READINESS, t_kill)),
            5.0,
            "a refused readiness from the agent",
        )
        refused = next(p for p in rec.probes(ProbeKind.READINESS, t_kill) if p.refused)
        assert not refused.ok and "connection refused" in refused.reason
        assert any(hb.rtt_s is not None for _, hb in rec.beats("a", t_kill)), "agent still up"


async def test_quick_reconnect_costs_one_miss(
    start_sim: Callable[..., Sim], agents: Callable[..., Proc]
) -> None:
    """A connection reset with the agent still there: one miss, then heartbeats again -
    well inside the miss budget, so no ejection."""
    agent = agents(start_sim("reset").url)
    rec = Recorder()
    async with running(rec, f"127.0.0.1:{agent.port}") as client:
        await rec.until(lambda: len(rec.beats("a")) >= 3, 3.0, "first heartbeats")
        t0 = time.monotonic()
        assert client._stream is not None
        client._stream.abort("test: connection reset")  # as a reset from the network would
        await rec.until(
            lambda: sum(hb.rtt_s is not None for _, hb in rec.beats("a", t0)) >= 3,
            2.0,
            "heartbeats on the new stream",
        )
    after = [hb for _, hb in rec.beats("a", t0)]
    misses = [hb for hb in after if hb.rtt_s is None]
    assert [hb.reason for hb in misses] == ["stream_broken"], after
    assert len(rec.misses_in_a_row("a", t0, 2)) < 2


async def test_unreachable_agent_is_a_miss_per_interval() -> None:
    """Nothing listening: one 'disconnected' miss per interval, no error, no burst."""
    rec = Recorder()
    async with running(rec, "127.0.0.1:9"):  # the discard port: refused on loopback
        await rec.until(lambda: len(rec.beats("a")) >= 8, 3.0, "8 misses")
    beats = rec.beats("a")
    assert all(hb.rtt_s is None and hb.reason == "disconnected" for _, hb in beats)
    span = beats[7][0] - beats[0][0]
    assert 0.5 < span < 1.2, span


async def test_on_a_manual_clock_no_stream_is_one_miss_per_interval_of_that_clock() -> None:
    """Nothing listening, time moved only by the test: exactly one 'disconnected' miss per
    interval the clock moves (however many dials fail meanwhile); close() leaves no timer
    armed on the clock and nothing is emitted after it."""
    c = ManualClock()
    cfg = HeartbeatConfig(interval=0.125, timeout=0.0625, misses_to_dead=3)  # exact in binary
    rec = Recorder()
    client = HeartbeatClient("a", "127.0.0.1:9", cfg, NO_MICRO, rec.emit, clock=c)
    task = asyncio.create_task(client.run())
    # the first dial is decided: the micro round, the first tick and the backoff are armed
    await rec.until(lambda: c.pending() == 3, 3.0, "the first dial to fail")
    c.advance(0.0)  # the first tick, at once
    for _ in range(8):
        c.advance(cfg.interval)
        await asyncio.sleep(0)  # the connect loop may dial again meanwhile
    beats = [hb for _, hb in rec.beats("a")]
    assert len(beats) == 9
    assert all(b.rtt_s is None and b.reason == "disconnected" for b in beats)
    await client.close()
    await task
    assert c.pending() == 0
    c.advance(1.0)
    assert len(rec.beats("a")) == 9


async def test_micro_inference_result_arrives_via_the_stream(
    start_sim: Callable[..., Sim], agents: Callable[..., Proc]
) -> None:
    """A micro-inference is requested inside the stream and its result emitted."""
    agent = agents(start_sim("micro").url)
    rec = Recorder()
    micro = MicroInferenceConfig(interval=0.2, jitter=0.1, timeout=1.0)
    async with running(rec, f"127.0.0.1:{agent.port}", micro=micro):
        await rec.until(lambda: len(rec.probes(ProbeKind.MICRO)) >= 2, 3.0, "2 micro results")
    results = rec.probes(ProbeKind.MICRO)
    assert all(r.ok and r.latency_s is not None and 0 < r.latency_s < 1.0 for r in results)


async def test_cuda_hang_fails_micro_while_heartbeats_stay_good(
    start_sim: Callable[..., Sim], agents: Callable[..., Proc]
) -> None:
    """Process up, CUDA dead: micro-inference fails, heartbeats keep coming (R4)."""
    sim = start_sim("cuda")
    agent = agents(sim.url)
    await asyncio.to_thread(sim.fault, "cuda_hang")
    rec = Recorder()
    micro = MicroInferenceConfig(interval=0.1, jitter=0.05, timeout=0.4)
    async with running(rec, f"127.0.0.1:{agent.port}", micro=micro):
        await rec.until(lambda: len(rec.probes(ProbeKind.MICRO)) >= 2, 3.0, "2 micro results")
    results = rec.probes(ProbeKind.MICRO)
    assert all(not r.ok and "timeout" in r.reason for r in results), results
    assert sum(hb.rtt_s is not None for _, hb in rec.beats("a")) >= 5


async def test_gateway_stall_is_not_blamed_on_the_agent(
    start_sim: Callable[..., Sim], agents: Callable[..., Proc]
) -> None:
    """Our own loop blocked for 250 ms: pongs that came meanwhile are not counted late."""
    agent = agents(start_sim("stall").url)
    rec = Recorder()
    async with running(rec, f"127.0.0.1:{agent.port}"):
        await rec.until(lambda: len(rec.beats("a")) >= 3, 3.0, "first heartbeats")
        t0 = time.monotonic()
        time.sleep(0.25)  # noqa: ASYNC251 - a gateway pause on purpose: block this loop
        await rec.until(lambda: len(rec.beats("a", t0)) >= 3, 2.0, "heartbeats after")
    assert all(hb.rtt_s is not None for _, hb in rec.beats("a", t0))


async def test_close_stops_all_emission(
    start_sim: Callable[..., Sim], agents: Callable[..., Proc]
) -> None:
    """After close() returns, nothing more is emitted (no stray timers or tasks)."""
    agent = agents(start_sim("close").url)
    rec = Recorder()
    async with running(rec, f"127.0.0.1:{agent.port}"):
        await rec.until(lambda: len(rec.beats("a")) >= 2, 3.0, "first heartbeats")
    n = len(rec.seen)
    t0 = time.monotonic()
    await rec.until(lambda: time.monotonic() - t0 > 0.3, 1.0, "0.3 s to pass")
    assert len(rec.seen) == n


@pytest.mark.slow
async def test_fault_to_third_miss_over_20_trials(
    start_sim: Callable[..., Sim], tmp_path: Path, procs: list[Proc]
) -> None:
    """SIGSTOP and SIGKILL, 20 trials each: the third consecutive miss comes within 400 ms
    (targets: p50 <= 240 ms, max <= 400 ms; asserted with CI headroom, printed exactly)."""
    trials, batch = 20, 5
    rng = random.Random(2024)
    sim = start_sim("trials")
    with ThreadPoolExecutor(max_workers=4) as pool:  # process start-up is the slow part
        agents = list(pool.map(lambda i: agent_for(tmp_path, sim.url, i), range(trials)))
    procs.extend(agents)
    rec = Recorder()

    async def trial(i: int, sig: signal.Signals) -> float:
        """One fault on agent i at a random phase of its ticks; ms to the third miss."""
        name = f"k{i}"
        await asyncio.sleep(rng.uniform(0, HB.interval))  # a random phase, not a settle
        os.kill(agents[i].pid, sig)
        t_fault = time.monotonic()
        try:
            await rec.until(
                lambda: len(rec.misses_in_a_row(name, t_fault, 3)) == 3, 2.0, f"{name} misses"
            )
        finally:
            if sig is signal.SIGSTOP:
                os.kill(agents[i].pid, signal.SIGCONT)
        return (rec.misses_in_a_row(name, t_fault, 3)[-1][0] - t_fault) * 1e3

    async with running_many(rec, agents):
        results: dict[str, list[float]] = {}
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            ms: list[float] = []
            # a few trials at once (each its own agent and client) to keep the test short
            for first in range(0, trials, batch):
                group = range(first, first + batch)
                await asyncio.gather(*(_healthy(rec, f"k{i}") for i in group))
                ms += await asyncio.gather(*(trial(i, sig) for i in group))
            results[sig.name] = ms
    for what, ms in results.items():
        p50, worst = statistics.median(ms), max(ms)
        print(f"\n{what}: fault -> 3rd miss, {trials} trials: p50 {p50:.0f} ms, max {worst:.0f} ms")
        assert p50 <= 300 and worst <= 450, (what, sorted(ms))


async def _healthy(rec: Recorder, name: str) -> None:
    """Wait until the latest two heartbeats were in time (the agent answers again)."""

    def two_good() -> bool:
        beats = rec.beats(name)
        return len(beats) >= 2 and all(hb.rtt_s is not None for _, hb in beats[-2:])

    await rec.until(two_good, 5.0, f"{name} healthy")


@asynccontextmanager
async def running_many(rec: Recorder, agents: list[Proc]) -> AsyncIterator[None]:
    """One client per agent, named k0, k1, ..., on one `SystemClock`, closed after the block."""
    clock = SystemClock(asyncio.get_running_loop())
    clients = [
        HeartbeatClient(
            f"k{i}",
            f"127.0.0.1:{a.port}",
            HB,
            NO_MICRO,
            rec.emit,
            rng=random.Random(i),
            clock=clock,
        )
        for i, a in enumerate(agents)
    ]
    tasks = [asyncio.create_task(c.run()) for c in clients]
    try:
        yield
    finally:
        await asyncio.gather(*(c.close() for c in clients))
        await asyncio.gather(*tasks)
        clock.close()
