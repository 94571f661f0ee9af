"""The health service: the pure health core (`Fleet`) and the drivers that feed and read it.

It owns the fleet, the probers and heartbeat clients that observe the backends, the health
tick, the event log and alert webhook, the min-ready watch and the operator's actions. Every
observation comes in through `report` (probers, heartbeats, and the proxy's outcomes: the
`Outcomes` seam) and every decision goes out as transitions to the subscribers (`on_change`
and `on_transitions`): in one process the proxy state cuts an ejected backend's streams; in
a multi-process gateway's primary the supervisor sends the new verdicts to the workers.
An admin drain, undrain or eject is one call that also emits its transitions.

Nothing here decides about health: the `Fleet` does. Time comes from the injected clock.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp

from pulsegate.clock import Clock
from pulsegate.config import AgentTlsConfig, Config
from pulsegate.control.metrics import HealthMetrics, Samples, ready_counts
from pulsegate.health.events import Transition
from pulsegate.health.fleet import Fleet, Reconfigured
from pulsegate.health.observations import FirstByteOverdue, Observation
from pulsegate.observe.alerts import AlertSender
from pulsegate.observe.events import EventLog
from pulsegate.observe.metrics import Registry
from pulsegate.probers import Prober
from pulsegate.runtime import TaskSet

if TYPE_CHECKING:
    from pulsegate.probers.heartbeat import HeartbeatClient
    from pulsegate.replicas import Replicas

log = logging.getLogger("pulsegate.health")

TICK_INTERVAL_S = 0.1

TransitionListener = Callable[[Sequence[Transition]], None]


class HealthService:
    def __init__(self, config: Config, clock: Clock, rng: random.Random, registry: Registry):
        self.config = config
        self.clock = clock
        self.rng = rng
        self.fleet = Fleet(config.backends, config.health, config.probes, rng, clock.now())
        self.events = EventLog(alert=self._alert, wall=clock.wall)
        self.metrics = HealthMetrics(registry, self.fleet, clock, self._below_min_samples)
        self.alerts: AlertSender | None = None
        self.prober: Prober | None = None
        self.heartbeats: dict[str, HeartbeatClient] = {}
        self._below_min: set[str] = set()
        self.config_loaded_at = clock.wall()  # when the config in force was loaded
        self._tasks: TaskSet | None = None  # set by start(): where drivers run
        self._session: aiohttp.ClientSession | None = None
        # Told after every observation or action that may have moved a verdict, and of
        # every batch of transitions (after the events are recorded).
        self.on_change: list[Callable[[], None]] = []
        self.on_transitions: list[TransitionListener] = []
        self.replicas: Replicas | None = None  # cluster.redis: replicas share what they see
        if config.cluster.redis:
            from pulsegate.replicas import Replicas

            self.replicas = Replicas(self, clock, registry)

    # -- observations in, decisions out -------------------------------------------------------

    def report(self, name: str, obs: Observation) -> None:
        """Feed one observation to the health core and act on what it decides."""
        self.metrics.observed(name, obs)
        if self.replicas is not None:
            self.replicas.observed(name, obs)
        transitions = self.fleet.observe(name, obs, self.clock.now())
        if transitions:
            self.emit(transitions)
        if type(obs) is FirstByteOverdue and self.prober is not None:
            self.prober.poke(name)  # look at it now: in-flight evidence precedes probes
        for f in self.on_change:
            f()

    def set_models(self, name: str, models: tuple[str, ...]) -> None:
        self.fleet.set_models(name, models)
        for f in self.on_change:
            f()

    def emit(self, transitions: Sequence[Transition]) -> None:
        """Record, count and pass on what the health core decided."""
        for t in transitions:
            if t.is_ejection:
                self.metrics.ejections.inc((t.backend, t.cause))
            self.events.record(
                t.backend, t.from_state.value, t.to_state.value, t.reason, t.signals, t.cause
            )
            if self.prober is not None:
                self.prober.poke(t.backend)
        for p in self.fleet.take_panic_changes():
            self.events.record(
                f"model:{p.model}",
                "normal" if p.active else "panic",
                "panic" if p.active else "panic_over",
                p.reason,
                {"ejected": p.ejected, "total": p.total},
                "panic",
            )
        for f in self.on_transitions:
            f(transitions)

    # -- the operator's actions -----------------------------------------------------------------

    def act(self, name: str, verb: str) -> bool:
        """`drain`, `undrain` or `eject` backend `name` by hand, with its transitions
        emitted; False for an unknown verb."""
        now = self.clock.now()
        if verb == "drain":
            transitions = self.fleet.drain(name, now)
        elif verb == "undrain":
            transitions = self.fleet.undrain(name, now)
        elif verb == "eject":
            transitions = self.fleet.eject(name, now, "admin")
        else:
            return False
        self.emit(transitions)
        for f in self.on_change:
            f()
        return True

    # -- min_ready (R25) ------------------------------------------------------------------------

    def _min_models(self) -> list[str]:
        r = self.config.routing
        return sorted(m for m in self.fleet.models() if r.min_ready_for(m) > 0)

    def _below_min_samples(self) -> Samples:
        for m in self._min_models():
            yield (m,), 1.0 if m in self._below_min else 0.0

    def check_min_ready(self) -> None:
        """Alert when a model has fewer ready backends than routing.min_ready (R25)."""
        r = self.config.routing
        if not r.min_ready and not r.min_ready_per_model:
            return
        for m, n in ready_counts(self.fleet).items():
            want = r.min_ready_for(m)
            below = n < want
            if below == (m in self._below_min):
                continue
            if below:
                self._below_min.add(m)
                self.events.record(
                    f"model:{m}", "capacity_ok", "capacity_low",
                    f"only {n} ready backend(s) for {m}, min_ready is {want}", {"ready": n},
                    "min_ready",
                )  # fmt: skip
            else:
                self._below_min.discard(m)
                self.events.record(
                    f"model:{m}", "capacity_low", "capacity_ok",
                    f"{n} ready backend(s) for {m} again (min_ready {want})", {"ready": n},
                    "min_ready",
                )  # fmt: skip

    # -- drivers --------------------------------------------------------------------------------

    def _alert(self, alert: dict[str, Any]) -> None:
        if self.alerts is not None:
            self.alerts.submit(alert)
        else:
            log.warning(alert["text"])

    def start_alerts(self, session: aiohttp.ClientSession) -> None:
        cfg = self.config.alerts
        self.alerts = AlertSender(cfg.webhook, session, cfg.timeout, cfg.retries, self.rng)
        self.alerts.start()

    def start(self, session: aiohttp.ClientSession, tasks: TaskSet) -> None:
        """Alerts, heartbeat clients, probers and the health tick."""
        self._tasks, self._session = tasks, session
        self.start_alerts(session)
        for b in self.config.backends:
            if b.agent:
                self._start_heartbeat(b.name, b.agent, tasks)
        self._start_prober(tasks)
        if self.replicas is not None:
            self.replicas.start(tasks)
        tasks.spawn(self._tick_loop(), "health-tick")

    def _start_heartbeat(self, name: str, agent: str, tasks: TaskSet) -> None:
        # Imported only when a backend has an agent: grpcio costs ~10 MB of RSS.
        import os

        from pulsegate.probers.heartbeat import HeartbeatClient

        p = self.config.probes
        token_env = next((b.agent_token_env for b in self.config.backends if b.name == name), None)
        token = os.environ.get(token_env) if token_env else None
        if token_env and not token:  # the stream will be refused: say why, once, by name
            log.warning("backend %s: environment variable %s is not set", name, token_env)
        hb = HeartbeatClient(
            name,
            agent,
            p.heartbeat,
            p.micro_inference,
            emit=self.report,
            rng=self.rng,
            clock=self.clock,
            token=token,
            tls=_agent_tls(self.config, name),
            owns=lambda: self._owns(name),
        )
        self.heartbeats[name] = hb
        tasks.spawn(hb.run(), f"heartbeat-{name}")

    def _start_prober(self, tasks: TaskSet) -> None:
        cfg = self.config
        self.prober = Prober(
            cfg.backends,
            cfg.probes,
            emit=self.report,
            unstable=self.fleet.unstable,
            set_models=self.set_models,
            rng=self.rng,
            clock=self.clock,
            micro_via_agent=self._micro_via_agent,
            owns=self._owns,
        )
        tasks.spawn(self.prober.start(), "prober-start")

    # -- reload ---------------------------------------------------------------------------------

    def apply(self, cfg: Config) -> Reconfigured:
        """Take `cfg` in place of the running config: the fleet keeps every backend whose
        name and URL stayed (`Fleet.reconfigure`); heartbeat clients start and stop with
        their backends' `agent`; the probers start over on the new list (a first round for
        every backend at once: what was added is judged now); a changed webhook gets a new
        alert sender. Synchronous: the proxy never sees a half-applied config."""
        old = self.config
        self.config = cfg
        self.config_loaded_at = self.clock.wall()
        change = self.fleet.reconfigure(cfg.backends, cfg.health, cfg.probes, self.clock.now())
        tasks, session = self._tasks, self._session
        if tasks is not None:
            agents = {b.name: b.agent for b in cfg.backends if b.agent}
            probes_changed = (old.probes.heartbeat, old.probes.micro_inference) != (
                cfg.probes.heartbeat,
                cfg.probes.micro_inference,
            )
            for name, hb in list(self.heartbeats.items()):
                if (
                    agents.get(name) != hb.target
                    or name in change.restarted
                    or probes_changed
                    or _token_env(old, name) != _token_env(cfg, name)
                    or _agent_tls(old, name) != _agent_tls(cfg, name)
                ):
                    del self.heartbeats[name]
                    tasks.spawn(hb.close(), f"heartbeat-close-{name}")
            for name, agent in agents.items():
                if name not in self.heartbeats:
                    self._start_heartbeat(name, agent, tasks)
            if self.prober is not None:
                tasks.spawn(self.prober.close(), "prober-close")
                self._start_prober(tasks)
            if session is not None and cfg.alerts != old.alerts and self.alerts is not None:
                tasks.spawn(self.alerts.close(), "alerts-close")
                self.start_alerts(session)
        for f in self.on_change:
            f()
        return change

    def _owns(self, name: str) -> bool:
        # Among replicas, one runs a backend's micro-inference and canary and shares them.
        return self.replicas is None or self.replicas.owns(name)

    def _micro_via_agent(self, name: str) -> bool:
        # While the agent's stream is up, micro-inference travels inside it; when it is down
        # the HTTP prober takes over, so the engine is still proven end to end.
        hb = self.heartbeats.get(name)
        return hb is not None and bool(hb.connected)

    def tick(self) -> None:
        transitions = self.fleet.tick(self.clock.now())
        if transitions:
            self.emit(transitions)
        self.check_min_ready()

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_INTERVAL_S)
            self.tick()

    async def close(self) -> None:
        """Stop the heartbeat clients, probers and alerts (the caller cancels its tasks)."""
        for hb in self.heartbeats.values():
            await hb.close()
        if self.prober is not None:
            await self.prober.close()
        if self.alerts is not None:
            await self.alerts.close()
        if self.replicas is not None:
            await self.replicas.close()

    # -- views ----------------------------------------------------------------------------------

    def backend_view(self, name: str, inflight: int) -> dict[str, Any]:
        b = self.config.backend(name)
        view: dict[str, Any] = {
            "name": name,
            "url": b.url,
            "zone": b.zone,
            "region": b.region,
            "models": sorted(self.fleet.backend_models(name)),
            "inflight": inflight,
        }
        view.update(self.fleet.snapshot(name))
        return view

    def names(self) -> Iterable[str]:
        return self.fleet.names()


def _agent_tls(cfg: Config, name: str) -> AgentTlsConfig | None:
    """Backend `name`'s `agent_tls` in `cfg` (a change restarts its heartbeat client)."""
    return next((b.agent_tls for b in cfg.backends if b.name == name), None)


def _token_env(cfg: Config, name: str) -> str | None:
    """Backend `name`'s `agent_token_env` in `cfg` (a change restarts its heartbeat client)."""
    for b in cfg.backends:
        if b.name == name:
            return b.agent_token_env
    return None
