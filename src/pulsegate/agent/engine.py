"""What the agent knows about its engine and GPU: a snapshot refreshed in the background, and
the micro-inference it runs on request.

A pong must cost microseconds, so nothing is fetched while answering one: a task reads the
engine's ``/metrics`` and ``GET /health`` (and NVML or a DCGM exporter) every `refresh`
seconds and swaps in a new immutable `Snapshot`. Each source has its own deadline; a source
that fails or times out makes its facts unknown (None) in the next snapshot, never stale
numbers passed off as fresh (`Snapshot.taken_at` tells how old the figures are).

Readiness (R27) is the engine's own ``/health``: 200 means ready, any other answer is "up,
not ready" with the status, no answer is "unreachable" with the reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import aiohttp
import orjson

from pulsegate.agent import periodic
from pulsegate.agent.gpu import GpuChoice, Nvml, NvmlUnavailable
from pulsegate.clock import Clock
from pulsegate.health.observations import EngineFacts, ProbeKind
from pulsegate.probers.engine_metrics import (
    GPU_NAMES,
    EngineMetricsReader,
    dialect,
    gpu_facts,
    parse_prometheus,
)
from pulsegate.probers.http import (
    FETCH_ERRORS,
    PROBE_HEADER,
    describe_failure,
    fetch,
    http_reason,
)
from pulsegate.probers.micro import probe_inference
from pulsegate.probers.payload import Api, micro_body

log = logging.getLogger("pulsegate.agent")

_GPU_FIELDS = ("gpu_free_ratio", "gpu_used_mb", "gpu_total_mb", "gpu_temp_c", "gpu_util")
_METRICS_CAP = 8 << 20
_SOURCE_TIMEOUT_S = 1.0  # per source and refresh; a hung engine shows up as unknown facts


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything a pong reports, as of `taken_at` (the agent's monotonic seconds).
    `version` changes whenever anything but `taken_at` does."""

    facts: EngineFacts
    ready: bool | None  # None until /health has been asked once
    status: str  # why not ready or unreachable; "" when ready
    reachable: bool  # /health answered (any status)
    dialect: str  # "vllm", "sglang", "tgi" or ""
    gpu_source: str  # "nvml", "dcgm", "engine" or ""
    taken_at: float
    version: int

    def same_as(self, other: Snapshot) -> bool:
        return (
            self.facts == other.facts
            and self.ready == other.ready
            and self.status == other.status
            and self.reachable == other.reachable
            and self.dialect == other.dialect
            and self.gpu_source == other.gpu_source
        )


@dataclass(frozen=True, slots=True)
class MicroOutcome:
    """One micro-inference at the engine. `busy`: 429 or 503 + Retry-After (no evidence)."""

    ok: bool
    latency_s: float | None
    error: str = ""
    busy: bool = False


class EngineWatcher:
    """Keeps `snapshot` fresh while running; runs micro-inferences on request."""

    def __init__(
        self,
        engine_url: str,
        gpu: GpuChoice,
        model: str | None,
        *,
        refresh: float = 0.15,
        clock: Clock,
        session: aiohttp.ClientSession,
        micro_session: aiohttp.ClientSession | None = None,
        api: Api = Api.COMPLETIONS,
    ) -> None:
        self.engine_url = engine_url.rstrip("/")
        self._gpu = gpu
        self._model = model
        self._model_discovered = False
        self._api = api  # completions and chat fall back to each other on a 404
        self._refresh = refresh
        self._clock = clock
        # `session` reads /health, /metrics and DCGM; `micro_session` (its own pool when
        # given) carries micro-inferences, so a slow engine answering them never holds up
        # the readiness and facts refresh.
        self._session = session
        self._micro_session = micro_session if micro_session is not None else session
        self._nvml: Nvml | None = None
        self._gpu_note = ""
        self._reader = EngineMetricsReader(gpu=False)
        # The last /metrics page read (None: unreadable): the GPU fault watcher reads its
        # DCGM fields from it rather than fetch the page a second time.
        self.metrics_page: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._changed: list[Callable[[Snapshot], None]] = []
        self.snapshot = Snapshot(
            EngineFacts(source="agent"), None, "starting", False, "", "", clock.now(), 0
        )

    @property
    def gpu_description(self) -> str:
        """Where GPU figures come from, for the startup log line."""
        return self._gpu_note

    def on_change(self, callback: Callable[[Snapshot], None]) -> None:
        """Call `callback(snapshot)` from the loop whenever a refresh changes something."""
        self._changed.append(callback)

    async def start(self) -> None:
        """Open the GPU source (raises NvmlUnavailable for an explicit ``nvml`` that cannot
        work), take a first snapshot, then keep refreshing in a background task."""
        mode = self._gpu.mode
        if mode in ("auto", "nvml"):
            try:
                self._nvml = await asyncio.to_thread(Nvml.open)
                self._gpu_note = f"nvml ({self._nvml.device_count} GPU)"
            except NvmlUnavailable as e:
                if mode == "nvml":
                    raise
                self._gpu_note = f"engine /metrics if it has DCGM gauges (no NVML: {e})"
        elif mode == "dcgm":
            self._gpu_note = f"dcgm-exporter {self._gpu.dcgm_url}"
        elif mode == "engine":
            self._gpu_note = "engine /metrics (DCGM gauges)"
        else:
            self._gpu_note = "none (GPU figures reported unknown)"
        await self.refresh_once()
        self._task = asyncio.create_task(self._run(), name="agent-refresh")

    async def stop(self) -> None:
        await periodic.cancel(self._task)
        self._task = None
        if self._nvml is not None:
            await asyncio.to_thread(self._nvml.close)
            self._nvml = None

    async def _run(self) -> None:
        await periodic.every(
            self._refresh, self._clock.now, self.refresh_once, "refreshing the engine snapshot"
        )

    async def refresh_once(self) -> None:
        """Read every source once (concurrently) and publish the new snapshot."""
        metrics_text, (ready, status, reachable), gpu = await asyncio.gather(
            self._fetch_metrics(), self._fetch_health(), self._read_gpu()
        )
        self.metrics_page = metrics_text
        if metrics_text is None:
            self._reader.reset()
            engine = EngineFacts()
            kind = ""
            engine_gpu: EngineFacts | None = None
        else:
            engine = self._reader.update(metrics_text)
            m = self._reader.last
            engine_gpu = gpu_facts(m) if any(n in m for n in GPU_NAMES) else None
            kind = dialect(m)
        gpu_source = ""
        if gpu is not None:
            gpu_source = gpu.source
        elif self._gpu.mode in ("auto", "engine") and engine_gpu is not None:
            gpu, gpu_source = engine_gpu, "engine"
        facts = replace(
            engine,
            source="agent",
            **{f: (getattr(gpu, f) if gpu is not None else None) for f in _GPU_FIELDS},
        )
        old = self.snapshot
        snap = Snapshot(
            facts, ready, status, reachable, kind, gpu_source, self._clock.now(), old.version
        )
        if not snap.same_as(old):
            snap = replace(snap, version=old.version + 1)
            self.snapshot = snap
            for cb in self._changed:
                cb(snap)
        else:
            self.snapshot = snap

    async def _fetch_metrics(self) -> str | None:
        try:
            reply = await fetch(
                self._session,
                "GET",
                self.engine_url + "/metrics",
                headers={PROBE_HEADER: "metrics"},
                timeout_s=_SOURCE_TIMEOUT_S,
                clock=self._clock,
                cap=_METRICS_CAP,
            )
        except FETCH_ERRORS:
            return None
        if reply.status != 200:
            return None
        return reply.body.decode("utf-8", "replace")

    async def _fetch_health(self) -> tuple[bool, str, bool]:
        try:
            reply = await fetch(
                self._session,
                "GET",
                self.engine_url + "/health",
                headers={PROBE_HEADER: "readiness"},
                timeout_s=_SOURCE_TIMEOUT_S,
                clock=self._clock,
                cap=64 * 1024,
            )
        except FETCH_ERRORS as e:
            return False, "unreachable: " + describe_failure(e, _SOURCE_TIMEOUT_S), False
        if reply.status == 200:
            return True, "", True
        return False, http_reason(reply, "/health"), True

    async def _read_gpu(self) -> EngineFacts | None:
        if self._nvml is not None:
            try:
                return await asyncio.to_thread(self._nvml.read)
            except Exception as e:  # NVML errors are per call; report unknown, keep trying
                log.warning("agent: NVML read failed: %s", e)
                return None
        if self._gpu.mode == "dcgm":
            try:
                reply = await fetch(
                    self._session,
                    "GET",
                    self._gpu.dcgm_url,
                    headers={},
                    timeout_s=_SOURCE_TIMEOUT_S,
                    clock=self._clock,
                    cap=_METRICS_CAP,
                )
            except FETCH_ERRORS:
                return None
            if reply.status != 200:
                return None
            g = gpu_facts(parse_prometheus(reply.body.decode("utf-8", "replace"), GPU_NAMES))
            return g if _any_gpu(g) else None
        return None

    # -- micro-inference -----------------------------------------------------------------

    async def micro(self, timeout_s: float) -> MicroOutcome:
        """A one-token completion through the local engine, within `timeout_s`."""
        t0 = self._clock.now()
        model = await self._resolve_model(timeout_s)
        if isinstance(model, MicroOutcome):
            return model
        left = timeout_s - (self._clock.now() - t0)
        if left <= 0:
            return MicroOutcome(False, None, f"timeout after {timeout_s:.3g}s (listing models)")
        inf = await probe_inference(
            ProbeKind.MICRO,
            self._micro_session,
            self.engine_url,
            {PROBE_HEADER: "micro"},
            lambda api: micro_body(model, api),
            self._api,
            left,
            self._clock,
        )
        self._api = inf.api
        r = inf.result
        if r is None:
            return MicroOutcome(False, None, "engine busy", busy=True)
        if not r.ok and self._model_discovered and "404" in r.reason:
            self._model = None  # the model list changed: ask again next time
        return MicroOutcome(r.ok, r.latency_s, r.reason)

    async def _resolve_model(self, timeout_s: float) -> str | MicroOutcome:
        if self._model:
            return self._model
        try:
            reply = await fetch(
                self._micro_session,
                "GET",
                self.engine_url + "/v1/models",
                headers={PROBE_HEADER: "micro"},
                timeout_s=timeout_s,
                clock=self._clock,
                cap=1 << 20,
            )
        except FETCH_ERRORS as e:
            return MicroOutcome(False, None, "listing models: " + describe_failure(e, timeout_s))
        if reply.status != 200:
            return MicroOutcome(False, None, http_reason(reply, "/v1/models"))
        try:
            data = orjson.loads(reply.body).get("data") or []
            model = str(data[0]["id"])
        except (orjson.JSONDecodeError, AttributeError, LookupError, TypeError):
            return MicroOutcome(False, None, "engine lists no model on /v1/models")
        self._model, self._model_discovered = model, True
        return model


def _any_gpu(f: EngineFacts) -> bool:
    return any(getattr(f, name) is not None for name in _GPU_FIELDS)
