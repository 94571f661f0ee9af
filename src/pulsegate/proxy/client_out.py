"""The client's side of a proxied request, whichever HTTP server read it.

Two servers hand the proxy path its requests: the lean one (`client_conn.py`, the proxied
POSTs on every connection) and aiohttp (what the lean one does not take: other paths, an
unusual head, `Expect`, chunked uploads). The forwarder sees either through `Incoming`
(the head's headers, the body) and answers a stream through `StreamOut`. A backend's whole
answer is a `Whole` (status, headers, body: what the lean server writes in one go, ~1.7 µs
less than making and reading back a `web.Response`); the gateway's own answers (errors,
refusals) are `web.Response`s. aiohttp's route turns a `Whole` into one (`Whole.response`).

`AioIncoming` and `AioStream` are aiohttp's. aiohttp's `StreamResponse.write` cost about
5 µs of each relayed token (docs/performance.md, "Where the time goes"): two coroutines,
the writer's checks, the chunk header formatted as a str and encoded, a `writelines`. And
being a coroutine, it kept the relay a coroutine per token. Once the response head is out
a token needs one thing: its bytes framed as one chunk in one `transport.write`, which can
be done from the upstream connection's callback (`Response.sink`), with no task switch at
all.

`AioStream.start()` sends the head through aiohttp (which holds it back to send it with
the first body bytes); from then on `write()` frames (chunked on HTTP/1.1, raw on HTTP/1.0's
body-until-close) and writes. It never waits: `busy` says the client's transport holds more
than `LIMIT` bytes (aiohttp's own threshold), and the relay then stops taking bytes from the
upstream and awaits `drain()`. A client that went away raises aiohttp's
`ClientConnectionResetError`, as `write` did. The ending (`send`, `end`) still goes
through aiohttp: the frames are in order on the one transport either way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Protocol

from aiohttp import ClientConnectionResetError, web
from aiohttp.http_writer import StreamWriter

# Bytes queued on the client's transport before the relay waits for the client (aiohttp's
# `StreamWriter.write` limit).
LIMIT = 0x10000


class Whole:
    """A backend's whole answer, passed on: its status (< 400: a backend's 4xx is judged
    and reshaped like the gateway's own errors), the headers the client gets, the body."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def response(self) -> web.Response:
        """The same answer for aiohttp's server."""
        return web.Response(status=self.status, body=self.body, headers=self.headers)


class BodyTooLarge(Exception):
    """The request body is past `gateway.max_body_bytes`."""


class StreamOut(Protocol):
    """A stream's answer to the client: the head, body bytes framed and written at once
    (`write`, never waiting: `busy` then says to `drain`), awaited writes and the end."""

    status: int

    async def start(self) -> None: ...

    @property
    def busy(self) -> bool: ...

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    async def send(self, data: bytes) -> None: ...

    async def end(self) -> None: ...


class Incoming(Protocol):
    """A request as the forwarder reads it: header names in lower case."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def content_length(self) -> int | None: ...

    def body_arrived(self) -> bool: ...

    async def read(self) -> bytes:
        """The whole body; raises `BodyTooLarge`."""
        ...

    def stream_out(self, status: int, headers: Mapping[str, str], close: bool) -> StreamOut: ...


class AioIncoming:
    """An aiohttp request (its server refuses an oversize body while reading)."""

    __slots__ = ("request",)

    def __init__(self, request: web.Request) -> None:
        self.request = request

    @property
    def headers(self) -> Mapping[str, str]:
        return self.request.headers

    @property
    def content_length(self) -> int | None:
        return self.request.content_length

    def body_arrived(self) -> bool:
        return self.request.content.is_eof()

    async def read(self) -> bytes:
        try:
            return await self.request.read()
        except web.HTTPRequestEntityTooLarge:
            raise BodyTooLarge from None

    def stream_out(self, status: int, headers: Mapping[str, str], close: bool) -> AioStream:
        return AioStream(self.request, status, headers, close)


class AioStream:
    """A stream answered through aiohttp: `response` is what its handler returns."""

    __slots__ = ("_client", "_request", "response", "status")

    def __init__(
        self, request: web.Request, status: int, headers: Mapping[str, str], close: bool
    ) -> None:
        self._request = request
        self.status = status
        self.response = web.StreamResponse(status=status, headers=headers)
        if close:
            self.response.force_close()  # `Connection: close`
        self._client = ClientOut()

    async def start(self) -> None:
        await self.response.prepare(self._request)
        await self._client.start(self.response)

    @property
    def busy(self) -> bool:
        return self._client.busy

    def write(self, data: bytes) -> None:
        self._client.write(data)

    async def drain(self) -> None:
        await self._client.drain()

    async def send(self, data: bytes) -> None:
        await self.response.write(data)

    async def end(self) -> None:
        await self.response.write_eof()


class ClientOut:
    __slots__ = ("_chunked", "_transport", "_writer")

    def __init__(self) -> None:
        self._transport: asyncio.WriteTransport | None = None
        self._writer: StreamWriter | None = None
        self._chunked = True

    async def start(self, out: web.StreamResponse) -> None:
        """Send `out`'s head (after `prepare`): from now on, writes go straight out."""
        await out.write(b"")  # an empty write sends a held-back head, and only that
        w = out._payload_writer  # aiohttp's writer of this response
        t = w.transport if w is not None else None
        if type(w) is not StreamWriter or out.compression or t is None:
            # The relay never compresses; another writer is another aiohttp: not guessed at.
            raise RuntimeError(f"cannot relay on {type(w).__name__} (compression off?)")
        self._transport, self._writer, self._chunked = t, w, w.chunked

    @property
    def busy(self) -> bool:
        """The client is behind: wait for `drain()` before writing more."""
        t = self._transport
        return t is not None and t.get_write_buffer_size() > LIMIT

    def write(self, data: bytes) -> None:
        t, w = self._transport, self._writer
        if t is None or w is None or t.is_closing():
            raise ClientConnectionResetError("Cannot write to closing transport")
        frame = b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data
        t.write(frame)
        w.output_size += len(frame)  # aiohttp's count of the body sent (its access log)

    async def drain(self) -> None:
        """Until the client took enough of what is queued (or went away)."""
        if self._writer is not None:
            await self._writer.drain()
