"""Which APIs a backend serves: `backends[].apis`, defaulting by `backends[].engine`.

A request for an API a backend does not serve never reaches it (the parse puts it in the
request's `avoid` list); one that no backend serves is a 404 `api_not_served`. Sending it
anyway would not be harmless: an engine without the route answers 404, which the proxy must
pass on as the client's own error (a 4xx is never retried), so one such backend in a pool
would fail a share of the requests outright.

What each engine kind serves out of the box, in the shape pulsegate forwards (vLLM's: an
engine whose route exists with another body, such as TGI's `/tokenize` or SGLang's
decoder-only `/v1/score`, does not count):

- vllm: all eight. docs.vllm.ai, "OpenAI-Compatible Server": chat, completions,
  responses, embeddings, Anthropic `/v1/messages`, `/rerank` (+ `/v1/rerank`, `/v2/rerank`),
  `/score` (+ `/v1/score`), `/tokenize`, `/detokenize`.
- sglang: chat, completions, embeddings, rerank. docs.sglang.io, "OpenAI-Compatible APIs"
  and "Native APIs" (`/v1/rerank` for cross-encoders; its `/v1/score` is decoder-only
  scoring with another body).
- tgi: chat, completions. TGI's "Messages API"; embeddings are TEI, a separate server; its
  `/tokenize` takes `inputs`.
- llama.cpp: chat, completions, embeddings, rerank. `tools/server/README.md` of llama.cpp
  (`/v1/embeddings` with `--embeddings`, `/v1/rerank` with `--reranking`; its `/tokenize`
  takes `content`).
- transformers: chat, responses. The `transformers serve` docs.
- openai: chat, completions, responses, embeddings. The hosted OpenAI API reference (or a
  SaaS compatible with it).

Not discovered from the engine, on purpose. vLLM's `/v1/models` does not say which tasks a
model serves; its `/openapi.json` does in recent versions (the pooling routes are
registered only for the model's tasks, `register_pooling_api_routers`) but not in older
ones (every route registered, a 400 "does not support" at call time), it is ~100 KB per
read, and a discovered set would be verdict state that must travel to every proxy worker
and into the parse (today the avoid lists are computed once per config). The engine kind
gives the default; an embedding-only deployment says `apis: [embeddings]`.
"""

from __future__ import annotations

from pulsegate.config.schema import APIS

ENGINE_APIS: dict[str, tuple[str, ...]] = {
    "vllm": APIS,
    "sglang": ("chat", "completions", "embeddings", "rerank"),
    "tgi": ("chat", "completions"),
    "llama.cpp": ("chat", "completions", "embeddings", "rerank"),
    "transformers": ("chat", "responses"),
    "openai": ("chat", "completions", "responses", "embeddings"),
}
ENGINES = tuple(ENGINE_APIS)


def _apis(v: object) -> tuple[str, ...]:
    """A non-empty list of distinct API names, in the order given."""
    if not isinstance(v, list) or not v:
        raise ValueError(f"must be a non-empty list of: {', '.join(APIS)}")
    out: list[str] = []
    for a in v:
        if a not in APIS:
            raise ValueError(f"unknown api {a!r}; one of: {', '.join(APIS)}")
        if a in out:
            raise ValueError(f"lists {a!r} twice")
        out.append(a)
    return tuple(out)
