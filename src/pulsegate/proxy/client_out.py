"""A relayed stream's bytes to the client: written straight to the transport, synchronously.

aiohttp's `StreamResponse.write` cost about 5 µs of each relayed token (docs/performance.md,
"Where the time goes"): two coroutines, the writer's checks, the chunk header formatted as a
str and encoded, a `writelines`. And being a coroutine, it kept the relay a coroutine per
token. Once the response head is out a token needs one thing: its bytes framed as one chunk
in one `transport.write`, which can be done from the upstream connection's callback
(`Response.sink`), with no task switch at all.

`start()` sends the head through aiohttp (which holds it back to send it with the first body
bytes); from then on `write()` frames (chunked on HTTP/1.1, raw on HTTP/1.0's
body-until-close) and writes. It never waits: `busy` says the client's transport holds more
than `LIMIT` bytes (aiohttp's own threshold), and the relay then stops taking bytes from the
upstream and awaits `drain()`. A client that went away raises aiohttp's
`ClientConnectionResetError`, as `write` did. The ending (`write_eof`, a last error event)
still goes through aiohttp: the frames are in order on the one transport either way.
"""

from __future__ import annotations

import asyncio

from aiohttp import ClientConnectionResetError, web
from aiohttp.http_writer import StreamWriter

# Bytes queued on the client's transport before the relay waits for the client (aiohttp's
# `StreamWriter.write` limit).
LIMIT = 0x10000


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
