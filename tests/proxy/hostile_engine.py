"""A backend that breaks its streams with bytes that are not SSE, as a process.

Its URL path prefix names the fault (`http://127.0.0.1:PORT/html` ...), so one process serves
every kind: a stream sends `--good` tokens of the vLLM-like engine's text (so a resume on
that engine continues it exactly), then the fault's bytes, then closes:

    html     an HTML error page written into the stream (a proxy in front of the engine)
    binary   raw bytes, invalid UTF-8
    utf8     a `data:` event whose JSON holds invalid UTF-8
    endless  one event of 2 MiB that never ends (no blank line), then silence
    choices  an event `{"choices":[1]}` (a choice that is not an object)

Health, `/v1/models` and `/tokenize` answer like the vLLM-like engine: probes find it well.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson
from aiohttp import web
from script_engines import serve
from vllm_like_engine import MODEL, health, models, text_at, tokenize

FAULTS = {
    "html": b"<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>\n\n",
    "binary": bytes(range(256)) + b"\n\n",
    "utf8": b'data: {"choices":[{"index":0,"delta":{"content":"\xff\xfe"}}]}\n\n',
    "endless": b"data: " + b"a" * (2 * 1024 * 1024),
    "choices": b'data: {"id":"x","choices":[1]}\n\n',
}


async def generate(request: web.Request) -> web.StreamResponse:
    good = request.app["good"]
    fault = request.match_info["fault"]
    body = await request.json()
    if not body.get("stream"):
        text = text_at(0, int(body.get("max_tokens") or 16))
        msg = {"role": "assistant", "content": text}
        choice = {"index": 0, "finish_reason": "length", "message": msg}
        doc = {"id": "c", "object": "chat.completion", "created": int(time.time()),
               "model": MODEL, "choices": [choice]}  # fmt: skip
        return web.Response(body=orjson.dumps(doc), content_type="application/json")
    out = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await out.prepare(request)
    head = {"id": "chatcmpl-h", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    await out.write(b"data: " + orjson.dumps({**head, "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}}]}) + b"\n\n")  # fmt: skip
    for i, c in enumerate(text_at(0, good)):
        ch = {"index": 0, "delta": {"content": c}, "finish_reason": None}
        await out.write(b"data: " + orjson.dumps({**head, "choices": [ch]}) + b"\n\n")
        if i == 0:
            await asyncio.sleep(0.02)
    await out.write(FAULTS[fault])
    if fault == "endless":
        await asyncio.sleep(30)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--good", type=int, default=3, help="tokens sent before the fault")
    cfg = p.parse_args()
    app = web.Application()
    app["good"] = cfg.good
    app.router.add_get("/{fault}/health", health)
    app.router.add_get("/{fault}/v1/models", models)
    app.router.add_post("/{fault}/tokenize", tokenize)
    app.router.add_post("/{fault}/v1/chat/completions", generate)
    serve(app, "hostile engine")


if __name__ == "__main__":
    main()
