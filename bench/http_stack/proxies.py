"""Candidate gateway HTTP stacks, each a thin proxy for POST /v1/chat/completions.

Every candidate: read the body, parse `model`/`stream` with orjson, forward the body unchanged
to the upstream over a pooled keep-alive client, return the upstream status/content-type/body
(or relay the SSE stream chunk by chunk).

    python proxies.py --kind KIND --port PORT   (env BENCH_UPSTREAM_PORT=...)

Kinds: aiohttp-web, aiohttp-lowlevel, uvicorn, granian, raw-aiohttp, raw-raw.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from collections import deque
from collections.abc import AsyncIterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

import httptools
from common import (
    PATH,
    PATH_STR,
    install_uvloop,
    make_aiohttp_session,
    parse_request,
    upstream_url,
)

# ----------------------------------------------------------------------------------------------
# (a) aiohttp web server (high-level Application and low-level web.Server) + ClientSession
# ----------------------------------------------------------------------------------------------


async def aiohttp_handler(request: Any) -> Any:
    from aiohttp import web

    if request.method != "POST" or request.path != PATH_STR:
        return web.Response(status=404)
    body = await request.read()
    _model, stream = parse_request(body)
    session = _session()
    async with session.post(UP_URL, data=body, headers=FWD_HEADERS) as r:
        ctype = r.headers.get("Content-Type", "application/json")
        if not stream:
            data = await r.read()
            return web.Response(body=data, status=r.status, headers={"Content-Type": ctype})
        resp = web.StreamResponse(
            status=r.status, headers={"Content-Type": ctype, "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        async for chunk in r.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp


async def run_aiohttp(port: int, lowlevel: bool) -> None:
    from aiohttp import web

    if lowlevel:
        runner: Any = web.ServerRunner(web.Server(aiohttp_handler, access_log=None))
    else:
        app = web.Application()
        app.router.add_post(PATH_STR, aiohttp_handler)
        runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
    await asyncio.Event().wait()


# ----------------------------------------------------------------------------------------------
# (b) raw ASGI app (no framework) + aiohttp client; served by uvicorn or granian
# ----------------------------------------------------------------------------------------------


async def asgi_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    if scope["method"] != "POST" or scope["path"] != PATH_STR:
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    msg = await receive()
    body = msg.get("body", b"")
    if msg.get("more_body"):
        parts = [body]
        while msg.get("more_body"):
            msg = await receive()
            parts.append(msg.get("body", b""))
        body = b"".join(parts)
    _model, stream = parse_request(body)
    session = _session()
    async with session.post(UP_URL, data=body, headers=FWD_HEADERS) as r:
        ctype = r.headers.get("Content-Type", "application/json").encode()
        if not stream:
            data = await r.read()
            await send(
                {
                    "type": "http.response.start",
                    "status": r.status,
                    "headers": [(b"content-type", ctype), (b"content-length", b"%d" % len(data))],
                }
            )
            await send({"type": "http.response.body", "body": data})
            return
        await send(
            {
                "type": "http.response.start",
                "status": r.status,
                "headers": [(b"content-type", ctype), (b"cache-control", b"no-cache")],
            }
        )
        async for chunk in r.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def run_uvicorn(port: int) -> None:
    import uvicorn

    uvicorn.run(
        asgi_app,
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
        backlog=1024,
    )


def run_granian(port: int) -> None:
    from granian import Granian
    from granian.constants import HTTPModes, Interfaces, Loops

    Granian(
        "proxies:asgi_app",
        address="127.0.0.1",
        port=port,
        interface=Interfaces.ASGI,
        workers=1,
        runtime_threads=1,
        loop=Loops.uvloop,
        http=HTTPModes.http1,
        websockets=False,
        log_enabled=False,
        working_dir=Path(__file__).resolve().parent,
    ).serve()


# ----------------------------------------------------------------------------------------------
# (c) hand-written asyncio Protocol HTTP/1.1 server on httptools (+ aiohttp or raw client)
# ----------------------------------------------------------------------------------------------


class AiohttpUpstream:
    async def fetch(self, body: bytes) -> tuple[int, bytes, bytes]:
        async with _session().post(UP_URL, data=body, headers=FWD_HEADERS) as r:
            data = await r.read()
            return r.status, r.headers.get("Content-Type", "application/json").encode(), data

    @contextlib.asynccontextmanager
    async def stream(self, body: bytes) -> AsyncIterator[tuple[int, bytes, AsyncIterator[bytes]]]:
        async with _session().post(UP_URL, data=body, headers=FWD_HEADERS) as r:
            yield (
                r.status,
                r.headers.get("Content-Type", "text/event-stream").encode(),
                (r.content.iter_any()),
            )


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase.encode())


class ProxyProtocol(asyncio.Protocol):
    upstream: Any = None

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.pending: deque[tuple[bytes, bytes, bytes, bool]] = deque()
        self.busy = False
        self.write_ok: asyncio.Event = asyncio.Event()
        self.write_ok.set()

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.write_ok.set()

    def pause_writing(self) -> None:
        self.write_ok.clear()

    def resume_writing(self) -> None:
        self.write_ok.set()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400)
        except httptools.HttpParserError:
            self._fail(400)

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        item = (
            self.parser.get_method(),
            self.url,
            b"".join(self.body),
            self.parser.should_keep_alive(),
        )
        if self.busy:  # pipelined request: answer in order
            self.pending.append(item)
            return
        self.busy = True
        asyncio.get_running_loop().create_task(self._run(item))

    # -- request handling
    def _fail(self, status: int) -> None:
        if self.transport is not None:
            self.transport.write(
                _status_line(status) + b"content-length: 0\r\nconnection: close\r\n\r\n"
            )
            self.transport.close()

    async def _run(self, item: tuple[bytes, bytes, bytes, bool] | None) -> None:
        while item is not None and self.transport is not None:
            method, url, body, keep_alive = item
            try:
                await self._handle(method, url, body, keep_alive)
            except Exception:
                self._fail(502)
                break
            if not keep_alive and self.transport is not None:
                self.transport.close()
                break
            item = self.pending.popleft() if self.pending else None
        self.busy = False

    async def _handle(self, method: bytes, url: bytes, body: bytes, keep_alive: bool) -> None:
        conn = b"" if keep_alive else b"connection: close\r\n"
        if method != b"POST" or url.split(b"?", 1)[0] != PATH:
            self._write(_status_line(404) + b"content-length: 0\r\n" + conn + b"\r\n")
            return
        _model, stream = parse_request(body)
        if not stream:
            status, ctype, data = await self.upstream.fetch(body)
            self._write(
                _status_line(status)
                + b"content-type: %s\r\ncontent-length: %d\r\n%s\r\n" % (ctype, len(data), conn)
                + data
            )
            return
        async with self.upstream.stream(body) as (status, ctype, chunks):
            self._write(
                _status_line(status) + b"content-type: %s\r\ncache-control: no-cache\r\n"
                b"transfer-encoding: chunked\r\n%s\r\n" % (ctype, conn)
            )
            async for chunk in chunks:
                if self.transport is None:
                    return  # client went away: leaving the block closes the upstream response
                self._write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                if not self.write_ok.is_set():
                    await self.write_ok.wait()
            self._write(b"0\r\n\r\n")

    def _write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)


async def run_raw(port: int, raw_client: bool) -> None:
    if raw_client:
        from rawclient import RawPool

        ProxyProtocol.upstream = RawPool("127.0.0.1", int(os.environ["BENCH_UPSTREAM_PORT"]), PATH)
    else:
        ProxyProtocol.upstream = AiohttpUpstream()
    server = await asyncio.get_running_loop().create_server(
        ProxyProtocol, "127.0.0.1", port, backlog=1024
    )
    async with server:
        await server.serve_forever()


# ----------------------------------------------------------------------------------------------

UP_URL = upstream_url() if "BENCH_UPSTREAM_PORT" in os.environ else ""
FWD_HEADERS = {"Content-Type": "application/json"}
_SESSION: Any = None


def _session() -> Any:
    """One pooled ClientSession per process, created lazily inside the running loop."""
    global _SESSION
    if _SESSION is None:
        _SESSION = make_aiohttp_session()
    return _SESSION


KINDS = ("aiohttp-web", "aiohttp-lowlevel", "uvicorn", "granian", "raw-aiohttp", "raw-raw")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=KINDS, required=True)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    if args.kind == "uvicorn":
        run_uvicorn(args.port)
    elif args.kind == "granian":
        run_granian(args.port)
    else:
        install_uvloop()
        if args.kind.startswith("aiohttp"):
            asyncio.run(run_aiohttp(args.port, lowlevel=args.kind == "aiohttp-lowlevel"))
        else:
            asyncio.run(run_raw(args.port, raw_client=args.kind == "raw-raw"))


if __name__ == "__main__":
    main()
