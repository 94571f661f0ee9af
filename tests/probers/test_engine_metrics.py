"""The Prometheus text parser and the vLLM / SGLang / TGI / DCGM mapping to EngineFacts."""

from __future__ import annotations

import math
from dataclasses import fields

import pytest

from pulsegate.probers.engine_metrics import (
    ALL_NAMES,
    EngineMetricsReader,
    Sample,
    dialect,
    engine_facts,
    gpu_facts,
    parse_engine_metrics,
    parse_prometheus,
)
from pulsegate.sim.gpu import read_gpu
from pulsegate.sim.metrics import EngineReading, render

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 12.0
"""

VLLM_OLD = """\
vllm:num_requests_running{model_name="m"} 1
vllm:num_requests_waiting{model_name="m"} 0
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
vllm:gpu_prefix_cache_hit_rate{model_name="m"} 0.6
"""

SGLANG = """\
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 12
sglang:num_running_reqs{model_name="m"} 30
sglang:token_usage{model_name="m"} 0.82
sglang:cache_hit_rate{model_name="m"} 0.4
"""

TGI = """\
# TYPE tgi_queue_size gauge
tgi_queue_size 5
tgi_batch_current_size 8
tgi_request_count 100
"""

DCGM = """\
DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-a",modelName="NVIDIA H100"} 20000
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-a",modelName="NVIDIA H100"} 60000
DCGM_FI_DEV_FB_RESERVED{gpu="0",UUID="GPU-a",modelName="NVIDIA H100"} 1920
DCGM_FI_DEV_FB_FREE{gpu="1",UUID="GPU-b",modelName="NVIDIA H100"} 40000
DCGM_FI_DEV_FB_USED{gpu="1",UUID="GPU-b",modelName="NVIDIA H100"} 40000
DCGM_FI_DEV_FB_RESERVED{gpu="1",UUID="GPU-b",modelName="NVIDIA H100"} 1920
DCGM_FI_DEV_GPU_TEMP{gpu="0"} 71
DCGM_FI_DEV_GPU_TEMP{gpu="1"} 64
DCGM_FI_DEV_GPU_UTIL{gpu="0"} 90
DCGM_FI_DEV_GPU_UTIL{gpu="1"} 50
"""


def test_vllm_data_parallel_engines_add_up() -> None:
    """vLLM: queues of several engines add up, KV usage averages, lifetime prefix hit rate."""
    f = parse_engine_metrics(VLLM)
    assert (f.queue_waiting, f.running) == (8, 5)
    assert f.kv_cache_usage == pytest.approx(0.6)
    assert f.prefix_cache_hit_rate == pytest.approx(0.25)
    assert f.gpu_free_ratio is None and f.gpu_total_mb is None
    assert f.source == "vllm"


def test_older_vllm_names() -> None:
    """vLLM before v1: gpu_cache_usage_perc and the gpu_prefix_cache_hit_rate gauge."""
    f = parse_engine_metrics(VLLM_OLD)
    assert (f.queue_waiting, f.running, f.kv_cache_usage) == (0, 1, 0.25)
    assert f.prefix_cache_hit_rate == 0.6


def test_sglang() -> None:
    """SGLang: queue, running, token usage as KV usage, cache hit rate."""
    f = parse_engine_metrics(SGLANG)
    assert (f.queue_waiting, f.running) == (12, 30)
    assert (f.kv_cache_usage, f.prefix_cache_hit_rate) == (0.82, 0.4)
    assert f.source == "sglang"


def test_tgi() -> None:
    """TGI: queue size and current batch; it publishes no KV or prefix-cache gauge."""
    f = parse_engine_metrics(TGI)
    assert (f.queue_waiting, f.running) == (5, 8)
    assert f.kv_cache_usage is None and f.prefix_cache_hit_rate is None
    assert f.source == "tgi"


def test_dcgm_gpus_combine() -> None:
    """DCGM: memory summed over GPUs (total = free + used + reserved), temp max, util mean."""
    f = parse_engine_metrics(DCGM)
    total = 20000 + 60000 + 1920 + 40000 + 40000 + 1920
    assert f.gpu_total_mb == total
    assert f.gpu_used_mb == 100000
    assert f.gpu_free_ratio == pytest.approx(60000 / total)
    assert (f.gpu_temp_c, f.gpu_util) == (71, 0.7)
    assert f.queue_waiting is None and f.source == "dcgm"


def test_dcgm_total_when_exported_wins() -> None:
    """DCGM_FI_DEV_FB_TOTAL, when exported, is the total; used derives from it if missing."""
    f = gpu_facts(parse_prometheus("DCGM_FI_DEV_FB_FREE 10\nDCGM_FI_DEV_FB_TOTAL 40\n", ALL_NAMES))
    assert (f.gpu_total_mb, f.gpu_used_mb, f.gpu_free_ratio) == (40, 30, 0.25)


def test_engine_and_gpu_together_and_gpu_left_out() -> None:
    """A page with both names both sources; gpu=False leaves the GPU fields unknown."""
    m = parse_prometheus(VLLM + DCGM, ALL_NAMES)
    both = engine_facts(m)
    assert both.source == "vllm+dcgm" and both.gpu_util == 0.7 and both.running == 5
    engine_only = engine_facts(m, gpu=False)
    assert engine_only.source == "vllm" and engine_only.gpu_util is None
    assert engine_only.running == 5


def test_nothing_known_is_all_none() -> None:
    """A page with no known metric: every fact is None and the source is empty."""
    f = parse_engine_metrics("# just a comment\nprocess_cpu_seconds_total 12.5\n")
    assert all(getattr(f, x.name) is None for x in fields(f) if x.name != "source")
    assert f.source == ""


def test_prefix_hit_rate_over_the_last_interval() -> None:
    """With the previous page, vLLM's hit rate is the interval's; a restart falls back."""
    page = (
        'vllm:prefix_cache_queries_total{{m="a"}} {q}\nvllm:prefix_cache_hits_total{{m="a"}} {h}\n'
    )
    r = EngineMetricsReader()
    assert r.update(page.format(q=1000, h=100)).prefix_cache_hit_rate == pytest.approx(0.1)
    assert r.update(page.format(q=1100, h=190)).prefix_cache_hit_rate == pytest.approx(0.9)
    # no queries since: the lifetime rate, not a made-up 0 or a stale interval
    assert r.update(page.format(q=1100, h=190)).prefix_cache_hit_rate == pytest.approx(190 / 1100)
    # counters went down: the engine restarted
    assert r.update(page.format(q=10, h=5)).prefix_cache_hit_rate == pytest.approx(0.5)
    r.reset()
    assert r.update(page.format(q=20, h=5)).prefix_cache_hit_rate == pytest.approx(0.25)


def test_ratios_are_clamped_and_nan_ignored() -> None:
    """Out-of-range ratios are clamped to 0..1; NaN and infinite samples are ignored."""
    f = parse_engine_metrics(
        "vllm:kv_cache_usage_perc 1.3\nvllm:num_requests_waiting NaN\n"
        "vllm:num_requests_running +Inf\nvllm:num_requests_running 2\n"
    )
    assert f.kv_cache_usage == 1.0
    assert f.queue_waiting is None
    assert f.running == 2


def test_parser_labels_escapes_timestamps_and_junk() -> None:
    """Label values unescape; timestamps and malformed lines are skipped, not fatal."""
    text = (
        'm{a="x\\"y",b="line\\nnext",c="back\\\\slash"} 1.5 1700000000000\n'
        "m_plain 2\n"
        "m_tab\t3\n"
        'broken{a="unterminated} 4\n'
        "no_value\n"
        "bad_value abc\n"
        "   \n"
        "m{} -1e3\n"
    )
    m = parse_prometheus(text)
    assert m["m"] == [
        Sample((("a", 'x"y'), ("b", "line\nnext"), ("c", "back\\slash")), 1.5),
        Sample((), -1000.0),
    ]
    assert m["m_plain"] == [Sample((), 2.0)]
    assert m["m_tab"] == [Sample((), 3.0)]
    assert set(m) == {"m", "m_plain", "m_tab"}


def test_name_filter_skips_names_sharing_a_prefix() -> None:
    """Filtering by name keeps exactly those names, not longer ones that share a prefix."""
    m = parse_prometheus(VLLM, {"vllm:num_requests_waiting", "vllm:prefix_cache_queries_total"})
    assert set(m) == {"vllm:num_requests_waiting", "vllm:prefix_cache_queries_total"}
    assert math.fsum(s.value for s in m["vllm:num_requests_waiting"]) == 8


def test_dialect_detection() -> None:
    """The dialect is read off the metric names."""
    assert dialect(parse_prometheus(VLLM)) == "vllm"
    assert dialect(parse_prometheus(SGLANG)) == "sglang"
    assert dialect(parse_prometheus(TGI)) == "tgi"
    assert dialect(parse_prometheus(DCGM)) == ""


def test_the_sims_page_reads_back() -> None:
    """The simulated engine's /metrics page maps back to the figures it was rendered from."""
    gpu = read_gpu(total_mb=81920, running=16, max_batch=32, kv_tokens=8192, oom=False)
    engine = EngineReading(
        model="demo-7b",
        max_batch=32,
        running=16,
        waiting=3,
        prefix_queries=40,
        prefix_hits=10,
        request_success=100,
        prompt_tokens=5000,
        generation_tokens=9000,
    )
    f = parse_engine_metrics(render(engine, gpu))
    # pulsegate.sim.gpu's worked example: 16 of 32 slots, KV 50 % -> 44032 MiB used
    assert (f.queue_waiting, f.running, f.capacity) == (3, 16, 32)
    assert f.kv_cache_usage == 0.5 and f.prefix_cache_hit_rate == 0.25
    assert (f.gpu_used_mb, f.gpu_total_mb) == (44032, 81920)
    assert f.gpu_free_ratio == pytest.approx(37888 / 81920)
    assert (f.gpu_temp_c, f.gpu_util) == (56.5, 0.5)
    assert f.source == "vllm+dcgm"
