"""Runtime fault injection: the fault value, its validation, and what it does to a request.

A fault is one immutable ``Fault``; ``FaultState`` holds the current one. Decisions are pure
functions (``on_arrival``, ``on_admit``, ``on_token``, ``engine_endpoint``) returning an
``Action`` that the HTTP shell carries out, so the table of behaviours is testable without
sockets.

Hangs and lifting: a request that must hang waits for ``FaultState.wait_change()`` and then
asks the same question again with the fault then current. So after ``none`` every hung
request carries on from where it stopped and completes normally (its hang counts as
latency); after another fault it gets that fault's treatment (e.g. ``error`` -> 500). A hung
request whose client disconnects is cancelled by the server, so nothing waits forever.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from pulsegate.sim.gpu import THROTTLE, GpuReading, read_gpu


class Mode(enum.StrEnum):
    NONE = "none"
    ERROR = "error"  # 500 for a fraction `rate` of inference requests
    HANG = "hang"  # every engine endpoint accepts and never answers
    STALL = "stall"  # streams stop after `after_tokens` tokens; non-stream requests hang
    SLOW = "slow"  # TTFT and ITL x `factor`
    LATE_FIRST = "late_first"  # the first token `seconds` late, the rest on time (slow prefill)
    OOM = "oom"  # free VRAM 0 in metrics; inference fails 500 "CUDA out of memory"
    WARMING = "warming"  # not ready for `seconds`: /health 503, no models, inference 503
    BLACKHOLE = "blackhole"  # requests with Content-Length > `over_bytes` are never read
    CUDA_HANG = "cuda_hang"  # /health and /metrics fine, every inference hangs
    RESET = "reset"  # TCP reset on inference (after `after_tokens` stream tokens if given)
    # Hostile backends (`hostile.py`): raw bytes no engine should send, one mode per kind.
    BAD_CHUNKED = "bad_chunked"  # a chunk-size line that is not hex, after `after_tokens`
    LONG_LENGTH = "long_length"  # Content-Length larger than the body; then the socket closes
    SHORT_LENGTH = "short_length"  # Content-Length smaller than the body (a forged answer follows)
    ENDLESS_HEADERS = "endless_headers"  # header lines without end
    BIG_HEADERS = "big_headers"  # one 1 MiB header field
    NON_SSE = "non_sse"  # an HTML page inside a stream, after `after_tokens`
    BAD_UTF8 = "bad_utf8"  # an event with invalid UTF-8 inside a stream, after `after_tokens`
    ENDLESS_EVENT = "endless_event"  # one SSE event that never ends, after `after_tokens`
    NOT_JSON = "not_json"  # a non-streamed 200 whose body is HTML, not JSON
    TRICKLE = "trickle"  # the whole answer, one byte every `interval_s`
    HEADERS_RESET = "headers_reset"  # the response head, then a TCP reset
    # Gray GPU faults: only the DCGM gauges on /metrics show them; inference carries on.
    XID = "xid"  # DCGM_FI_DEV_XID_ERRORS = `code`
    ECC = "ecc"  # a volatile double-bit ECC error and a row remap pending
    THROTTLE = "throttle"  # DCGM_FI_DEV_CLOCK_THROTTLE_REASONS for `reason` (`gpu.THROTTLE`)


class Action(enum.Enum):
    PROCEED = "proceed"
    HANG = "hang"  # wait for the fault to change, then ask again
    FAIL_ERROR = "fail_error"  # 500 injected error
    FAIL_OOM = "fail_oom"  # 500 CUDA out of memory
    FAIL_WARMING = "fail_warming"  # 503 not ready
    RESET = "reset"  # abort the TCP connection with RST
    HOSTILE = "hostile"  # `hostile.py` writes the fault's raw bytes and closes the connection


class FaultError(ValueError):
    """A fault request that is malformed; the message is shown to the caller (400)."""


@dataclass(frozen=True, slots=True)
class Fault:
    mode: Mode = Mode.NONE
    rate: float = 1.0
    after_tokens: int | None = None
    factor: float = 1.0
    seconds: float = 0.0
    over_bytes: int = 1024
    interval_s: float = 1.0
    code: int = 79
    reason: str = "thermal"

    def params(self) -> dict[str, Any]:
        """The parameters that mean something for this mode (what /sim/fault shows)."""
        return {name: getattr(self, name) for name in _PARAMS[self.mode]}


NO_FAULT = Fault()


def _number(lo: float, hi: float, *, lo_open: bool = False) -> Callable[[str, object], float]:
    def check(name: str, v: object) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise FaultError(f"'{name}' must be a number, got {v!r}")
        if v < lo or (lo_open and v == lo) or v > hi:
            left = "(" if lo_open else "["
            raise FaultError(f"'{name}' must be in {left}{lo:g}, {hi:g}], got {v!r}")
        return float(v)

    return check


def _count(lo: int, hi: int) -> Callable[[str, object], int]:
    def check(name: str, v: object) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise FaultError(f"'{name}' must be an integer, got {v!r}")
        if not lo <= v <= hi:
            raise FaultError(f"'{name}' must be in [{lo}, {hi}], got {v!r}")
        return v

    return check


def _choice(options: Mapping[str, object]) -> Callable[[str, object], str]:
    def check(name: str, v: object) -> str:
        if not isinstance(v, str) or v not in options:
            raise FaultError(f"'{name}' must be one of {', '.join(options)}, got {v!r}")
        return v

    return check


# mode -> {parameter: (validator, default)}. The default of `after_tokens` is 20 for stall
# (a stall mid-stream is the interesting case) and None for reset (reset at once).
_PARAMS: dict[Mode, dict[str, tuple[Callable[[str, object], Any], Any]]] = {
    Mode.NONE: {},
    Mode.ERROR: {"rate": (_number(0.0, 1.0), 1.0)},
    Mode.HANG: {},
    Mode.STALL: {"after_tokens": (_count(0, 1_000_000), 20)},
    Mode.SLOW: {"factor": (_number(1.0, 1000.0), 5.0)},
    Mode.LATE_FIRST: {"seconds": (_number(0.0, 3600.0, lo_open=True), 1.5)},
    Mode.OOM: {},
    Mode.WARMING: {"seconds": (_number(0.0, 86_400.0, lo_open=True), 5.0)},
    Mode.BLACKHOLE: {"over_bytes": (_count(0, 1 << 40), 1024)},
    Mode.CUDA_HANG: {},
    Mode.RESET: {"after_tokens": (_count(0, 1_000_000), None)},
    Mode.BAD_CHUNKED: {"after_tokens": (_count(0, 1_000_000), 3)},
    Mode.LONG_LENGTH: {"after_tokens": (_count(0, 1_000_000), 3)},
    Mode.SHORT_LENGTH: {"after_tokens": (_count(0, 1_000_000), 3)},
    Mode.ENDLESS_HEADERS: {},
    Mode.BIG_HEADERS: {},
    Mode.NON_SSE: {"after_tokens": (_count(0, 1_000_000), 3)},
    Mode.BAD_UTF8: {"after_tokens": (_count(0, 1_000_000), 3)},
    Mode.ENDLESS_EVENT: {"after_tokens": (_count(0, 1_000_000), 3)},
    Mode.NOT_JSON: {},
    Mode.TRICKLE: {"interval_s": (_number(0.0, 60.0, lo_open=True), 1.0)},
    Mode.HEADERS_RESET: {},
    Mode.XID: {"code": (_count(1, 65535), 79)},
    Mode.ECC: {},
    Mode.THROTTLE: {"reason": (_choice(THROTTLE), "thermal")},
}

# The hostile modes that only a stream can show (a non-streamed request is served normally),
# and the one only a non-streamed answer can (a stream's non-JSON event is `non_sse`).
HOSTILE_STREAM_ONLY = frozenset({Mode.NON_SSE, Mode.BAD_UTF8, Mode.ENDLESS_EVENT})
HOSTILE_WHOLE_ONLY = frozenset({Mode.NOT_JSON})
HOSTILE = frozenset(
    {
        Mode.BAD_CHUNKED,
        Mode.LONG_LENGTH,
        Mode.SHORT_LENGTH,
        Mode.ENDLESS_HEADERS,
        Mode.BIG_HEADERS,
        Mode.TRICKLE,
        Mode.HEADERS_RESET,
        *HOSTILE_STREAM_ONLY,
        *HOSTILE_WHOLE_ONLY,
    }
)


def parse_fault(body: object) -> Fault:
    """Validate a ``POST /sim/fault`` body into a Fault; raise FaultError saying what is wrong."""
    if not isinstance(body, Mapping):
        raise FaultError('body must be a JSON object like {"mode": "error", "rate": 0.5}')
    raw_mode = body.get("mode")
    try:
        mode = Mode(raw_mode) if isinstance(raw_mode, str) else None
    except ValueError:
        mode = None
    if mode is None:
        known = ", ".join(m.value for m in Mode)
        raise FaultError(f"unknown mode {raw_mode!r}; expected one of: {known}")
    spec = _PARAMS[mode]
    unknown = sorted(set(body) - {"mode"} - set(spec))
    if unknown:
        allowed = ", ".join(spec) or "none"
        raise FaultError(f"unknown parameter(s) {unknown} for mode '{mode}' (allowed: {allowed})")
    values = {
        name: (check(name, body[name]) if body.get(name) is not None else default)
        for name, (check, default) in spec.items()
    }
    return replace(NO_FAULT, mode=mode, **values)


class FaultState:
    """The current fault, plus a wake-up for requests hung on it. Time is passed in."""

    def __init__(self) -> None:
        self._fault = NO_FAULT
        self._since = 0.0
        self._until = math.inf  # `warming` ends by itself at this monotonic time
        self._changed = asyncio.Event()

    def set(self, fault: Fault, now: float) -> None:
        """Install ``fault`` and wake every hung request so it re-evaluates."""
        self._fault = fault
        self._since = now
        self._until = now + fault.seconds if fault.mode is Mode.WARMING else math.inf
        self.wake()

    def current(self, now: float) -> Fault:
        """The fault in force at ``now``; an expired ``warming`` reads as no fault."""
        if now >= self._until:
            self._fault, self._until = NO_FAULT, math.inf
        return self._fault

    def describe(self, now: float) -> dict[str, Any]:
        """What ``GET /sim/fault`` returns."""
        fault = self.current(now)
        out: dict[str, Any] = {"mode": fault.mode.value, **fault.params()}
        out["active_s"] = round(now - self._since, 3) if fault.mode is not Mode.NONE else 0.0
        if fault.mode is Mode.WARMING:
            out["remaining_s"] = round(self._until - now, 3)
        return out

    def wake(self) -> None:
        """Wake hung requests without changing the fault (used at shutdown)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_change(self) -> None:
        """Return once the fault is next set (to anything, including the same mode)."""
        await self._changed.wait()


# ---- decisions: pure functions of the fault and the request's position ----


def engine_endpoint(fault: Fault) -> Action:
    """For /health, /v1/models and /metrics: only a full `hang` silences them."""
    return Action.HANG if fault.mode is Mode.HANG else Action.PROCEED


def on_arrival(fault: Fault, content_length: int | None) -> Action:
    """Before the body is read: a blackhole swallows large requests (size from the header)."""
    if fault.mode is Mode.HANG or fault.mode is Mode.CUDA_HANG:
        return Action.HANG
    if (
        fault.mode is Mode.BLACKHOLE
        and content_length is not None
        and content_length > fault.over_bytes
    ):
        return Action.HANG
    return Action.PROCEED


def on_admit(fault: Fault, *, stream: bool, draw: float) -> Action:
    """After the body is read, before queueing. ``draw`` is uniform in [0, 1) for `error`."""
    mode = fault.mode
    if mode is Mode.HANG or mode is Mode.CUDA_HANG:
        return Action.HANG
    if mode is Mode.ERROR:
        return Action.FAIL_ERROR if draw < fault.rate else Action.PROCEED
    if mode is Mode.OOM:
        return Action.FAIL_OOM
    if mode is Mode.WARMING:
        return Action.FAIL_WARMING
    if mode is Mode.RESET and (fault.after_tokens is None or not stream):
        return Action.RESET
    if mode in HOSTILE:
        if mode in (HOSTILE_WHOLE_ONLY if stream else HOSTILE_STREAM_ONLY):
            return Action.PROCEED
        return Action.HOSTILE
    return Action.PROCEED


def on_token(fault: Fault, index: int, *, stream: bool) -> Action:
    """Before producing token ``index`` (0-based) of a running request."""
    mode = fault.mode
    if mode is Mode.HANG or mode is Mode.CUDA_HANG:
        return Action.HANG  # a wedged GPU stops in-flight work too
    if mode is Mode.STALL:
        after = fault.after_tokens or 0
        return Action.HANG if (not stream or index >= after) else Action.PROCEED
    if mode is Mode.RESET and index >= (fault.after_tokens or 0):
        return Action.RESET
    return Action.PROCEED


def slowdown(fault: Fault) -> float:
    """Multiplier on TTFT and ITL."""
    return fault.factor if fault.mode is Mode.SLOW else 1.0


def first_token_delay(fault: Fault) -> float:
    """Seconds added to the time to first token (`late_first`: a prefill that runs late, as
    on an engine with a cold cache or a queue in front of its GPU; decoding keeps its pace)."""
    return fault.seconds if fault.mode is Mode.LATE_FIRST else 0.0


def gpu_reading(fault: Fault, **load: Any) -> GpuReading:
    """`gpu.read_gpu` for the engine's `load` (its keyword arguments but `oom`), as `fault`
    shows it: `oom`, and the gray GPU faults."""
    return gpu_gauges(read_gpu(oom=fault.mode is Mode.OOM, **load), fault)


def gpu_gauges(reading: GpuReading, fault: Fault) -> GpuReading:
    """The GPU gauges as the gray GPU faults (`xid`, `ecc`, `throttle`) show them."""
    if fault.mode is Mode.XID:
        return replace(reading, xid=fault.code)
    if fault.mode is Mode.ECC:
        return replace(reading, ecc_dbe=1, remap_pending=1)
    if fault.mode is Mode.THROTTLE:
        return replace(reading, throttle=THROTTLE[fault.reason])
    return reading
