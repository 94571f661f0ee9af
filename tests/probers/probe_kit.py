"""Helpers for the prober tests: fast probe settings, a recorder, a prober context, sim
control, a scriptable engine stub, and a fake heartbeat stream.

The sim (`pulsegate sim`, a real process) covers the fault modes; the stub (an aiohttp
server on loopback, in this process) covers engine shapes the sim does not have: chat-only
endpoints, changing model lists, busy answers, request bookkeeping (headers, body sizes,
how many probes of a path were in flight at once). Nothing sleeps to settle: waits poll a
condition with a deadline.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from pulsegate.agent.wire import pb
from pulsegate.clock import SystemClock
from pulsegate.config import (
    BackendConfig,
    CanaryConfig,
    MicroInferenceConfig,
    ProbesConfig,
    ReadinessConfig,
)
from pulsegate.health.observations import EngineFacts, Observation, ProbeKind, ProbeResult
from pulsegate.probers import Prober


def fast_probes(**over: Any) -> ProbesConfig:
    """Probe settings scaled down ~20x so a test sees many rounds in a second."""
    cfg: dict[str, Any] = {
        "readiness": ReadinessConfig(interval=0.2, interval_unstable=0.05, timeout=0.5),
        "micro_inference": MicroInferenceConfig(interval=0.15, jitter=0.05, timeout=0.3),
        "canary": CanaryConfig(interval=0.15, payload_bytes=6144, timeout=0.25),
        "metrics_interval": 0.1,
    }
    cfg.update(over)
    return ProbesConfig(**cfg)


@dataclass
class Recorder:
    """Everything a Prober emitted and every set_models call, with arrival times."""

    seen: list[tuple[float, str, Observation]] = field(default_factory=list)
    models: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)

    def emit(self, name: str, obs: Observation) -> None:
        self.seen.append((time.monotonic(), name, obs))

    def set_models(self, name: str, ids: tuple[str, ...]) -> None:
        self.models.append((name, ids))

    def probes(self, kind: ProbeKind, since: float = 0.0) -> list[ProbeResult]:
        return [
            o
            for t, _, o in self.seen
            if t >= since and isinstance(o, ProbeResult) and o.kind is kind
        ]

    def facts(self) -> list[EngineFacts]:
        return [o for _, _, o in self.seen if isinstance(o, EngineFacts)]

    async def wait_for(
        self,
        kind: ProbeKind,
        pred: Callable[[ProbeResult], bool],
        *,
        since: float = 0.0,
        within: float = 5.0,
    ) -> ProbeResult:
        """The first `kind` result after `since` that satisfies `pred`; fail after `within` s."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            for r in self.probes(kind, since):
                if pred(r):
                    return r
            await asyncio.sleep(0.01)
        raise AssertionError(
            f"no {kind.value} result matching within {within}s: {self.probes(kind, since)[-3:]}"
        )


async def until(cond: Callable[[], object], within: float = 5.0, what: str = "") -> None:
    """Poll `cond` on the event loop until truthy; fail after `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out after {within}s waiting for {what or cond}")


@asynccontextmanager
async def running_prober(
    backends: list[BackendConfig], probes: ProbesConfig | None = None, **kw: Any
) -> AsyncIterator[tuple[Prober, Recorder]]:
    """A started Prober (on a `SystemClock` of this loop unless `clock=` is given); closed
    (tasks awaited) on exit."""
    rec = Recorder()
    kw.setdefault("unstable", lambda name: False)
    kw.setdefault("emit", rec.emit)
    kw.setdefault("set_models", rec.set_models)
    own = "clock" not in kw
    clock = kw.pop("clock") if not own else SystemClock(asyncio.get_running_loop())
    prober = Prober(backends, probes or fast_probes(), rng=random.Random(7), clock=clock, **kw)
    try:
        await prober.start()
        yield prober, rec
    finally:
        await prober.close()
        if own:
            clock.close()


@dataclass
class SimControl:
    url: str
    session: aiohttp.ClientSession

    async def fault(self, mode: str, **params: Any) -> None:
        async with self.session.post(f"{self.url}/sim/fault", json={"mode": mode, **params}) as r:
            assert r.status == 200, await r.text()

    async def stats(self) -> dict[str, Any]:
        async with self.session.get(f"{self.url}/sim/stats") as r:
            return await r.json()  # type: ignore[no-any-return]

    def backend(self, **kw: Any) -> BackendConfig:
        kw.setdefault("models", ("demo-7b",))
        return BackendConfig(name="sim-a", url=self.url, **kw)


# ---- the scriptable stub engine ----------------------------------------------------------


@dataclass
class Hit:
    path: str
    headers: dict[str, str]
    body: bytes


class Stub:
    """An OpenAI-ish engine whose answers a test sets field by field."""

    def __init__(self) -> None:
        self.url = ""
        self.models: list[str] = ["stub-1"]
        self.completions = True  # False: /v1/completions answers 404 (chat-only engine)
        self.infer_status = 200
        self.infer_headers: dict[str, str] = {}
        self.infer_delay = 0.0
        self.delay_probe: dict[str, float] = {}  # x-pulsegate-probe -> extra answer delay
        self.metrics: str | None = None  # the /metrics page; None: 404
        self.hits: list[Hit] = []
        # in flight at once, by (path, x-pulsegate-probe)
        self.inflight: dict[tuple[str, str], int] = {}
        self.max_inflight: dict[tuple[str, str], int] = {}

    def count(self, path: str, probe: str | None = None) -> int:
        """Requests seen on `path` (with that x-pulsegate-probe header, if given)."""
        return sum(
            1
            for h in self.hits
            if h.path == path and (probe is None or h.headers.get("x-pulsegate-probe") == probe)
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        body = await request.read()
        self.hits.append(Hit(path, dict(request.headers), body))
        key = (path, request.headers.get("x-pulsegate-probe", ""))
        self.inflight[key] = self.inflight.get(key, 0) + 1
        self.max_inflight[key] = max(self.max_inflight.get(key, 0), self.inflight[key])
        try:
            await asyncio.sleep(self.delay_probe.get(key[1], 0.0))
            return await self._answer(path)
        finally:
            self.inflight[key] -= 1

    async def _answer(self, path: str) -> web.StreamResponse:
        if path == "/health":
            return web.Response(status=200)
        if path == "/metrics" and self.metrics is not None:
            return web.Response(text=self.metrics, content_type="text/plain")
        if path == "/v1/models":
            data = [{"id": m, "object": "model"} for m in self.models]
            return web.json_response({"object": "list", "data": data})
        if path == "/v1/completions" and not self.completions:
            return web.json_response({"detail": "Not Found"}, status=404)
        if path in ("/v1/completions", "/v1/chat/completions"):
            if self.infer_delay:
                await asyncio.sleep(self.infer_delay)
            if self.infer_status != 200:
                err = {"error": {"message": "busy", "type": "x", "code": self.infer_status}}
                return web.Response(
                    body=orjson.dumps(err),
                    status=self.infer_status,
                    headers=self.infer_headers,
                    content_type="application/json",
                )
            return web.json_response({"id": "x", "choices": [{"index": 0, "text": " pong"}]})
        return web.Response(status=404)


# ---- a fake heartbeat stream -------------------------------------------------------------


class FakeStream:
    """Where the heartbeat units write (`heartbeat_pings.Sender`): records every ping;
    `accept = False` is back-pressure."""

    def __init__(self) -> None:
        self.sent: list[pb.Ping] = []
        self.accept = True

    def send(self, payload: bytes) -> bool:
        if not self.accept:
            return False
        self.sent.append(pb.Ping.FromString(payload))
        return True
