"""What the I/O shells tell the health core: plain, immutable facts about one backend.

The proxy reports `RequestResult` for every client request attempt; probers report
`ProbeResult`, `EngineFacts` and `Heartbeat`; the proxy's in-flight watcher reports
`FirstByteOverdue`; the proxy and the connect probe report `ConnectResult` for each fresh
TCP connection they open (`connects`). The core turns these into verdicts and never does I/O itself.
A value that is not known is ``None``: never a made-up number.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Outcome(enum.Enum):
    """How one attempt of a client request on one backend ended (from the gateway's side)."""

    OK = "ok"
    CONNECT_ERROR = "connect_error"  # refused, reset before headers, DNS, TLS
    TIMEOUT = "timeout"  # no response headers within the per-try timeout
    HTTP_5XX = "http_5xx"  # the backend answered 500-599
    OVERLOADED = "overloaded"  # 429 (or 503 with Retry-After): busy, not broken
    STREAM_BROKEN = "stream_broken"  # failed after the first byte (reset, EOF, stall)
    CLIENT_ERROR = "client_error"  # 4xx caused by the request itself: says nothing of health
    CANCELLED = "cancelled"  # the client went away: says nothing of health

    @property
    def is_failure(self) -> bool:
        """Counts against the backend's error rate and consecutive-failure breaker."""
        return self in _FAILURES


_FAILURES = frozenset(
    {Outcome.CONNECT_ERROR, Outcome.TIMEOUT, Outcome.HTTP_5XX, Outcome.STREAM_BROKEN}
)


class ProbeKind(enum.Enum):
    READINESS = "readiness"  # engine health endpoint + model listed
    MICRO = "micro"  # 1-token inference through the real engine
    CANARY = "canary"  # 4-8 KB prompt, 1 token, hard timeout: catches large-packet loss


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One attempt of a client request. ttft_s is time to response headers / first byte."""

    outcome: Outcome
    ttft_s: float | None = None
    status: int | None = None


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One active probe. `ready` is the readiness probe's verdict (None for other kinds):
    False means the engine answers but is not ready (loading, warming, model missing)."""

    kind: ProbeKind
    ok: bool
    latency_s: float | None = None
    reason: str = ""
    ready: bool | None = None
    # Readiness only: the engine's port refused the connection. Nothing listens there (the
    # process is gone or restarting): as hard as evidence gets, unlike a timeout.
    refused: bool = False


@dataclass(frozen=True, slots=True)
class GpuFaults:
    """GPU fault counters from NVML or a DCGM exporter (`health.gpu_faults` judges them).
    None = unknown. `xid`: the last critical Xid seen (0: none); `ecc_dbe`: volatile
    double-bit ECC errors; `remap_pending`: a row remap or page retirement waits for a GPU
    reset; `throttle`: NVML's clocksThrottleReasons bitmask; `nvlink_errors`: CRC flit errors."""

    xid: int | None = None
    ecc_dbe: float | None = None
    remap_pending: bool | None = None
    throttle: int | None = None
    nvlink_errors: float | None = None


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """Engine and GPU gauges, from a metrics scrape or an agent's pong. None = unknown."""

    queue_waiting: float | None = None
    running: float | None = None
    kv_cache_usage: float | None = None  # 0..1
    prefix_cache_hit_rate: float | None = None  # 0..1
    gpu_free_ratio: float | None = None  # 0..1 of framebuffer memory free
    gpu_used_mb: float | None = None
    gpu_total_mb: float | None = None
    gpu_temp_c: float | None = None
    gpu_util: float | None = None  # 0..1
    capacity: float | None = None  # requests the engine runs at once (batch), if known
    source: str = ""  # "vllm", "sglang", "tgi", "dcgm", "nvml", "agent", ...
    gpu_faults: GpuFaults | None = None  # from an agent's pong (None: not reported)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """One heartbeat ping's fate: rtt_s for a pong in time, None for a miss."""

    rtt_s: float | None
    facts: EngineFacts | None = None
    reason: str = ""  # for a miss: "late", "backpressure", "stream_broken", ...


@dataclass(frozen=True, slots=True)
class FirstByteOverdue:
    """Client requests on this backend still waiting for their first byte far beyond its
    usual time-to-first-token: evidence the gateway has before any probe fires."""

    count: int
    oldest_s: float


@dataclass(frozen=True, slots=True)
class ConnectResult:
    """One fresh TCP connection to the backend (never the reuse of a pooled one): made, or
    why not (`reason`: "timed out", "connection refused", ...). Connections already open
    keep working through a SYN drop or a full accept queue; only a new one sees it."""

    ok: bool
    reason: str = ""


Observation = (
    RequestResult | ProbeResult | EngineFacts | Heartbeat | FirstByteOverdue | ConnectResult
)
