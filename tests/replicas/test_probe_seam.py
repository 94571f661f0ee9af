"""The prober's `owns` seam: a replica sends a backend's micro-inference and canary only
while it owns the backend; readiness always (each replica keeps its own)."""

from __future__ import annotations

import asyncio
import collections
import random
from typing import Any

from pulsegate.clock import SystemClock
from pulsegate.config import (
    BackendConfig,
    CanaryConfig,
    MicroInferenceConfig,
    ProbesConfig,
    ReadinessConfig,
)
from pulsegate.health.observations import ProbeKind, ProbeResult
from pulsegate.probers import Prober
from pulsegate.probers.micro import Inference
from pulsegate.probers.readiness import Readiness
from pulsegate.probers.scheduler import ProbeIO

PROBES = ProbesConfig(
    readiness=ReadinessConfig(interval=0.05, interval_unstable=0.05, timeout=0.5),
    micro_inference=MicroInferenceConfig(interval=0.05, jitter=0.0, timeout=0.05),
    canary=CanaryConfig(interval=0.05, timeout=0.05),
)


async def test_only_the_owner_sends_inference_probes() -> None:
    """Not owned: readiness only. Owned: micro-inference and canary as well."""
    sent: collections.Counter[ProbeKind] = collections.Counter()
    mine = {"a": False}

    async def readiness(*args: Any) -> Readiness:
        sent[ProbeKind.READINESS] += 1
        return Readiness(ProbeResult(ProbeKind.READINESS, True, 0.001, ready=True))

    async def inference(kind: ProbeKind, session: Any, url: str, h: Any, body: Any, api: Any,
                        timeout_s: float, clock: Any) -> Inference:  # fmt: skip
        sent[kind] += 1
        return Inference(ProbeResult(kind, True, 0.001), api)

    loop = asyncio.get_running_loop()
    clock = SystemClock(loop)
    prober = Prober(
        [BackendConfig(name="a", url="http://127.0.0.1:9", models=("m",))],
        PROBES,
        emit=lambda name, obs: None,
        unstable=lambda name: False,
        set_models=lambda name, models: None,
        rng=random.Random(1),
        owns=lambda name: mine[name],
        clock=clock,
        io=ProbeIO(readiness=readiness, inference=inference),
    )
    await prober.start()
    try:
        for _ in range(200):  # until readiness has run a few rounds (10 s at most)
            if sent[ProbeKind.READINESS] >= 5:
                break
            await asyncio.sleep(0.05)
        assert sent[ProbeKind.READINESS] >= 5
        assert sent[ProbeKind.MICRO] == sent[ProbeKind.CANARY] == 0
        mine["a"] = True
        prober.poke("a")
        for _ in range(200):
            if sent[ProbeKind.MICRO] >= 2 and sent[ProbeKind.CANARY] >= 2:
                break
            await asyncio.sleep(0.05)
        assert sent[ProbeKind.MICRO] >= 2 and sent[ProbeKind.CANARY] >= 2
    finally:
        await prober.close()
        clock.close()
