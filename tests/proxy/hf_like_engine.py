"""A stand-in for `transformers serve`'s quirks (shared/notes/real-engines.md), as a process.

Streams end without `data: [DONE]`; `usage` always rides on the last content chunk;
`stream_options` is ignored; errors are FastAPI's `{"detail": ...}`; ids are bare UUIDs.
Third-party behaviour to test the gateway's edge normalisation against, not our engine.
"""

from __future__ import annotations

import asyncio
import json
import uuid

from aiohttp import web
from script_engines import serve

MODEL = "demo-7b"
WORDS = ["alpha", "beta", "gamma", "delta", "eps"]


async def health(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


async def generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if body.get("model") != MODEL:
        return web.json_response({"detail": f"Server is pinned to {MODEL}"}, status=400)
    if "frobnicate" in body:
        return web.json_response({"detail": [{"msg": "unknown field frobnicate"}]}, status=422)
    n = int(body.get("max_tokens") or 4)
    chat = request.path.endswith("chat/completions")
    rid = str(uuid.uuid4())
    if not body.get("stream"):
        text = " ".join(WORDS[i % 5] for i in range(n))
        choice = {"index": 0, "finish_reason": "length"}
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
        return web.json_response({"id": rid, "choices": [choice], "usage": usage})
    out = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await out.prepare(request)
    for i in range(n):
        piece = ("" if i == 0 else " ") + WORDS[i % 5]
        ch: dict[str, object] = {"index": 0}
        ch |= {"delta": {"content": piece}} if chat else {"text": piece}
        obj: dict[str, object] = {"id": rid, "object": "chat.completion.chunk", "choices": [ch]}
        if i == n - 1:
            ch["finish_reason"] = "length"
            obj["usage"] = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
        await out.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        await asyncio.sleep(0.002)
    return out  # no [DONE]


def main() -> None:
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/completions", generate)
    serve(app, "hf-like engine")


if __name__ == "__main__":
    main()
