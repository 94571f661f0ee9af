"""An engine that drops kept-alive connections the way a server's idle timeout races a
request: the second client request on a connection gets no answer, the connection closes.

Probe requests (`x-pulsegate-probe`) are always answered. `GET /stats` counts what was
answered and what was dropped. Started as a process by `tests/proxy/test_upstream.py`.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from script_engines import serve

MODEL = "demo-7b"
answered = 0
dropped = 0
requests_on: dict[object, int] = {}  # client requests per connection (transport)


async def health(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


async def stats(_: web.Request) -> web.Response:
    return web.json_response({"answered": answered, "dropped": dropped})


async def generate(request: web.Request) -> web.StreamResponse:
    global answered, dropped
    await request.read()
    if "x-pulsegate-probe" not in request.headers:
        seen = requests_on.get(request.transport, 0)
        requests_on[request.transport] = seen + 1
        if seen >= 1:
            dropped += 1
            assert request.transport is not None
            request.transport.abort()  # closed without a byte of answer
            await asyncio.sleep(3600)
        answered += 1
    msg = {"role": "assistant", "content": "ok"}
    return web.json_response(
        {
            "id": "x",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )


def main() -> None:
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/stats", stats)
    app.router.add_post("/v1/chat/completions", generate)
    serve(app, "stale engine")


if __name__ == "__main__":
    main()
