"""What the connection guard (`conn_guard.py`) costs, in process.

    .venv/bin/python bench/conn_guard.py [--calls 200000] [--repeat 15]

Each case runs `--calls` times through a `Conn` around a protocol that does nothing, and
the same calls straight into that protocol (the baseline: aiohttp's own work is the same
with or without the guard), `--repeat` times interleaved, keeping each one's best run;
printed: the guard's own cost per call (best minus baseline). CPU time of this process
(`time.process_time`), so other jobs on a shared box count little.

Cases:
  request           a head in one write, its handler's begin and end (per request)
  body chunk        a `data_received` while a handler runs (per chunk of a body)
  connection        factory, `connection_made`, `connection_lost` (per connection)
  sweep, 100 heads  one sweep with 100 heads arriving, none late (per sweep: once a second
                    at the default, whatever the number of idle connections)
And a yardstick: one keep-alive `GET` on loopback, client and aiohttp server in this
process (uvloop), through `runtime.client_site` and through a plain `web.TCPSite`: CPU time
per request, best of `--repeat` runs of `--requests` (the guard's share is within its noise).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable

from pulsegate.conn_guard import Conn, ConnGuard


class Nothing(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        pass


class Transport(asyncio.Transport):
    def is_closing(self) -> bool:
        return False


HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * 100


class Done:
    def is_eof(self) -> bool:
        return True


DONE = Done()


def _now() -> float:
    return 1000.0


def _cases(calls: int) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    guard = ConnGuard(Nothing, 10**9, 10.0, _now)
    conn = Conn(guard, Nothing())
    conn.connection_made(Transport())
    inner = Nothing()

    def request() -> None:
        for _ in range(calls):
            conn.data_received(HEAD)
            guard.begin(conn)
            guard.end(conn, DONE)

    def request_base() -> None:
        for _ in range(calls):
            inner.data_received(HEAD)

    def chunk() -> None:
        guard.begin(conn)
        for _ in range(calls):
            conn.data_received(HEAD)
        guard.end(conn, DONE)

    def connection() -> None:
        t = Transport()
        for _ in range(calls):
            c = guard.factory()
            c.connection_made(t)
            c.connection_lost(None)

    def connection_base() -> None:
        t = Transport()
        for _ in range(calls):
            c = Nothing()
            c.connection_made(t)
            c.connection_lost(None)

    sweeper = ConnGuard(Nothing, 10**9, 10.0, _now)
    for _ in range(100):
        c = sweeper.factory()
        c.connection_made(Transport())
        c.data_received(b"G")
    sweeps = max(1, calls // 100)

    def sweep() -> None:
        for _ in range(sweeps):
            sweeper.sweep(1001.0)

    def nothing() -> None:
        for _ in range(sweeps):
            pass

    return {
        "request": (request, request_base),
        "body chunk": (chunk, request_base),
        "connection": (connection, connection_base),
        "sweep, 100 heads": (sweep, nothing),
    }


def _best(fn: Callable[[], None], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best


async def _loopback(guarded: bool, requests: int, repeat: int) -> float:
    from aiohttp import web

    from pulsegate import runtime
    from pulsegate.config.schema import GatewayConfig

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/x", hello)
    runner = runtime.runner(app, 75.0)
    await runner.setup()
    site: web.BaseSite
    if guarded:
        site = runtime.client_site(runner, GatewayConfig(port=0), 0, None)
    else:
        site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runtime.bound_port(site, 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    ask = b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n"
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        for _ in range(requests):
            writer.write(ask)
            await reader.readuntil(b"\r\n\r\nok")
        best = min(best, time.process_time() - t0)
    writer.close()
    await site.stop()
    await runner.cleanup()
    return best / requests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    for name, (fn, base) in _cases(args.calls).items():
        n = args.calls if not name.startswith("sweep") else max(1, args.calls // 100)
        cost = (_best(fn, args.repeat) - _best(base, args.repeat)) / n
        print(f"{name:18s} {cost * 1e9:8.0f} ns per call")
    runtime_uvloop()
    for guarded in (False, True):
        per = asyncio.run(_loopback(guarded, args.calls // 40, args.repeat))
        label = "loopback, guarded" if guarded else "loopback, TCPSite"
        print(f"{label:18s} {per * 1e6:8.1f} us per request (client and server)")


def runtime_uvloop() -> None:
    from pulsegate import runtime

    runtime.install_uvloop()


if __name__ == "__main__":
    main()
