"""A fast fake OpenAI engine for `bench/run.py --engine fast` (bench only, needs httptools).

The sim is an aiohttp server: about 11k requests/s on one of this box's cores, so nginx in
front of it measures the sim, not nginx. This engine is a raw asyncio Protocol on httptools
under uvloop (~3x the sim) that answers what pulsegate's health machinery asks for:
``GET /health``, ``GET /v1/models``, ``GET /metrics`` (the sim's vLLM + DCGM page, idle
values) and ``POST /v1/{chat/,}completions``, streamed or not, ``max_tokens`` tokens, the
first at once and one every ``--itl-ms`` after it. No faults, no queue, no validation.

``--ports K`` listens on K ports in one process (each its own engine to a gateway), for
`bench/scale.py`'s 200 backends on a 2-core box; every port is written, one a line, to
``--ports-file`` before the announcement (which names the first).

    python bench/perf/fast_engine.py --port 0 --model bench-zero --itl-ms 0
    python bench/perf/fast_engine.py --ports 200 --ports-file /tmp/ports --model bench-zero
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path
from typing import Any

import httptools
import orjson

from pulsegate.sim.gpu import read_gpu
from pulsegate.sim.metrics import EngineReading, render

WORDS = [b"alpha", b"bravo", b"charlie", b"delta", b"echo", b"foxtrot", b"golf", b"hotel"]


class Pages:
    """Every byte string the engine sends, built once."""

    def __init__(self, model: str) -> None:
        self.model = model
        reading = EngineReading(model, 512, 0, 0, 0, 0, 0, 0, 0)
        gpu = read_gpu(total_mb=81920.0, running=0, max_batch=512, kv_tokens=0, oom=False)
        self.metrics = render(reading, gpu).encode()
        self.models = orjson.dumps(
            {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "bench"}]}
        )
        head = b'data: {"id":"chatcmpl-fast","object":"chat.completion.chunk","model":"'
        self.chunk_head = head + model.encode() + b'","choices":[{"index":0,"delta":'
        self._whole: dict[int, bytes] = {}

    def whole(self, n: int) -> bytes:
        if n not in self._whole:
            text = " ".join(WORDS[i % len(WORDS)].decode() for i in range(n))
            self._whole[n] = orjson.dumps(
                {
                    "id": "chatcmpl-fast",
                    "object": "chat.completion",
                    "created": 1700000000,
                    "model": self.model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "length",
                        }
                    ],
                    "usage": {"prompt_tokens": 12, "completion_tokens": n, "total_tokens": n + 12},
                }
            )
        return self._whole[n]

    def event(self, delta: bytes, finish: bytes = b"null") -> bytes:
        return self.chunk_head + delta + b',"finish_reason":' + finish + b"}]}\n\n"

    def token(self, i: int, last: bool) -> bytes:
        delta = b'{"content":" ' + WORDS[i % len(WORDS)] + b'"}'
        return self.event(delta, b'"length"' if last else b"null")


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _head(status: int, ctype: bytes, length: int | None) -> bytes:
    reason = b"OK" if status == 200 else b"Not Found"
    h = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\n" % (status, reason, ctype)
    if length is None:
        return h + b"transfer-encoding: chunked\r\n\r\n"
    return h + b"content-length: %d\r\n\r\n" % length


class Engine(asyncio.Protocol):
    def __init__(self, pages: Pages, itl_s: float) -> None:
        self.pages = pages
        self.itl_s = itl_s
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self.url = b""
        self.body: list[bytes] = []
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        url, body = self.url, b"".join(self.body)
        self.url, self.body = b"", []
        method = self.parser.get_method()
        if method == b"GET":
            self._get(url)
        elif url.startswith(b"/v1/") and url.endswith(b"completions"):
            self._infer(body)
        else:
            self._send(404, b"application/json", b'{"error":"not found"}')

    def _send(self, status: int, ctype: bytes, body: bytes) -> None:
        self.transport.write(_head(status, ctype, len(body)) + body)

    def _get(self, url: bytes) -> None:
        p = self.pages
        if url == b"/health":
            self._send(200, b"text/plain", b"")
        elif url == b"/v1/models":
            self._send(200, b"application/json", p.models)
        elif url == b"/metrics":
            self._send(200, b"text/plain; version=0.0.4", p.metrics)
        else:
            self._send(404, b"application/json", b'{"error":"not found"}')

    def _infer(self, body: bytes) -> None:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            self._send(400, b"application/json", b'{"error":"bad json"}')
            return
        mt = doc.get("max_completion_tokens", doc.get("max_tokens"))
        n = mt if isinstance(mt, int) and mt > 0 else 16
        if doc.get("stream") is not True:
            self._send(200, b"application/json", self.pages.whole(n))
            return
        p = self.pages
        first = p.event(b'{"role":"assistant","content":""}') + p.token(0, n == 1)
        out = _head(200, b"text/event-stream", None) + _chunk(first)
        if self.itl_s <= 0:
            rest = b"".join(p.token(i, i == n - 1) for i in range(1, n))
            self.transport.write(out + _chunk(rest + b"data: [DONE]\n\n") + b"0\r\n\r\n")
            return
        self.transport.write(out)
        self.loop.call_later(self.itl_s, self._next, 1, n)

    def _next(self, i: int, n: int) -> None:
        t = self.transport
        if t.is_closing():
            return
        if i >= n:
            t.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            return
        t.write(_chunk(self.pages.token(i, i == n - 1)))
        self.loop.call_later(self.itl_s, self._next, i + 1, n)


async def main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    pages = Pages(args.model)
    itl_s = args.itl_ms / 1000.0
    servers = []
    for _ in range(args.ports):
        server = await loop.create_server(
            lambda: Engine(pages, itl_s), args.host, args.port, backlog=1024
        )
        servers.append(server)
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    if args.ports_file:
        # Written before the announcement, so the reader finds it whole once that arrives.
        await asyncio.to_thread(Path(args.ports_file).write_text, "".join(f"{p}\n" for p in ports))
    print(f"fast engine {args.name} listening on http://{args.host}:{ports[0]}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--name", default="fast")
    ap.add_argument("--model", default="bench-zero")
    ap.add_argument("--itl-ms", type=float, default=0.0)
    ap.add_argument("--ports", type=int, default=1, help="listen on this many ports (--port 0)")
    ap.add_argument("--ports-file", default="", help="write every port here, one a line")
    cli = ap.parse_args()
    if cli.ports > 1 and cli.port:
        ap.error("--ports above 1 needs --port 0")
    import uvloop

    uvloop.run(main(cli))
