"""One client request, parsed once: the few fields routing needs, nothing else. Pure.

`parse` reads the body with orjson and looks at `model`, the API's own required fields
(`fields.py`), `stream`, the output bound (`max_tokens`, `max_output_tokens`), `n`, the
standard fields' types (`validate.py`), `stop` and the session key; the original bytes go
upstream unchanged. A request that cannot be served gets a `Rejection` (status, message,
code), which the HTTP layer turns into the API's error shape (`errors.py`).

Which backends serve which API (`backends[].apis`) is settled here too, from the config
alone: those that do not serve the request's API go in its `avoid` list (never picked), and
when that is every backend that may serve its model the answer is 404 `api_not_served`,
before `route` looks at the model (an API nobody serves is the stronger statement, and it
needs no verdicts). With every backend serving every API (vLLM's default) this costs one
dict lookup.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from pulsegate.balancer import prefix_key
from pulsegate.proxy.fields import SPECS, anthropic_user
from pulsegate.proxy.stops import stop_strings
from pulsegate.proxy.validate import fewer_choices

if TYPE_CHECKING:
    from pulsegate.config import BackendConfig, Config

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# The `api` label of each proxied path (metrics, access log, traces), vLLM's paths and
# aliases: the path the client used is the one forwarded.
API: dict[str, str] = {
    CHAT: "chat",
    COMPLETIONS: "completions",
    "/v1/responses": "responses",
    "/v1/embeddings": "embeddings",
    "/v1/messages": "messages",
    "/v1/rerank": "rerank",
    "/rerank": "rerank",
    "/v2/rerank": "rerank",
    "/v1/score": "score",
    "/score": "score",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
}
# The `backends[].apis` entry an API label needs, where it is not the label itself.
_SERVED_AS = {"detokenize": "tokenize"}
# A non-streamed request without max_tokens is allowed this many tokens' worth of time.
DEFAULT_MAX_TOKENS = 1024
# The APIs with OpenAI's `n` and `stop`, and a prompt for prefix affinity.
_OPENAI = frozenset(("chat", "completions"))


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
    # API label -> the backends that do not serve it (only APIs some backend lacks).
    lacking: dict[str, tuple[str, ...]] = field(init=False)

    def __post_init__(self) -> None:
        lacking: dict[str, tuple[str, ...]] = {}
        for label in SPECS:
            api = _SERVED_AS.get(label, label)
            names = tuple(b.name for b in self.backends if api not in b.apis)
            if names:
                lacking[label] = names
        object.__setattr__(self, "lacking", lacking)

    @classmethod
    def of(cls, config: Config) -> Limits:
        """The parse's limits as `config` sets them (the proxy's and the endpoint picker's)."""
        r = config.retry
        return cls(
            max_body=config.gateway.max_body_bytes,
            per_try=r.per_try_timeout,
            per_token=r.per_token_timeout,
            request_timeout=r.request_timeout,
            prefix_chars=config.routing.prefix_affinity_chars,
            backends=tuple(config.backends),
        )


class ProxyRequest:
    """A parsed request, made once per request: a plain class, so that mypyc compiles its
    `__init__` (a dataclass's is generated and stays interpreted; a frozen one also costs a
    setattr call per field)."""

    __slots__ = (
        "api",
        "avoid",
        "body",
        "deadline",
        "doc",
        "model",
        "path",
        "session_key",
        "stops",
        "stream",
    )

    def __init__(
        self,
        path: str,
        api: str,
        body: bytes,
        doc: dict[str, Any],
        model: str,
        stream: bool,
        session_key: str | None,
        avoid: Sequence[str],
        deadline: float,
        stops: tuple[str, ...],
    ) -> None:
        self.path = path
        self.api = api  # the `API` label: chat, completions, responses, messages, embeddings...
        self.body = body
        self.doc = doc
        self.model = model
        self.stream = stream
        self.session_key = session_key
        # Backends that cannot serve it (not its API, `n` beyond their `max_n`): never picked.
        self.avoid = avoid
        # Seconds an attempt may wait for its first byte.
        self.deadline = deadline
        self.stops = stops


def parse(
    path: str, body: bytes, session_header: str | None, limits: Limits
) -> ProxyRequest | Rejection:
    """The request at `path` (a key of `API`) with `body` (already read, within
    `limits.max_body`) and the client's `x-session-id` header, or why it is refused."""
    if len(body) > limits.max_body:
        return too_large(limits.max_body)
    if len(body) > DENSE_FROM:
        dense = too_dense(body)
        if dense is not None:
            return dense
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        return Rejection(400, f"request body is not valid JSON: {e}", "invalid_json")
    if not isinstance(doc, dict):
        return Rejection(400, "request body must be a JSON object", "invalid_request")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        return Rejection(400, "'model' is required and must be a string", "missing_model")
    api = API.get(path, "chat")
    spec = SPECS[api]
    why = spec.check(doc)
    if why is not None:
        return Rejection(400, *why)
    avoid: Sequence[str] = limits.lacking.get(api, ())
    if avoid:
        refused = _not_served(api, model, avoid, limits.backends)
        if refused is not None:
            return refused
    openai = api in _OPENAI
    if openai:  # `n` against the backends' `max_n`
        unable, why_n = fewer_choices(doc, model, limits.backends)
        if why_n is not None:
            return Rejection(400, why_n, "invalid_request")
        if unable:
            avoid = [*avoid, *unable]
    stream = spec.streams and doc.get("stream") is True
    return ProxyRequest(
        path=path,
        api=api,
        body=body,
        doc=doc,
        model=model,
        stream=stream,
        session_key=session_key(doc, session_header, limits.prefix_chars, api),
        avoid=avoid,
        deadline=first_byte_deadline(doc, stream, limits, spec.tokens),
        stops=stop_strings(doc) if openai else (),
    )


def _not_served(
    api: str, model: str, lacking: Sequence[str], backends: Sequence[BackendConfig]
) -> Rejection | None:
    """404 `api_not_served` when no backend that may serve `model` (listed it, or lists no
    models: discovered) serves `api`; None when one does, or when no backend may serve the
    model at all (that is `route`'s 404 `model_not_found`)."""
    serving = [b.name for b in backends if not b.models or model in b.models]
    if not serving and len(lacking) < len(backends):
        return None
    if all(name in lacking for name in serving):
        where = "any backend" if len(lacking) == len(backends) else f"a backend of '{model}'"
        return Rejection(404, f"the {api} API is not served by {where}", "api_not_served")
    return None


# A body's JSON is parsed on the event loop; its cost is set by how many values it holds,
# not its size: 4 MiB of prose parses in ~5 ms, 4 MiB of `[],` (1.3M empty arrays) in ~400
# ms, during which no other client is served. Bodies past DENSE_FROM bytes are first
# counted (`bytes.count`, ~1 ms a MiB), and refused beyond MAX_CONTAINERS `{`/`[` or
# MAX_SEPARATORS `,`: bounds on the values that hold even while those characters are also
# counted inside strings. What they allow parses in under ~40 ms on the 2-core box
# (docs/reliability.md): 100k containers is 50x a 2,000-message conversation with
# content parts; 1M separators is 3x OpenAI's 300k-token limit on one embeddings request
# given as token ids.
DENSE_FROM = 64 * 1024
MAX_CONTAINERS = 100_000
MAX_SEPARATORS = 1_000_000


def too_dense(body: bytes) -> Rejection | None:
    """Why `body` holds too many JSON values to parse on the loop, or None."""
    containers = body.count(b"{") + body.count(b"[")
    if containers > MAX_CONTAINERS:
        what = f"more than {MAX_CONTAINERS:,} JSON objects and arrays"
    elif body.count(b",") > MAX_SEPARATORS:
        what = f"more than {MAX_SEPARATORS:,} JSON values"
    else:
        return None
    return Rejection(400, f"request body holds {what} (counting the characters '{{', '[' "
                     "and ',' anywhere in it); split the request", "invalid_request")  # fmt: skip


def too_large(limit: int) -> Rejection:
    return Rejection(413, f"request body exceeds the {limit}-byte limit", "request_too_large")


def body_too_slow(seconds: float) -> Rejection:
    return Rejection(408, f"request body did not arrive within {seconds:g}s", "request_timeout")


def session_key(
    doc: dict[str, Any], header: str | None, prefix_chars: int, api: str = "chat"
) -> str | None:
    """The affinity key: the `x-session-id` header, else the `user` field (Anthropic's
    `metadata.user_id` for messages), else (with prefix affinity on, for chat and
    completions) a digest of the prompt's first `prefix_chars` characters."""
    if header is not None:
        return header
    user = anthropic_user(doc) if api == "messages" else doc.get("user")
    if isinstance(user, str) and user:
        return user
    if prefix_chars and api in _OPENAI:
        return prefix_key(prompt_head(doc, prefix_chars), prefix_chars)
    return None


def first_byte_deadline(
    doc: dict[str, Any],
    stream: bool,
    limits: Limits,
    keys: tuple[str, ...] | None = ("max_completion_tokens", "max_tokens"),
) -> float:
    """Seconds an attempt may wait for its first byte.

    A stream's first byte is its first token: `per_try_timeout`. A non-streamed answer
    arrives whole, so its first byte waits for the entire generation; allowing
    `per_token_timeout` per requested token (the first of `keys` present) keeps long
    legitimate generations from being cut (R17) while a hung backend is still left within
    seconds for short ones. `keys` None: the API generates nothing (embeddings, rerank,
    score, tokenize): its answer is ready after the prefill, like a first token, so
    `per_try_timeout` (a hung embedder is left in 5 s, not the 107 s of 1024 tokens).
    """
    if stream or keys is None:
        return limits.per_try
    mt = doc.get(keys[0])
    if mt is None and len(keys) > 1:
        mt = doc.get(keys[1])
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
