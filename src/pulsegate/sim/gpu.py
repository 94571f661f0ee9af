"""What the simulated GPU looks like from outside: memory, KV-cache use, temperature, load.

Pure functions of the engine's load, so the numbers are easy to check by hand. Worked
example with the defaults (80 GiB card, 7B model, 32 slots): idle -> 14336 MiB used
(weights), 67584 MiB free, 34 C, 0 % util; 16 sequences holding 8192 tokens in total ->
KV 50 %, used 14336 + 0.5 x (0.9 x 81920 - 14336) = 44032 MiB (37888 free), util 50 %,
temp 56.5 C.
"""

from __future__ import annotations

from dataclasses import dataclass

GPU_MODEL_NAME = "NVIDIA H100 80GB HBM3"
# A 7B model in bf16 is ~13.5 GiB of weights plus CUDA context: 14 GiB resident when idle.
WEIGHTS_MB = 14336.0
# Fixed KV capacity in tokens. Real engines size it from free VRAM (~118k tokens on this
# card), but sim prompts are a few dozen words, so 16384 keeps the gauge readable: 32
# sequences of 512 tokens fill it.
KV_CAPACITY_TOKENS = 16384
# At full KV the card sits at vLLM's default gpu_memory_utilization of 90 %.
MEMORY_UTILIZATION = 0.9
IDLE_TEMP_C = 34.0
FULL_LOAD_TEMP_C = 79.0
# The `throttle` fault's reasons -> NVML clocksThrottleReasons bits (what
# DCGM_FI_DEV_CLOCK_THROTTLE_REASONS shows): a hardware thermal or power-brake slowdown also
# sets the hardware-slowdown bit, as on a real card.
THROTTLE = {
    "thermal": 0x40 | 0x8,
    "power": 0x80 | 0x8,
    "hw_slowdown": 0x8,
    "sw_thermal": 0x20,
    "sw_power_cap": 0x4,  # routine under load: the gateway judges it as nothing
}


@dataclass(frozen=True, slots=True)
class GpuReading:
    fb_used_mb: float
    fb_free_mb: float
    temp_c: float
    util_pct: float
    kv_usage: float  # 0..1
    # Fault gauges (the `xid`, `ecc` and `throttle` faults); 0 on a healthy card.
    xid: int = 0
    ecc_dbe: int = 0
    remap_pending: int = 0
    throttle: int = 0


def read_gpu(
    *, total_mb: float, running: int, max_batch: int, kv_tokens: int, oom: bool
) -> GpuReading:
    """The gauges for ``running`` sequences holding ``kv_tokens`` tokens of KV cache."""
    kv_usage = min(1.0, kv_tokens / KV_CAPACITY_TOKENS)
    weights = min(WEIGHTS_MB, 0.5 * total_mb)  # a small --gpu-total-mb still leaves KV room
    kv_budget = max(0.0, MEMORY_UTILIZATION * total_mb - weights)
    used = weights + kv_usage * kv_budget
    util = 100.0 * min(1.0, running / max_batch) if max_batch > 0 else 0.0
    temp = IDLE_TEMP_C + (FULL_LOAD_TEMP_C - IDLE_TEMP_C) * util / 100.0
    if oom:
        used = total_mb  # the allocator has nothing left: what a leak or fragmentation shows
        kv_usage = 1.0  # and no KV block can be had either
    return GpuReading(
        fb_used_mb=round(used),
        fb_free_mb=round(max(0.0, total_mb - used)),
        temp_c=round(temp, 1),
        util_pct=round(util, 1),
        kv_usage=kv_usage,
    )
