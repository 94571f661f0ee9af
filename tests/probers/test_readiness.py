"""Readiness: the engine's own /health and /v1/models, never a bare TCP check (R27)."""

from __future__ import annotations

import socket
import time

from probe_kit import SimControl, Stub, running_prober, until

from pulsegate.config import BackendConfig
from pulsegate.health.observations import ProbeKind

R = ProbeKind.READINESS


async def test_ready_when_healthy_and_model_listed(sim: SimControl) -> None:
    """A healthy sim listing its model reads ok and ready, with a latency."""
    async with running_prober([sim.backend()]) as (_, rec):
        r = await rec.wait_for(R, lambda r: True)
    assert (r.ok, r.ready, r.reason) == (True, True, "")
    assert r.latency_s is not None and 0 < r.latency_s < 0.5


async def test_warming_is_answered_but_not_ready(sim: SimControl) -> None:
    """While warming (/health 503) readiness is ok=True, ready=False, and says why."""
    await sim.fault("warming", seconds=30)
    async with running_prober([sim.backend()]) as (_, rec):
        r = await rec.wait_for(R, lambda r: True)
        assert (r.ok, r.ready) == (True, False)
        assert "503" in r.reason
        t = time.monotonic()
        await sim.fault("none")
        await rec.wait_for(R, lambda r: bool(r.ready), since=t)


async def test_refused_is_a_failed_probe() -> None:
    """Nothing listening: ok=False, ready=False, reason 'connection refused'."""
    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    b = BackendConfig(name="gone", url=f"http://127.0.0.1:{port}", models=("m",))
    async with running_prober([b]) as (_, rec):
        r = await rec.wait_for(R, lambda r: True)
    assert (r.ok, r.ready, r.reason, r.refused) == (False, False, "connection refused", True)
    assert r.latency_s is None


async def test_configured_model_missing_is_not_ready(sim: SimControl) -> None:
    """An engine up but not listing the configured model is not ready, and names it."""
    async with running_prober([sim.backend(models=("demo-7b", "other-13b"))]) as (_, rec):
        r = await rec.wait_for(R, lambda r: True)
    assert (r.ok, r.ready) == (True, False)
    assert r.reason == "model(s) not listed: other-13b"


async def test_models_discovered_and_updated(stub: Stub) -> None:
    """Without configured models, /v1/models is the list: set_models on discovery and change."""
    b = BackendConfig(name="stub", url=stub.url)
    async with running_prober([b]) as (_, rec):
        await until(lambda: rec.models, what="first discovery")
        assert rec.models == [("stub", ("stub-1",))]
        stub.models = ["stub-1", "stub-2"]
        await until(lambda: len(rec.models) == 2, what="changed list")
        assert rec.models[1] == ("stub", ("stub-1", "stub-2"))
        n = stub.count("/v1/models")
        await until(lambda: stub.count("/v1/models") >= n + 3, what="more readiness rounds")
        assert len(rec.models) == 2  # an unchanged list is not reported again
        stub.models = []  # an engine listing nothing is not ready; the last list is kept
        t = time.monotonic()
        r = await rec.wait_for(R, lambda r: r.ready is False, since=t)
        assert (r.ok, r.reason) == (True, "no models listed")
        assert len(rec.models) == 2
