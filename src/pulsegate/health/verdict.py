"""What the health core tells the balancer: one immutable verdict per backend.

The balancer consumes verdicts only (R26): it never looks at raw signals or probes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class State(enum.Enum):
    COLD = "cold"  # model not loaded / never seen ready
    WARMING = "warming"  # loading or warming up: never gets client traffic
    READY = "ready"
    DEGRADED = "degraded"  # routable, down-weighted (low score, VRAM > 90%, KV cache near full)
    EJECTED = "ejected"  # out of rotation, still probed (observation list)
    PROBATION = "probation"  # recovered; traffic ramps up in small steps
    DRAINED = "drained"  # taken out by an operator

    # Members are singletons compared by identity, so identity is a valid hash, and a C one:
    # Enum's own hashes the name in Python, an interpreted call per `state in ROUTABLE`
    # (twice per proxied request in the balancer).
    __hash__ = object.__hash__


# States that may carry client traffic outside panic mode.
ROUTABLE = frozenset({State.READY, State.DEGRADED, State.PROBATION})


@dataclass(frozen=True, slots=True)
class Verdict:
    """A backend as the balancer sees it. `weight` is already effective:
    score-derived weight x probation ramp x configured weight (0 means: do not pick)."""

    name: str
    state: State
    score: float
    weight: float
    zone: str = ""
    region: str = ""
    # Smoothed latency in seconds used as the p2c load factor (probe/heartbeat RTT or TTFT).
    rtt_s: float | None = None
    gpu_free_ratio: float | None = None
    prefix_cache_hit_rate: float | None = None
    # Most concurrent requests the gateway may send (0: unlimited).
    max_inflight: int = 0
    # True when only routable because the fleet is in panic mode.
    panic: bool = False
    # The weight session affinity hashes on: configured weight x probation ramp x suspect
    # factor, without the score. Score jitter must not move sessions; bounded load and
    # ejection do that.
    affinity_weight: float = 1.0
    # The probation ramp (0..1; 1.0 in every other state): a zone tier made only of ramping
    # backends takes that share of its traffic, the next tier the rest (`balancer.py`).
    ramp: float = 1.0
