"""Fixtures for the prober tests: one real simulated engine per module, a stub per test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from probe_kit import SimControl, Stub

from support import Sim


@pytest.fixture(scope="module")
def sim_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    """One real `pulsegate sim` process for the whole module, stopped by PID."""
    sim = Sim(Path(tmp_path_factory.mktemp("sim")), "sim-a")
    yield sim
    sim.stop()


@pytest.fixture
async def sim(sim_proc: Sim) -> AsyncIterator[SimControl]:
    """The module's sim with no fault in force, driven over aiohttp from the test's loop."""
    async with aiohttp.ClientSession() as s:
        ctl = SimControl(sim_proc.url, s)
        await ctl.fault("none")
        yield ctl
        await ctl.fault("none")


@pytest.fixture
async def stub() -> AsyncIterator[Stub]:
    """A scriptable engine stub on a loopback port, stopped after the test."""
    engine = Stub()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", engine.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    engine.url = f"http://127.0.0.1:{port}"
    yield engine
    await runner.cleanup()
