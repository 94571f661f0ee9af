"""Scheduler, prefix cache, GPU maths and the metrics page (no sockets)."""

from __future__ import annotations

import asyncio

import pytest

from pulsegate.sim.engine import ARRIVALS_KEPT, Engine, PrefixCache, Seq
from pulsegate.sim.gpu import read_gpu
from pulsegate.sim.metrics import EngineReading, render


async def test_slots_are_fifo() -> None:
    """With 2 slots, later requests wait and get slots strictly in arrival order."""
    eng = Engine(name="t", max_batch=2)
    a, b, c, d = (Seq(prompt_tokens=1) for _ in range(4))
    assert eng.try_admit(a) and eng.try_admit(b)
    order: list[Seq] = []

    async def wait(s: Seq) -> None:
        await eng.admit(s)
        order.append(s)

    tc, td = asyncio.create_task(wait(c)), asyncio.create_task(wait(d))
    await asyncio.sleep(0)
    assert (eng.running, eng.waiting) == (2, 2)
    assert not eng.try_admit(Seq(prompt_tokens=1))  # no overtaking the queue
    eng.release(a, ok=True)
    await asyncio.sleep(0)
    assert order == [c]
    eng.release(b)
    await asyncio.gather(tc, td)
    assert order == [c, d]
    assert (eng.running, eng.waiting, eng.request_success_total) == (2, 0, 1)


async def test_cancelled_waiter_leaves_the_queue() -> None:
    """A waiter cancelled (client gone) leaves no trace and the next one gets the slot."""
    eng = Engine(name="t", max_batch=1)
    first, gone, nxt = Seq(1), Seq(1), Seq(1)
    eng.try_admit(first)
    t_gone = asyncio.create_task(eng.admit(gone))
    t_next = asyncio.create_task(eng.admit(nxt))
    await asyncio.sleep(0)
    t_gone.cancel()
    eng.release(first)  # released before the cancelled waiter has run its cleanup
    await asyncio.wait_for(t_next, 1)
    with pytest.raises(asyncio.CancelledError):
        await t_gone
    assert (eng.running, eng.waiting) == (1, 0)


def test_kv_tokens_and_generation_counter() -> None:
    """KV holds prompt+generated of running sequences; finished tokens stay counted."""
    eng = Engine(name="t", max_batch=4)
    s = Seq(prompt_tokens=10)
    eng.try_admit(s)
    s.generated = 5
    assert (eng.kv_tokens, eng.generation_tokens_total) == (15, 5)
    eng.release(s, ok=True)
    assert (eng.kv_tokens, eng.generation_tokens_total, eng.prompt_tokens_total) == (0, 5, 10)


def test_arrivals_split_probe_and_client() -> None:
    """Probe arrivals count apart and do not move the last-client timestamp or ring."""
    eng = Engine(name="t", max_batch=1)
    eng.arrive("/v1/completions", probe=False, wall=10.0)
    eng.arrive("/v1/completions", probe=True, wall=11.0)
    st = eng.stats()
    assert (st["requests_total"], st["client_requests_total"], st["probe_requests_total"]) == (
        2,
        1,
        1,
    )
    assert st["last_client_request_wall"] == 10.0 and st["inflight"] == 2
    assert eng.recent_arrivals() == [{"t": 10.0, "path": "/v1/completions"}]
    assert eng.recent_arrivals(since=10.0) == []
    for i in range(ARRIVALS_KEPT + 5):
        eng.arrive("/x", probe=False, wall=float(i))
    assert len(eng.recent_arrivals()) == ARRIVALS_KEPT


def test_prefix_cache_lru() -> None:
    """Hits need the same first 256 chars; least recently used entries are evicted."""
    pc = PrefixCache(capacity=2, prefix_chars=4)
    assert not pc.lookup("aaaa-1")
    assert pc.lookup("aaaa-2")  # same 4-char prefix
    assert not pc.lookup("bbbb")
    assert not pc.lookup("cccc")  # evicts aaaa (bbbb was used more recently)
    assert not pc.lookup("aaaa")
    assert (pc.queries, pc.hits) == (5, 1)


def test_gpu_worked_example() -> None:
    """The docstring's example: 8192 KV tokens on 80 GiB -> 44032 MiB used, 56.5 C."""
    idle = read_gpu(total_mb=81920, running=0, max_batch=32, kv_tokens=0, oom=False)
    assert (idle.fb_used_mb, idle.fb_free_mb, idle.temp_c, idle.util_pct) == (14336, 67584, 34, 0)
    half = read_gpu(total_mb=81920, running=16, max_batch=32, kv_tokens=8192, oom=False)
    assert (half.fb_used_mb, half.fb_free_mb, half.kv_usage) == (44032, 37888, 0.5)
    assert (half.temp_c, half.util_pct) == (56.5, 50.0)
    oom = read_gpu(total_mb=81920, running=0, max_batch=32, kv_tokens=0, oom=True)
    assert oom.fb_free_mb == 0


def test_metrics_page_names() -> None:
    """The page carries vLLM and DCGM names with their labels."""
    reading = EngineReading("m", 8, 2, 3, 10, 4, 7, 20, 30)
    gpu = read_gpu(total_mb=81920, running=2, max_batch=8, kv_tokens=100, oom=False)
    text = render(reading, gpu)
    assert 'vllm:num_requests_waiting{model_name="m"} 3\n' in text
    assert 'vllm:prefix_cache_hits_total{model_name="m"} 4\n' in text
    assert "# TYPE vllm:request_success counter\n" in text
    assert 'pulsegate_sim_max_batch{model_name="m"} 8\n' in text
    assert 'DCGM_FI_DEV_GPU_UTIL{gpu="0",modelName="NVIDIA H100 80GB HBM3"} 25.0\n' in text
