"""The single-process gateway: the health service and the proxy, composed through the seams.

Nothing here decides anything: the health service (`control/`) judges the backends and the
proxy (`proxy/`) carries requests. This module builds both and connects them the way one
process does: the proxy reads the fleet's verdicts and reports its outcomes straight to the
health service, and an ejection cuts the backend's live streams at once. A multi-process
gateway composes the same parts across processes (`cluster/primary.py`, `cluster/worker.py`);
a baseline mode (`gateway.mode`) plugs `control/baseline.py` in as the verdict source.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from pulsegate import runtime
from pulsegate.balancer import Balancer
from pulsegate.clock import Clock
from pulsegate.config import Config
from pulsegate.control.baseline import BaselineSource
from pulsegate.control.service import HealthService
from pulsegate.health.events import Transition
from pulsegate.health.fleet import Reconfigured
from pulsegate.observe.metrics import Registry
from pulsegate.proxy.forward import Forwarder
from pulsegate.proxy.metrics import ProxyMetrics, proxy_gauges
from pulsegate.proxy.ports import Outcomes, Router, Verdicts
from pulsegate.proxy.route import BalancedRouter
from pulsegate.proxy.side import ProxySide
from pulsegate.proxy.state import ProxyState
from pulsegate.runtime import TaskSet


class Gateway:
    """Health service + proxy in one process."""

    def __init__(self, config: Config, clock: Clock, rng: random.Random | None = None) -> None:
        self.config = config
        self.clock = clock
        self.rng = rng = rng or random.Random()
        self.registry = Registry()
        self.proxy_metrics = ProxyMetrics(self.registry)
        self.health = HealthService(config, clock, rng, self.registry)
        names = [b.name for b in config.backends]
        self.baseline = (
            BaselineSource(config, self.health) if config.gateway.mode != "pulsegate" else None
        )
        inflight: dict[str, int] = dict.fromkeys(names, 0)
        verdicts: Verdicts
        router: Router
        outcomes: Outcomes
        if self.baseline is not None:
            verdicts = router = outcomes = self.baseline
        else:
            verdicts, outcomes = self.health.fleet, self.health
            router = self._router(config, inflight)
        state = ProxyState(
            names, clock, router, verdicts, outcomes, config.routing.queue_max, inflight=inflight
        )
        self.side = ProxySide(config, clock, state, verdicts, outcomes, self.proxy_metrics)
        self.inflight: Mapping[str, int] = state.inflight
        proxy_gauges(self.registry, state.inflight, lambda: state.queue.depth)
        self.health.on_transitions.append(self._cut_ejected)
        self.tasks = TaskSet("gateway")
        self.session: aiohttp.ClientSession | None = None

    def _router(self, cfg: Config, inflight: Mapping[str, int]) -> BalancedRouter:
        return BalancedRouter(self.health.fleet, Balancer(cfg.routing, self.rng), inflight)

    def _cut_ejected(self, transitions: Sequence[Transition]) -> None:
        for t in transitions:
            if t.is_ejection:
                self.side.proxy.cut_ejected(t.backend, t.cause)

    async def start(self) -> Forwarder:
        """Start the drivers; returns the proxy's request handler."""
        session = self.session = runtime.client_session(self.config.retry.connect_timeout)
        if self.baseline is None:
            self.health.start(session, self.tasks)
        else:
            self.health.start_alerts(session)
            self.baseline.start(session, self.tasks)
        self.tasks.spawn(self.side.proxy.watch_first_bytes(), "first-byte-watch")
        return self.side.start()

    def apply(self, cfg: Config) -> Reconfigured:
        """A reload: `cfg` (already validated, its process keys kept by the caller) in
        place of the running config. The health service takes the backends and every
        health-side key; the proxy side the targets, routing, retry and streaming keys."""
        if self.baseline is not None:
            raise ValueError(f"gateway.mode {self.config.gateway.mode} does not reload")
        self.config = cfg
        change = self.health.apply(cfg)
        self.side.reconfigure(cfg, self._router(cfg, self.inflight))
        return change

    def names(self) -> Sequence[str]:
        return tuple(self.side.targets)

    def backend_view(self, name: str) -> dict[str, Any]:
        view = self.health.backend_view(name, self.inflight.get(name, 0))
        if self.baseline is not None:
            view.update(self.baseline.overlay(name))
        return view

    async def close(self) -> None:
        await self.health.close()
        await self.tasks.cancel()
        if self.session is not None:
            await self.session.close()
        await self.side.close()
