"""The floor of any Python data plane here: a TCP pipe on uvloop that touches every read.

`bench/run.py --targets ...,pyfloor` puts this beside pulsegate, nginx and Envoy to answer
one question with a number: what does it cost to have Python see each socket read at all?
Each client connection gets its own upstream connection (1:1, opened at accept), and every
read on either side is written as it came to the other: one `data_received` call and one
`write` per read, no HTTP parsing, no routing, no health, no copy. No gateway that looks at
what it relays (pulsegate parses every SSE event to resume a stream and to refuse a
backend's garbage) can cost less per request or per token on the same event loop; what it
costs above this line is what its own Python does.

    python bench/perf/floor_proxy.py --port 0 --to 127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import asyncio
import signal


class _Up(asyncio.Protocol):
    """The upstream side of one pipe: what the engine sends goes to the client as it came."""

    def __init__(self, down: asyncio.Transport) -> None:
        self.down = down

    def data_received(self, data: bytes) -> None:
        self.down.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.down.close()


class _Down(asyncio.Protocol):
    """The client side of one pipe: reads wait (paused) until the upstream is connected."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.up: asyncio.Transport | None = None
        self.transport: asyncio.Transport | None = None
        self.held: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        try:
            up, _ = await loop.create_connection(lambda: _Up(self.transport), self.host, self.port)
        except OSError:
            self.transport.close()
            return
        self.up = up  # type: ignore[assignment]
        for data in self.held:
            up.write(data)
        self.held = []

    def data_received(self, data: bytes) -> None:
        up = self.up
        if up is None:
            self.held.append(data)
        else:
            up.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None:
            self.up.close()


async def serve(port: int, to: str) -> None:
    host, _, up_port = to.rpartition(":")
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Down(host, int(up_port)), "127.0.0.1", port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bound = server.sockets[0].getsockname()[1]
    print(f"listening on 127.0.0.1:{bound}", flush=True)
    await stop.wait()
    server.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--to", required=True, help="HOST:PORT of the engine")
    args = ap.parse_args()
    import uvloop

    uvloop.run(serve(args.port, args.to))


if __name__ == "__main__":
    main()
