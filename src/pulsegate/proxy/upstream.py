"""The proxy path's upstream client: HTTP/1.1 keep-alive pools on asyncio protocols + httptools.

Why not aiohttp's `ClientSession` here: it spent ~100 µs of the ~230 µs CPU per proxied
request (`docs/performance.md`), over its whole general-purpose path (payload registry, a
write task per request, cookie jar, multidicts). This client does one thing: POST a body to
a backend and hand back the status, headers and body, whole or as it arrives. Probers,
alerts and the baseline poll loop keep aiohttp.

    Upstream                 one per gateway: the pools, closed in Gateway.close()
      Pool                   one per backend: LIFO idle connections, stale-connection retry
        _Conn                one TCP (or TLS) connection: an asyncio.Protocol + httptools
          Response           status, headers, body (whole or chunk by chunk)

Exceptions (library errors are translated here, once; `classify.py` maps them to outcomes):

    UpstreamError
      ConnectFailed          refused, unreachable, DNS, TLS handshake or certificate
      ConnectTimeout         no connection within `retry.connect_timeout`
      ConnectionLost         reset or EOF before the response was complete
      ProtocolError          the backend sent something that is not HTTP/1.1

Timeouts other than connect are the caller's: `asyncio.timeout()` around `post()` and the
body reads (cancellation aborts the connection, it is never reused half-read).

Stale connections: a server may close an idle keep-alive connection at any moment (uvicorn,
which vLLM runs on, after 5 s). A request written to a *reused* connection that then sees a
reset or EOF before any response byte is sent once more on a fresh connection, as nginx and
Envoy do. Never once a response byte arrived, never on a fresh connection.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Iterator, Mapping
from urllib.parse import urlsplit

import httptools

# Idle keep-alive connections live this long (nginx's upstream `keepalive_timeout` is 60 s,
# uvicorn closes its side after 5 s: the stale retry covers the difference).
IDLE_TIMEOUT_S = 30.0
# Idle connections kept per backend beyond those in use (the bench's nginx: 256 per worker).
# Fewer would make a burst after a stall open new connections into a backend's full accept
# queue, where a dropped SYN costs its 1 s retransmit (docs/performance.md, findings).
MAX_IDLE = 256
# Stream backpressure: stop reading the socket while this much is buffered and unread.
# 64 KiB is hundreds of SSE events; a reader that falls this far behind is the client's.
HIGH_WATER = 64 * 1024
# `release()` before the body's last bytes (a stream's chunked terminator right after
# `[DONE]`): the connection waits this long and this many bytes for the end of the message
# before it goes back to the pool, else it is closed.
LINGER_S = 1.0
LINGER_BYTES = 64 * 1024
# Bodies up to this size are sent in one write with the head (one send() call).
_JOIN_BELOW = 16 * 1024
_SKIP_HEADERS = frozenset(("host", "content-length", "transfer-encoding", "connection"))


class UpstreamError(Exception):
    """Base of everything the upstream client raises (besides cancellation)."""


class ConnectFailed(UpstreamError):
    """The connection could not be made: refused, unreachable, DNS, TLS."""

    def __init__(self, message: str, os_error: OSError | None = None) -> None:
        super().__init__(message)
        self.os_error = os_error


class ConnectTimeout(UpstreamError):
    """No connection within the connect timeout."""


class ConnectionLost(UpstreamError):
    """Reset or EOF before the response was complete."""

    def __init__(self, message: str, *, got_bytes: bool, reset: bool = False) -> None:
        super().__init__(message)
        self.got_bytes = got_bytes  # some response byte had arrived: never retried
        self.reset = reset


class ProtocolError(UpstreamError):
    """The backend's bytes are not a valid HTTP/1.1 response."""


class Headers(Mapping[str, str]):
    """Response headers with case-insensitive lookup; repeated fields joined by ', '."""

    __slots__ = ("_d",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        d: dict[str, str] = {}
        for name, value in raw:
            k = name.decode("latin-1").lower()
            v = value.decode("latin-1")
            d[k] = f"{d[k]}, {v}" if k in d else v
        self._d = d

    def __getitem__(self, key: str) -> str:
        return self._d[key.lower()]

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return self._d.get(key.lower(), default)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key.lower() in self._d

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


class Response:
    """One response. Read it with `read()` (whole) or `read_chunk()` (as it arrives), then
    `release()` (back to the pool when fully read and keep-alive) or `close()` (abort)."""

    __slots__ = (
        "_buf",
        "_conn",
        "_done",
        "_exc",
        "_head",
        "_keep_alive",
        "_paused",
        "_released",
        "_size",
        "_until_eof",
        "_waiter",
        "_whole",
        "headers",
        "status",
    )

    def __init__(self, conn: _Conn, head: asyncio.Future[None]) -> None:
        self._conn: _Conn | None = conn
        self._head = head
        self.status = 0
        self.headers: Headers = _NO_HEADERS
        self._buf: list[bytes] = []
        self._size = 0
        self._waiter: asyncio.Future[None] | None = None
        self._done = False  # the whole message has arrived
        self._exc: UpstreamError | None = None
        self._keep_alive = False
        self._paused = False
        self._whole = False  # read() is waiting for everything: no backpressure
        self._until_eof = False  # neither Content-Length nor chunked: the body ends at EOF
        self._released = False  # release() came before the end: lingering for it

    @property
    def buffered(self) -> int:
        """Body bytes received and not yet read."""
        return self._size

    # -- the reader's side --------------------------------------------------------------------

    async def read(self) -> bytes:
        """The whole body."""
        self._whole = True
        if self._paused:
            self._resume()
        while not self._done:
            if self._exc is not None:
                raise self._exc
            await self._wait()
        buf = self._buf
        self._buf = []
        self._size = 0
        return buf[0] if len(buf) == 1 else b"".join(buf)

    async def read_chunk(self) -> bytes:
        """What has arrived since the last call (waiting for some); b"" at the end."""
        while True:
            buf = self._buf
            if buf:
                self._buf = []
                self._size = 0
                if self._paused:
                    self._resume()
                return buf[0] if len(buf) == 1 else b"".join(buf)
            if self._exc is not None:
                raise self._exc
            if self._done:
                return b""
            await self._wait()

    def release(self) -> None:
        """Done with it: the connection goes back to the pool if the message is complete and
        keep-alive; a message whose end has not arrived yet lingers for it (`LINGER_S`)."""
        conn = self._conn
        if conn is None:
            return
        if self._paused:  # a paused socket in the pool would never read its next answer
            self._resume()
        self._conn = None
        if self._done and self._exc is None:
            if self._keep_alive:
                conn.pool._put(conn)
            else:
                conn.close()
        elif self._exc is None and not conn.closed and not self._until_eof:
            self._released = True
            self._buf = []
            self._size = 0
            conn.linger()
        else:
            conn.abort()

    def close(self) -> None:
        """Abort: the connection is closed, never reused; a pending read raises now."""
        conn = self._conn
        self._conn = None
        if not self._done and self._exc is None:
            self._fail(ConnectionLost("closed by the gateway", got_bytes=True))
        if conn is not None:
            conn.abort()

    async def _wait(self) -> None:
        fut = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await fut
        finally:
            self._waiter = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _resume(self) -> None:
        self._paused = False
        conn = self._conn
        if conn is not None and not conn.closed:
            conn.transport.resume_reading()

    # -- the connection's side ----------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        self._buf.append(data)
        self._size += len(data)
        if self._size > HIGH_WATER and not self._whole and not self._paused:
            conn = self._conn
            if conn is not None:
                self._paused = True
                conn.transport.pause_reading()
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _complete(self, keep_alive: bool) -> None:
        self._done = True
        self._keep_alive = keep_alive
        self._wake()

    def _fail(self, exc: UpstreamError) -> None:
        if self._done or self._exc is not None:
            return
        self._exc = exc
        if not self._head.done():
            self._head.set_exception(exc)
        self._wake()


_NO_HEADERS = Headers([])


class _Conn(asyncio.Protocol):
    """One upstream connection; `resp` is the response being received, None while idle."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # connection_made
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Response | None = None
        self.closed = False
        self.uses = 0  # responses completed on this connection
        self.idle_since = 0.0
        self.got_bytes = False
        self._raw: list[tuple[bytes, bytes]] = []
        self._informational = False
        self._linger: asyncio.TimerHandle | None = None
        self._lingered = 0

    # -- requests -----------------------------------------------------------------------------

    async def request(self, head: bytes, body: bytes) -> Response:
        """Write one request and wait for its response's headers."""
        if self.closed:  # lost between connect (or the pool) and now: nothing was sent
            raise ConnectionLost("server disconnected", got_bytes=False)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        resp = self.resp = Response(self, fut)
        self.got_bytes = False
        if len(body) < _JOIN_BELOW:
            self.transport.write(head + body)
        else:
            self.transport.writelines((head, body))
        try:
            await fut
        except BaseException:
            resp._conn = None
            self.abort()
            raise
        return resp

    def linger(self) -> None:
        """The reader is done but the message's end is still due: wait a little for it."""
        self._lingered = 0
        self._linger = asyncio.get_running_loop().call_later(LINGER_S, self.abort)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close()

    def abort(self) -> None:
        self.resp = None
        if not self.closed:
            self.closed = True
            self.transport.abort()

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.resp is None:
            self.abort()  # bytes nobody asked for (an idle connection): never reuse it
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            resp = self.resp
            if resp is not None:
                resp._fail(ProtocolError(f"malformed response: {e}"))
            self.abort()

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        self.pool._lost(self)
        resp = self.resp
        self.resp = None
        if resp is None:
            return
        if exc is None and resp._until_eof and resp.status:
            resp._complete(False)
            return
        reset = isinstance(exc, ConnectionResetError | BrokenPipeError)
        what = "connection reset" if reset else "server disconnected"
        resp._fail(ConnectionLost(what, got_bytes=self.got_bytes, reset=reset))

    def pause_writing(self) -> None:
        pass  # request bodies are bounded (gateway.max_body_bytes): the transport buffers

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        resp = self.resp
        if resp is None or resp._done:
            raise ProtocolError("bytes after the end of the response")
        self._raw = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw.append((name, value))

    def on_headers_complete(self) -> None:
        resp = self.resp
        if resp is None:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:
            self._informational = True  # 100 Continue and friends: the real one follows
            return
        resp.status = status
        h = resp.headers = Headers(self._raw)
        if status not in (204, 304) and "content-length" not in h:
            te = h.get("transfer-encoding")
            resp._until_eof = te is None or "chunked" not in te.lower()
        if not resp._head.done():
            resp._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        if resp is None:
            return
        if resp._released:
            self._lingered += len(body)
            if self._lingered > LINGER_BYTES:
                self.abort()  # the "end" is a whole body: not worth waiting for
            return
        resp._feed(body)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        resp = self.resp
        if resp is None:
            return
        keep_alive = self.parser.should_keep_alive() and not resp._until_eof
        if not resp._released:
            resp._complete(keep_alive)
            return
        if self._linger is not None:  # released early: its end came, back to the pool
            self._linger.cancel()
            self._linger = None
        if keep_alive:
            self.pool._put(self)
        else:
            self.close()


class Pool:
    """Keep-alive connections to one backend: its base URL and its fixed request headers."""

    def __init__(self, up: Upstream, url: str, headers: Mapping[str, str]) -> None:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"upstream URL must be http:// or https://host: {url!r}")
        self.url = url
        self.host = u.hostname
        tls = u.scheme == "https"
        default = 443 if tls else 80
        self.port = u.port or default
        self._ssl: ssl.SSLContext | None = up.ssl_context() if tls else None
        self._up = up
        host = f"[{self.host}]" if ":" in self.host else self.host
        if self.port != default:
            host = f"{host}:{self.port}"
        fixed = [f"host: {host}\r\n"]
        for k, v in headers.items():
            if "\r" in k or "\n" in k or "\r" in v or "\n" in v:
                raise ValueError(f"header {k!r} for {u.scheme}://{host} contains a line break")
            if k.lower() not in _SKIP_HEADERS:
                fixed.append(f"{k}: {v}\r\n")
        self._fixed = "".join(fixed).encode("latin-1")
        self._heads: dict[str, bytes] = {}
        self._idle: collections.deque[_Conn] = collections.deque()
        self._conns: set[_Conn] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        # Counters for tests and the bench: connections opened, requests on reused ones,
        # stale reused connections retried.
        self.connects = 0
        self.reuses = 0
        self.stale_retries = 0

    @property
    def idle(self) -> int:
        return sum(1 for c in self._idle if not c.closed)

    async def post(self, path: str, body: bytes) -> Response:
        """POST `body` to the backend URL + `path`; returns once the headers arrived."""
        head = self._heads.get(path)
        if head is None:
            head = self._head(path)
        head = head + b"%d\r\n\r\n" % len(body)
        conn = self._take()
        if conn is not None:
            self.reuses += 1
            try:
                return await conn.request(head, body)
            except ConnectionLost as e:
                if e.got_bytes:
                    raise
                # The server closed this idle connection while we wrote to it: nothing of
                # the request can have been answered. Once more, on a fresh connection.
                self.stale_retries += 1
        conn = await self._connect()
        return await conn.request(head, body)

    def _head(self, path: str) -> bytes:
        u = urlsplit(self.url + path)  # `backend.url + path`: a URL prefix is kept
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        head = f"POST {target} HTTP/1.1\r\n".encode("latin-1") + self._fixed + b"content-length: "
        self._heads[path] = head
        return head

    def _take(self) -> _Conn | None:
        idle = self._idle
        if not idle:
            return None
        now = asyncio.get_running_loop().time()
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport.is_closing():
                continue
            if now - conn.idle_since > self._up.idle_timeout:
                conn.close()
                continue
            return conn
        return None

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        timeout = self._up.connect_timeout
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    lambda: _Conn(self),
                    self.host,
                    self.port,
                    ssl=self._ssl,
                    server_hostname=self.host if self._ssl is not None else None,
                    ssl_handshake_timeout=timeout if self._ssl is not None else None,
                )
        except TimeoutError:
            raise ConnectTimeout(f"connect timed out after {timeout * 1000:.0f}ms") from None
        except OSError as e:  # refused, unreachable, DNS (gaierror), TLS (SSLError)
            why = e.strerror or str(e) or type(e).__name__
            raise ConnectFailed(f"cannot connect ({why})", e) from e
        self.connects += 1
        self._conns.add(conn)
        return conn

    def _put(self, conn: _Conn) -> None:
        conn.resp = None
        conn.uses += 1
        if conn.closed:
            return
        idle = self._idle
        if len(idle) >= self._up.max_idle:
            idle.popleft().close()  # the longest idle goes
        conn.idle_since = asyncio.get_running_loop().time()
        idle.append(conn)
        if self._sweeper is None:
            self._arm()

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._sweeper = loop.call_later(self._up.idle_timeout / 4, self._sweep)

    def _sweep(self) -> None:
        """Close idle connections past the idle timeout, oldest first (LIFO: at the left)."""
        self._sweeper = None
        idle = self._idle
        limit = asyncio.get_running_loop().time() - self._up.idle_timeout
        while idle and (idle[0].closed or idle[0].idle_since < limit):
            idle.popleft().close()
        if idle:
            self._arm()

    def _lost(self, conn: _Conn) -> None:
        self._conns.discard(conn)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._idle.clear()
        for conn in list(self._conns):
            conn.abort()


class Upstream:
    """The proxy path's client: one `Pool` per backend, made on first use."""

    def __init__(
        self,
        connect_timeout: float,
        *,
        idle_timeout: float = IDLE_TIMEOUT_S,
        max_idle: int = MAX_IDLE,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.max_idle = max_idle
        self._ssl = ssl_context
        self._pools: dict[str, Pool] = {}

    def pool(self, name: str, url: str, headers: Mapping[str, str]) -> Pool:
        """The pool of backend `name` (made on first use from its URL and headers)."""
        p = self._pools.get(name)
        if p is None:
            p = self._pools[name] = Pool(self, url, headers)
        return p

    def ssl_context(self) -> ssl.SSLContext:
        """For https:// backends (hosted APIs): the system's trust store, SNI, hostname
        check; made once, on the first https backend."""
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    async def close(self) -> None:
        for p in self._pools.values():
            p.close()
        self._pools.clear()
