"""Readiness (R27): ask the engine itself whether it can serve, never a bare TCP check.

Two requests under one deadline: ``GET /health`` (is the engine process up and its engine
loop alive) then ``GET /v1/models`` (is the model loaded). The outcome is one
``ProbeResult(READINESS, ok, latency, reason, ready)`` where

- ``ok``    the engine gave a sane answer to the probe (any readiness verdict at all);
- ``ready`` it can serve now: up, and every configured model listed (or, with no models
  configured, at least one model listed).

| engine answers                                   | ok    | ready | reason                    |
| ------------------------------------------------ | ----- | ----- | ------------------------- |
| /health 2xx, models listed                       | True  | True  | ""                        |
| /health 2xx, a configured model missing          | True  | False | model(s) not listed: m    |
| /health 503 (loading, warming: vLLM, TGI, SGLang)| True  | False | health HTTP 503: msg      |
| /v1/models 503 or an empty list                  | True  | False | ...                       |
| /health 404 (no such endpoint): /v1/models alone | as /v1/models                     |
| /v1/models 404, models configured: /health alone | True  | True  | ""                        |
| /health other 4xx/5xx (vLLM: 500 = engine dead)  | False | False | health HTTP 500: msg      |
| refused, reset, timeout, garbage                 | False | False | connection refused, ...   |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
import orjson

from pulsegate.clock import Clock
from pulsegate.health.observations import ProbeKind, ProbeResult
from pulsegate.probers.http import (
    FETCH_ERRORS,
    Reply,
    describe_failure,
    fetch,
    http_reason,
    is_refused,
)

# Statuses that mean "up, but not ready yet": the engine is loading or warming the model.
_NOT_READY = frozenset({503, 425})


@dataclass(frozen=True, slots=True)
class Readiness:
    """A readiness probe's result plus the model ids /v1/models listed (None: not known)."""

    result: ProbeResult
    listed: tuple[str, ...] | None = None


async def probe_readiness(
    session: aiohttp.ClientSession,
    base_url: str,
    headers: Mapping[str, str],
    configured: tuple[str, ...],
    timeout_s: float,
    clock: Clock,
) -> Readiness:
    """One readiness probe; never raises for anything the backend does."""
    t0 = clock.now()

    def result(ok: bool, ready: bool, reason: str = "") -> ProbeResult:
        return ProbeResult(ProbeKind.READINESS, ok, clock.now() - t0, reason, ready)

    def down(reason: str, refused: bool = False) -> Readiness:
        return Readiness(ProbeResult(ProbeKind.READINESS, False, None, reason, False, refused))

    try:
        health = await fetch(
            session,
            "GET",
            f"{base_url}/health",
            headers=headers,
            timeout_s=timeout_s,
            clock=clock,
            cap=64 * 1024,
        )
        if health.status in _NOT_READY:
            return Readiness(result(True, False, http_reason(health, "health")))
        if health.status >= 300 and health.status != 404:
            return Readiness(result(False, False, http_reason(health, "health")))
        left = timeout_s - (clock.now() - t0)
        if left <= 0:
            raise TimeoutError
        models = await fetch(
            session,
            "GET",
            f"{base_url}/v1/models",
            headers=headers,
            timeout_s=left,
            clock=clock,
        )
    except FETCH_ERRORS as e:
        return down(describe_failure(e, timeout_s), is_refused(e))

    has_health = health.status != 404
    if models.status == 404:
        if has_health and configured:
            return Readiness(result(True, True))  # nothing to list against: trust /health
        what = "no /v1/models" if has_health else "neither /health nor /v1/models found"
        return Readiness(result(True, False, what))
    if models.status in _NOT_READY:
        return Readiness(result(True, False, http_reason(models, "models")))
    if models.status >= 300:
        return Readiness(result(False, False, http_reason(models, "models")))
    listed = _model_ids(models)
    if listed is None:
        return Readiness(result(False, False, "models: not an OpenAI model list"))
    if configured:
        missing = [m for m in configured if m not in listed]
        if missing:
            return Readiness(result(True, False, f"model(s) not listed: {', '.join(missing)}"))
        return Readiness(result(True, True), listed)
    if not listed:
        return Readiness(result(True, False, "no models listed"), listed)
    return Readiness(result(True, True), listed)


def _model_ids(reply: Reply) -> tuple[str, ...] | None:
    """Ids from ``{"data": [{"id": ...}, ...]}``, in listed order; None if not that shape."""
    try:
        doc = orjson.loads(reply.body)
    except orjson.JSONDecodeError:
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return None
    ids = [m.get("id") for m in data if isinstance(m, dict)]
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, str) and i))
