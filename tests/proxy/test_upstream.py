"""The proxy path's upstream client against real loopback servers started here.

Each server is a raw asyncio server scripted per test (what it answers, when it closes), so
the edge cases are the real socket events: keep-alive reuse, an idle connection closed by
the server, a reset mid-body, a server that never answers, TLS with a self-signed cert.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import uvloop

from pulsegate.health.observations import Outcome
from pulsegate.proxy.classify import classify_exception, describe
from pulsegate.proxy.upstream import (
    HIGH_WATER,
    ConnectFailed,
    ConnectionLost,
    ConnectTimeout,
    Pool,
    ProtocolError,
    Upstream,
)

# Both loops per test via the `event_loop_policy` fixture; its replacement hook would have to
# live in the shared conftest and cover every test there.
pytestmark = pytest.mark.filterwarnings(
    'ignore:Overriding the "event_loop_policy":DeprecationWarning'
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Request-Id: r1\r\n"


@pytest.fixture(params=["asyncio", "uvloop"])
def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    """Both loops: the gateway runs on uvloop, the library must not depend on it."""
    if request.param == "uvloop":
        return uvloop.EventLoopPolicy()
    return asyncio.DefaultEventLoopPolicy()


class Server:
    """A loopback server running `handler(reader, writer, n)` for its n-th connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.sni: list[str | None] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self, ssl_ctx: ssl.SSLContext | None = None) -> Server:
        if ssl_ctx is not None:

            def sni(obj: ssl.SSLObject, name: str | None, ctx: ssl.SSLContext) -> None:
                self.sni.append(name)

            ssl_ctx.sni_callback = sni
        self._server = await asyncio.start_server(self._conn, "127.0.0.1", 0, ssl=ssl_ctx)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        n = self.connections
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self.handler(r, w, n)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._tasks.discard(task)
            w.close()

    async def read_request(self, r: asyncio.StreamReader) -> bytes:
        """One request (head + Content-Length body); b"" when the client closed first."""
        try:
            head = await r.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return b""
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        req = head + await r.readexactly(length)
        self.requests.append(req)
        return req

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await self._server.wait_closed()


@contextlib.asynccontextmanager
async def client(**kw: float) -> AsyncIterator[Upstream]:
    up = Upstream(kw.pop("connect_timeout", 2.0), **kw)  # type: ignore[arg-type]
    try:
        yield up
    finally:
        await up.close()


def answering(body: bytes = b'{"ok":true}', extra: bytes = b"") -> Handler:
    """A keep-alive server answering every request with `body` (Content-Length)."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        srv: Server = handler.server  # type: ignore[attr-defined]
        while await srv.read_request(r):
            w.write(OK + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            await w.drain()

    return handler


async def start(handler: Handler, ssl_ctx: ssl.SSLContext | None = None) -> Server:
    srv = Server(handler)
    handler.server = srv  # type: ignore[attr-defined]
    return await srv.start(ssl_ctx)


async def poll(cond: Callable[[], object], within: float = 5.0) -> None:
    """Yield to the loop until `cond()` holds; fail after `within` seconds."""
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within}s")
        await asyncio.sleep(0.005)


def _pool(up: Upstream, srv: Server, prefix: str = "", **headers: str) -> Pool:
    return up.pool("b", f"http://127.0.0.1:{srv.port}{prefix}", headers)


# -- requests and bodies -----------------------------------------------------------------------


async def test_writes_the_request_and_reads_a_content_length_body() -> None:
    """Request line keeps the URL prefix; Host, Content-Length and the backend's headers
    are sent; the body, status and headers (any case) come back."""
    srv = await start(answering(b'{"answer":42}'))
    try:
        async with client() as up:
            pool = _pool(
                up,
                srv,
                "/openai",
                **{"content-type": "application/json", "authorization": "Bearer k"},
            )
            resp = await pool.post("/v1/chat/completions", b'{"model":"m"}')
            assert resp.status == 200
            assert resp.headers.get("content-type") == "application/json"
            assert resp.headers.get("X-REQUEST-ID") == "r1" and "x-request-id" in resp.headers
            assert await resp.read() == b'{"answer":42}'
            resp.release()
        (req,) = srv.requests
        head, _, body = req.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        assert lines[0] == b"POST /openai/v1/chat/completions HTTP/1.1"
        fields = {k.lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:])}
        assert fields[b"host"] == b"127.0.0.1:%d" % srv.port
        assert fields[b"content-length"] == b"13"
        assert fields[b"authorization"] == b"Bearer k"
        assert fields[b"content-type"] == b"application/json"
        assert body == b'{"model":"m"}'
    finally:
        await srv.close()


async def test_large_request_body_arrives_whole() -> None:
    """A body past the one-write size is still sent whole, after the head."""
    srv = await start(answering())
    payload = b"x" * 300_000
    try:
        async with client() as up:
            resp = await _pool(up, srv).post("/v1/completions", payload)
            await resp.read()
            resp.release()
        assert srv.requests[0].endswith(b"\r\n\r\n" + payload)
    finally:
        await srv.close()


async def test_chunked_body_is_streamed_as_it_arrives() -> None:
    """Each chunk is readable before the server sends the next; b"" at the end."""
    go_on = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        w.write(OK + b"Transfer-Encoding: chunked\r\n\r\n" + b"6\r\ndata:1\r\n")
        await go_on.wait()
        w.write(b"6\r\ndata:2\r\n0\r\n\r\n")
        await w.drain()
        await srv.read_request(r)

    srv = await start(handler)
    try:
        async with client() as up:
            resp = await _pool(up, srv).post("/v1/completions", b"{}")
            assert await resp.read_chunk() == b"data:1"
            go_on.set()
            assert await resp.read_chunk() == b"data:2"
            assert await resp.read_chunk() == b""
            assert await resp.read_chunk() == b""  # stays at the end
            resp.release()
    finally:
        await srv.close()


async def test_body_until_eof_without_length() -> None:
    """No Content-Length, not chunked: the body ends at EOF and the connection is not kept."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await w.drain()

    srv = await start(handler)
    try:
        async with client() as up:
            pool = _pool(up, srv)
            resp = await pool.post("/v1/completions", b"{}")
            assert await resp.read() == b"all of it"
            resp.release()
            assert pool.idle == 0
    finally:
        await srv.close()


async def test_malformed_response_is_a_protocol_error() -> None:
    """Bytes that are not HTTP raise ProtocolError, classified as a broken stream."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        w.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        await w.drain()
        await r.read()

    srv = await start(handler)
    try:
        async with client() as up:
            with pytest.raises(ProtocolError) as e:
                await _pool(up, srv).post("/v1/completions", b"{}")
        assert classify_exception(e.value, False) is Outcome.STREAM_BROKEN
    finally:
        await srv.close()


def test_header_with_line_break_is_refused() -> None:
    """A backend header that could inject another header is refused when the pool is made."""
    with pytest.raises(ValueError, match="line break"):
        Upstream(1.0).pool("b", "http://127.0.0.1:1", {"authorization": "Bearer k\r\nx: y"})
    with pytest.raises(ValueError, match="http"):
        Upstream(1.0).pool("b", "ftp://127.0.0.1:1", {})


# -- keep-alive pool ---------------------------------------------------------------------------


async def test_released_connections_are_reused() -> None:
    """Five requests in a row use one connection; close() instead of release() does not."""
    srv = await start(answering())
    try:
        async with client() as up:
            pool = _pool(up, srv)
            for _ in range(5):
                resp = await pool.post("/v1/completions", b"{}")
                await resp.read()
                resp.release()
            assert (pool.connects, pool.reuses, srv.connections) == (1, 4, 1)
            resp = await pool.post("/v1/completions", b"{}")
            resp.close()  # aborted: never back in the pool
            resp = await pool.post("/v1/completions", b"{}")
            await resp.read()
            resp.release()
            assert (pool.connects, srv.connections) == (2, 2)
    finally:
        await srv.close()


async def test_concurrent_requests_get_their_own_connections() -> None:
    """Requests in flight at once never share a connection; afterwards all are idle."""
    both_in = asyncio.Event()
    seen = 0

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        nonlocal seen
        while await srv.read_request(r):
            seen += 1
            if seen == 2:
                both_in.set()
            await both_in.wait()
            w.write(OK + b"Content-Length: 1\r\n\r\n%d" % n)
            await w.drain()

    srv = await start(handler)
    try:
        async with client() as up:
            pool = _pool(up, srv)

            async def one() -> bytes:
                resp = await pool.post("/v1/completions", b"{}")
                body = await resp.read()
                resp.release()
                return body

            bodies = await asyncio.gather(one(), one())
            assert sorted(bodies) == [b"0", b"1"]
            assert pool.idle == 2
    finally:
        await srv.close()


async def test_release_before_the_end_lingers_for_it() -> None:
    """Released right after the last event, the connection returns to the pool once the
    chunked terminator arrives, and the next request reuses it."""
    send_end = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        w.write(OK + b"Transfer-Encoding: chunked\r\n\r\n" + b"4\r\nlast\r\n")
        await send_end.wait()
        w.write(b"0\r\n\r\n")
        while await srv.read_request(r):
            w.write(OK + b"Content-Length: 2\r\n\r\nok")

    srv = await start(handler)
    try:
        async with client() as up:
            pool = _pool(up, srv)
            resp = await pool.post("/v1/chat/completions", b"{}")
            assert await resp.read_chunk() == b"last"
            resp.release()
            resp.close()  # what the relay's `finally` does: no effect once released
            assert pool.idle == 0
            send_end.set()
            await poll(lambda: pool.idle == 1)
            resp = await pool.post("/v1/chat/completions", b"{}")
            assert await resp.read() == b"ok"
            assert (pool.connects, srv.connections) == (1, 1)
    finally:
        await srv.close()


async def test_idle_connections_expire() -> None:
    """An idle connection past the idle timeout is closed by the pool's sweep."""
    srv = await start(answering())
    try:
        async with client(idle_timeout=0.05) as up:
            pool = _pool(up, srv)
            resp = await pool.post("/v1/completions", b"{}")
            await resp.read()
            resp.release()
            assert pool.idle == 1
            await poll(lambda: pool.idle == 0)
    finally:
        await srv.close()


async def test_idle_time_is_read_from_the_injected_clock() -> None:
    """Idle time is `Upstream(now=...)`'s: reused at 9 s idle of 10, a fresh one at 10.5 s."""
    t = 1000.0
    srv = await start(answering())
    up = Upstream(2.0, idle_timeout=10.0, now=lambda: t)
    try:
        pool = _pool(up, srv)
        for idle in (0.0, 9.0, 10.5):
            t += idle
            resp = await pool.post("/v1/completions", b"{}")
            assert await resp.read() == b'{"ok":true}'
            resp.release()
        assert (pool.connects, pool.reuses, srv.connections) == (2, 1, 2)
    finally:
        await up.close()
        await srv.close()


async def test_idle_count_is_bounded() -> None:
    """No more than `max_idle` connections wait in the pool; the most recent are kept."""
    release = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while await srv.read_request(r):
            await release.wait()
            w.write(OK + b"Content-Length: 0\r\n\r\n")

    srv = await start(handler)
    try:
        async with client(max_idle=2) as up:
            pool = _pool(up, srv)
            posts = [asyncio.ensure_future(pool.post("/v1/completions", b"{}")) for _ in range(4)]
            await poll(lambda: len(srv.requests) == 4)
            release.set()
            for resp in await asyncio.gather(*posts):
                await resp.read()
                resp.release()
            assert pool.idle == 2
    finally:
        await srv.close()


# -- stale connections -------------------------------------------------------------------------


async def test_stale_idle_connection_is_retried_once_on_a_fresh_one() -> None:
    """The server closes a kept-alive connection as the next request arrives on it (no
    byte of answer): the request is sent again on a new connection and succeeds."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        w.write(OK + b"Content-Length: 1\r\n\r\n%d" % n)
        await w.drain()
        if n == 0:
            await srv.read_request(r)  # then close without a byte: the race, made certain
            return
        while await srv.read_request(r):
            w.write(OK + b"Content-Length: 1\r\n\r\n%d" % n)

    srv = await start(handler)
    try:
        async with client() as up:
            pool = _pool(up, srv)
            resp = await pool.post("/v1/completions", b"{}")
            assert await resp.read() == b"0"
            resp.release()
            resp = await pool.post("/v1/completions", b"{}")
            assert await resp.read() == b"1"
            assert (pool.stale_retries, pool.connects, len(srv.requests)) == (1, 2, 3)
    finally:
        await srv.close()


async def test_no_retry_once_a_response_byte_arrived() -> None:
    """A reused connection that breaks after part of the status line is not retried."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        w.write(OK + b"Content-Length: 0\r\n\r\n")
        await srv.read_request(r)
        w.write(b"HTTP/1.1 200")
        await w.drain()

    srv = await start(handler)
    try:
        async with client() as up:
            pool = _pool(up, srv)
            resp = await pool.post("/v1/completions", b"{}")
            await resp.read()
            resp.release()
            with pytest.raises(ConnectionLost) as e:
                await pool.post("/v1/completions", b"{}")
            assert e.value.got_bytes
            assert (pool.stale_retries, srv.connections) == (0, 1)
        assert classify_exception(e.value, False) is Outcome.CONNECT_ERROR
    finally:
        await srv.close()


async def test_fresh_connection_closed_before_answer_is_not_retried() -> None:
    """Only reused connections are retried: a new one that closes is the backend's failure."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)

    srv = await start(handler)
    try:
        async with client() as up:
            pool = _pool(up, srv)
            with pytest.raises(ConnectionLost) as e:
                await pool.post("/v1/completions", b"{}")
            assert not e.value.got_bytes
            assert (pool.stale_retries, srv.connections) == (0, 1)
        assert classify_exception(e.value, False) is Outcome.CONNECT_ERROR
        assert describe(e.value) == "server disconnected"
    finally:
        await srv.close()


# -- failures ----------------------------------------------------------------------------------


def _reset(w: asyncio.StreamWriter) -> None:
    """Close with RST, not FIN (SO_LINGER 0)."""
    sock = w.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    w.transport.abort()


async def test_eof_mid_body_is_an_error() -> None:
    """The server closes after the headers and part of the body: the read fails and the
    failure is a broken stream (bytes had arrived)."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        w.write(OK + b"Content-Length: 100\r\n\r\npartial")
        await w.drain()

    srv = await start(handler)
    try:
        async with client() as up:
            pool = _pool(up, srv)
            resp = await pool.post("/v1/completions", b"{}")
            assert await resp.read_chunk() == b"partial"
            with pytest.raises(ConnectionLost) as e:
                await resp.read_chunk()
            assert e.value.got_bytes and not e.value.reset
            assert classify_exception(e.value, True) is Outcome.STREAM_BROKEN
            resp.release()  # a failed response is dropped, not pooled
            assert pool.idle == 0
    finally:
        await srv.close()


async def test_rst_before_the_body_ends() -> None:
    """An RST from the server while the body is due raises, reported as a reset."""
    reset_now = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        w.write(OK + b"Content-Length: 100\r\n\r\npartial")
        await w.drain()
        await reset_now.wait()
        _reset(w)

    srv = await start(handler)
    try:
        async with client() as up:
            resp = await _pool(up, srv).post("/v1/completions", b"{}")
            reset_now.set()
            with pytest.raises(ConnectionLost) as e:
                await resp.read()
            assert e.value.got_bytes and e.value.reset
            assert describe(e.value) == "connection reset"
    finally:
        await srv.close()


async def test_slow_headers_time_out_and_the_connection_is_dropped() -> None:
    """The caller's deadline cuts a wait for headers; that connection is never reused."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        if n == 0:
            await r.read()  # never answer
            return
        w.write(OK + b"Content-Length: 0\r\n\r\n")
        await r.read()

    srv = await start(handler)
    try:
        async with client() as up:
            pool = _pool(up, srv)
            with pytest.raises(TimeoutError) as e:
                async with asyncio.timeout(0.2):
                    await pool.post("/v1/completions", b"{}")
            assert classify_exception(e.value, False) is Outcome.TIMEOUT
            assert pool.idle == 0
            resp = await pool.post("/v1/completions", b"{}")
            assert resp.status == 200
            assert pool.connects == 2
    finally:
        await srv.close()


async def test_connect_refused() -> None:
    """Nothing listening: ConnectFailed, a connect error, described without secrets."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        async with client() as up:
            pool = up.pool("b", f"http://127.0.0.1:{port}", {"authorization": "Bearer secret"})
            with pytest.raises(ConnectFailed) as e:
                await pool.post("/v1/completions", b"{}")
    assert classify_exception(e.value, False) is Outcome.CONNECT_ERROR
    assert describe(e.value).startswith("cannot connect (")
    assert "secret" not in describe(e.value)


async def test_connect_timeout() -> None:
    """A listener whose accept queue is full drops the SYN: ConnectTimeout, a timeout."""
    with socket.socket() as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(0)
        port = lst.getsockname()[1]
        fillers = []
        try:
            for _ in range(8):  # fill the accept queue; later SYNs are dropped
                s = socket.socket()
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    s.connect(("127.0.0.1", port))
                fillers.append(s)
            async with client(connect_timeout=0.2) as up:
                with pytest.raises(ConnectTimeout) as e:
                    await up.pool("b", f"http://127.0.0.1:{port}", {}).post("/v1/x", b"{}")
        finally:
            for s in fillers:
                s.close()
    assert classify_exception(e.value, False) is Outcome.TIMEOUT


# -- backpressure ------------------------------------------------------------------------------


async def test_unread_stream_stops_reading_the_socket() -> None:
    """A reader that does not keep up holds at most about HIGH_WATER unread bytes; the
    rest waits in the server's send buffer, and everything arrives once read."""
    total = 8 * 1024 * 1024
    piece = b"x" * 65536
    sent = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        w.write(OK + b"Content-Length: %d\r\n\r\n" % total)
        for _ in range(total // len(piece)):
            w.write(piece)
            if w.transport.get_write_buffer_size() > 0:
                sent.set()  # the kernel buffers are full: the client stopped reading
            await w.drain()
        await r.read()

    srv = await start(handler)
    try:
        async with client() as up:
            resp = await _pool(up, srv).post("/v1/completions", b"{}")
            await asyncio.wait_for(sent.wait(), 10)
            assert resp.buffered <= HIGH_WATER + 256 * 1024  # one socket read past the mark
            got = resp.buffered
            while chunk := await resp.read_chunk():
                got += len(chunk)
            assert got - resp.buffered >= total - HIGH_WATER - 256 * 1024
    finally:
        await srv.close()


async def test_released_unread_response_never_poisons_the_pool() -> None:
    """A big answer released unread (its reading paused at the high-water mark) leaves no
    paused or half-read connection in the pool: the next request is answered."""
    big = b"y" * (3 * HIGH_WATER)

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        while await srv.read_request(r):
            w.write(OK + b"Content-Length: %d\r\n\r\n" % len(big) + big)
            await w.drain()

    srv = await start(handler)
    try:
        async with client() as up:
            pool = _pool(up, srv)
            resp = await pool.post("/v1/completions", b"{}")
            await poll(lambda: resp.buffered > HIGH_WATER or resp._done)
            resp.release()
            async with asyncio.timeout(5):
                resp = await pool.post("/v1/completions", b"{}")
                assert await resp.read() == big
    finally:
        await srv.close()


# -- TLS ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for localhost, made with the openssl command."""
    d = tmp_path_factory.mktemp("tls")
    key, crt = d / "key.pem", d / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-keyout", str(key), "-out", str(crt), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    return crt, key


def _server_ctx(cert: tuple[Path, Path]) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(str(cert[0]), str(cert[1]))
    return ctx


async def test_https_backend_with_sni(cert: tuple[Path, Path]) -> None:
    """https:// backends speak TLS, send the host name (SNI) and keep connections alive."""
    srv = await start(answering(b"secure"), _server_ctx(cert))
    trust = ssl.create_default_context(cafile=str(cert[0]))
    try:
        async with client() as up:
            up._ssl = trust
            pool = up.pool("b", f"https://localhost:{srv.port}", {})
            for _ in range(2):
                resp = await pool.post("/v1/completions", b"{}")
                assert await resp.read() == b"secure"
                resp.release()
            assert srv.sni == ["localhost"]
            assert (pool.connects, srv.connections) == (1, 1)
            assert srv.requests[0].split(b"\r\n")[1] == b"host: localhost:%d" % srv.port
    finally:
        await srv.close()


async def test_https_untrusted_certificate_is_a_connect_error(cert: tuple[Path, Path]) -> None:
    """A certificate the trust store does not know fails the connection, never the request."""
    srv = await start(answering(), _server_ctx(cert))
    try:
        async with client() as up:
            pool = up.pool("b", f"https://localhost:{srv.port}", {})
            with pytest.raises(ConnectFailed) as e:
                await pool.post("/v1/completions", b"{}")
        assert classify_exception(e.value, False) is Outcome.CONNECT_ERROR
        assert isinstance(e.value.os_error, ssl.SSLError)
    finally:
        await srv.close()


def test_a_tls_backend_gets_at_least_the_tls_floor_to_connect() -> None:
    """The LAN-tuned 250 ms is for plain HTTP; TCP + TLS to a hosted API gets 3 s at least."""
    from pulsegate.proxy.upstream import TLS_CONNECT_MIN_S, connect_deadline

    assert connect_deadline(0.25, tls=False) == 0.25
    assert connect_deadline(0.25, tls=True) == TLS_CONNECT_MIN_S == 3.0
    assert connect_deadline(10.0, tls=True) == 10.0


# -- the sink (a stream relay takes the body in the connection's callback) --------------------


def _chunked_server(batches: list[list[bytes]], steps: list[asyncio.Event], end: str) -> Handler:
    """Answers one request chunked: each batch's chunks in one write, the next batch once
    the next step is set; then the terminating chunk (`end` "done") or a reset ("reset")."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        srv: Server = handler.server  # type: ignore[attr-defined]
        await srv.read_request(r)
        w.write(OK + b"Transfer-Encoding: chunked\r\n\r\n")
        for batch, step in zip(batches, steps, strict=True):
            w.write(b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in batch))
            await w.drain()
            await step.wait()
        if end == "reset":
            w.transport.abort()
            return
        w.write(b"0\r\n\r\n")
        await w.drain()
        await r.read()

    return handler


def _keep(got: list[bytes], b: bytes, go_on: bool) -> bool:
    got.append(b)
    return go_on


async def test_a_sink_takes_each_read_whole_and_stops_when_told() -> None:
    """What came before the sink is its first piece; then each socket read reaches it in
    the connection's callback as one piece (two chunks of one write: one call); returning
    False stops it and wakes `sinking()`, and what comes next is buffered for the next
    `sink()`; the end wakes it too."""
    batches = [[b"first"], [b"second", b"stop"], [b"after", b"last"]]
    steps = [asyncio.Event() for _ in batches]
    srv = await start(_chunked_server(batches, steps, "done"))
    try:
        async with client() as up:
            resp = await _pool(up, srv).post("/v1/completions", b"{}")
            await poll(lambda: resp.buffered == len(b"first"))
            got: list[bytes] = []
            resp.sink(lambda b: _keep(got, b, b"stop" not in b))
            assert got == [b"first"]
            steps[0].set()
            await asyncio.wait_for(resp.sinking(), 5)
            assert got == [b"first", b"secondstop"]  # one read, one piece; then stopped
            steps[1].set()
            await poll(lambda: resp.buffered == len(b"afterlast"))  # no sink: buffered
            resp.sink(lambda b: _keep(got, b, False))  # takes it, stops at once
            assert got[-1] == b"afterlast"
            resp.sink(lambda b: _keep(got, b, True))
            steps[2].set()
            await asyncio.wait_for(resp.sinking(), 5)  # the message ended
            resp.unsink()
            assert await resp.read_chunk() == b""
            resp.release()
    finally:
        await srv.close()


async def test_a_failing_upstream_wakes_the_sinking_reader() -> None:
    """A reset while the sink takes the body: `sinking()` returns and `read_chunk()`
    raises what broke."""
    steps = [asyncio.Event(), asyncio.Event()]
    srv = await start(_chunked_server([[b"one"], [b"two"]], steps, "reset"))
    try:
        async with client() as up:
            resp = await _pool(up, srv).post("/v1/completions", b"{}")
            got: list[bytes] = []
            resp.sink(lambda b: _keep(got, b, True))
            for step in steps:
                step.set()
            await asyncio.wait_for(resp.sinking(), 5)
            resp.unsink()
            with pytest.raises(ConnectionLost):
                await resp.read_chunk()
            assert b"".join(got) == b"onetwo"
    finally:
        await srv.close()
