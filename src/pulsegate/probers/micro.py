"""One-token inference probes: the micro-inference (R4) and the synthetic canary (R19, R20).

Both POST a one-token request through the real engine under a hard deadline (connect +
send + first byte + the few bytes of answer) and differ only in body and verdict:

- micro-inference: ``"ping"``, proves the compute pipeline, not just the process, is alive
  ("process up, CUDA dead"). ``ok`` only for a 2xx completion with ``choices``.
- canary: a 4-8 KB prompt, proves large requests cross the network to the engine and back.
  A 4xx answer (prompt too long for a small model, a rejected field) still proves the path,
  so it is ``ok`` with the status as reason: a misfitting canary must not isolate a fleet.

Which endpoint: ``/v1/completions`` first; a 404 there retries ``/v1/chat/completions``
within the same deadline (and the reverse), and the endpoint that answered is returned so
the caller remembers it per backend. A 404 from both (vLLM's "model does not exist") is
reported as it is and changes nothing. An embedding-only backend (``apis: [embeddings]``,
`payload.probe_api`) is probed on ``/v1/embeddings`` and nowhere else: ``ok`` for a 2xx
list of embeddings (``data``).

A busy engine (429, or 503 with Retry-After) is neither healthy nor sick: the result is
None, so the core hears nothing rather than a failure (R17: busy must not look sick).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
import orjson

from pulsegate.clock import Clock
from pulsegate.health.observations import ProbeKind, ProbeResult
from pulsegate.probers.http import FETCH_ERRORS, Reply, describe_failure, fetch, http_reason
from pulsegate.probers.payload import Api

_ANSWER_CAP = 256 * 1024  # a one-token completion is a few hundred bytes


@dataclass(frozen=True, slots=True)
class Inference:
    """A one-token probe's result (None: the engine is busy, no evidence) and the endpoint
    to use next time."""

    result: ProbeResult | None
    api: Api


async def probe_inference(
    kind: ProbeKind,
    session: aiohttp.ClientSession,
    base_url: str,
    headers: Mapping[str, str],
    body: Callable[[Api], bytes],
    api: Api,
    timeout_s: float,
    clock: Clock,
) -> Inference:
    """One micro-inference or canary; never raises for anything the backend does."""
    t0 = clock.now()

    async def post(endpoint: Api, left: float) -> Reply:
        return await fetch(
            session,
            "POST",
            base_url + endpoint.value,
            headers=headers,
            body=body(endpoint),
            timeout_s=left,
            clock=clock,
            cap=_ANSWER_CAP,
        )

    try:
        reply = await post(api, timeout_s)
        if reply.status == 404 and api is not Api.EMBEDDINGS:
            other = Api.CHAT if api is Api.COMPLETIONS else Api.COMPLETIONS
            left = timeout_s - (clock.now() - t0)
            if left <= 0:
                raise TimeoutError
            second = await post(other, left)
            if second.status != 404:
                reply, api = second, other
    except FETCH_ERRORS as e:
        return Inference(ProbeResult(kind, False, None, describe_failure(e, timeout_s)), api)
    return Inference(_judge(kind, reply, api), api)


def _judge(kind: ProbeKind, reply: Reply, api: Api = Api.COMPLETIONS) -> ProbeResult | None:
    status = reply.status
    if status == 429 or (status == 503 and reply.retry_after):
        return None
    if 200 <= status < 300:
        field, what = (
            ("data", "embeddings") if api is Api.EMBEDDINGS else ("choices", "a completion")
        )
        if _is_answer(reply.body, field):
            return ProbeResult(kind, True, reply.headers_s)
        return ProbeResult(kind, False, reply.headers_s, f"bad response: not {what}")
    if kind is ProbeKind.CANARY and 400 <= status < 500 and status != 408:
        return ProbeResult(kind, True, reply.headers_s, http_reason(reply))
    return ProbeResult(kind, False, reply.headers_s, http_reason(reply))


def _is_answer(body: bytes, field: str) -> bool:
    """A JSON object with a list `field` (`choices`; `data` for embeddings)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(doc, dict) and isinstance(doc.get(field), list)
