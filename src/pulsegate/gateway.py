"""The gateway's composition root: wires config, the pure core and the I/O shells together.

Nothing here decides anything about health or routing: the Fleet (health core) and the
Balancer do, and this module only feeds them observations, acts on their transitions
(events, alerts, metrics) and keeps the per-request bookkeeping the proxy needs
(in-flight counts and first-byte watches) in plain dicts.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from pulsegate import clock
from pulsegate import stall as loop_stall
from pulsegate.balancer import Balancer
from pulsegate.baselines import Baseline, BaselineEvent
from pulsegate.capacity import CapacityQueue
from pulsegate.config import BackendConfig, Config
from pulsegate.health.events import Transition
from pulsegate.health.fleet import Fleet
from pulsegate.health.observations import (
    FirstByteOverdue,
    Heartbeat,
    Observation,
    ProbeResult,
)
from pulsegate.health.verdict import ROUTABLE, State, Verdict
from pulsegate.observe.alerts import AlertSender
from pulsegate.observe.events import EventLog
from pulsegate.observe.metrics import Counter, Gauge, Histogram, Registry
from pulsegate.proxy.budget import RetryBudget
from pulsegate.proxy.relay import EJECTED_STALL_S, Watchdog
from pulsegate.proxy.upstream import Upstream

log = logging.getLogger("pulsegate.gateway")

# A stream still waiting for its first token after this many times the backend's usual
# time-to-first-token (and at least OVERDUE_FLOOR_S) is evidence against the backend.
OVERDUE_FACTOR = 4.0
OVERDUE_FLOOR_S = 0.5
WATCH_INTERVAL_S = 0.05
TICK_INTERVAL_S = 0.1


@dataclass(frozen=True, slots=True)
class BackendRuntime:
    """What the proxy needs per backend, computed once: URL and upstream headers."""

    name: str
    url: str
    headers: dict[str, str]
    resume: str = "vllm"


def _runtime(b: BackendConfig) -> BackendRuntime:
    headers = {"content-type": "application/json"}
    if b.api_key_env:
        key = os.environ.get(b.api_key_env)
        if key:
            headers["authorization"] = f"Bearer {key}"
        else:
            log.warning("backend %s: environment variable %s is not set", b.name, b.api_key_env)
    return BackendRuntime(b.name, b.url, headers, b.resume)


class Gateway:
    def __init__(self, config: Config, rng: random.Random | None = None) -> None:
        self.config = config
        self.rng = rng or random.Random()
        now = clock.monotonic()
        micro_enabled = True
        self.fleet = Fleet(
            config.backends,
            config.health,
            config.probes,
            self.rng,
            now,
            require_micro_for_ready=micro_enabled,
        )
        self.balancer = Balancer(config.routing, self.rng)
        # The chaos lab's simpler gateways (gateway.mode): same proxy, other verdicts.
        self.baseline = (
            Baseline(config.gateway.mode, config) if config.gateway.mode != "pulsegate" else None
        )
        self.budget = RetryBudget(config.retry.budget_ratio, config.retry.budget_min_per_s, now)
        self.backends = {b.name: _runtime(b) for b in config.backends}
        # This process's requests in flight per backend, and the counts routing decisions
        # read: the same dict in one process; gateway-wide totals in a worker (cluster/).
        self.inflight: MutableMapping[str, int] = {b.name: 0 for b in config.backends}
        self.load: Mapping[str, int] = self.inflight
        self._waiting: dict[str, dict[int, float]] = {b.name: {} for b in config.backends}
        self._overdue_reported: dict[str, float] = {}
        self._streams: dict[str, set[Watchdog]] = {b.name: set() for b in config.backends}
        self._pending: dict[str, set[asyncio.Timeout]] = {b.name: set() for b in config.backends}
        self.queue = CapacityQueue(config.routing.queue_max)
        self._below_min: set[str] = set()
        self.shutting_down = False
        self.drained = asyncio.Event()
        self._tokens = itertools.count()
        self.session: aiohttp.ClientSession = None  # type: ignore[assignment]  # set in start()
        self.upstream: Upstream = None  # type: ignore[assignment]  # set in start()
        self.alerts: AlertSender | None = None
        self.events = EventLog(alert=self._alert)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.prober: Any = None
        self.heartbeats: dict[str, Any] = {}
        self._build_metrics()

    # -- metrics ----------------------------------------------------------------------------

    def _build_metrics(self) -> None:
        r = self.registry = Registry()
        self.m_requests: Counter = r.counter(
            "pulsegate_requests_total",
            "Client request attempts by backend, model and status code",
            ("backend", "model", "code"),
        )
        self.m_request_seconds: Histogram = r.histogram(
            "pulsegate_request_seconds", "Time from request to response headers or final error"
        )
        self.m_ttft: Histogram = r.histogram(
            "pulsegate_ttft_seconds", "Time to first byte from the serving backend"
        )
        self.m_retries: Counter = r.counter(
            "pulsegate_retries_total", "Retries on another backend, by reason", ("reason",)
        )
        self.m_resumes: Counter = r.counter(
            "pulsegate_stream_resumes_total", "Streams continued on another backend"
        )
        self.m_queued: Counter = r.counter(
            "pulsegate_queued_total", "Requests that waited for a backend with free capacity"
        )
        self.m_ejections: Counter = r.counter(
            "pulsegate_ejections_total", "Ejections by backend and reason", ("backend", "reason")
        )
        self.m_probe: Histogram = r.histogram(
            "pulsegate_probe_seconds", "Active probe latency", ("backend", "kind")
        )
        self.m_rtt: Histogram = r.histogram(
            "pulsegate_heartbeat_rtt_seconds", "Heartbeat round-trip time", ("backend",)
        )
        self.m_probe_failures: Counter = r.counter(
            "pulsegate_probe_failures_total",
            "Active probes that failed (no answer in time, refused, error status)",
            ("backend", "kind"),
        )
        self.m_heartbeat_misses: Counter = r.counter(
            "pulsegate_heartbeat_misses_total",
            "Heartbeats missed, by reason",
            ("backend", "reason"),
        )
        r.add(Gauge("pulsegate_backend_score", "Health score 0-100", ("backend",), self._scores))
        r.add(
            Gauge(
                "pulsegate_event_loop_stall_seconds_total",
                "Time this gateway's event loop stood still (ticks over 40 ms late); deadlines "
                "that passed meanwhile are not held against backends",
                (),
                _stall_seconds,
                kind="counter",
            )
        )
        r.add(
            Gauge(
                "pulsegate_backend_state",
                "1 for the backend's current state",
                ("backend", "state"),
                self._states,
            )
        )
        r.add(Gauge("pulsegate_backend_weight", "Effective weight", ("backend",), self._weights))
        r.add(Gauge("pulsegate_backend_inflight", "Requests in flight", ("backend",), self._infl))
        r.add(Gauge("pulsegate_panic", "1 while in panic mode", (), self._panic))
        r.add(
            Gauge(
                "pulsegate_model_ready",
                "Ready backends per model (routable: ready, degraded, probation)",
                ("model",),
                self._model_ready,
            )
        )
        r.add(
            Gauge(
                "pulsegate_model_below_min_ready",
                "1 while a model has fewer ready backends than routing.min_ready",
                ("model",),
                lambda: (((m,), 1.0 if m in self._below_min else 0.0) for m in self._min_models()),
            )
        )
        r.add(Gauge("pulsegate_queue_depth", "Requests waiting for capacity", (), self._qdepth))

    def _qdepth(self) -> Iterable[tuple[tuple[str, ...], float]]:
        yield (), float(self.queue.depth)

    def _ready_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(self.fleet.models(), 0)
        for name in self.backends:
            if self.fleet.state(name) in ROUTABLE:
                for m in self.fleet.backend_models(name):
                    counts[m] = counts.get(m, 0) + 1
        return counts

    def _model_ready(self) -> Iterable[tuple[tuple[str, ...], float]]:
        for m, n in sorted(self._ready_counts().items()):
            yield (m,), float(n)

    def _min_models(self) -> list[str]:
        r = self.config.routing
        return sorted(m for m in self.fleet.models() if r.min_ready_for(m) > 0)

    def _check_min_ready(self) -> None:
        """Alert when a model has fewer ready backends than routing.min_ready (R25)."""
        r = self.config.routing
        if not r.min_ready and not r.min_ready_per_model:
            return
        for m, n in self._ready_counts().items():
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

    def _snapshots(self) -> Iterable[tuple[str, dict[str, Any]]]:
        for name in self.backends:
            yield name, self.fleet.snapshot(name)

    def _scores(self) -> Iterable[tuple[tuple[str, ...], float]]:
        for name, s in self._snapshots():
            if s.get("score_known", True):  # an unknown score is absent, not 0
                yield (name,), float(s["score"])

    def _weights(self) -> Iterable[tuple[tuple[str, ...], float]]:
        for name, s in self._snapshots():
            yield (name,), float(s["weight"])

    def _states(self) -> Iterable[tuple[tuple[str, ...], float]]:
        for name, s in self._snapshots():
            for st in State:
                yield (name, st.value), 1.0 if s["state"] == st.value else 0.0

    def _infl(self) -> Iterable[tuple[tuple[str, ...], float]]:
        for name, n in self.inflight.items():
            yield (name,), float(n)

    def _panic(self) -> Iterable[tuple[tuple[str, ...], float]]:
        yield (), 1.0 if self.fleet.panic else 0.0

    # -- routing ----------------------------------------------------------------------------

    def pick(self, model: str, tried: Sequence[str], session_key: str | None) -> Verdict | None:
        if self.baseline is not None:
            return self.baseline.pick(model, tried)
        return self.balancer.pick(self.fleet.routable(model), self.load, tried, session_key)

    def report(self, name: str, obs: Observation) -> None:
        """Feed one observation to the health core and act on what it decides."""
        if type(obs) is ProbeResult:
            if obs.latency_s is not None:
                self.m_probe.observe(obs.latency_s, (name, obs.kind.value))
            if not obs.ok:
                self.m_probe_failures.inc((name, obs.kind.value))
        elif type(obs) is Heartbeat:
            if obs.rtt_s is not None:
                self.m_rtt.observe(obs.rtt_s, (name,))
            else:
                self.m_heartbeat_misses.inc((name, obs.reason or "late"))
        if self.baseline is not None:
            self._baseline_events(self.baseline.observe(name, obs, clock.monotonic()))
            return
        transitions = self.fleet.observe(name, obs, clock.monotonic())
        if transitions:
            self.on_transitions(transitions)

    def set_models(self, name: str, models: tuple[str, ...]) -> None:
        self.fleet.set_models(name, models)

    def on_transitions(self, transitions: Iterable[Transition]) -> None:
        for t in transitions:
            to = t.to_state.value
            if t.is_ejection:
                self.m_ejections.inc((t.backend, t.cause))
                self.cut_ejected(t.backend, t.cause)
            self.events.record(t.backend, t.from_state.value, to, t.reason, t.signals, t.cause)
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

    def _baseline_events(self, events: Iterable[BaselineEvent]) -> None:
        for e in events:
            if e.to_state == "ejected":
                self.m_ejections.inc((e.backend, e.cause))
            self.events.record(e.backend, e.from_state, e.to_state, e.reason, None, e.cause)

    async def _poll_loop(self, name: str) -> None:
        """Baseline `polling`: GET /health on a fixed interval, nothing else."""
        assert self.baseline is not None
        rd = self.config.probes.readiness
        url = self.backends[name].url + "/health"
        timeout = aiohttp.ClientTimeout(total=rd.timeout)
        while True:
            try:
                async with self.session.get(url, timeout=timeout) as r:
                    await r.read()
                    ok, why = r.status == 200, f"HTTP {r.status}"
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                ok, why = False, type(e).__name__
            self._baseline_events(self.baseline.poll(name, ok, why))
            await asyncio.sleep(rd.interval)

    def _alert(self, alert: dict[str, Any]) -> None:
        if self.alerts is not None:
            self.alerts.submit(alert)
        else:
            log.warning(alert["text"])

    def acquire(self, name: str) -> None:
        self.inflight[name] += 1

    def release(self, name: str) -> None:
        self.inflight[name] -= 1
        if self.queue.depth:
            self.queue.wake_for(self.fleet.backend_models(name))
        if self.shutting_down and not any(self.inflight.values()):
            self.drained.set()

    # -- the capacity queue: when every candidate is at its limit, wait, then 503 -----------

    def queue_ahead(self, model: str) -> bool:
        """Requests for `model` already wait for capacity: a newcomer queues behind them."""
        return self.queue.ahead(model)

    def saturated(self, model: str, tried: Sequence[str]) -> bool:
        """Some routable backend for `model`, not yet tried, is at its concurrency limit."""
        if self.baseline is not None:
            return False
        inflight = self.load
        for v in self.fleet.routable(model):
            cap = v.max_inflight
            if cap > 0 and v.name not in tried and inflight.get(v.name, 0) >= cap:
                return True
        return False

    async def wait_for_capacity(
        self, model: str, session_key: str | None, within: float, tried: Sequence[str] = ()
    ) -> Verdict | None:
        """Wait in `model`'s FIFO (bounded by routing.queue_max) until a backend for it has
        room, at most `within` seconds. None: the queue is full or the wait timed out."""
        if self.queue.depth >= self.queue.limit:
            return None
        self.m_queued.inc()
        return await self.queue.wait(
            model,
            within,
            lambda: self.pick(model, tried, session_key),
            lambda: self.pick(model, (), None) is not None,
        )

    async def wait_drained(self, within: float) -> bool:
        """During shutdown: wait until nothing is in flight, at most `within` seconds."""
        if not any(self.inflight.values()):
            return True
        try:
            async with asyncio.timeout(within):
                await self.drained.wait()
        except TimeoutError:
            return False
        return True

    # -- live streams: cut at once when their backend is ejected (R21) -----------------------

    def watch_stream(self, name: str, watch: Watchdog) -> None:
        self._streams[name].add(watch)

    def unwatch_stream(self, name: str, watch: Watchdog) -> None:
        self._streams[name].discard(watch)

    def watch_pending(self, name: str, cm: asyncio.Timeout) -> None:
        self._pending[name].add(cm)

    def unwatch_pending(self, name: str, cm: asyncio.Timeout) -> None:
        self._pending[name].discard(cm)

    def cut_ejected(self, name: str, cause: str) -> None:
        """Backend `name` was ejected: its live streams get the short stall limit and its
        attempts still waiting for a first byte move on now."""
        for w in list(self._streams.get(name, ())):
            w.tighten(EJECTED_STALL_S, f"backend ejected ({cause})")
        self._cut_pending(name)

    def _cut_pending(self, name: str) -> None:
        """The backend was ejected: attempts still waiting for its first byte give up now
        and move to another backend (the client has received nothing yet)."""
        now = asyncio.get_running_loop().time()
        for cm in list(self._pending.get(name, ())):
            with contextlib.suppress(RuntimeError):  # already expiring or done
                cm.reschedule(now)

    def end_streams(self, reason: str) -> int:
        """Cut every live upstream stream (graceful shutdown past its grace period)."""
        n = 0
        for watches in self._streams.values():
            for w in list(watches):
                w.cut(reason)
                n += 1
        return n

    # -- first-byte watch: in-flight evidence before any probe fires -------------------------

    def watch_first_byte(self, name: str, t0: float) -> int:
        token = next(self._tokens)
        self._waiting[name][token] = t0
        return token

    def first_byte_seen(self, name: str, token: int) -> None:
        self._waiting[name].pop(token, None)

    def _check_overdue(self, now: float) -> None:
        for name, waiting in self._waiting.items():
            if not waiting:
                continue
            since = min(waiting.values())
            oldest = now - since
            usual = self.fleet.usual_ttft(name, now) or 0.0
            limit = max(OVERDUE_FLOOR_S, OVERDUE_FACTOR * usual)
            if oldest < limit:
                continue
            # Time our own loop stood still is not the backend's delay (pulsegate.stall).
            oldest = loop_stall.running(since, now)
            if oldest < limit:
                continue
            # Report at most once per limit period per backend: it is evidence, not a flood.
            last = self._overdue_reported.get(name, -1e9)
            if now - last < limit:
                continue
            self._overdue_reported[name] = now
            count = sum(1 for t in waiting.values() if now - t >= limit)
            self.report(name, FirstByteOverdue(count, oldest))
            if self.prober is not None:
                self.prober.poke(name)

    # -- lifecycle --------------------------------------------------------------------------

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s crashed", task.get_name(), exc_info=task.exception())

    async def start(self) -> None:
        cfg = self.config
        # Measure this process's own stalls from the start: deadlines that judge backends
        # discount them, and a stall before the first question must be known too.
        loop_stall.watch()
        # The proxy path's client (per-backend keep-alive pools); the aiohttp session below
        # serves probes, alerts and the baseline poll loop.
        self.upstream = Upstream(cfg.retry.connect_timeout)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30, ttl_dns_cache=60)
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.retry.connect_timeout),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
            read_bufsize=2**16,
        )
        self._start_health()
        self._spawn(self._watch_loop(), "first-byte-watch")

    def _start_health(self) -> None:
        """The health core's drivers: alerts, probers, the tick (a proxy worker has none)."""
        cfg = self.config
        self.alerts = AlertSender(
            cfg.alerts.webhook, self.session, cfg.alerts.timeout, cfg.alerts.retries, self.rng
        )
        self.alerts.start()
        if self.baseline is None:
            self._start_probers()
        elif self.baseline.mode == "polling":
            for name in self.backends:
                self._spawn(self._poll_loop(name), f"poll-{name}")
        self._spawn(self._tick_loop(), "health-tick")

    def _start_probers(self) -> None:
        from pulsegate.probers import Prober

        cfg = self.config
        if any(b.agent for b in cfg.backends):
            from pulsegate.probers.heartbeat import HeartbeatClient

            for b in cfg.backends:
                if b.agent:
                    hb = HeartbeatClient(
                        b.name,
                        b.agent,
                        cfg.probes.heartbeat,
                        cfg.probes.micro_inference,
                        emit=self.report,
                        rng=self.rng,
                    )
                    self.heartbeats[b.name] = hb
                    self._spawn(hb.run(), f"heartbeat-{b.name}")

        def micro_via_agent(name: str) -> bool:
            # While the agent's stream is up, micro-inference travels inside it; when it is
            # down the HTTP prober takes over, so the engine is still proven end to end.
            hb = self.heartbeats.get(name)
            return hb is not None and bool(hb.connected)

        self.prober = Prober(
            cfg.backends,
            cfg.probes,
            self.session,
            emit=self.report,
            unstable=self.fleet.unstable,
            set_models=self.set_models,
            rng=self.rng,
            micro_via_agent=micro_via_agent,
        )
        self._spawn(self.prober.start(), "prober-start")

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_INTERVAL_S)
            if self.baseline is not None:
                self._baseline_events(self.baseline.tick(clock.monotonic()))
                continue
            transitions = self.fleet.tick(clock.monotonic())
            if transitions:
                self.on_transitions(transitions)
            self._check_min_ready()

    async def _watch_loop(self) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            self._check_overdue(clock.monotonic())

    async def close(self) -> None:
        for hb in self.heartbeats.values():
            await hb.close()
        if self.prober is not None:
            await self.prober.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.alerts is not None:
            await self.alerts.close()
        if self.session is not None:
            await self.session.close()
        if self.upstream is not None:
            await self.upstream.close()

    # -- admin views --------------------------------------------------------------------------

    def backend_view(self, name: str) -> dict[str, Any]:
        b = self.config.backend(name)
        s = self.fleet.snapshot(name)
        view = {
            "name": name,
            "url": b.url,
            "zone": b.zone,
            "region": b.region,
            "models": sorted(self.fleet.backend_models(name)),
            "inflight": self.inflight.get(name, 0),
        }
        view.update(s)
        if self.baseline is not None:
            state = self.baseline.state(name)
            view.update(
                state=state, weight=0.0 if state == "ejected" else 1.0, mode=self.baseline.mode
            )
        return view


def _stall_seconds() -> Iterable[tuple[tuple[str, ...], float]]:
    yield (), loop_stall.watch().total_s
