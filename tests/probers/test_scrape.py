"""Engine metrics scrape (R11): the engine's Prometheus page becomes EngineFacts."""

from __future__ import annotations

import logging

import pytest
from probe_kit import SimControl, Stub, running_prober, until

from pulsegate.config import BackendConfig


async def test_sim_metrics_become_engine_facts(sim: SimControl) -> None:
    """The sim's vLLM + DCGM page yields queue, running, KV-cache and GPU memory facts."""
    async with running_prober([sim.backend(metrics_path="/metrics")]) as (_, rec):
        await until(lambda: len(rec.facts()) >= 2, what="two scrapes")
    f = rec.facts()[-1]
    assert f.queue_waiting == 0 and f.running == 0
    assert f.kv_cache_usage is not None and 0 <= f.kv_cache_usage <= 1
    assert f.gpu_free_ratio is not None and 0 < f.gpu_free_ratio <= 1
    assert f.gpu_total_mb == pytest.approx(81920, rel=0.01)


async def test_oom_shows_in_the_facts(sim: SimControl) -> None:
    """Under the oom fault the scraped free-VRAM ratio drops to zero."""
    await sim.fault("oom")
    async with running_prober([sim.backend(metrics_path="/metrics")]) as (_, rec):
        await until(lambda: rec.facts(), what="a scrape")
    assert rec.facts()[-1].gpu_free_ratio == 0


async def test_failed_scrapes_emit_nothing_and_log_once(
    stub: Stub, caplog: pytest.LogCaptureFixture
) -> None:
    """A 404 metrics page: no facts, one warning for many failures, one line on recovery."""
    caplog.set_level(logging.INFO, logger="pulsegate.probers")
    b = BackendConfig(name="stub", url=stub.url, models=("stub-1",), metrics_path="/metrics")
    async with running_prober([b]) as (_, rec):
        await until(lambda: stub.count("/metrics") >= 5, what="5 failed scrapes")
        assert rec.facts() == []
        stub.metrics = "garbage 1\n"  # a page with nothing we know is no facts either
        n = stub.count("/metrics")
        await until(lambda: stub.count("/metrics") >= n + 3, what="3 unknown pages")
        assert rec.facts() == []
        stub.metrics = "vllm:num_requests_waiting 3\nvllm:num_requests_running 5\n"
        await until(lambda: rec.facts(), what="facts once the page is good")
    assert rec.facts()[0].queue_waiting == 3
    lines = [r.getMessage() for r in caplog.records if "metrics scrape" in r.getMessage()]
    assert lines == ["metrics scrape of stub: HTTP 404", "metrics scrape of stub ok again"]
