"""The synthetic canary (R19, R20): a realistic 4-8 KB prompt under a hard timeout."""

from __future__ import annotations

import time

import orjson
from probe_kit import SimControl, Stub, fast_probes, running_prober

from pulsegate.config import BackendConfig, CanaryConfig
from pulsegate.health.observations import ProbeKind

C, M, R = ProbeKind.CANARY, ProbeKind.MICRO, ProbeKind.READINESS


async def test_canary_body_is_a_flagged_realistic_prompt(stub: Stub) -> None:
    """The canary sends >= payload_bytes of prompt text, 1 token, flagged synthetic."""
    probes = fast_probes(canary=CanaryConfig(interval=0.15, payload_bytes=5000, timeout=0.25))
    b = BackendConfig(name="stub", url=stub.url, models=("stub-1",))
    async with running_prober([b], probes) as (_, rec):
        r = await rec.wait_for(C, lambda r: True)
    assert (r.ok, r.reason) == (True, "")
    hits = [h for h in stub.hits if h.headers.get("x-pulsegate-probe") == "canary"]
    body = hits[0].body
    assert 5000 <= len(body) < 5000 + 400
    assert all(h.body == body for h in hits)  # generated once, not per probe
    req = orjson.loads(body)
    assert (req["max_tokens"], req["user"], req["model"]) == (1, "pulsegate-canary", "stub-1")
    words = req["prompt"].split()
    assert len(words) > 600 and sum(w.isalpha() for w in words) / len(words) > 0.7


async def test_blackhole_fails_canary_while_readiness_and_micro_stay_green(
    sim: SimControl,
) -> None:
    """Bodies over 1 KB vanish: the canary times out; /health and micro-inference stay ok;
    after the fault is lifted the next canary passes (no poisoned pooled connection)."""
    probes = fast_probes(canary=CanaryConfig(interval=0.15, payload_bytes=6144, timeout=0.25))
    async with running_prober([sim.backend()], probes) as (_, rec):
        await rec.wait_for(C, lambda r: r.ok)
        t = time.monotonic()
        await sim.fault("blackhole", over_bytes=1024)
        failed = await rec.wait_for(C, lambda r: not r.ok, since=t)
        detected = time.monotonic() - t
        assert failed.reason == "timeout after 250ms"
        t2 = time.monotonic()
        await rec.wait_for(C, lambda r: not r.ok, since=t2)  # the 2nd consecutive failure
        isolated = time.monotonic() - t
        assert all(r.ok and r.ready for r in rec.probes(R, since=t))
        assert all(r.ok for r in rec.probes(M, since=t))
        assert rec.probes(R, since=t) and rec.probes(M, since=t)
        t3 = time.monotonic()
        await sim.fault("none")
        await rec.wait_for(C, lambda r: r.ok, since=t3)
    # one interval (0.15 s, jittered) + the 0.25 s timeout, then one more of each
    assert detected < 0.15 * 1.1 + 0.25 + 0.15, detected
    assert isolated < 2 * (0.15 * 1.1 + 0.25) + 0.15, isolated
    print(f"blackhole: first canary failure {detected * 1000:.0f} ms, 2nd {isolated * 1000:.0f} ms")


async def test_canary_never_waits_behind_a_hung_micro_inference(stub: Stub) -> None:
    """Micro-inference hanging 1 s at a time does not delay the 250 ms canary: own slots."""
    stub.delay_probe = {"micro": 1.0, "readiness": 0.2}
    b = BackendConfig(name="stub", url=stub.url, models=("stub-1",), metrics_path="/metrics")
    stub.metrics = "vllm:num_requests_waiting 0\n"
    async with running_prober([b]) as (_, rec):
        await rec.wait_for(M, lambda r: not r.ok)
        t = time.monotonic()
        for _ in range(4):
            await rec.wait_for(C, lambda r: True, since=time.monotonic())
    assert all(r.ok for r in rec.probes(C, since=t))
