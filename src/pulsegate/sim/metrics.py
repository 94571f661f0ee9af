"""The sim's ``/metrics`` page: vLLM's engine metrics and dcgm-exporter's GPU gauges.

Names and label sets copy what the real exporters publish, so the gateway's scraper cannot
tell a sim from a vLLM node with a dcgm-exporter sidecar (except ``pulsegate_sim_max_batch``,
which lets a gateway learn the batch capacity vLLM does not export).
"""

from __future__ import annotations

from dataclasses import dataclass

from pulsegate.sim.gpu import GPU_MODEL_NAME, GpuReading


@dataclass(frozen=True, slots=True)
class EngineReading:
    model: str
    max_batch: int
    running: int
    waiting: int
    prefix_queries: int
    prefix_hits: int
    request_success: int
    prompt_tokens: int
    generation_tokens: int


def _esc(value: str) -> str:
    return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


def render(engine: EngineReading, gpu: GpuReading) -> str:
    """Prometheus text exposition format 0.0.4."""
    m = f'{{model_name="{_esc(engine.model)}"}}'
    g = f'{{gpu="0",modelName="{GPU_MODEL_NAME}"}}'
    # (name, type, help, labels, value)
    rows: list[tuple[str, str, str, str, float]] = [
        ("vllm:num_requests_running", "gauge", "Requests in model execution batches.", m,
         engine.running),
        ("vllm:num_requests_waiting", "gauge", "Requests waiting to be processed.", m,
         engine.waiting),
        ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", m,
         gpu.kv_usage),
        ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries.", m,
         engine.prefix_queries),
        ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits.", m,
         engine.prefix_hits),
        ("vllm:request_success_total", "counter", "Successfully processed requests.", m,
         engine.request_success),
        ("vllm:prompt_tokens_total", "counter", "Prefill tokens processed.", m,
         engine.prompt_tokens),
        ("vllm:generation_tokens_total", "counter", "Generation tokens processed.", m,
         engine.generation_tokens),
        ("pulsegate_sim_max_batch", "gauge", "Batch slots of this simulated engine.", m,
         engine.max_batch),
        ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).", g,
         gpu.fb_free_mb),
        ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", g,
         gpu.fb_used_mb),
        ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", g, gpu.temp_c),
        ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", g, gpu.util_pct),
        ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.", g,
         gpu.xid),
        ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter",
         "Total number of double-bit volatile ECC errors.", g, gpu.ecc_dbe),
        ("DCGM_FI_DEV_ROW_REMAP_PENDING", "gauge", "Whether remapping of rows is pending.", g,
         gpu.remap_pending),
        ("DCGM_FI_DEV_RETIRED_PENDING", "gauge", "Whether pages are pending retirement.", g,
         gpu.remap_pending),
        ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "gauge", "Current clock throttle reasons.", g,
         gpu.throttle),
        ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "counter",
         "Total number of NVLink flow-control CRC errors.", g, 0),
    ]  # fmt: skip
    lines: list[str] = []
    for name, kind, help_, labels, value in rows:
        # prometheus_client names a counter family without "_total" in HELP and TYPE
        family = name.removesuffix("_total") if kind == "counter" else name
        lines += [f"# HELP {family} {help_}", f"# TYPE {family} {kind}", f"{name}{labels} {value}"]
    lines.append("")
    return "\n".join(lines)
