"""The probe scheduler: one asyncio task per backend and probe kind, cadence set by state.

Each task runs one probe, emits what it observed, then pauses until the next one is due:

| kind       | stable (`unstable(name)` False)      | unstable                    | jitter    |
| ---------- | ------------------------------------ | --------------------------- | --------- |
| readiness  | readiness.interval (10 s)            | readiness.interval_unstable | +-10%     |
| micro      | interval + U(0, jitter) (3-5 s)      | a third of that (1-1.7 s)   | as stated |
| canary     | canary.interval (2 s)                | a third (0.67 s)            | +-10%     |
| metrics    | metrics_interval (1 s)               | the same                    | +-10%     |
| connect    | connect.interval (0.5 s; 0: off)     | a half (0.25 s)             | +-10%     |

Intervals run from the start of one probe to the start of the next, so a probe that times
out does not stretch the cadence; since a task awaits its probe before pausing, at most one
probe of a kind is ever in flight per backend (R14: probes never overload an instance).
While stable, a pause re-asks `unstable(name)` at every unstable-interval mark, so a backend
turning unstable is probed fast within one short interval, without the gateway having to
poke. A loop whose own last probe failed (no answer, error, not ready) also uses the fast
interval: the next round confirms or clears the failure without waiting for the core. So
from a blackhole to the second consecutive canary failure takes at most one interval plus
a third of one plus the timeout (2.2 + 0.73 + 0.35 = 3.3 s with defaults, about 2 s on
average) instead of two full intervals.

`poke(name)` ends that backend's pauses at once - but never sooner than
`cadence.POKE_MIN_GAP_S` after the previous probe of the same kind, and a poke that arrives
while a probe is in flight is answered by that probe, not by a second one.

Gating (decisions the health core cannot make for us, because they are about what to send):
- micro-inference and canary wait for the backend's first readiness answer and are skipped
  while the engine itself says it is not ready (loading, warming, model missing): sending
  inference to a loading engine only manufactures failures. They resume the moment
  readiness says ready. A backend that does not answer readiness at all is still probed:
  failures there are real evidence.
- micro-inference is skipped while `micro_via_agent(name)` is True (the agent's heartbeat
  stream carries it); asked every round, so the HTTP probe resumes if the agent goes away.
- the connect probe (`dial`: a new TCP connection, closed at once) waits for the first
  readiness answer too, then runs whatever the engine says, on every gateway replica: it
  judges the path from this gateway, and it costs the engine nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from pulsegate.clock import Clock
from pulsegate.config import BackendConfig, ProbesConfig
from pulsegate.health.observations import (
    ConnectResult,
    EngineFacts,
    Observation,
    ProbeKind,
    ProbeResult,
)
from pulsegate.probers.cadence import Kind, delays, pause
from pulsegate.probers.dial import Addresses, dial
from pulsegate.probers.engine_metrics import EngineMetricsReader
from pulsegate.probers.http import PROBE_HEADER, new_probe_session
from pulsegate.probers.micro import Inference, probe_inference
from pulsegate.probers.payload import Api, CanaryText, canary_body, micro_body, probe_api
from pulsegate.probers.readiness import Readiness, probe_readiness
from pulsegate.probers.scrape import scrape_engine
from pulsegate.probers.waits import Wake

log = logging.getLogger("pulsegate.probers")


@dataclass(frozen=True, slots=True)
class ProbeIO:
    """The probes' I/O, one function per kind: the defaults talk HTTP to the engine. Tests
    plug in functions that answer at once, to drive the cadence on a `ManualClock` (a
    seam, like httpx's transport: no module is patched)."""

    readiness: Callable[..., Awaitable[Readiness]] = probe_readiness
    inference: Callable[..., Awaitable[Inference]] = probe_inference
    scrape: Callable[..., Awaitable[EngineFacts | str]] = scrape_engine
    connect: Callable[..., Awaitable[ConnectResult | None]] = dial


@dataclass(eq=False)
class _Backend:
    """What the loops of one backend share. Touched only from the event loop."""

    cfg: BackendConfig
    headers: dict[Kind, dict[str, str]] = field(repr=False)  # carry the backend's key
    canary_text: CanaryText
    models: tuple[str, ...]
    api: Api = Api.COMPLETIONS
    not_ready: bool = False  # the engine answered readiness and said: cannot serve yet
    answered: asyncio.Event = field(default_factory=asyncio.Event)  # first readiness done
    wake: dict[Kind, Wake] = field(default_factory=dict)
    canary_bodies: dict[tuple[str, Api], bytes] = field(default_factory=dict)
    logged: dict[str, str] = field(default_factory=dict)  # topic -> last state logged
    metrics: EngineMetricsReader = field(default_factory=EngineMetricsReader)


class Prober:
    """Active HTTP probes for every backend; produces observations and nothing else.

    Probes run on the Prober's own session (`new_probe_session()`, made in `start()`, closed
    in `close()`): its own small connection pool, so probes never queue behind client
    traffic and never hold more than 4 connections to a backend. `clock` is the one time
    source: it times probes, their deadlines and the cadence; `rng` draws jitter and the
    canary text; `io` performs the probes.
    """

    def __init__(
        self,
        backends: Sequence[BackendConfig],
        probes: ProbesConfig,
        emit: Callable[[str, Observation], None],
        unstable: Callable[[str], bool],
        set_models: Callable[[str, tuple[str, ...]], None],
        rng: random.Random,
        micro_via_agent: Callable[[str], bool] = lambda name: False,
        owns: Callable[[str], bool] = lambda name: True,
        *,
        clock: Clock,
        io: ProbeIO = ProbeIO(),
    ) -> None:
        self._io = io
        self._configs = tuple(backends)
        self._probes = probes
        self._pool: aiohttp.ClientSession | None = None
        self._emit_cb = emit
        self._unstable_cb = unstable
        self._set_models_cb = set_models
        self._rng = rng
        self._clock = clock
        self._addresses = Addresses()  # where the connect probe's hosts resolve
        self._via_agent_cb = micro_via_agent
        self._owns_cb = owns  # gateway replicas: is this one's micro-inference and canary ours
        self._backends: dict[str, _Backend] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._failing: set[str] = set()  # callbacks whose last call raised

    async def start(self) -> None:
        """Read API keys from the environment and start every probe loop."""
        if self._backends or self._closed:
            raise RuntimeError("Prober.start() may be called once")
        self._pool = new_probe_session()
        for cfg in self._configs:
            b = _Backend(
                cfg=cfg,
                headers={k: {PROBE_HEADER: k.value, **_auth(cfg)} for k in Kind},
                canary_text=CanaryText(self._rng, self._probes.canary.payload_bytes),
                models=cfg.models,
                api=probe_api(cfg.apis),
            )
            kinds = [Kind.READINESS, Kind.MICRO, Kind.CANARY]
            if cfg.metrics_path:
                kinds.append(Kind.METRICS)
            if self._probes.connect.interval > 0:
                kinds.append(Kind.CONNECT)
            b.wake = {k: Wake() for k in kinds}
            self._backends[cfg.name] = b
            for kind in kinds:
                task = asyncio.create_task(
                    self._loop(b, kind), name=f"probe {cfg.name} {kind.value}"
                )
                self._tasks.add(task)

    async def close(self) -> None:
        """Cancel every probe loop and wait for them; in-flight requests are abandoned."""
        self._closed = True
        tasks = list(self._tasks)
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._pool is not None:
            await self._pool.close()

    def poke(self, name: str) -> None:
        """Wake the pausing probe loops of backend `name` now (unknown names are ignored)."""
        b = self._backends.get(name)
        if b is not None:
            for wake in b.wake.values():
                wake.set()

    # ---- the loop ------------------------------------------------------------------------

    async def _loop(self, b: _Backend, kind: Kind) -> None:
        probe: Callable[[_Backend], Awaitable[bool]] = {
            Kind.READINESS: self._readiness,
            Kind.MICRO: self._micro,
            Kind.CANARY: self._canary,
            Kind.METRICS: self._metrics,
            Kind.CONNECT: self._connect,
        }[kind]
        if kind is not Kind.READINESS:
            await b.answered.wait()
            # Spread the first probes of many backends over a tenth of an interval.
            spread = self._rng.uniform(0.0, 0.1 * self._delays(kind)[0])
            await b.wake[kind].wait(self._clock, spread)
        while True:
            started = self._clock.now()
            failed = False
            try:
                failed = await probe(b)
            except Exception:  # a bug in one round must not stop the backend's probing
                log.exception("probe %s %s crashed", b.cfg.name, kind.value)
            b.wake[kind].clear()  # pokes during the probe are answered by it
            await self._pause(b, kind, started, failed)

    async def _pause(self, b: _Backend, kind: Kind, started: float, failed: bool) -> None:
        """Until the next probe is due (`cadence.pause`)."""
        slow, fast = self._delays(kind)
        await pause(
            self._clock, b.wake[kind], started, slow, fast, failed, lambda: self._unstable(b)
        )

    def _delays(self, kind: Kind) -> tuple[float, float]:
        """(stable, unstable) delay between probe starts, jitter drawn."""
        return delays(self._probes, kind, self._rng)

    # ---- the probes ----------------------------------------------------------------------

    # Each probe returns True when its round failed (no answer, or not ready), so the loop
    # looks again at the fast cadence.

    async def _readiness(self, b: _Backend) -> bool:
        cfg = b.cfg
        r = await self._io.readiness(
            self._session(),
            cfg.url,
            b.headers[Kind.READINESS],
            cfg.models,
            self._probes.readiness.timeout,
            self._clock,
        )
        if r.listed and not cfg.models and r.listed != b.models:
            b.models = r.listed
            self._call("set_models", self._set_models_cb, cfg.name, r.listed)
        was_not_ready = b.not_ready
        b.not_ready = r.result.ok and not r.result.ready
        b.answered.set()
        self._emit(cfg.name, r.result)
        if was_not_ready and not b.not_ready:  # engine just became ready: prove it serves
            for kind in (Kind.MICRO, Kind.CANARY):
                b.wake[kind].set()
        return not r.result.ready

    async def _micro(self, b: _Backend) -> bool:
        if self._call("micro_via_agent", self._via_agent_cb, b.cfg.name) or not self._servable(b):
            return False
        if not self._owned(b):
            return False
        model = b.models[0]
        out = await self._io.inference(
            ProbeKind.MICRO,
            self._session(),
            b.cfg.url,
            b.headers[Kind.MICRO],
            lambda api: micro_body(model, api),
            b.api,
            self._probes.micro_inference.timeout,
            self._clock,
        )
        return self._settle(b, Kind.MICRO, out.api, out.result)

    async def _canary(self, b: _Backend) -> bool:
        if not self._servable(b) or not self._owned(b):
            return False
        model = b.models[0]

        def body(api: Api) -> bytes:
            key = (model, api)
            if key not in b.canary_bodies:
                size = self._probes.canary.payload_bytes
                b.canary_bodies[key] = canary_body(b.canary_text, model, api, size)
            return b.canary_bodies[key]

        out = await self._io.inference(
            ProbeKind.CANARY,
            self._session(),
            b.cfg.url,
            b.headers[Kind.CANARY],
            body,
            b.api,
            self._probes.canary.timeout,
            self._clock,
        )
        return self._settle(b, Kind.CANARY, out.api, out.result)

    async def _metrics(self, b: _Backend) -> bool:
        cfg = b.cfg
        timeout = min(self._probes.readiness.timeout, self._probes.metrics_interval)
        out = await self._io.scrape(
            self._session(),
            f"{cfg.url}{cfg.metrics_path}",
            b.headers[Kind.METRICS],
            timeout,
            self._clock,
            b.metrics,
        )
        if isinstance(out, str):
            self._log_change(b, "metrics", "failing", f"metrics scrape of {cfg.name}: {out}")
            return True
        self._log_change(b, "metrics", "ok", f"metrics scrape of {cfg.name} ok again")
        self._emit(cfg.name, out)
        return False

    async def _connect(self, b: _Backend) -> bool:
        r = await self._io.connect(
            b.cfg.url, self._probes.connect.timeout, self._clock, self._addresses
        )
        if r is None:  # our own shortage (file descriptors, ports): no evidence either way
            return False
        if r.ok:
            self._log_change(b, "connect", "ok", f"new connections to {b.cfg.name} made again")
        else:
            msg = f"new connection to {b.cfg.name} failed: {r.reason}"
            self._log_change(b, "connect", "failing", msg)
        self._emit(b.cfg.name, r)
        return not r.ok

    # ---- helpers -------------------------------------------------------------------------

    def _session(self) -> aiohttp.ClientSession:
        assert self._pool is not None, "probing before start()"
        return self._pool

    def _servable(self, b: _Backend) -> bool:
        """Worth sending inference to: a model to name, and the engine not saying "not ready"."""
        return bool(b.models) and not b.not_ready

    def _settle(self, b: _Backend, kind: Kind, api: Api, result: ProbeResult | None) -> bool:
        name = b.cfg.name
        if api is not b.api:
            log.info("backend %s answers probes on %s", name, api.value)
            b.api = api
        if result is None:
            msg = f"{kind.value} probe of {name}: engine busy (429 or 503 + Retry-After), skipped"
            self._log_change(b, kind.value, "busy", msg)
            return False
        if result.ok and result.reason:  # a canary the engine refused, network path fine
            msg = (
                f"canary of {name} answered {result.reason}: the network path is fine, but "
                "check probes.canary.payload_bytes against the model's context length"
            )
            self._log_change(b, kind.value, "refused", msg)
        else:
            self._log_change(b, kind.value, "ok", f"{kind.value} probe of {name} answered")
        self._emit(name, result)
        return not result.ok

    def _owned(self, b: _Backend) -> bool:
        """This replica runs the backend's micro-inference and canary (another one shares
        its results otherwise); a failing callback counts as owned: probe rather than not."""
        return self._call("owns", self._owns_cb, b.cfg.name) is not False

    def _unstable(self, b: _Backend) -> bool:
        return bool(self._call("unstable", self._unstable_cb, b.cfg.name))

    def _emit(self, name: str, obs: Observation) -> None:
        self._call("emit", self._emit_cb, name, obs)

    def _call(self, what: str, fn: Callable[..., object], *args: object) -> object:
        """Call back into the gateway. Its bug is logged (with traceback the first time, until
        the callback works again) and never allowed to stop probing."""
        try:
            out = fn(*args)
        except Exception:
            if what not in self._failing:
                self._failing.add(what)
                log.exception("prober callback %s(%s) failed", what, args[0])
            return None
        self._failing.discard(what)
        return out

    def _log_change(self, b: _Backend, topic: str, state: str, message: str) -> None:
        """Log `message` only when `topic` changes state ("ok" at start): no line per probe."""
        if b.logged.get(topic, "ok") == state:
            return
        b.logged[topic] = state
        log.log(logging.INFO if state == "ok" else logging.WARNING, "%s", message)


def _auth(cfg: BackendConfig) -> dict[str, str]:
    """``Authorization: Bearer $api_key_env``, read once at start; the key is never logged."""
    if not cfg.api_key_env:
        return {}
    key = os.environ.get(cfg.api_key_env)
    if not key:
        log.warning(
            "backend %s: environment variable %s is not set; probing without a key",
            cfg.name,
            cfg.api_key_env,
        )
        return {}
    return {"Authorization": f"Bearer {key}"}
