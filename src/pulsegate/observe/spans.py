"""A finished exchange as OTLP spans: the request's SERVER span and a CLIENT span per attempt.

Pure: an `Exchange`, the ids the request path drew for it (`traces.TraceIds`) and an
`otlp.Encoder` in, encoded `Span` messages out. Run on the tracer's exporter thread, after
the request ended, so every time is already known: the exchange's monotonic times are
anchored at its wall-clock arrival (`Exchange.wall`) for the spans' Unix nanoseconds.

Names follow the GenAI semantic conventions: `{gen_ai.operation.name} {gen_ai.request.model}`
(`chat demo-7b`), the request span and its attempt spans alike (a client span of a GenAI
call is named the same way).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from pulsegate.health.verdict import Verdict
from pulsegate.observe.otlp import CLIENT, ERROR, HAS_IS_REMOTE, IS_REMOTE, SERVER, Encoder, Value
from pulsegate.proxy.exchange import Exchange

# `gen_ai.operation.name` per api label (the conventions' well-known values).
_OPERATIONS = {
    "chat": "chat",
    "responses": "chat",
    "messages": "chat",
    "completions": "text_completion",
    "embeddings": "embeddings",
}


@dataclass(slots=True)
class AttemptIds:
    span_id: int
    verdict: Verdict | None  # the backend's when the attempt started (None: not routable)
    url: str  # the backend's


@dataclass(slots=True)
class TraceIds:
    """What the request path fixed of one request's trace (`Exchange.trace`)."""

    trace_id: int
    span_id: int
    parent_id: int  # the client's span, 0: a root span
    sampled: bool
    # Per attempt index (`Exchange.attempts`): its span id and what was known at its start.
    attempts: dict[int, AttemptIds] = field(default_factory=dict)


@functools.lru_cache(maxsize=256)
def _address(url: str) -> tuple[str | None, int]:
    """`server.address`, `server.port` of a backend URL."""
    u = urlsplit(url)
    return u.hostname, u.port or (443 if u.scheme == "https" else 80)


def operation(api: str) -> str:
    return _OPERATIONS.get(api, api)


def spans(ex: Exchange, t: TraceIds, enc: Encoder, rng: random.Random) -> list[bytes]:
    """The encoded spans of `ex`: the request's first, then one per attempt in order.
    `rng`: span ids for attempts that never went out (no id was drawn for them)."""
    base_ns = ex.wall - ex.start  # monotonic clock seconds -> Unix seconds
    group, number = enc.group, enc.number
    op = operation(ex.api)
    model = ex.model
    name = f"{op} {model}" if model else op
    what: tuple[tuple[str, Value], ...] = (
        ("gen_ai.operation.name", op),
        ("http.request.method", "POST"),
        ("url.path", ex.path),
    )
    if model is not None:
        what += (("gen_ai.request.model", model),)
    failed = ex.error is not None or ex.status >= 500
    how: tuple[tuple[str, Value], ...] = (
        ("http.response.status_code", ex.status),
        ("pulsegate.stream", ex.stream),
        ("pulsegate.attempts", len(ex.attempts)),
        ("pulsegate.resumes", ex.resumes),
    )
    if failed:
        how += (("error.type", ex.error or str(ex.status)),)
    if ex.key is not None:
        how += (("pulsegate.key", ex.key),)  # the key's name, never the key
    attrs = [group(what), group(how)]
    if ex.tokens_in is not None:
        attrs.append(number("gen_ai.usage.input_tokens", ex.tokens_in))
    if ex.tokens_out is not None:
        attrs.append(number("gen_ai.usage.output_tokens", ex.tokens_out))
    if ex.ttft is not None:
        attrs.append(number("pulsegate.ttft_ms", round(ex.ttft * 1000, 3)))
    trace_id = t.trace_id.to_bytes(16, "big")
    flags = (1 | HAS_IS_REMOTE | IS_REMOTE) if t.parent_id else (1 | HAS_IS_REMOTE)
    out = [
        enc.span(
            trace_id,
            t.span_id,
            t.parent_id,
            name,
            SERVER,
            int((ex.start + base_ns) * 1e9),
            int((ex.end + base_ns) * 1e9),
            b"".join(attrs),
            ERROR if failed else 0,
            ex.error,
            flags,
        )
    ]
    for i, a in enumerate(ex.attempts):
        ids = t.attempts.get(i)
        ok = a.outcome == "ok"
        pairs: tuple[tuple[str, Value], ...] = (
            ("gen_ai.operation.name", op),
            ("pulsegate.backend", a.backend),
            ("pulsegate.attempt.kind", "resume" if a.resume else ("first" if i == 0 else "retry")),
        )
        if model is not None:
            pairs += (("gen_ai.request.model", model),)
        if a.status is not None:
            pairs += (("http.response.status_code", a.status),)
        if not ok:
            # An attempt with no outcome never went out (a resume whose tokens had all
            # reached the client already).
            pairs += (("error.type", a.outcome or "not_sent"),)
        score = b""
        if ids is not None:
            host, port = _address(ids.url)
            if host is not None:
                pairs += (("server.address", host), ("server.port", port))
            v = ids.verdict
            if v is not None:
                pairs += (("pulsegate.backend.state", v.state.value),)
                score = number("pulsegate.backend.score", float(v.score))
        span_id = ids.span_id if ids is not None else rng.getrandbits(64) or 1
        out.append(
            enc.span(
                trace_id,
                span_id,
                t.span_id,
                name,
                CLIENT,
                int((a.start + base_ns) * 1e9),
                int(((a.end or ex.end) + base_ns) * 1e9),
                group(pairs) + score,
                0 if ok else ERROR,
                None if ok else a.outcome or None,
            )
        )
    return out


__all__ = ["AttemptIds", "TraceIds", "operation", "spans"]
