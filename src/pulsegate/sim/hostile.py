"""Hostile backends: the raw bytes of answers no engine should send, one per fault mode.

aiohttp's response objects cannot write broken framing (a wrong Content-Length, a chunk size
that is not hex, a head that never ends), so these faults take the connection over: the
handler writes bytes straight to ``request.transport`` and always ends by closing or
resetting it, so aiohttp never writes a response of its own after them and no later request
is answered on that connection. The pure half (``plan``) says what to write; ``serve``
writes it. Every loop is bounded (``ENDLESS_BYTES``, ``HOLD_S``).

What each mode writes (streams: ``after_tokens`` valid token events first, the same text a
healthy sim would produce, so a resume elsewhere splices seamlessly):

    bad_chunked      chunked head, the events, then ``zz\\r\\n`` as a chunk size; held open
    long_length      Content-Length 64 KiB past the body, the body, then a clean close
    short_length     Content-Length half the body, the body, then a forged second answer
                     (``HTTP/1.1 200`` with ``SMUGGLED`` in it) in the same write; held open
    endless_headers  ``x-pad-N`` header lines, 64 KiB a write, until ENDLESS_BYTES or closed
    big_headers      one 1 MiB header field, then a valid answer; held open
    non_sse          the events, then an HTML error page inside the chunked stream; held
    bad_utf8         the events, then ``data:`` with bytes 0xff 0xfe inside; held
    endless_event    the events, then ``data: aaaa...`` without end, until ENDLESS_BYTES
    not_json         a non-streamed 200 ``application/json`` whose body is an HTML page
    trickle          a valid answer, one byte every ``interval_s`` (default 1 s)
    headers_reset    the response head, then a TCP reset (SO_LINGER 0)

"Held open" waits up to HOLD_S for the gateway to give up (its client disconnecting cancels
the handler), so it is the gateway that must notice the bytes are wrong, not a close.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import web

from pulsegate.sim import faults as F
from pulsegate.sim.protocol import DONE, Framer, GenRequest
from pulsegate.sim.sink import abort_connection
from pulsegate.sim.text import TokenGen

# A held connection waits this long for the gateway to give up on it, then is reset.
HOLD_S = 10.0
# An endless head or event stops here (the gateway refuses at 64 KiB / 1 MiB): 256 MiB at
# loopback speed is ~0.5 s, long enough that the bound, not the end, is what is tested.
ENDLESS_BYTES = 256 * 1024 * 1024
_PIECE = 64 * 1024
# Stop writing while this much is queued in the transport (the gateway reads slower).
_WRITE_HIGH = 1024 * 1024
BIG_HEADER_BYTES = 1024 * 1024
HTML_PAGE = b"<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>\n"
SMUGGLED = b"SMUGGLED"
_FORGED = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 24\r\n\r\n"
    b'{"forged": "SMUGGLED!!"}'
)


@dataclass(frozen=True, slots=True)
class Plan:
    """What to write: ``data`` at once (or a byte at a time for trickle), then ``endless``
    filler until the bound, then either hold the connection, close it or reset it."""

    data: bytes
    endless: bytes = b""
    then: str = "hold"  # "hold" | "close" | "reset"
    interval_s: float = 0.0  # > 0: one byte of ``data`` per interval


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data) if data else b""


def _head(stream: bool, framing: bytes, extra: bytes = b"") -> bytes:
    ctype = b"text/event-stream; charset=utf-8" if stream else b"application/json"
    return b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype + b"\r\n" + extra + framing + b"\r\n"


def _events(framer: Framer, req: GenRequest, seed: int, n: int) -> bytes:
    """The first ``n`` token events of the healthy answer (never its last: no end)."""
    gen = TokenGen(req.context, seed if req.seed is None else req.seed, req.keys)
    n = max(0, min(n, req.max_tokens - 1))
    return framer.first() + b"".join(framer.token(gen.next()) for _ in range(n))


def _whole(framer: Framer, req: GenRequest, seed: int) -> bytes:
    """The complete healthy answer: the whole SSE stream, or the JSON object."""
    gen = TokenGen(req.context, seed if req.seed is None else req.seed, req.keys)
    texts = [gen.next() for _ in range(req.max_tokens)]
    if not req.stream:
        return framer.whole("".join(texts), "length", req.prompt_tokens, req.max_tokens)
    last = len(texts) - 1
    body = framer.first() + b"".join(
        framer.token(t, "length" if i == last else None) for i, t in enumerate(texts)
    )
    if req.include_usage:
        body += framer.usage(req.prompt_tokens, req.max_tokens)
    return body + DONE


def plan(fault: F.Fault, req: GenRequest, framer: Framer, seed: int) -> Plan:
    """The bytes ``fault`` writes for ``req`` (pure: tests read it without a socket)."""
    mode, stream = fault.mode, req.stream
    chunked = b"transfer-encoding: chunked\r\n"
    after = fault.after_tokens or 0
    events = _events(framer, req, seed, after) if stream else b""
    whole = _whole(framer, req, seed)
    body = events if stream else whole
    if mode is F.Mode.BAD_CHUNKED:
        return Plan(_head(stream, chunked) + _chunk(events) + b"zz\r\nhello\r\n")
    if mode is F.Mode.LONG_LENGTH:
        length = b"content-length: %d\r\n" % (len(body) + 65536)
        return Plan(_head(stream, length) + body, then="close")
    if mode is F.Mode.SHORT_LENGTH:
        length = b"content-length: %d\r\n" % (len(body) // 2)
        return Plan(_head(stream, length) + body + _FORGED)
    if mode is F.Mode.ENDLESS_HEADERS:
        line = b"x-pad: " + b"p" * 57 + b"\r\n"  # 64 bytes a line, 1,024 lines a write
        return Plan(b"HTTP/1.1 200 OK\r\n", endless=line * (_PIECE // len(line)), then="reset")
    if mode is F.Mode.BIG_HEADERS:
        big = b"x-big: " + b"b" * BIG_HEADER_BYTES + b"\r\n"
        return Plan(_head(stream, b"content-length: %d\r\n" % len(whole), big) + whole)
    if mode is F.Mode.NON_SSE:
        return Plan(_head(stream, chunked) + _chunk(events) + _chunk(HTML_PAGE))
    if mode is F.Mode.BAD_UTF8:
        bad = b'data: {"choices":[{"index":0,"delta":{"content":"\xff\xfe"}}]}\n\n'
        return Plan(_head(stream, chunked) + _chunk(events) + _chunk(bad))
    if mode is F.Mode.ENDLESS_EVENT:
        head = _head(stream, chunked) + _chunk(events) + _chunk(b"data: ")
        return Plan(head, endless=_chunk(b"a" * (_PIECE - 16)), then="reset")
    if mode is F.Mode.NOT_JSON:
        return Plan(_head(stream, b"content-length: %d\r\n" % len(HTML_PAGE)) + HTML_PAGE)
    if mode is F.Mode.TRICKLE:
        length = b"content-length: %d\r\n" % len(whole)
        return Plan(_head(stream, length) + whole, then="close", interval_s=fault.interval_s)
    if mode is F.Mode.HEADERS_RESET:
        framing = chunked if stream else b"content-length: %d\r\n" % len(whole)
        return Plan(_head(stream, framing), then="reset")
    raise ValueError(f"not a hostile mode: {mode}")


async def serve(request: web.Request, p: Plan) -> None:
    """Write ``p`` to the request's connection, then hold, close or reset it. The connection
    is never handed back to aiohttp: it ends closed on every path (cancellation included)."""
    transport = request.transport
    if transport is None:
        return
    try:
        if p.interval_s > 0:
            for i in range(len(p.data)):
                if transport.is_closing():
                    return
                transport.write(p.data[i : i + 1])
                await asyncio.sleep(p.interval_s)
        else:
            transport.write(p.data)
        if p.endless:
            await _fill(transport, p.endless)
        if p.then == "hold":
            await _hold()
    finally:
        if p.then == "close":
            transport.close()  # a clean FIN after what was queued
        else:
            abort_connection(request)


async def _fill(transport: asyncio.Transport, piece: bytes) -> None:
    """Write ``piece`` until ENDLESS_BYTES or the peer is gone, at the peer's pace."""
    sent = 0
    while sent < ENDLESS_BYTES and not transport.is_closing():
        if transport.get_write_buffer_size() > _WRITE_HIGH:
            await asyncio.sleep(0.005)
            continue
        transport.write(piece)
        sent += len(piece)
        await asyncio.sleep(0)


async def _hold() -> None:
    """Keep the connection open for HOLD_S; the peer closing it cancels the handler sooner
    (the sim runs aiohttp with ``handler_cancellation``)."""
    await asyncio.sleep(HOLD_S)
