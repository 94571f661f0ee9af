"""A scriptable third-party engine for the agent tests: an aiohttp server on loopback.

Covers engine shapes the simulated engine does not have - no ``/metrics`` at all, a
completion that takes as long as the test says - and records the requests it got. The
agent under test is a real process; only the engine it watches is this stub.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web


@dataclass
class EngineStub:
    """What the stub answers; tests change the fields while it runs."""

    model: str = "stub-model"
    metrics: str | None = None  # None: /metrics is 404
    health_status: int = 200
    completion_delay_s: float = 0.0
    completion_status: int = 200
    # An embedding model's engine: /v1/embeddings answers, completions and chat are 404.
    embeddings: bool = False
    requests: list[tuple[str, dict[str, str], Any]] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        doc = orjson.loads(body) if body else None
        self.requests.append((request.path, dict(request.headers), doc))
        if request.path == "/health":
            return web.Response(status=self.health_status, text="")
        if request.path == "/metrics":
            if self.metrics is None:
                return web.Response(status=404, text="not found")
            return web.Response(text=self.metrics, content_type="text/plain")
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": self.model}]})
        if request.path in ("/v1/completions", "/v1/chat/completions") and not self.embeddings:
            await asyncio.sleep(self.completion_delay_s)
            if self.completion_status != 200:
                return web.json_response(
                    {"error": {"message": "stub failure", "type": "server_error"}},
                    status=self.completion_status,
                )
            return web.json_response(
                {"id": "cmpl-1", "object": "text_completion", "choices": [{"text": "x"}]}
            )
        if request.path == "/v1/embeddings" and self.embeddings:
            return web.json_response(
                {
                    "object": "list",
                    "data": [{"object": "embedding", "index": 0, "embedding": [0.6, 0.8]}],
                }
            )
        return web.Response(status=404, text="not found")

    def calls(self, path: str) -> list[tuple[dict[str, str], Any]]:
        return [(h, d) for p, h, d in self.requests if p == path]


@asynccontextmanager
async def engine_stub(**fields: Any) -> AsyncIterator[EngineStub]:
    """Run an `EngineStub` on a free loopback port for the duration of the block."""
    stub = EngineStub(**fields)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", stub.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    stub.url = f"http://127.0.0.1:{port}"
    try:
        yield stub
    finally:
        await runner.cleanup()
