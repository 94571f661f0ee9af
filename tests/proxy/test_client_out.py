"""`ClientOut`: a relayed stream's bytes written straight to the client's transport.

A real aiohttp server (in this process, the gateway's server stack) answers with a
`StreamResponse` written through `ClientOut`; raw socket clients read it, so the bytes on
the wire are checked as they are: the head, chunked frames (HTTP/1.1) or the raw body
(HTTP/1.0), and a client that does not read holding the server's queue at the limit.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web

from pulsegate.proxy.client_out import LIMIT, ClientOut

PIECE = b"data: " + b"x" * 16_000 + b"\n\n"


class Served:
    """What the handler saw: the most the transport held after a write, whether it ever
    had to wait for the client, and when it has written everything."""

    def __init__(self) -> None:
        self.most = 0
        self.waited = False
        self.done = asyncio.Event()


@pytest.fixture
async def server() -> AsyncIterator[tuple[int, Served, Callable[[int], None]]]:
    served = Served()
    count = [8]

    async def handle(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await out.prepare(request)
        client = ClientOut()
        await client.start(out)
        for _ in range(count[0]):
            if client.busy:
                served.waited = True
                await client.drain()
            client.write(PIECE)
            t = request.transport
            assert t is not None
            served.most = max(served.most, t.get_write_buffer_size())
        await out.write_eof()
        served.done.set()
        return out

    app = web.Application()
    app.router.add_post("/s", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield port, served, lambda n: count.__setitem__(0, n)
    await runner.cleanup()


async def _ask(
    port: int, version: str, rcvbuf: int = 0
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    r, w = await asyncio.open_connection(sock=sock, limit=1 << 24)
    w.write(f"POST /s HTTP/{version}\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
    await w.drain()
    return r, w


def _dechunk(body: bytes) -> list[bytes]:
    frames: list[bytes] = []
    while True:
        size, _, body = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            assert body == b"\r\n"
            return frames
        frames.append(body[:n])
        assert body[n : n + 2] == b"\r\n"
        body = body[n + 2 :]


async def test_http11_gets_one_chunk_per_write_after_the_head(
    server: tuple[int, Served, Callable[[int], None]],
) -> None:
    port, _, _ = server
    r, w = await _ask(port, "1.1")
    head = await r.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head
    body = await r.readuntil(b"0\r\n\r\n")
    assert _dechunk(body) == [PIECE] * 8
    w.close()


async def test_http10_gets_the_raw_body_until_close(
    server: tuple[int, Served, Callable[[int], None]],
) -> None:
    port, _, _ = server
    r, w = await _ask(port, "1.0")
    head = await r.readuntil(b"\r\n\r\n")
    assert b"chunked" not in head.lower()
    assert await r.read() == PIECE * 8  # the server closed: the body ended
    w.close()


async def test_a_client_that_does_not_read_holds_the_queue_at_the_limit(
    server: tuple[int, Served, Callable[[int], None]],
) -> None:
    """4 MB to a client that reads nothing at first: the writer waits for it (never more
    than LIMIT and one write queued), and once it reads, every byte arrives in order."""
    port, served, set_count = server
    n = 4_000_000 // len(PIECE)
    set_count(n)
    r, w = await _ask(port, "1.1", rcvbuf=4096)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while not served.waited:  # the kernel's buffers filled: the handler now waits
        assert loop.time() < deadline, "the handler never had to wait"
        await asyncio.sleep(0.01)  # the poll's interval
    assert not served.done.is_set()
    await r.readuntil(b"\r\n\r\n")
    body = await r.readuntil(b"0\r\n\r\n")
    assert _dechunk(body) == [PIECE] * n
    assert served.most <= LIMIT + len(PIECE) + 16
    w.close()
