"""Engine metrics scrape (R11): ``GET {url}{metrics_path}`` -> `EngineFacts`.

The text is parsed by `engine_metrics` (vLLM, SGLang and TGI dialects, DCGM GPU gauges)
through one `EngineMetricsReader` per backend, which keeps the previous page so vLLM's
prefix-cache hit rate is the rate over the last interval, not since the engine started; a
failed scrape resets it. A scrape that fails, or finds no metric it knows, yields a reason
instead of facts: the core must never see invented numbers, and "unknown" is simply no
observation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields

import aiohttp

from pulsegate.clock import Clock
from pulsegate.health.observations import EngineFacts
from pulsegate.probers.engine_metrics import EngineMetricsReader
from pulsegate.probers.http import FETCH_ERRORS, describe_failure, fetch, http_reason

# vLLM with many models and histogram buckets publishes a few hundred KB; 8 MiB is plenty.
_METRICS_CAP = 8 << 20


async def scrape_engine(
    session: aiohttp.ClientSession,
    url: str,
    headers: Mapping[str, str],
    timeout_s: float,
    clock: Clock,
    reader: EngineMetricsReader,
) -> EngineFacts | str:
    """The engine's facts, or why there are none; never raises for anything the backend does."""
    try:
        reply = await fetch(
            session,
            "GET",
            url,
            headers=headers,
            timeout_s=timeout_s,
            clock=clock,
            cap=_METRICS_CAP,
        )
    except FETCH_ERRORS as e:
        reader.reset()
        return describe_failure(e, timeout_s)
    if reply.status != 200:
        reader.reset()
        return http_reason(reply)
    facts = reader.update(reply.body.decode("utf-8", "replace"))
    if not _known(facts):
        return "no known engine or GPU metrics"
    return facts


def _known(facts: EngineFacts) -> bool:
    return any(getattr(facts, f.name) is not None for f in fields(facts) if f.name != "source")
