"""The scheduler: cadence by state, pokes, one probe of a kind in flight, clean shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest
from probe_kit import SimControl, Stub, fast_probes, running_prober, until

from pulsegate.config import BackendConfig, CanaryConfig, MicroInferenceConfig, ReadinessConfig
from pulsegate.health.observations import Observation, ProbeKind

R, M, C = ProbeKind.READINESS, ProbeKind.MICRO, ProbeKind.CANARY

SLOW = fast_probes(
    readiness=ReadinessConfig(interval=10, interval_unstable=0.05, timeout=0.5),
    micro_inference=MicroInferenceConfig(interval=10, jitter=0, timeout=0.3),
    canary=CanaryConfig(interval=10, payload_bytes=6144, timeout=0.3),
)


async def test_unstable_backend_is_probed_faster(stub: Stub) -> None:
    """A 10 s stable readiness cadence becomes ~50 ms once unstable(), and slow again after."""
    unstable = False
    b = BackendConfig(name="stub", url=stub.url, models=("stub-1",))
    async with running_prober([b], SLOW, unstable=lambda name: unstable) as (_, rec):
        await rec.wait_for(R, lambda r: True)
        await asyncio.sleep(0.3)  # a bounded window: stable means no second round in it
        assert len(rec.probes(R)) == 1
        unstable = True
        t = time.monotonic()
        await until(lambda: len(rec.probes(R, since=t)) >= 5, within=1.0, what="5 fast rounds")
        unstable = False
        t = time.monotonic()
        await asyncio.sleep(0.4)  # a round already decided may still run; then no more
        assert len(rec.probes(R, since=t)) <= 1


async def test_micro_and_canary_speed_up_threefold(stub: Stub) -> None:
    """Micro-inference and canary rounds come about 3x as often while unstable."""
    probes = fast_probes(
        micro_inference=MicroInferenceConfig(interval=0.3, jitter=0, timeout=0.2),
        canary=CanaryConfig(interval=0.3, payload_bytes=4096, timeout=0.2),
    )
    unstable = True
    b = BackendConfig(name="stub", url=stub.url, models=("stub-1",))
    async with running_prober([b], probes, unstable=lambda name: unstable) as (_, rec):
        await rec.wait_for(C, lambda r: True)
        t = time.monotonic()
        await asyncio.sleep(0.9)  # bounded window: ~9 rounds at 100 ms, 3 at 300 ms
        fast = len(rec.probes(M, since=t)), len(rec.probes(C, since=t))
        unstable = False
        flip = time.monotonic()  # the next round of each was scheduled fast; later ones slow
        await rec.wait_for(M, lambda r: True, since=flip)
        await rec.wait_for(C, lambda r: True, since=flip)
        t = time.monotonic()
        await asyncio.sleep(0.9)
        slow = len(rec.probes(M, since=t)), len(rec.probes(C, since=t))
    assert all(6 <= n <= 11 for n in fast), fast
    assert all(2 <= n <= 4 for n in slow), slow


async def test_poke_wakes_every_probe_of_that_backend(stub: Stub) -> None:
    """poke(name) brings a readiness, micro and canary round now despite 10 s intervals."""
    b = BackendConfig(name="stub", url=stub.url, models=("stub-1",))
    async with running_prober([b], SLOW) as (prober, rec):
        for kind in (R, M, C):
            await rec.wait_for(kind, lambda r: True)
        t = time.monotonic()
        prober.poke("stub")
        prober.poke("nobody")  # unknown names are ignored
        for kind in (R, M, C):
            await rec.wait_for(kind, lambda r: True, since=t, within=1.0)
        assert time.monotonic() - t < 0.5


async def test_poke_storm_never_doubles_a_probe_in_flight(stub: Stub) -> None:
    """Poking 200 times at an engine taking 200 ms per answer keeps one request per kind in
    flight (answers come within the timeouts, so the engine's own count is exact)."""
    stub.infer_delay = 0.2
    b = BackendConfig(name="stub", url=stub.url, models=("stub-1",))
    async with running_prober([b], fast_probes()) as (prober, rec):
        await rec.wait_for(R, lambda r: True)
        for _ in range(200):
            prober.poke("stub")
            await asyncio.sleep(0.005)
        n_micro = stub.count("/v1/completions", "micro")
    assert set(stub.max_inflight.values()) == {1}, stub.max_inflight
    assert ("/v1/completions", "canary") in stub.max_inflight
    # ~1.2 s of pokes with 200 ms answers: one micro-inference after another, no more
    assert n_micro <= 1.5 / 0.2 + 1


async def test_close_leaves_no_tasks(sim: SimControl) -> None:
    """close() cancels and awaits every probe loop, even with a probe hung in flight."""
    await sim.fault("cuda_hang")
    async with running_prober([sim.backend(metrics_path="/metrics")]) as (prober, rec):
        await rec.wait_for(R, lambda r: True)
        tasks = set(prober._tasks)
        assert len(tasks) == 5  # readiness, micro, canary, metrics, connect
    assert all(t.done() for t in tasks)
    assert prober._pool is not None and prober._pool.closed
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("probe ")]


async def test_micro_skipped_while_agent_carries_it(stub: Stub) -> None:
    """micro_via_agent(name) True: no HTTP micro-inference; readiness and canary still run."""
    via_agent = True
    b = BackendConfig(name="stub", url=stub.url, models=("stub-1",), agent="127.0.0.1:1")
    async with running_prober([b], micro_via_agent=lambda name: via_agent) as (_, rec):
        for _ in range(3):
            await rec.wait_for(C, lambda r: True, since=time.monotonic())
        assert rec.probes(M) == []
        via_agent = False  # the agent stream is gone: HTTP micro-inference resumes
        await rec.wait_for(M, lambda r: r.ok)


async def test_inference_probes_wait_while_engine_warms(sim: SimControl) -> None:
    """While the engine says it is warming, no micro/canary is sent; both run once ready."""
    await sim.fault("warming", seconds=30)
    async with running_prober([sim.backend()]) as (_, rec):
        for _ in range(3):
            await rec.wait_for(R, lambda r: r.ready is False, since=time.monotonic())
        assert rec.probes(M) == [] and rec.probes(C) == []
        await sim.fault("none")
        await rec.wait_for(M, lambda r: r.ok)
        await rec.wait_for(C, lambda r: r.ok)


async def test_a_crashing_callback_does_not_stop_probing(
    stub: Stub, caplog: pytest.LogCaptureFixture
) -> None:
    """emit() and unstable() raising are logged once each; the loops keep probing."""
    seen: list[Observation] = []

    def emit(name: str, obs: Observation) -> None:
        seen.append(obs)
        raise RuntimeError("gateway bug")

    def unstable(name: str) -> bool:
        raise RuntimeError("core bug")

    b = BackendConfig(name="stub", url=stub.url, models=("stub-1",))
    async with running_prober([b], emit=emit, unstable=unstable):
        await until(lambda: len(seen) >= 10, what="10 observations despite errors")
    failures = [r.getMessage() for r in caplog.records if "prober callback" in r.getMessage()]
    assert failures == [
        "prober callback emit(stub) failed",
        "prober callback unstable(stub) failed",
    ]
