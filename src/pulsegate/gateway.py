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
from pulsegate.proxy.attempt import AttemptOpener
from pulsegate.proxy.budget import RetryBudget
from pulsegate.proxy.forward import Forwarder, retry_budget
from pulsegate.proxy.metrics import ProxyMetrics, proxy_gauges
from pulsegate.proxy.ports import Outcomes, Router, Verdicts
from pulsegate.proxy.route import BalancedRouter
from pulsegate.proxy.state import ProxyState
from pulsegate.proxy.targets import Target, target
from pulsegate.proxy.upstream import Upstream
from pulsegate.runtime import TaskSet


class Gateway:
    """Health service + proxy in one process."""

    forwarder: Forwarder  # the request handler (set by `start`, replaced by a reload)

    def __init__(self, config: Config, clock: Clock, rng: random.Random | None = None) -> None:
        self.config = config
        self.clock = clock
        self.rng = rng = rng or random.Random()
        self.registry = Registry()
        self.proxy_metrics = ProxyMetrics(self.registry)
        self.health = HealthService(config, clock, rng, self.registry)
        names = [b.name for b in config.backends]
        self.targets: Mapping[str, Target] = {b.name: target(b) for b in config.backends}
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
            fleet = self.health.fleet
            verdicts, outcomes = fleet, self.health
            router = BalancedRouter(fleet, Balancer(config.routing, rng), inflight)
        self.verdicts = verdicts
        self.outcomes = outcomes
        self.proxy = ProxyState(
            names, clock, router, verdicts, outcomes, config.routing.queue_max, inflight=inflight
        )
        self.inflight: Mapping[str, int] = self.proxy.inflight
        proxy_gauges(self.registry, self.proxy.inflight, lambda: self.proxy.queue.depth)
        self.health.on_transitions.append(self._cut_ejected)
        self.tasks = TaskSet("gateway")
        self.upstream: Upstream | None = None
        self.session: aiohttp.ClientSession | None = None
        self._opener: AttemptOpener | None = None

    def _cut_ejected(self, transitions: Sequence[Transition]) -> None:
        for t in transitions:
            if t.is_ejection:
                self.proxy.cut_ejected(t.backend, t.cause)

    async def start(self) -> Forwarder:
        """Start the drivers; returns the proxy's request handler."""
        cfg = self.config
        upstream = self.upstream = Upstream(cfg.retry.connect_timeout, now=self.clock.now)
        session = self.session = runtime.client_session(cfg.retry.connect_timeout)
        if self.baseline is None:
            self.health.start(session, self.tasks)
        else:
            self.health.start_alerts(session)
            self.baseline.start(session, self.tasks)
        self.tasks.spawn(self.proxy.watch_first_bytes(), "first-byte-watch")
        self._opener = AttemptOpener(
            upstream, self.proxy, self.outcomes, self.proxy_metrics, self.clock
        )
        self.forwarder = self._forwarder(retry_budget(cfg, self.clock.now()))
        return self.forwarder

    def _forwarder(self, budget: RetryBudget) -> Forwarder:
        assert self._opener is not None
        return Forwarder(
            self.config,
            self.targets,
            self.proxy,
            self.proxy.router,
            self.verdicts,
            self.outcomes,
            self._opener,
            self.proxy_metrics,
            self.clock,
            budget,
        )

    def apply(self, cfg: Config) -> Reconfigured:
        """A reload: `cfg` (already validated, its process keys kept by the caller) in
        place of the running config. The health service takes the backends and every
        health-side key; the proxy gets the new targets, routing, retry and streaming keys
        in a new request handler (requests in flight finish on the one they started with),
        and the pools of removed or changed backends close as their requests end."""
        if self.baseline is not None:
            raise ValueError(f"gateway.mode {self.config.gateway.mode} does not reload")
        old = self.config
        self.config = cfg
        change = self.health.apply(cfg)
        targets = {b.name: target(b) for b in cfg.backends}
        if self.upstream is not None:
            for name, t in self.targets.items():
                if targets.get(name) != t:
                    self.upstream.retire(name)
        self.targets = targets
        fleet = self.health.fleet
        router = BalancedRouter(fleet, Balancer(cfg.routing, self.rng), self.proxy.inflight)
        self.proxy.reconfigure(targets, router, fleet, cfg.routing.queue_max)
        if self._opener is not None:
            budget = self.forwarder.budget
            if cfg.retry != old.retry:
                budget = retry_budget(cfg, self.clock.now())
            self.forwarder = self._forwarder(budget)
        return change

    def names(self) -> Sequence[str]:
        return tuple(self.targets)

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
        if self.upstream is not None:
            await self.upstream.close()
