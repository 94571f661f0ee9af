"""One client request, parsed once: the few fields routing needs, nothing else. Pure.

`parse` reads the body with orjson and looks at `model`, `stream`, `max_tokens`, `n`, the
standard fields' types (`validate.py`), `stop` and the session key; the original bytes go
upstream unchanged. A request that cannot be served gets a `Rejection` (status, message,
code), which the HTTP layer turns into OpenAI's error shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from pulsegate.balancer import prefix_key
from pulsegate.proxy.stops import stop_strings
from pulsegate.proxy.validate import fewer_choices, invalid_field

if TYPE_CHECKING:
    from pulsegate.config import BackendConfig

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# The `api` label of each proxied path (metrics, access log, traces).
API: dict[str, str] = {CHAT: "chat", COMPLETIONS: "completions"}
# A non-streamed request without max_tokens is allowed this many tokens' worth of time.
DEFAULT_MAX_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why the request is refused before any backend sees it."""

    status: int
    message: str
    code: str
    headers: Mapping[str, str] | None = None  # e.g. a 429's Retry-After


@dataclass(frozen=True, slots=True)
class Limits:
    """What the parse needs of the config, computed once."""

    max_body: int
    per_try: float  # a stream's wait for its first token (retry.per_try_timeout)
    per_token: float  # a non-streamed answer's extra wait per requested token
    request_timeout: float
    prefix_chars: int  # routing.prefix_affinity_chars; 0: off
    backends: tuple[BackendConfig, ...]


@dataclass(slots=True)  # not frozen: a frozen init costs a setattr call per field, per request
class ProxyRequest:
    path: str
    body: bytes
    doc: dict[str, Any]
    model: str
    stream: bool
    session_key: str | None
    # Backends that cannot serve it (`n` beyond their `max_n`): never picked.
    avoid: Sequence[str]
    # Seconds an attempt may wait for its first byte.
    deadline: float
    stops: tuple[str, ...]


def parse(
    path: str, body: bytes, session_header: str | None, limits: Limits
) -> ProxyRequest | Rejection:
    """The request at `path` with `body` (already read, within `limits.max_body`) and the
    client's `x-session-id` header, or why it is refused."""
    if len(body) > limits.max_body:
        return too_large(limits.max_body)
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        return Rejection(400, f"request body is not valid JSON: {e}", "invalid_json")
    if not isinstance(doc, dict):
        return Rejection(400, "request body must be a JSON object", "invalid_request")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        return Rejection(400, "'model' is required and must be a string", "missing_model")
    chat = path == CHAT
    if chat:
        msgs = doc.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return Rejection(
                400, "'messages' is required and must be a non-empty list", "missing_messages"
            )
    elif "prompt" not in doc:
        return Rejection(400, "'prompt' is required", "missing_prompt")
    why = invalid_field(doc, chat)
    if why is not None:
        return Rejection(400, why, "invalid_request")
    avoid, why = fewer_choices(doc, model, limits.backends)
    if why is not None:
        return Rejection(400, why, "invalid_request")
    stream = doc.get("stream") is True
    return ProxyRequest(
        path=path,
        body=body,
        doc=doc,
        model=model,
        stream=stream,
        session_key=session_key(doc, session_header, limits.prefix_chars),
        avoid=avoid,
        deadline=first_byte_deadline(doc, stream, limits),
        stops=stop_strings(doc),
    )


def too_large(limit: int) -> Rejection:
    return Rejection(413, f"request body exceeds the {limit}-byte limit", "request_too_large")


def session_key(doc: dict[str, Any], header: str | None, prefix_chars: int) -> str | None:
    """The affinity key: the `x-session-id` header, else the `user` field, else (with
    prefix affinity on) a digest of the prompt's first `prefix_chars` characters."""
    if header is not None:
        return header
    user = doc.get("user")
    if isinstance(user, str) and user:
        return user
    if prefix_chars:
        return prefix_key(prompt_head(doc, prefix_chars), prefix_chars)
    return None


def first_byte_deadline(doc: dict[str, Any], stream: bool, limits: Limits) -> float:
    """Seconds an attempt may wait for its first byte.

    A stream's first byte is its first token: `per_try_timeout`. A non-streamed answer
    arrives whole, so its first byte waits for the entire generation; allowing
    `per_token_timeout` per requested token keeps long legitimate generations from being
    cut (R17) while a hung backend is still left within seconds for short ones.
    """
    if stream:
        return limits.per_try
    mt = doc.get("max_completion_tokens", doc.get("max_tokens"))
    tokens = mt if isinstance(mt, int) and mt > 0 else DEFAULT_MAX_TOKENS
    return min(limits.request_timeout, limits.per_try + tokens * limits.per_token)


def prompt_head(doc: dict[str, Any], k: int) -> str:
    """The first k characters of the prompt (system prompt + first turn) for prefix affinity."""
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        return prompt[:k]
    parts: list[str] = []
    n = 0
    for m in doc.get("messages") or ():
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            parts.append(c)
            n += len(c)
            if n >= k:
                break
    return "".join(parts)[:k]
