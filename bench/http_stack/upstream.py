"""Minimal fast OpenAI-compatible upstream: raw asyncio protocol + httptools, uvloop.

POST /v1/chat/completions -> fixed ~300 B JSON completion, or (when the body has
"stream": true) an SSE stream of 64 small `data:` chunks + `data: [DONE]`, one chunk every
BENCH_CHUNK_DELAY_MS milliseconds (0 = as fast as possible).
"""

from __future__ import annotations

import argparse
import asyncio
import os

import httptools
from common import (
    COMPLETION_BODY,
    SSE_CHUNK,
    SSE_CHUNKS,
    SSE_DONE,
    install_uvloop,
)

JSON_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(COMPLETION_BODY)).encode()
    + b"\r\n\r\n"
    + COMPLETION_BODY
)
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)
CHUNK_FRAME = b"%x\r\n%s\r\n" % (len(SSE_CHUNK), SSE_CHUNK)
DONE_FRAME = b"%x\r\n%s\r\n0\r\n\r\n" % (len(SSE_DONE), SSE_DONE)
DELAY = float(os.environ.get("BENCH_CHUNK_DELAY_MS", "5")) / 1000.0


class Upstream(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []

    def on_message_begin(self) -> None:
        self.body = []

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        if b'"stream":true' in body or b'"stream": true' in body:
            asyncio.get_running_loop().create_task(self.stream())
        else:
            self.transport.write(JSON_RESPONSE)
            if not self.parser.should_keep_alive():
                self.transport.close()

    async def stream(self) -> None:
        t = self.transport
        t.write(SSE_HEAD)
        for _ in range(SSE_CHUNKS):
            if DELAY:
                await asyncio.sleep(DELAY)
            if t.is_closing():
                return
            t.write(CHUNK_FRAME)
        t.write(DONE_FRAME)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            self.transport.close()


async def main(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Upstream, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    install_uvloop()
    asyncio.run(main(ap.parse_args().port))
