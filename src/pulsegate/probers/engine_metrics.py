"""Engine and GPU gauges from Prometheus text: a pure parser and the name mapping to
`EngineFacts`, shared by the node agent and the gateway's metrics scrape.

No I/O, no clock. Three layers:

- `parse_prometheus(text, names)` -> `{name: [Sample]}`: the text exposition format (0.0.4
  and OpenMetrics' sample lines), comments skipped, label values unescaped, malformed lines
  ignored. With `names`, only those metrics are parsed: a vLLM page is 100-300 KB of
  histogram buckets and the agent reads it every ~150 ms, so skipping early matters.
- `engine_facts(metrics, previous)` -> `EngineFacts`: the engine dialect (vLLM, SGLang, TGI)
  and dcgm-exporter's GPU gauges mapped to one shape. A metric that is absent stays None;
  nothing is invented. Several series of one metric (data-parallel engines, several GPUs)
  are combined: queues and memory add up, usage ratios average, temperature takes the max.
- `parse_engine_metrics(text)`: both in one call (stateless); `EngineMetricsReader`: the same
  for a poller that keeps the previous scrape, so vLLM's prefix-cache hit rate is the rate
  over the last interval rather than since the engine started.

Names, per dialect (values as published: counts, and ratios in 0..1):

- vLLM: queue_waiting ``vllm:num_requests_waiting``, running ``vllm:num_requests_running``,
  kv_cache_usage ``vllm:kv_cache_usage_perc`` (older: ``vllm:gpu_cache_usage_perc``),
  prefix_cache_hit_rate ``vllm:prefix_cache_hits_total`` / ``vllm:prefix_cache_queries_total``
  (older: the gauge ``vllm:gpu_prefix_cache_hit_rate``).
- SGLang: ``sglang:num_queue_reqs``, ``sglang:num_running_reqs``, ``sglang:token_usage``,
  ``sglang:cache_hit_rate``.
- TGI: ``tgi_queue_size``, ``tgi_batch_current_size`` (no KV or prefix-cache gauge).

GPU (dcgm-exporter, MiB, C, %): DCGM_FI_DEV_FB_FREE, DCGM_FI_DEV_FB_USED,
DCGM_FI_DEV_FB_RESERVED, DCGM_FI_DEV_FB_TOTAL, DCGM_FI_DEV_GPU_TEMP, DCGM_FI_DEV_GPU_UTIL.
Total memory is FB_TOTAL when exported, else free + used + reserved. The simulated engine
also exports `pulsegate_sim_max_batch` (batch capacity, which vLLM does not publish).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

from pulsegate.health.observations import EngineFacts


@dataclass(frozen=True, slots=True)
class Sample:
    """One series' value; `labels` as sorted (name, value) pairs."""

    labels: tuple[tuple[str, str], ...]
    value: float


Metrics = Mapping[str, list[Sample]]

# vLLM
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_KV = "vllm:kv_cache_usage_perc"
VLLM_KV_OLD = "vllm:gpu_cache_usage_perc"
VLLM_PREFIX_HITS = "vllm:prefix_cache_hits_total"
VLLM_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
VLLM_PREFIX_RATE_OLD = "vllm:gpu_prefix_cache_hit_rate"
# SGLang
SGLANG_WAITING = "sglang:num_queue_reqs"
SGLANG_RUNNING = "sglang:num_running_reqs"
SGLANG_KV = "sglang:token_usage"
SGLANG_PREFIX = "sglang:cache_hit_rate"
# TGI
TGI_WAITING = "tgi_queue_size"
TGI_RUNNING = "tgi_batch_current_size"
# dcgm-exporter
DCGM_FREE = "DCGM_FI_DEV_FB_FREE"
DCGM_USED = "DCGM_FI_DEV_FB_USED"
DCGM_RESERVED = "DCGM_FI_DEV_FB_RESERVED"
DCGM_TOTAL = "DCGM_FI_DEV_FB_TOTAL"
DCGM_TEMP = "DCGM_FI_DEV_GPU_TEMP"
DCGM_UTIL = "DCGM_FI_DEV_GPU_UTIL"
# pulsegate's simulated engine
SIM_MAX_BATCH = "pulsegate_sim_max_batch"

ENGINE_NAMES = frozenset(
    {
        VLLM_WAITING,
        VLLM_RUNNING,
        VLLM_KV,
        VLLM_KV_OLD,
        VLLM_PREFIX_HITS,
        VLLM_PREFIX_QUERIES,
        VLLM_PREFIX_RATE_OLD,
        SGLANG_WAITING,
        SGLANG_RUNNING,
        SGLANG_KV,
        SGLANG_PREFIX,
        TGI_WAITING,
        TGI_RUNNING,
        SIM_MAX_BATCH,
    }
)
GPU_NAMES = frozenset({DCGM_FREE, DCGM_USED, DCGM_RESERVED, DCGM_TOTAL, DCGM_TEMP, DCGM_UTIL})
ALL_NAMES = ENGINE_NAMES | GPU_NAMES

_GPU_FIELDS = ("gpu_free_ratio", "gpu_used_mb", "gpu_total_mb", "gpu_temp_c", "gpu_util")


# ---------------------------------------------------------------------------------------------
# Text exposition format


def parse_prometheus(text: str, names: Collection[str] | None = None) -> dict[str, list[Sample]]:
    """Samples by metric name. Only `names` when given; comments and bad lines skipped."""
    out: dict[str, list[Sample]] = {}
    prefixes = tuple(names) if names is not None else None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        if prefixes is not None and not line.startswith(prefixes):
            continue
        parsed = _parse_line(line)
        if parsed is None:
            continue
        name, sample = parsed
        if names is not None and name not in names:
            continue  # a longer name sharing a wanted prefix (e.g. ..._created)
        out.setdefault(name, []).append(sample)
    return out


def _parse_line(line: str) -> tuple[str, Sample] | None:
    brace = line.find("{")
    space = _first_space(line)
    if brace != -1 and (space == -1 or brace < space):
        name = line[:brace]
        parsed = _parse_labels(line, brace + 1)
        if parsed is None:
            return None
        labels, end = parsed
        rest = line[end:]
    else:
        if space == -1:
            return None
        name, rest = line[:space], line[space:]
        labels = ()
    fields = rest.split()
    if not name or not fields:
        return None
    value = _parse_value(fields[0])
    if value is None:
        return None
    return name, Sample(labels, value)


def _first_space(line: str) -> int:
    i = line.find(" ")
    j = line.find("\t")
    if i == -1:
        return j
    if j == -1:
        return i
    return min(i, j)


def _parse_labels(line: str, i: int) -> tuple[tuple[tuple[str, str], ...], int] | None:
    """Labels from just after ``{``; returns them sorted and the index after ``}``."""
    labels: list[tuple[str, str]] = []
    n = len(line)
    while True:
        while i < n and line[i] in " \t,":
            i += 1
        if i >= n:
            return None
        if line[i] == "}":
            return tuple(sorted(labels)), i + 1
        eq = line.find("=", i)
        if eq == -1:
            return None
        key = line[i:eq].strip()
        i = eq + 1
        while i < n and line[i] in " \t":
            i += 1
        if i >= n or line[i] != '"':
            return None
        i += 1
        chars: list[str] = []
        while i < n and line[i] != '"':
            c = line[i]
            if c == "\\" and i + 1 < n:
                i += 1
                c = {"n": "\n", "\\": "\\", '"': '"'}.get(line[i], "\\" + line[i])
            chars.append(c)
            i += 1
        if i >= n:
            return None
        labels.append((key, "".join(chars)))
        i += 1


def _parse_value(s: str) -> float | None:
    try:
        v = float(s)  # accepts NaN, +Inf, -Inf, 1e3
    except ValueError:
        return None
    return v


# ---------------------------------------------------------------------------------------------
# Mapping to EngineFacts


def _values(m: Metrics, name: str) -> list[float]:
    return [s.value for s in m.get(name, ()) if math.isfinite(s.value)]


def _sum(m: Metrics, name: str) -> float | None:
    v = _values(m, name)
    return sum(v) if v else None


def _mean(m: Metrics, name: str) -> float | None:
    v = _values(m, name)
    return sum(v) / len(v) if v else None


def _max(m: Metrics, name: str) -> float | None:
    v = _values(m, name)
    return max(v) if v else None


def _first(*values: float | None) -> float | None:
    for v in values:
        if v is not None:
            return v
    return None


def _ratio(v: float | None) -> float | None:
    return None if v is None else min(1.0, max(0.0, v))


def dialect(m: Metrics) -> str:
    """``"vllm"``, ``"sglang"``, ``"tgi"`` or ``""`` from which engine metrics are present."""
    for name in m:
        if name.startswith("vllm:"):
            return "vllm"
        if name.startswith("sglang:"):
            return "sglang"
        if name.startswith("tgi_"):
            return "tgi"
    return ""


def _prefix_rate(m: Metrics, previous: Metrics | None) -> float | None:
    """vLLM's hit rate: over the last interval when a previous scrape is known and saw
    queries since; else over the engine's life; else the older gauge."""
    hits, queries = _sum(m, VLLM_PREFIX_HITS), _sum(m, VLLM_PREFIX_QUERIES)
    if hits is not None and queries is not None:
        if previous is not None:
            h0, q0 = _sum(previous, VLLM_PREFIX_HITS), _sum(previous, VLLM_PREFIX_QUERIES)
            # A counter that went down means the engine restarted: fall back to lifetime.
            if h0 is not None and q0 is not None and queries > q0 and hits >= h0:
                return _ratio((hits - h0) / (queries - q0))
        if queries > 0:
            return _ratio(hits / queries)
    return _ratio(_mean(m, VLLM_PREFIX_RATE_OLD))


def gpu_facts(m: Metrics) -> EngineFacts:
    """Only the GPU fields, from dcgm-exporter gauges (all GPUs in the page together)."""
    free, used = _sum(m, DCGM_FREE), _sum(m, DCGM_USED)
    total = _sum(m, DCGM_TOTAL)
    if total is None and free is not None and used is not None:
        total = free + used + (_sum(m, DCGM_RESERVED) or 0.0)
    if used is None and free is not None and total is not None:
        used = max(0.0, total - free)
    free_ratio = _ratio(free / total) if free is not None and total else None
    util = _mean(m, DCGM_UTIL)
    return EngineFacts(
        gpu_free_ratio=free_ratio,
        gpu_used_mb=used,
        gpu_total_mb=total,
        gpu_temp_c=_max(m, DCGM_TEMP),
        gpu_util=_ratio(util / 100.0) if util is not None else None,
        source="dcgm" if any(n in m for n in GPU_NAMES) else "",
    )


def engine_facts(m: Metrics, previous: Metrics | None = None, *, gpu: bool = True) -> EngineFacts:
    """Everything the page says; `gpu=False` leaves the GPU fields unknown (when the caller
    has a better GPU source, such as NVML). `source` names the dialect(s) found, e.g.
    ``"vllm+dcgm"``."""
    kind = dialect(m)
    if kind == "vllm":
        waiting, running = _sum(m, VLLM_WAITING), _sum(m, VLLM_RUNNING)
        kv = _ratio(_first(_mean(m, VLLM_KV), _mean(m, VLLM_KV_OLD)))
        prefix = _prefix_rate(m, previous)
    elif kind == "sglang":
        waiting, running = _sum(m, SGLANG_WAITING), _sum(m, SGLANG_RUNNING)
        kv = _ratio(_mean(m, SGLANG_KV))
        prefix = _ratio(_mean(m, SGLANG_PREFIX))
    elif kind == "tgi":
        waiting, running = _sum(m, TGI_WAITING), _sum(m, TGI_RUNNING)
        kv = prefix = None
    else:
        waiting = running = kv = prefix = None
    facts = EngineFacts(
        queue_waiting=waiting,
        running=running,
        kv_cache_usage=kv,
        prefix_cache_hit_rate=prefix,
        capacity=_sum(m, SIM_MAX_BATCH),
    )
    parts = [kind] if kind else []
    if gpu:
        g = gpu_facts(m)
        facts = replace(facts, **{f: getattr(g, f) for f in _GPU_FIELDS})
        if g.source:
            parts.append(g.source)
    return replace(facts, source="+".join(parts))


def parse_engine_metrics(text: str) -> EngineFacts:
    """`engine_facts` of one page, stateless (prefix hit rate over the engine's life)."""
    return engine_facts(parse_prometheus(text, ALL_NAMES))


class EngineMetricsReader:
    """`engine_facts` for a poller: remembers the previous page for interval rates."""

    def __init__(self, *, gpu: bool = True) -> None:
        self._gpu = gpu
        self._previous: Metrics | None = None

    def update(self, text: str) -> EngineFacts:
        m = parse_prometheus(text, ALL_NAMES)
        facts = engine_facts(m, self._previous, gpu=self._gpu)
        self._previous = m
        return facts

    @property
    def last(self) -> Metrics:
        """The samples of the last page read (empty before the first or after `reset`)."""
        return self._previous or {}

    def reset(self) -> None:
        """Forget the previous page (after a failed scrape or an engine restart)."""
        self._previous = None
