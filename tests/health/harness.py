"""A fake-clock harness around the health core: no sleeping, time is a float we move."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import replace

from pulsegate.config import BackendConfig, HealthConfig, ProbesConfig
from pulsegate.health.events import Transition
from pulsegate.health.fleet import Fleet
from pulsegate.health.observations import (
    Heartbeat,
    Observation,
    Outcome,
    ProbeKind,
    ProbeResult,
    RequestResult,
)
from pulsegate.health.verdict import State

OK = RequestResult(Outcome.OK, ttft_s=0.1)
FAIL = RequestResult(Outcome.HTTP_5XX, status=503)
READY = ProbeResult(ProbeKind.READINESS, ok=True, latency_s=0.005, ready=True)
NOT_READY = ProbeResult(
    ProbeKind.READINESS, ok=True, latency_s=0.005, ready=False, reason="loading"
)
MICRO_OK = ProbeResult(ProbeKind.MICRO, ok=True, latency_s=0.05)
MICRO_FAIL = ProbeResult(ProbeKind.MICRO, ok=False, reason="timeout after 2000ms")
CANARY_OK = ProbeResult(ProbeKind.CANARY, ok=True, latency_s=0.08)
CANARY_FAIL = ProbeResult(ProbeKind.CANARY, ok=False, reason="timeout after 350ms")
PONG = Heartbeat(rtt_s=0.001)
MISS = Heartbeat(rtt_s=None, reason="late")


class Harness:
    """A Fleet plus a fake monotonic clock and a log of every transition."""

    def __init__(
        self,
        names: Sequence[str] = ("a", "b", "c"),
        health: HealthConfig | None = None,
        probes: ProbesConfig | None = None,
        models: Sequence[str] = ("m",),
        seed: int = 1,
        weights: dict[str, float] | None = None,
    ) -> None:
        self.health = health or HealthConfig()
        self.probes = probes or ProbesConfig()
        self.configs = [
            BackendConfig(
                name=n, url=f"http://{n}", models=tuple(models), weight=(weights or {}).get(n, 1.0)
            )
            for n in names
        ]
        self.now = 0.0
        self.fleet = Fleet(self.configs, self.health, self.probes, random.Random(seed), self.now)
        self.log: list[Transition] = []

    def obs(self, name: str, o: Observation) -> list[Transition]:
        """Feed one observation at the current time."""
        out = list(self.fleet.observe(name, o, self.now))
        self.log += out
        return out

    def feed(self, name: str, o: Observation, n: int) -> list[Transition]:
        """Feed the same observation n times at the current time."""
        out: list[Transition] = []
        for _ in range(n):
            out += self.obs(name, o)
        return out

    def tick(self, dt: float = 0.0) -> list[Transition]:
        """Move the clock by dt and tick."""
        self.now += dt
        out = self.fleet.tick(self.now)
        self.log += out
        return out

    def run(
        self,
        seconds: float,
        each: Callable[[Harness], object] | None = None,
        step: float = 0.1,
    ) -> list[Transition]:
        """Advance `seconds` in `step`s: call `each(self)` then tick, at every step."""
        out: list[Transition] = []
        end = self.now + seconds - 1e-9
        while self.now < end:
            self.now += step
            if each is not None:
                each(self)
            t = self.fleet.tick(self.now)
            self.log += t
            out += t
        return out

    def make_ready(self, *names: str) -> None:
        """Readiness ok and a micro-inference ok (both needed for ready) for each named backend
        (all by default)."""
        for n in names or tuple(c.name for c in self.configs):
            self.obs(n, READY)
            self.obs(n, MICRO_OK)

    def healthy_traffic(self, names: Sequence[str] | None = None) -> Callable[[Harness], None]:
        """A step function: one OK request per backend, a micro-inference ok every 3 s."""

        def each(h: Harness) -> None:
            for n in names or [c.name for c in h.configs]:
                h.obs(n, OK)
                if int(h.now * 10) % 30 == 0:
                    h.obs(n, MICRO_OK)

        return each

    def state(self, name: str) -> State:
        return self.fleet.state(name)

    def weight(self, name: str) -> float:
        return self.fleet.backend(name).weight

    def snap(self, name: str) -> dict[str, object]:
        return self.fleet.snapshot(name, self.now)

    def causes(self, name: str) -> list[str]:
        return [t.cause for t in self.log if t.backend == name]


def health_with(**kw: object) -> HealthConfig:
    """HealthConfig with some fields replaced."""
    return replace(HealthConfig(), **kw)  # type: ignore[arg-type]
