"""Hand-written pooled keep-alive HTTP/1.1 client on httptools (ceiling experiment only).

Deliberately minimal: no retries on stale idle connections, no pool limit, no timeouts,
no TLS, no redirects/proxies/decompression -- everything aiohttp's client does for us.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

import httptools


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.keep_alive = False
        self.status = 0
        self.ctype = b"application/json"
        self.head: asyncio.Future[None] | None = None
        self.done: asyncio.Future[None] | None = None
        self.body: list[bytes] = []
        self.queue: asyncio.Queue[bytes | None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        err = ConnectionError("upstream connection lost")
        for fut in (self.head, self.done):
            if fut is not None and not fut.done():
                fut.set_exception(err)
        if self.queue is not None:
            self.queue.put_nowait(None)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.done is not None and not self.done.done():
                self.done.set_exception(exc)
            assert self.transport is not None
            self.transport.close()

    def on_message_begin(self) -> None:
        self.body = []
        self.ctype = b"application/json"

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 12 and name.lower() == b"content-type":
            self.ctype = value

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.queue is not None:
            self.queue.put_nowait(body)
        else:
            self.body.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        if self.queue is not None:
            self.queue.put_nowait(None)
        if self.done is not None and not self.done.done():
            self.done.set_result(None)


class RawPool:
    def __init__(self, host: str, port: int, path: bytes) -> None:
        self.host, self.port = host, port
        self.idle: deque[_Conn] = deque()
        self.prefix = b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n" % (
            path,
            host.encode(),
            port,
        )

    async def _acquire(self) -> _Conn:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Conn, self.host, self.port)
        return conn

    def _release(self, conn: _Conn) -> None:
        conn.head = conn.done = None
        conn.queue = None
        if conn.keep_alive and not conn.closed:
            self.idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()

    def _send(self, conn: _Conn, body: bytes) -> None:
        assert conn.transport is not None
        conn.keep_alive = False
        conn.transport.write(self.prefix + b"content-length: %d\r\n\r\n" % len(body) + body)

    async def fetch(self, body: bytes) -> tuple[int, bytes, bytes]:
        conn = await self._acquire()
        conn.done = asyncio.get_running_loop().create_future()
        self._send(conn, body)
        try:
            await conn.done
        except BaseException:
            conn.keep_alive = False
            self._release(conn)
            raise
        data = b"".join(conn.body)
        self._release(conn)
        return conn.status, conn.ctype, data

    @contextlib.asynccontextmanager
    async def stream(self, body: bytes) -> AsyncIterator[tuple[int, bytes, AsyncIterator[bytes]]]:
        conn = await self._acquire()
        loop = asyncio.get_running_loop()
        conn.head = loop.create_future()
        conn.done = loop.create_future()
        q: asyncio.Queue[bytes | None] = asyncio.Queue()
        conn.queue = q
        self._send(conn, body)

        async def chunks() -> AsyncIterator[bytes]:
            while (item := await q.get()) is not None:
                yield item
            if conn.closed and not conn.done.done():  # type: ignore[union-attr]
                raise ConnectionError("upstream closed mid-stream")

        try:
            await conn.head
            yield conn.status, conn.ctype, chunks()
            await conn.done  # type: ignore[misc]
        except BaseException:
            conn.keep_alive = False
            raise
        finally:
            self._release(conn)
