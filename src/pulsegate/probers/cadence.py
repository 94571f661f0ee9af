"""When a probe loop probes next: its delays by kind and state, and the pause between rounds.

The table and the rules are in `pulsegate.probers.scheduler`'s docstring. Here they are
plain functions of the configuration, an injected `random.Random` and a `Clock`, so the
cadence is tested on a `ManualClock` without a backend or a sleep.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable

from pulsegate.clock import Clock
from pulsegate.config import ProbesConfig
from pulsegate.probers.waits import Wake, sleep

# Unstable micro-inference and canary run this many times faster (3-5 s -> 1-1.7 s, R14).
UNSTABLE_SPEEDUP = 3.0
# Interval jitter for readiness, canary and metrics (micro has its own configured jitter).
JITTER = 0.1
# A storm of pokes starts at most one probe per kind per backend every 200 ms.
POKE_MIN_GAP_S = 0.2


class Kind(enum.Enum):
    """A probe loop; the value is what the `x-pulsegate-probe` header says."""

    READINESS = "readiness"
    MICRO = "micro"
    CANARY = "canary"
    METRICS = "metrics"
    CONNECT = "connect"  # a bare TCP connect (`dial`): sends no request, so no header


def delays(probes: ProbesConfig, kind: Kind, rng: random.Random) -> tuple[float, float]:
    """(stable, unstable) delay between probe starts, jitter drawn."""
    j = rng.uniform(1.0 - JITTER, 1.0 + JITTER)
    if kind is Kind.READINESS:
        return probes.readiness.interval * j, probes.readiness.interval_unstable * j
    if kind is Kind.MICRO:
        micro = probes.micro_inference
        base = micro.interval + rng.uniform(0.0, micro.jitter)
        return base, base / UNSTABLE_SPEEDUP
    if kind is Kind.CANARY:
        return probes.canary.interval * j, probes.canary.interval * j / UNSTABLE_SPEEDUP
    if kind is Kind.CONNECT:  # half after a failed connect: confirmed or cleared soon
        return probes.connect.interval * j, probes.connect.interval * j / 2
    return probes.metrics_interval * j, probes.metrics_interval * j


async def pause(
    clock: Clock,
    wake: Wake,
    started: float,
    slow: float,
    fast: float,
    failed: bool,
    unstable: Callable[[], bool],
) -> None:
    """Until the next probe is due, counted from `started` (the last probe's start): the
    `slow` delay; the `fast` one once `unstable()` (asked again at every `fast` mark) or
    right after this loop's own probe `failed` (confirm or clear it soon); or at once when
    `wake` is set, but never sooner than `POKE_MIN_GAP_S` after `started`."""
    checkpoint = min(fast, slow)
    while True:
        left = checkpoint - (clock.now() - started)
        if left > 0 and await wake.wait(clock, left):
            gap = POKE_MIN_GAP_S - (clock.now() - started)
            if gap > 0:
                await sleep(clock, gap)
            return
        if checkpoint >= slow or failed or unstable():
            return
        checkpoint = min(checkpoint + fast, slow)
