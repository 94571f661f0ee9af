"""Writing responses: where a request's tokens go (one JSON body or an SSE stream written in
bursts), JSON and error responses, and the abrupt connection reset."""

from __future__ import annotations

import contextlib
import socket
import struct

import orjson
from aiohttp import web

from pulsegate.sim.protocol import DONE, Framer, GenRequest, error_body


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def error_response(status: int, message: str, err_type: str) -> web.Response:
    return web.Response(
        body=error_body(message, err_type, status), status=status, content_type="application/json"
    )


def abort_connection(request: web.Request) -> None:
    """Close the connection with a TCP RST (SO_LINGER 0), like a crashed engine process."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class TokenSink:
    """Where tokens go: joined into one JSON body, or framed as SSE chunks.

    SSE chunks are buffered and written only before the decoder waits (or at the end), so a
    zero-delay stream is one write instead of one per token.
    """

    __slots__ = ("_buf", "_framer", "_resp", "_texts")

    def __init__(self, framer: Framer) -> None:
        self._framer = framer
        self._resp: web.StreamResponse | None = None
        self._buf: list[bytes] = []
        self._texts: list[str] = []

    async def start(self, request: web.Request) -> None:
        """Send the stream's headers (before queueing, as vLLM does)."""
        resp = web.StreamResponse(headers={"Cache-Control": "no-cache"})
        resp.content_type = "text/event-stream"
        resp.charset = "utf-8"
        await resp.prepare(request)
        self._resp = resp
        self._buf.append(self._framer.first())

    def token(self, text: str, last: bool) -> None:
        if self._resp is None:
            self._texts.append(text)
        else:
            self._buf.append(self._framer.token(text, "length" if last else None))

    async def flush(self) -> None:
        if self._resp is not None and self._buf:
            data = b"".join(self._buf)
            self._buf.clear()
            await self._resp.write(data)

    async def finish(self, req: GenRequest, n: int) -> web.StreamResponse:
        if self._resp is None:
            body = self._framer.whole("".join(self._texts), "length", req.prompt_tokens, n)
            return web.Response(body=body, content_type="application/json")
        if req.include_usage:
            self._buf.append(self._framer.usage(req.prompt_tokens, n))
        self._buf.append(DONE)
        await self.flush()
        await self._resp.write_eof()
        return self._resp
