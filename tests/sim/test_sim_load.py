"""Timing under load: the batch-slot queue, the prefix cache, load-following gauges."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from conftest import SimProc

M = '{model_name="demo-7b"}'
G = '{gpu="0",modelName="NVIDIA H100 80GB HBM3"}'


def _parse(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


async def test_requests_beyond_max_batch_queue(sim_factory: Callable[..., SimProc]) -> None:
    """With 2 slots and 6 requests, 4 wait (seen in /metrics) and finish in FIFO waves."""
    sim = sim_factory("--max-batch", "2", "--ttft-ms", "0", "--itl-ms", "20", name="queue")
    body = {"prompt": "load test " * 50, "max_tokens": 10, "stream": True}
    seen: list[dict[str, float]] = []

    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as c:

        async def one() -> float:
            t0 = time.monotonic()
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")
            return time.monotonic() - t0

        tasks = [asyncio.create_task(one()) for _ in range(6)]
        while not all(t.done() for t in tasks):
            seen.append(_parse((await c.get("/metrics")).text))
            await asyncio.sleep(0.02)
        latencies = sorted(await asyncio.gather(*tasks))
        idle = _parse((await c.get("/metrics")).text)

    assert max(m[f"vllm:num_requests_waiting{M}"] for m in seen) > 0
    assert max(m[f"vllm:num_requests_running{M}"] for m in seen) == 2
    busy = [m for m in seen if m[f"vllm:num_requests_running{M}"] == 2]
    assert busy and all(m[f"vllm:kv_cache_usage_perc{M}"] > 0 for m in busy)
    assert all(m[f"DCGM_FI_DEV_FB_USED{G}"] > 14336 for m in busy)  # over the weights
    assert all(m[f"DCGM_FI_DEV_GPU_UTIL{G}"] == 100 for m in busy)
    # three waves of 10 tokens at 20 ms: the last request waited for two full waves. A floor
    # (the sim's own sleeps), not a ratio: load on the box only makes every latency longer.
    assert latencies[-1] >= 3 * 9 * 0.020
    assert idle[f"vllm:num_requests_waiting{M}"] == idle[f"vllm:num_requests_running{M}"] == 0
    assert idle[f"DCGM_FI_DEV_FB_USED{G}"] == 14336


def test_prefix_cache_hit_lowers_ttft(sim_factory: Callable[..., SimProc]) -> None:
    """A repeated prompt prefix hits the cache: TTFT x0.3, hit counted in /metrics."""
    sim = sim_factory("--ttft-ms", "300", "--itl-ms", "0", name="prefix")
    body = {"prompt": "shared system prompt " * 20, "max_tokens": 1}

    def ttft() -> float:
        t0 = time.monotonic()
        assert httpx.post(f"{sim.url}/v1/completions", json=body, timeout=5).status_code == 200
        return time.monotonic() - t0

    before = sim.metrics()
    miss = ttft()
    # 300 ms vs ~90 ms. Load on the box only lengthens a latency: the best of three hits
    # is the sim's own sleep plus the least noise.
    hit = min(ttft() for _ in range(3))
    after = sim.metrics()
    assert miss >= 0.29 and hit < 0.6 * miss
    assert (
        after[f"vllm:prefix_cache_queries_total{M}"] - before[f"vllm:prefix_cache_queries_total{M}"]
        == 4
    )
    assert (
        after[f"vllm:prefix_cache_hits_total{M}"] - before[f"vllm:prefix_cache_hits_total{M}"] == 3
    )
