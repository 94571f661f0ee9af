"""Micro-inference (R4): one token through the real engine proves the compute pipeline."""

from __future__ import annotations

import time

import pytest
from probe_kit import SimControl, Stub, fast_probes, running_prober, until

from pulsegate.config import BackendConfig
from pulsegate.health.observations import ProbeKind

M, R = ProbeKind.MICRO, ProbeKind.READINESS


async def test_micro_ok_and_never_client_traffic(sim: SimControl) -> None:
    """A healthy engine answers the micro-inference; the sim counts it as a probe only."""
    before = await sim.stats()
    async with running_prober([sim.backend()]) as (_, rec):
        r = await rec.wait_for(M, lambda r: True)
        await rec.wait_for(M, lambda r: True, since=time.monotonic())
    assert (r.ok, r.reason, r.ready) == (True, "", None)
    assert r.latency_s is not None and r.latency_s < 0.3
    after = await sim.stats()
    assert after["client_requests_total"] == before["client_requests_total"]
    assert after["probe_requests_total"] >= before["probe_requests_total"] + 2


async def test_micro_reports_the_engine_error(sim: SimControl) -> None:
    """An OOM engine's 500 becomes 'HTTP 500: CUDA out of memory...' (message capped)."""
    await sim.fault("oom")
    async with running_prober([sim.backend()]) as (_, rec):
        r = await rec.wait_for(M, lambda r: True)
    assert not r.ok
    assert r.reason.startswith("HTTP 500: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert len(r.reason) <= len("HTTP 500: ") + 120
    assert r.latency_s is not None  # the engine did answer


async def test_cuda_hang_times_out_while_health_stays_green(sim: SimControl) -> None:
    """cuda_hang: /health 200 and ready, yet the micro-inference fails 'timeout after 300ms'."""
    await sim.fault("cuda_hang")
    async with running_prober([sim.backend()]) as (_, rec):
        r = await rec.wait_for(M, lambda r: True)
        ready = await rec.wait_for(R, lambda r: True)
    assert (r.ok, r.reason, r.latency_s) == (False, "timeout after 300ms", None)
    assert (ready.ok, ready.ready) == (True, True)


async def test_chat_fallback_is_remembered(stub: Stub) -> None:
    """A chat-only engine: completions 404 once, then every probe goes to chat directly."""
    stub.completions = False
    b = BackendConfig(name="stub", url=stub.url, models=("stub-1",))
    async with running_prober([b]) as (_, rec):
        first = await rec.wait_for(M, lambda r: True)
        for _ in range(3):
            await rec.wait_for(M, lambda r: r.ok, since=time.monotonic())
    assert first.ok
    assert stub.count("/v1/completions", "micro") + stub.count("/v1/completions", "canary") <= 2
    assert stub.count("/v1/chat/completions", "micro") >= 4
    chat = next(h for h in stub.hits if h.path == "/v1/chat/completions")
    assert b'"messages"' in chat.body


async def test_busy_engine_is_no_evidence(stub: Stub) -> None:
    """429 (busy, not broken) emits no micro/canary result at all, then results resume."""
    stub.infer_status = 429
    b = BackendConfig(name="stub", url=stub.url, models=("stub-1",))
    async with running_prober([b]) as (_, rec):
        await until(lambda: stub.count("/v1/completions", "micro") >= 3, what="3 busy probes")
        assert rec.probes(M) == [] and rec.probes(ProbeKind.CANARY) == []
        stub.infer_status = 200
        await rec.wait_for(M, lambda r: r.ok)


async def test_probe_requests_carry_header_and_key(
    stub: Stub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every probe request says which probe it is and carries the configured API key."""
    monkeypatch.setenv("STUB_KEY", "sk-test-123")
    b = BackendConfig(name="stub", url=stub.url, models=("stub-1",), api_key_env="STUB_KEY")
    async with running_prober([b], fast_probes()) as (_, rec):
        await rec.wait_for(M, lambda r: r.ok)
        await rec.wait_for(ProbeKind.CANARY, lambda r: r.ok)
    kinds = {h.headers.get("x-pulsegate-probe") for h in stub.hits}
    assert kinds == {"readiness", "micro", "canary"}
    assert {h.headers.get("Authorization") for h in stub.hits} == {"Bearer sk-test-123"}
    micro = next(h for h in stub.hits if h.headers["x-pulsegate-probe"] == "micro")
    assert micro.body == b'{"model":"stub-1","max_tokens":1,"temperature":0,"prompt":"ping"}'
