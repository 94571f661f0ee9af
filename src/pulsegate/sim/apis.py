"""The sim's pooling and tokenizer APIs, in vLLM's framing: `/v1/embeddings`, `/v1/rerank`
(and `/rerank`, `/v2/rerank`), `/v1/score` (and `/score`), `/tokenize`, `/detokenize`.

Answers are pure functions of the request (`embed`, `rerank_doc`, `score_doc`,
`tokenize_doc`, `detokenize_doc`): the same text gives the same vector in every sim process
(CRC-32 keyed, like `text.py`), and texts sharing words point the same way, so a rerank
ranks a document that repeats the query's words first. Tokens are the sim's words: a
vocabulary word is its index + 1 (`detokenize` inverts those), any other word 1000 + its
CRC-32 (`text.token_id`: the ids the generation endpoints stream for `return_token_ids`);
`tokenize` counts exactly the tokens the sim generates, so a resume's `/tokenize` count is
exact against a sim as against vLLM.

Faults apply as on the generation endpoints. Embeddings, rerank and score are inference
(`engine.arrive`, a batch slot, a prefill of one TTFT x `slow`): `hang`, `cuda_hang` and a
`blackhole` for large bodies hang them, `error`/`oom`/`warming` fail them, `stall` hangs
them (a non-streamed answer never comes), `reset` drops the connection. Tokenize and
detokenize run on the API server's CPU in vLLM, not the GPU: only `hang` (the whole
process), `error`, `warming` and `reset` reach them, and they are not counted as inference
arrivals (the gateway's resume counts tokens with them). Each path's client and probe
requests are counted in `/sim/stats` (`api_requests`).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import functools
import math
import random
import secrets
import struct
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from aiohttp import web

from pulsegate.sim import faults as F
from pulsegate.sim.engine import Engine, Seq
from pulsegate.sim.sink import abort_connection, error_response, json_response
from pulsegate.sim.text import VOCAB, token_id

DIMS = 64  # embedding width: small enough to read, enough for cosine to mean something
MAX_MODEL_LEN = 8192
_MASK = (1 << 64) - 1
_POOLING = ("/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score")
_TOKENIZER = ("/tokenize", "/detokenize")
PATHS = _POOLING + _TOKENIZER
_FAILURES: dict[F.Action, tuple[int, str, str]] = {
    F.Action.FAIL_ERROR: (500, "simulated engine failure (fault 'error')", "InternalServerError"),
    F.Action.FAIL_OOM: (500, "CUDA out of memory (simulated fault 'oom')", "InternalServerError"),
    F.Action.FAIL_WARMING: (503, "engine is warming up (fault 'warming')", "ServiceUnavailable"),
}


class BadRequest(Exception):
    """A request vLLM would refuse with a 400 (or the 404 of another model)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


# ---- pure: text, tokens, vectors ----


def words(text: str) -> list[str]:
    return text.split()


def token_word(tid: int) -> str:
    return VOCAB[tid - 1] if 1 <= tid <= len(VOCAB) else f"<{tid}>"


@functools.lru_cache(maxsize=4096)
def _direction(word: str) -> tuple[float, ...]:
    """A word's own fixed direction: DIMS values in [-1, 1] from a xorshift seeded by it."""
    x = (zlib.crc32(word.encode()) << 32 | zlib.crc32(word[::-1].encode())) or 1
    out = []
    for _ in range(DIMS):
        x ^= (x << 13) & _MASK
        x ^= x >> 7
        x ^= (x << 17) & _MASK
        out.append((x % 2001 - 1000) / 1000.0)
    return tuple(out)


def embed(text: str, dims: int = DIMS) -> list[float]:
    """A unit vector from the words of `text`: the sum of its words' directions (the first
    `dims` of them), normalised. Repeated words are looked up once (a 6 KB canary has ~200
    distinct words of ~1,000: ~2 ms)."""
    v = [0.0] * dims
    for w, n in collections.Counter(words(text)).items():
        d = _direction(w)
        for i in range(dims):
            v[i] += n * d[i]
    norm = math.sqrt(sum(x * x for x in v))
    if norm == 0.0:
        v[0], norm = 1.0, 1.0  # the empty text still gets a unit vector
    return [x / norm for x in v]


def _cosine(a: str, b: str) -> float:
    """Relevance in [0, 1] from the cosine of the two texts' vectors."""
    return round((1.0 + sum(x * y for x, y in zip(embed(a), embed(b), strict=True))) / 2.0, 6)


def _text_of(item: object, what: str) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and isinstance(item.get("text"), str):
        return str(item["text"])
    if isinstance(item, list) and all(isinstance(t, int) for t in item):
        return "".join(" " + token_word(t) for t in item)
    raise BadRequest(f"{what} must be text")


def _inputs(v: object) -> list[str]:
    """Embedding inputs: a string, a list of strings, a list of token ids, or a list of those."""
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return [_text_of(v, "input")]
        return [_text_of(x, "input") for x in v]
    raise BadRequest("'input' must be a string, a list of strings or a list of token ids")


def _usage(n: int) -> dict[str, Any]:
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}


def _encode(vec: list[float], fmt: object) -> list[float] | str:
    if fmt in (None, "float"):
        return vec
    if fmt == "base64":  # little-endian float32, as vLLM and OpenAI send it
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
    raise BadRequest(f"'encoding_format' must be 'float' or 'base64', got {fmt!r}")


def embeddings_doc(body: dict[str, Any], model: str, created: int) -> tuple[dict[str, Any], int]:
    texts = _inputs(body.get("input"))
    dims = body.get("dimensions")
    if dims is not None and (not isinstance(dims, int) or not 1 <= dims <= DIMS):
        raise BadRequest(f"'dimensions' must be an integer from 1 to {DIMS}, got {dims!r}")
    n = sum(len(words(t)) for t in texts)
    fmt = body.get("encoding_format")
    data = [
        {"index": i, "object": "embedding", "embedding": _encode(embed(t, dims or DIMS), fmt)}
        for i, t in enumerate(texts)
    ]
    doc = {
        "id": f"embd-{secrets.token_hex(8)}",
        "object": "list",
        "created": created,
        "model": model,
        "data": data,
        "usage": _usage(n),
    }
    return doc, n


def rerank_doc(body: dict[str, Any], model: str) -> tuple[dict[str, Any], int]:
    query = body.get("query")
    docs = body.get("documents")
    if not isinstance(query, str):
        raise BadRequest("'query' must be a string")
    if not isinstance(docs, list) or not docs:
        raise BadRequest("'documents' must be a non-empty list")
    texts = [_text_of(d, "each document") for d in docs]
    top_n = body.get("top_n")
    if top_n is not None and (not isinstance(top_n, int) or top_n < 0):
        raise BadRequest(f"'top_n' must be a non-negative integer, got {top_n!r}")
    scores = [_cosine(query, t) for t in texts]
    order = sorted(range(len(texts)), key=lambda i: (-scores[i], i))
    results = [
        {"index": i, "document": {"text": texts[i]}, "relevance_score": scores[i]} for i in order
    ]
    if top_n:
        results = results[:top_n]
    n = sum(len(words(query)) + len(words(t)) for t in texts)
    doc = {
        "id": f"rerank-{secrets.token_hex(8)}",
        "model": model,
        "usage": {"total_tokens": n},
        "results": results,
    }
    return doc, n


def _side(v: object, key: str) -> list[str]:
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v:
        return [_text_of(x, key) for x in v]
    raise BadRequest(f"'{key}' must be a string or a non-empty list")


def score_doc(body: dict[str, Any], model: str, created: int) -> tuple[dict[str, Any], int]:
    """vLLM's pairing: one `text_1` against each `text_2`, or two lists of the same length."""
    left, right = _side(body.get("text_1"), "text_1"), _side(body.get("text_2"), "text_2")
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise BadRequest("'text_1' and 'text_2' must have the same length (or text_1 one item)")
    data = [
        {"index": i, "object": "score", "score": _cosine(a, b)}
        for i, (a, b) in enumerate(zip(left, right, strict=True))
    ]
    n = sum(len(words(a)) + len(words(b)) for a, b in zip(left, right, strict=True))
    doc = {
        "id": f"score-{secrets.token_hex(8)}",
        "object": "list",
        "created": created,
        "model": model,
        "data": data,
        "usage": _usage(n),
    }
    return doc, n


def tokenize_doc(body: dict[str, Any]) -> dict[str, Any]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(body.get("messages"), list) and body["messages"]:
        text = " ".join(_message_text(m) for m in body["messages"])
    else:
        raise BadRequest("'prompt' (a string) or 'messages' (a list) is required")
    ids = [token_id(w) for w in words(text)]
    strs = [token_word(t) for t in ids] if body.get("return_token_strs") is True else None
    return {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": strs}


def _message_text(m: object) -> str:
    if not isinstance(m, dict):
        raise BadRequest("each message must be an object")
    c = m.get("content")
    if isinstance(c, list):
        return " ".join(
            p["text"] for p in c if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return c if isinstance(c, str) else ""


def detokenize_doc(body: dict[str, Any]) -> dict[str, Any]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise BadRequest("'tokens' must be a list of integers")
    return {"prompt": "".join(" " + token_word(t) for t in tokens)}


def on_tokenizer(fault: F.Fault, draw: float) -> F.Action:
    """The faults that reach the CPU-side tokenizer endpoints (the module docstring)."""
    mode = fault.mode
    if mode is F.Mode.HANG:
        return F.Action.HANG
    if mode is F.Mode.ERROR:
        return F.Action.FAIL_ERROR if draw < fault.rate else F.Action.PROCEED
    if mode is F.Mode.WARMING:
        return F.Action.FAIL_WARMING
    if mode is F.Mode.RESET:
        return F.Action.RESET
    return F.Action.PROCEED


# ---- the HTTP side ----

Gate = Callable[[Callable[[F.Fault], F.Action]], Awaitable[F.Action]]


class PoolingApis:
    """The handlers of `PATHS` for one sim: its engine, fault state and gate are the sim's
    own (`gate` waits out a hang and raises `closing` when the sim shuts down)."""

    def __init__(
        self,
        *,
        engine: Engine,
        faults: F.FaultState,
        gate: Gate,
        closing: type[Exception],
        rng: random.Random,
        now: Callable[[], float],
        ttft_s: float,
        model: str,
        probe_header: str,
    ) -> None:
        self._engine = engine
        self._faults = faults
        self._gate = gate
        self._closing = closing
        self._rng = rng
        self._now = now
        self._ttft_s = ttft_s
        self._model = model
        self._probe_header = probe_header
        self.counts: dict[str, dict[str, int]] = {p: {"client": 0, "probe": 0} for p in PATHS}

    def routes(
        self,
    ) -> Sequence[tuple[str, Callable[[web.Request], Awaitable[web.StreamResponse]]]]:
        return [(p, self.handle) for p in PATHS]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        probe = self._probe_header in request.headers
        self.counts[path]["probe" if probe else "client"] += 1
        pooling = path in _POOLING
        if pooling:
            self._engine.arrive(path, probe=probe, wall=time.time())
        try:
            return await (self._pooling(request) if pooling else self._tokenizer(request))
        except self._closing:
            return error_response(503, "engine is shutting down", "ServiceUnavailable")
        except ConnectionResetError:
            return web.Response(status=500)  # gone; never written
        finally:
            if pooling:
                self._engine.depart()

    async def _body(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as e:
            return error_response(400, f"Invalid JSON body: {e}", "BadRequestError")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object", "BadRequestError")
        model = body.get("model")
        if model is not None and model != self._model:
            return error_response(404, f"The model `{model}` does not exist.", "NotFoundError")
        return body

    async def _pooling(self, request: web.Request) -> web.StreamResponse:
        length = request.content_length
        await self._gate(lambda f: F.on_arrival(f, length))
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        try:
            doc, n = self._answer(request.path, body)
        except BadRequest as e:
            return error_response(e.status, str(e), "BadRequestError")
        action = await self._gate(lambda f: F.on_admit(f, stream=False, draw=self._rng.random()))
        if action is F.Action.RESET:
            abort_connection(request)
            return web.Response(status=500)
        if action in _FAILURES:
            return error_response(*_FAILURES[action])
        seq = Seq(prompt_tokens=n)
        await self._engine.admit(seq)
        ok = False
        try:
            await asyncio.sleep(self._ttft_s * F.slowdown(self._faults.current(self._now())))
            action = await self._gate(lambda f: F.on_token(f, 0, stream=False))
            if action is F.Action.RESET:
                abort_connection(request)
                return web.Response(status=500)
            ok = True
            return json_response(doc)
        finally:
            self._engine.release(seq, ok=ok)

    def _answer(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        created = int(time.time())
        if path == "/v1/embeddings":
            return embeddings_doc(body, self._model, created)
        if path.endswith("/rerank"):
            return rerank_doc(body, self._model)
        return score_doc(body, self._model, created)

    async def _tokenizer(self, request: web.Request) -> web.StreamResponse:
        action = await self._gate(lambda f: on_tokenizer(f, self._rng.random()))
        if action is F.Action.RESET:
            abort_connection(request)
            return web.Response(status=500)
        if action in _FAILURES:
            return error_response(*_FAILURES[action])
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        try:
            if request.path == "/tokenize":
                return json_response(tokenize_doc(body))
            return json_response(detokenize_doc(body))
        except BadRequest as e:
            return error_response(e.status, str(e), "BadRequestError")
