"""The proxy half of a process, composed once for the single-process gateway and the worker.

It owns the targets (`targets.py`), the upstream pools, the attempt opener and the current
request handler (`Forwarder`) over a `ProxyState` the caller made (in one process with plain
counts; in a worker with its shared-memory row). A reload (`reconfigure`) retires the pools
of removed or changed backends, gives the state the new backend list and router, and
replaces the request handler: requests in flight finish on the one they started with.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from pulsegate.clock import Clock
from pulsegate.config import Config
from pulsegate.front.door import FrontDoor, front_door
from pulsegate.observe.recording import Recording
from pulsegate.proxy.affinity import ResponseAffinity
from pulsegate.proxy.attempt import AttemptOpener
from pulsegate.proxy.budget import RetryBudget
from pulsegate.proxy.exchange import Door, Recorder
from pulsegate.proxy.forward import Forwarder, retry_budget
from pulsegate.proxy.metrics import ProxyMetrics
from pulsegate.proxy.ports import Outcomes, Router, Verdicts
from pulsegate.proxy.state import ProxyState
from pulsegate.proxy.targets import Target, target
from pulsegate.proxy.upstream import Upstream


class ProxySide:
    forwarder: Forwarder  # the request handler (set by `start`, replaced by a reload)

    def __init__(
        self,
        config: Config,
        clock: Clock,
        state: ProxyState,
        verdicts: Verdicts,
        outcomes: Outcomes,
        metrics: ProxyMetrics,
    ) -> None:
        self.config = config
        self.clock = clock
        self.proxy = state
        self.verdicts = verdicts
        self.outcomes = outcomes
        self.metrics = metrics
        self.targets: Mapping[str, Target] = {b.name: target(b) for b in config.backends}
        self.upstream = Upstream(config.retry.connect_timeout, now=clock.now)
        self._opener = AttemptOpener(self.upstream, state, outcomes, metrics, clock)
        # The front door (`auth:`, `front/door.py`; rebuilt by a reload) and who is told of
        # each finished request (access log, traces): set by whoever composes the process,
        # before `start`.
        self._front: FrontDoor | None = front_door(config, metrics, clock.now(), clock=clock)
        self.door: Door | None = self._front
        # The access log and the tracer (`gateway.access_log`, `observability`), followed
        # across reloads; `recorders` adds them to whatever else is told.
        self.recording = Recording(config, verdicts, metrics, self._opener)
        self.recorders: tuple[Recorder, ...] = self.recording.recorders
        self.affinity = ResponseAffinity()  # response id -> backend, kept across reloads
        self._closing: set[asyncio.Future[None]] = set()  # replaced fleet syncs closing

    def start(self) -> Forwarder:
        self.recording.start()
        if self._front is not None and self._front.sync is not None:
            self._front.sync.start()  # fleet-wide limits' reports (`cluster.redis`)
        self.forwarder = self._forwarder(retry_budget(self.config, self.clock.now()))
        return self.forwarder

    def _forwarder(self, budget: RetryBudget) -> Forwarder:
        return Forwarder(
            self.config,
            self.targets,
            self.proxy,
            self.proxy.router,
            self.verdicts,
            self.outcomes,
            self._opener,
            self.metrics,
            self.clock,
            budget,
            self.door,
            self.recorders,
            self.affinity,
        )

    def reconfigure(self, cfg: Config, router: Router) -> None:
        """A reload's proxy side: new targets, routing, retry and streaming keys. The retry
        budget carries over unless its keys changed."""
        old = self.config
        self.config = cfg
        targets = {b.name: target(b) for b in cfg.backends}
        for name, t in self.targets.items():
            if targets.get(name) != t:
                self.upstream.retire(name)
        self.targets = targets
        self.proxy.reconfigure(targets, router, self.verdicts, cfg.routing.queue_max)
        mine = self.recording.recorders
        self.recording.reconfigure(cfg)  # reopens the access log: a reload is a rotation too
        others = tuple(r for r in self.recorders if r not in mine)
        self.recorders = (*others, *self.recording.recorders)
        if self.door is self._front:  # not replaced by whoever composed the process
            old_sync = self._front.sync if self._front is not None else None
            self._front = front_door(cfg, self.metrics, self.clock.now(), self._front, self.clock)
            self.door = self._front
            sync = self._front.sync if self._front is not None else None
            if sync is not old_sync:  # `cluster.redis` or `auth` changed: a new store
                if old_sync is not None:
                    self._closing.add(asyncio.ensure_future(old_sync.close()))
                if sync is not None:
                    sync.start()
        budget = self.forwarder.budget
        if cfg.retry != old.retry:
            budget = retry_budget(cfg, self.clock.now())
        self.forwarder = self._forwarder(budget)

    def reopen_logs(self) -> None:
        """SIGUSR1: the access log's file was rotated."""
        self.recording.reopen()

    async def close(self) -> None:
        if self._front is not None and self._front.sync is not None:
            await self._front.sync.close()
        await self.recording.close()
        await self.upstream.close()
