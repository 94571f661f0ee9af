"""A stand-in for vLLM's streaming as a process: several tokens per event, `/tokenize`, `n`.

vLLM merges tokens into one SSE event whenever its API loop lags the engine (seen: 200
tokens in 135-202 events, 19 in one), so an event is not a token. This engine always sends
`--merge` tokens per event, one token per character, and answers `POST /tokenize` with the
character count, like the real-engine suite's tiny model (docs/real-engines.md).

Its text is a fixed pseudo-random character sequence indexed by position: a chat answer
starts at position 0 or, with `continue_final_message`, right after the final assistant
message; a completion continues its prompt's length. So a continuation asked for at the
wrong token, or for too many tokens, gives a different or longer text than an
uninterrupted run. Non-streamed answers honour `n`. Third-party behaviour to test the
gateway against, not our engine.

    python vllm_like_engine.py [--merge N] [--itl-ms MS]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
import uuid
from typing import Any

import orjson
from aiohttp import web
from script_engines import serve

MODEL = "demo-7b"
_rng = random.Random(7)
# 101 characters, no repeats of a short period: a shifted continuation shows at once.
SEQ = "".join(_rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(101))


def text_at(start: int, count: int) -> str:
    return "".join(SEQ[(start + i) % len(SEQ)] for i in range(count))


def _json(doc: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(doc), status=status, content_type="application/json")


async def health(_: web.Request) -> web.Response:
    return web.Response(status=200)


async def models(_: web.Request) -> web.Response:
    return _json({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


async def tokenize(request: web.Request) -> web.Response:
    body = await request.json()
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        return _json({"error": {"message": "prompt must be a string", "type": "invalid"}}, 400)
    return _json({"count": len(prompt), "max_model_len": 4096, "tokens": [ord(c) for c in prompt]})


def _prompt(body: dict[str, Any], chat: bool) -> tuple[int, int]:
    """(position the answer starts at, prompt tokens)."""
    if not chat:
        prompt = str(body.get("prompt", ""))
        return len(prompt), len(prompt)
    msgs = body.get("messages") or []
    tokens = sum(len(str(m.get("content") or "")) for m in msgs)
    last = msgs[-1] if msgs else {}
    if body.get("continue_final_message") and last.get("role") == "assistant":
        return len(str(last.get("content") or "")), tokens
    return 0, tokens


async def generate(request: web.Request) -> web.StreamResponse:
    cfg = request.app["cfg"]
    body = await request.json()
    if body.get("model") != MODEL:
        return _json({"error": {"message": "no such model", "type": "NotFoundError"}}, 404)
    chat = request.path.endswith("chat/completions")
    start, prompt_tokens = _prompt(body, chat)
    max_tokens = int(body.get("max_tokens") or 16)
    n = int(body.get("n") or 1)
    text = text_at(start, max_tokens)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": max_tokens,
        "total_tokens": prompt_tokens + max_tokens,
    }
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    head = {"id": rid, "created": int(time.time()), "model": MODEL}
    if not body.get("stream"):
        choices = []
        for i in range(n):
            ch: dict[str, Any] = {"index": i, "finish_reason": "length"}
            ch |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            choices.append(ch)
        obj = "chat.completion" if chat else "text_completion"
        return _json({**head, "object": obj, "choices": choices, "usage": usage})
    out = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await out.prepare(request)
    obj = "chat.completion.chunk" if chat else "text_completion"

    async def send(choice: dict[str, Any], **extra: Any) -> None:
        doc = {**head, "object": obj, "choices": [choice], **extra}
        await out.write(b"data: " + orjson.dumps(doc) + b"\n\n")

    if chat:
        await send({"index": 0, "delta": {"role": "assistant", "content": ""}})
    merge = cfg.merge
    for at in range(0, max_tokens, merge):
        await asyncio.sleep(cfg.itl_ms / 1000 * merge)
        piece = text[at : at + merge]
        last = at + merge >= max_tokens
        ch = {"index": 0, "finish_reason": "length" if last else None}
        ch |= {"delta": {"content": piece}} if chat else {"text": piece}
        await send(ch)
    so = body.get("stream_options")
    if isinstance(so, dict) and so.get("include_usage"):
        await out.write(b"data: " + orjson.dumps({**head, "object": obj, "choices": [],
                                                  "usage": usage}) + b"\n\n")  # fmt: skip
    await out.write(b"data: [DONE]\n\n")
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--merge", type=int, default=4, help="tokens per SSE event")
    p.add_argument("--itl-ms", type=float, default=5.0, help="milliseconds per token")
    cfg = p.parse_args()
    app = web.Application()
    app["cfg"] = cfg
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    serve(app, "vllm-like engine")


if __name__ == "__main__":
    main()
