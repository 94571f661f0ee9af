"""Properties of the upstream client (`proxy/upstream_conn.py`) on generated responses.

A loopback server answers each request with a hypothesis-drawn response (status line,
headers, Content-Length right, short, long or missing, chunked framing with good or bad
sizes, junk after it), written in pieces cut at drawn points, then closes. What must hold
(issue #22): every outcome is the whole body (exactly the body sent, when the framing was
valid) or an `UpstreamError` subclass; never another exception, never a hang (each exchange
is bounded at 5 s, far above the ~ms it takes). One event loop and one server serve every
example, so ~300 examples take a few seconds.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import uvloop
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pulsegate.proxy.upstream import Upstream, UpstreamError


@dataclass
class Answer:
    """One drawn response: its bytes, the pieces they are written in, the body a valid
    framing promises (None: the framing was broken on purpose) and how it is read."""

    pieces: list[bytes]
    body: bytes | None
    streamed: bool


_junk = st.sampled_from([b"", b"\r\n", b"garbage", b"HTTP/1.1 200 OK\r\n\r\n", b"\x00\xff"])
_status = st.sampled_from([b"200 OK", b"201 Created", b"400 Bad", b"500 Oops", b"503 Busy"])
_bad_status = st.sampled_from([b"000 Zero", b"101 Up", b"999 Huh", b"2x0 Bad", b"", b"200"])
_bad_chunk = st.sampled_from([b"zz\r\n", b"-1\r\n", b"f" * 18 + b"\r\n", b"5\r\nab\r\n"])
_names = st.sampled_from([b"X-A", b"Content-Type", b"Connection", b"Server", b"X-Dup"])
_values = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20).map(
    str.encode
)


def _chunked(body: bytes, sizes: list[int], bad: bytes | None) -> bytes:
    out, pos = b"", 0
    for s in sizes:
        piece = body[pos : pos + s]
        if not piece:
            break
        out += b"%x\r\n%s\r\n" % (len(piece), piece)
        pos += len(piece)
    if pos < len(body):
        out += b"%x\r\n%s\r\n" % (len(body) - pos, body[pos:])
    if bad is not None:
        out += bad  # a bad chunk size line in place of the terminator
    return out + b"0\r\n\r\n"


@st.composite
def answers(draw: st.DrawFn) -> Answer:
    body = draw(st.binary(max_size=300))
    valid = draw(st.booleans())
    status = draw(_status) if valid or draw(st.booleans()) else draw(_bad_status)
    headers = draw(st.lists(st.tuples(_names, _values), max_size=4))
    head = b"HTTP/1.1 " + status + b"\r\n"
    head += b"".join(n + b": " + v + b"\r\n" for n, v in headers if n != b"Connection")
    framing = draw(st.sampled_from(["length", "chunked", "eof"]))
    if framing == "length":
        declared = len(body) if valid else len(body) + draw(st.integers(-5, 5))
        payload = body
        head += b"Content-Length: %d\r\n" % max(declared, 0)
        if not valid and draw(st.booleans()):
            head += b"Content-Length: %d\r\n" % (len(body) + 1)  # two that disagree
    elif framing == "chunked":
        sizes = draw(st.lists(st.integers(1, 64), max_size=6))
        bad = None if valid else draw(_bad_chunk)
        payload = _chunked(body, sizes, bad)
        head += b"Transfer-Encoding: chunked\r\n"
    else:
        payload = body
    head += b"Connection: close\r\n\r\n"
    raw = head + payload + (b"" if valid else draw(_junk))
    if not valid and draw(st.booleans()):
        raw = raw[: draw(st.integers(0, len(raw)))]  # cut anywhere: a short response
    cuts = sorted(set(draw(st.lists(st.integers(0, len(raw)), max_size=6))))
    pieces, prev = [], 0
    for c in cuts:
        pieces.append(raw[prev:c])
        prev = c
    pieces.append(raw[prev:])
    return Answer([p for p in pieces if p], body if valid else None, draw(st.booleans()))


class _Bench:
    """One loop, one server; `exchange(answer)` runs one request against it."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()  # the loop the gateway runs on
        self.answer: Answer | None = None
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0)
        )
        self.port = self.server.sockets[0].getsockname()[1]
        self.up = Upstream(2.0)
        self.n = 0

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            head = await r.readuntil(b"\r\n\r\n")
            n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await r.readexactly(n)
            assert self.answer is not None
            for p in self.answer.pieces:
                w.write(p)
                await w.drain()
                await asyncio.sleep(0)  # a separate segment, as far as the loop can tell
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    async def _exchange(self, a: Answer) -> bytes:
        self.n += 1
        pool = self.up.pool(f"b{self.n}", f"http://127.0.0.1:{self.port}", {})
        resp = await pool.post("/v1/completions", b"{}")
        try:
            if not a.streamed:
                return await resp.read()
            out = b""
            while chunk := await resp.read_chunk():
                out += chunk
            return out
        finally:
            resp.release()

    def exchange(self, a: Answer) -> bytes | UpstreamError:
        self.answer = a

        async def bounded() -> bytes | UpstreamError:
            async with asyncio.timeout(5):
                try:
                    return await self._exchange(a)
                except UpstreamError as e:
                    return e

        return self.loop.run_until_complete(bounded())

    def close(self) -> None:
        self.server.close()
        self.loop.run_until_complete(self.up.close())
        self.loop.run_until_complete(self.server.wait_closed())
        self.loop.close()


_bench: _Bench | None = None


def _get_bench() -> _Bench:
    global _bench
    if _bench is None:
        _bench = _Bench()
    return _bench


def teardown_module() -> None:
    if _bench is not None:
        _bench.close()


@settings(max_examples=300, deadline=None)
@given(answers())
def test_every_response_gives_the_whole_body_or_an_upstream_error(a: Answer) -> None:
    """Valid framing: exactly the body sent, read whole or chunk by chunk. Broken framing:
    some body or an `UpstreamError` subclass. Never another exception, never a hang."""
    got = _get_bench().exchange(a)
    event("body" if isinstance(got, bytes) else type(got).__name__)  # --hypothesis-show-statistics
    if a.body is not None:
        assert got == a.body, got
    else:
        assert isinstance(got, bytes | UpstreamError)
