"""A baseline mode (`gateway.mode`: round_robin, polling, passive) as the proxy's verdict source.

The chaos lab measures pulsegate against simpler gateways on the same proxy path: only the
verdicts differ. `BaselineSource` is the proxy's `Verdicts`, `Router` and `Outcomes` in
such a mode (`proxy/ports.py`), with the drivers the mode needs (the polling mode's
`GET /health` loop, the passive mode's backoff tick). Its events go to the health service's
event log and ejection counter, so `/admin/events` and `/metrics` read the same as in
pulsegate mode; the health service runs no probers then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any

import aiohttp

from pulsegate.baselines import Baseline, BaselineEvent
from pulsegate.config import Config
from pulsegate.control.service import HealthService
from pulsegate.health.observations import Observation
from pulsegate.health.verdict import Verdict
from pulsegate.runtime import TaskSet

TICK_INTERVAL_S = 0.1


class BaselineSource:
    def __init__(self, config: Config, health: HealthService) -> None:
        self.config = config
        self.baseline = Baseline(config.gateway.mode, config)
        self._health = health
        self._models = {b.name: frozenset(b.models) for b in config.backends}

    # -- Verdicts -------------------------------------------------------------------------------

    def routable(self, model: str) -> tuple[Verdict, ...]:
        return ()  # no concurrency limits to be saturated by: `pick` decides alone

    def serves(self, model: str) -> bool:
        return model in self.baseline.models()

    def models(self) -> set[str]:
        return self.baseline.models()

    def backend_models(self, name: str) -> frozenset[str]:
        return self._models.get(name, frozenset())

    def usual_ttft(self, name: str, now: float) -> float | None:
        return None

    # -- Router ---------------------------------------------------------------------------------

    def pick(self, model: str, tried: Sequence[str], session_key: str | None) -> Verdict | None:
        return self.baseline.pick(model, tried)

    def saturated(self, model: str, tried: Sequence[str]) -> bool:
        return False

    # -- Outcomes -------------------------------------------------------------------------------

    def report(self, name: str, obs: Observation) -> None:
        self._health.metrics.observed(name, obs)
        self._record(self.baseline.observe(name, obs, self._health.clock.now()))

    def _record(self, events: Iterable[BaselineEvent]) -> None:
        h = self._health
        for e in events:
            if e.to_state == "ejected":
                h.metrics.ejections.inc((e.backend, e.cause))
            h.events.record(e.backend, e.from_state, e.to_state, e.reason, None, e.cause)

    # -- drivers --------------------------------------------------------------------------------

    def start(self, session: aiohttp.ClientSession, tasks: TaskSet) -> None:
        if self.baseline.mode == "polling":
            for b in self.config.backends:
                tasks.spawn(self._poll_loop(session, b.name, b.url), f"poll-{b.name}")
        tasks.spawn(self._tick_loop(), "baseline-tick")

    async def _poll_loop(self, session: aiohttp.ClientSession, name: str, url: str) -> None:
        """Baseline `polling`: GET /health on a fixed interval, nothing else."""
        rd = self.config.probes.readiness
        timeout = aiohttp.ClientTimeout(total=rd.timeout)
        while True:
            try:
                async with session.get(url + "/health", timeout=timeout) as r:
                    await r.read()
                    ok, why = r.status == 200, f"HTTP {r.status}"
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                ok, why = False, type(e).__name__
            self._record(self.baseline.poll(name, ok, why))
            await asyncio.sleep(rd.interval)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_INTERVAL_S)
            self._record(self.baseline.tick(self._health.clock.now()))

    def overlay(self, name: str) -> dict[str, Any]:
        """What the admin view says of backend `name` in this mode."""
        state = self.baseline.state(name)
        return {
            "state": state,
            "weight": 0.0 if state == "ejected" else 1.0,
            "mode": self.baseline.mode,
        }
