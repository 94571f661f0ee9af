"""The upstream client against hostile backends: every response it takes is bounded.

Each finding of the reliability review is a scripted loopback server here (issue #22): a head
that never ends, too many header fields, a body past the limit, a 1xx with a body, a 101 or
status 000, `Transfer-Encoding: chunked, gzip`. The client refuses with a `ProtocolError`
(a backend failure the proxy retries elsewhere), closes that connection, and stays fast.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from test_upstream import _pool, client, start

from pulsegate.health.observations import Outcome
from pulsegate.proxy.classify import classify_exception
from pulsegate.proxy.upstream import Pool, ProtocolError
from pulsegate.proxy.upstream_conn import MAX_HEAD_BYTES, MAX_HEADERS

pytestmark = pytest.mark.filterwarnings(
    'ignore:Overriding the "event_loop_policy":DeprecationWarning'
)


def script(*parts: bytes, close: bool = True):  # type: ignore[no-untyped-def]
    """A server that reads one request and writes `parts` (a write each), then closes."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        srv = handler.server  # type: ignore[attr-defined]
        await srv.read_request(r)
        for p in parts:
            w.write(p)
            await w.drain()
        if not close:
            await asyncio.sleep(30)  # hold the connection: the client must not wait for it

    return handler


async def _answer(pool: Pool) -> bytes:
    async with asyncio.timeout(5):
        resp = await pool.post("/v1/completions", b"{}")
        return await resp.read()


async def _refused(*parts: bytes, close: bool = True) -> ProtocolError:
    srv = await start(script(*parts, close=close))
    try:
        async with client() as up:
            with pytest.raises(ProtocolError) as e:
                await _answer(_pool(up, srv))
            assert classify_exception(e.value, True) is Outcome.STREAM_BROKEN
            return e.value
    finally:
        await srv.close()


async def test_more_header_fields_than_the_bound_are_refused() -> None:
    """400k small header lines: refused after MAX_HEADERS, in well under a second."""
    t0 = time.monotonic()
    line = b"X-Flood: 1\r\n"
    e = await _refused(b"HTTP/1.1 200 OK\r\n" + line * 400_000, close=False)
    assert f"more than {MAX_HEADERS} header fields" in str(e)
    assert time.monotonic() - t0 < 2.0


async def test_a_head_past_its_byte_bound_is_refused_while_it_arrives() -> None:
    """One endless header value (no end of head in sight) is refused once the head passes
    MAX_HEAD_BYTES, without waiting for the rest."""
    e = await _refused(b"HTTP/1.1 200 OK\r\nX-Big: ", *[b"a" * 16384] * 32, close=False)
    assert f"headers exceed {MAX_HEAD_BYTES} bytes" in str(e)


async def test_a_body_past_the_read_limit_is_refused() -> None:
    """A whole-body read past its limit fails instead of growing memory."""
    body = b"x" * (3 * 1024 * 1024)
    srv = await start(script(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body), body))
    try:
        async with client() as up:
            resp = await _pool(up, srv).post("/v1/completions", b"{}")
            with pytest.raises(ProtocolError, match="exceeds 1048576 bytes"):
                await resp.read(limit=1024 * 1024)
    finally:
        await srv.close()


async def test_an_interim_response_is_skipped() -> None:
    """A 103 before the answer: the answer comes back alone."""
    srv = await start(
        script(
            b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n",
            b'HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{"ok":true}',
        )
    )
    try:
        async with client() as up:
            resp = await _pool(up, srv).post("/v1/completions", b"{}")
            assert resp.status == 200
            assert await resp.read() == b'{"ok":true}'
    finally:
        await srv.close()


async def test_a_1xx_with_a_body_is_refused_not_prepended() -> None:
    """A 1xx has no body (RFC 9110 15.2): bytes after its head are a malformed response,
    never prepended to the final answer."""
    e = await _refused(
        b"HTTP/1.1 103 Early Hints\r\nContent-Length: 5\r\n\r\nhello",
        b'HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n{"ok":true}',
    )
    assert "malformed" in str(e)


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
        b"HTTP/1.1 000 Nothing\r\nContent-Length: 2\r\n\r\nok",
    ],
    ids=["101", "000"],
)
async def test_a_status_that_is_no_answer_is_a_protocol_error(head: bytes) -> None:
    """A 101 nobody asked for and a status 000 are a backend's protocol error, never a
    success and never a fatal transport error."""
    e = await _refused(head)
    assert "status" in str(e) or "upgrade" in str(e)


async def test_chunked_not_last_is_read_to_the_end_of_the_connection() -> None:
    """`Transfer-Encoding: chunked, gzip` frames the body by the connection's end (RFC 9112):
    the whole answer arrives, it is not lost as a broken connection."""
    srv = await start(
        script(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n", b"whole answer")
    )
    try:
        async with client() as up:
            resp = await _pool(up, srv).post("/v1/completions", b"{}")
            assert await resp.read() == b"whole answer"
    finally:
        await srv.close()
