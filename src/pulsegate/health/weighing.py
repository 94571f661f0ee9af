"""A backend weighed: the numbers its verdict carries (score, routing weight, rtt, memory
headroom), and the verdict built from them.

The numbers are recomputed from the signals at each evaluation and on discrete events (state
change, suspect, VRAM crossing 5%, ramp step), not on every request: the balancer's in-flight
counts carry the instant load, and a verdict that does not change lets the fleet's routable
cache stay valid.
"""

from __future__ import annotations

import dataclasses

from pulsegate.config import BackendConfig, WeightsConfig
from pulsegate.health.score import GPU_FREE_MIN, ScoreInputs, routing_weight, score
from pulsegate.health.signals import Signals
from pulsegate.health.verdict import ROUTABLE, State, Verdict

PANIC_WEIGHT_FLOOR = 0.01  # an ejected backend routed in panic gets at least this weight


class Weighing:
    """Score, score-derived weight, rtt and prefix-cache hit rate, as of the last refresh."""

    __slots__ = ("base_weight", "inputs", "pickable", "prefix_hit", "rtt_s", "score")

    def __init__(self) -> None:
        self.score: float | None = None
        self.inputs = ScoreInputs()
        self.base_weight = 1.0
        self.rtt_s: float | None = None
        self.prefix_hit: float | None = None
        self.pickable = True  # VRAM unknown or >= 5% free (R5): below, never picked

    def refresh(
        self, s: Signals, weights: WeightsConfig, now: float, peer_ratio: float | None = None
    ) -> None:
        """Recompute every number from the signals. `peer_ratio` (`slowness.peer_ratio`): how
        much slower than its peers the backend is; the weight counts the worse of it and the
        ratio to its own baseline, so a backend slow from its start (its baseline learned
        slow) still gets little traffic."""
        inputs = s.score_inputs(now)
        self.inputs = inputs
        self.score = score(inputs, weights)
        ratio = inputs.latency_ratio
        if peer_ratio is not None and (ratio is None or peer_ratio > ratio):
            ratio = peer_ratio
        self.base_weight = routing_weight(self.score, ratio, inputs.error_rate)
        self.rtt_s = s.rtt_s(now)
        self.prefix_hit = s.prefix_cache_hit_rate(now)
        gf = inputs.gpu_free
        self.pickable = gf is None or gf >= GPU_FREE_MIN

    def check_pickable(self, s: Signals, now: float) -> bool:
        """Re-read the memory gauge alone (between refreshes); True when `pickable` changed."""
        gf = s.memory_free(now)
        pickable = gf is None or gf >= GPU_FREE_MIN
        if pickable == self.pickable:
            return False
        self.pickable = pickable
        return True

    def verdict(
        self,
        config: BackendConfig,
        state: State,
        affinity: float,
        max_inflight: int,
        ramp: float = 1.0,
    ) -> Verdict:
        """The verdict in `state`: weight = score-derived weight x `affinity` (configured
        weight x probation ramp x suspect factor), 0 unless routable and pickable."""
        w = 0.0
        if state in ROUTABLE and self.pickable:
            w = self.base_weight * affinity
        return Verdict(
            name=config.name,
            state=state,
            score=0.0 if self.score is None else round(self.score, 2),
            weight=w,
            zone=config.zone,
            region=config.region,
            rtt_s=self.rtt_s,
            gpu_free_ratio=self.inputs.gpu_free,
            prefix_cache_hit_rate=self.prefix_hit,
            max_inflight=max_inflight,
            affinity_weight=affinity,
            ramp=ramp,
        )

    def panic_verdict(self, config: BackendConfig, verdict: Verdict) -> Verdict:
        """`verdict` of an ejected-but-alive backend routed in panic (least-bad first)."""
        w = max(self.base_weight, PANIC_WEIGHT_FLOOR) * config.weight
        return dataclasses.replace(verdict, weight=w, panic=True)
