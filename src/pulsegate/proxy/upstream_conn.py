"""One upstream HTTP/1.1 connection (an asyncio.Protocol fed to httptools) and its `Response`.

The lower half of `upstream.py`'s client, split off along its seam: this module only reacts
to socket events (bytes in, a parsed response and its body out to the reader), it never
opens a connection, knows no URL and keeps no idle list. The pool (`upstream.Pool`) opens
connections and takes them back; a connection knows it only as a `ConnPool`, the two
methods named below, so this module imports nothing of `upstream.py`.

    Connection           one TCP (or TLS) connection: writes a request, parses the answer
      Response           status, headers, body (whole or chunk by chunk), backpressure

Exceptions (library errors are translated here and in `upstream.Pool`, once; `classify.py`
maps them to outcomes; all are re-exported by `upstream.py`):

    UpstreamError
      ConnectFailed          refused, unreachable, DNS, TLS handshake or certificate
      ConnectTimeout         no connection within `retry.connect_timeout`
      ConnectionLost         reset or EOF before the response was complete
      ProtocolError          the backend sent something that is not HTTP/1.1
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

import httptools

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
# A response head is at most this many bytes and header fields (Envoy's defaults for
# `max_response_headers_kb` and `max_response_headers_count` are 60 KiB and 100): a backend
# sending 400k header lines left the gateway unresponsive for 30 s before the bound, and one
# 64 MiB header cost 3.1 s of CPU (httptools re-joins a value's pieces as they arrive).
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 100
# A body read whole (a non-streamed answer, an error) is at most this big: a 1 GiB answer
# took the gateway from 356 MB to 2.19 GB before the bound. 64 MiB holds an embeddings answer
# for ~1,500 inputs of 1,024 dimensions as JSON text.
MAX_BODY_BYTES = 64 * 1024 * 1024


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
    """The backend's bytes are not a valid HTTP/1.1 response, or exceed a bound."""


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


class ConnPool(Protocol):
    """What a connection asks of its pool (`upstream.Pool`)."""

    def _put(self, conn: Connection) -> None:
        """A complete keep-alive exchange: `conn` goes back to the idle ones."""
        ...

    def _lost(self, conn: Connection) -> None:
        """`conn` is closed: forget it."""
        ...


class Response:
    """One response. Read it with `read()` (whole) or `read_chunk()` (as it arrives), then
    `release()` (back to the pool when fully read and keep-alive) or `close()` (abort).

    A stream relay hands the body to a `sink` instead: what each socket read brings goes to
    it in the connection's own callback, in one piece, with no future and no task switch.
    The sink returns False to stop (the reader, waiting in `sinking()`, is woken to act);
    it must not raise. Bytes that come while no sink is set are buffered as for
    `read_chunk()`, and the next `sink()` call takes them first."""

    __slots__ = (
        "_buf",
        "_conn",
        "_done",
        "_exc",
        "_head",
        "_keep_alive",
        "_limit",
        "_paused",
        "_released",
        "_sink",
        "_size",
        "_until_eof",
        "_waiter",
        "_whole",
        "headers",
        "status",
    )

    def __init__(self, conn: Connection, head: asyncio.Future[None]) -> None:
        self._conn: Connection | None = conn
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
        self._limit = MAX_BODY_BYTES  # read(): the most it takes
        self._sink: Callable[[bytes], bool] | None = None

    @property
    def buffered(self) -> int:
        """Body bytes received and not yet read."""
        return self._size

    # -- the reader's side --------------------------------------------------------------------

    async def read(self, limit: int = MAX_BODY_BYTES) -> bytes:
        """The whole body; a body past `limit` bytes is a `ProtocolError` (and the
        connection is closed: never read on into memory)."""
        self._whole = True
        self._limit = limit
        if self._size > limit:
            self._too_large()
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
            if self._buf:
                return self._unbuffer()
            if self._exc is not None:
                raise self._exc
            if self._done:
                return b""
            await self._wait()

    def sink(self, take: Callable[[bytes], bool]) -> None:
        """From now on give the body to `take` as it arrives (what is buffered first); until
        `take` returns False, or `unsink()`."""
        if self._buf and not take(self._unbuffer()):
            return
        self._sink = take

    def _unbuffer(self) -> bytes:
        """What is buffered (some is), joined; reading resumes if it was paused."""
        buf = self._buf
        self._buf = []
        self._size = 0
        if self._paused:
            self._resume()
        return buf[0] if len(buf) == 1 else b"".join(buf)

    def unsink(self) -> None:
        self._sink = None

    async def sinking(self) -> None:
        """Wait while the sink takes the body: until it stops, or the message ends or
        fails (then `read_chunk()` says which)."""
        while self._sink is not None and not self._done and self._exc is None:
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
        self._sink = None
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

    def _too_large(self) -> None:
        self._fail(ProtocolError(f"response body exceeds {self._limit} bytes"))
        self._buf = []
        self._size = 0
        conn = self._conn
        if conn is not None:
            conn.abort()

    def _feed(self, data: bytes) -> None:
        self._buf.append(data)
        self._size += len(data)
        if self._sink is not None:
            return  # handed over whole at the end of the socket read (`_flush`)
        if self._whole:
            if self._size > self._limit:
                self._too_large()
                return
        elif self._size > HIGH_WATER and not self._paused:
            conn = self._conn
            if conn is not None:
                self._paused = True
                conn.transport.pause_reading()
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _flush(self) -> None:
        """The end of one socket read: a sink gets all the body pieces it held (a chunked
        body is a piece per chunk: an engine that sends 19 tokens in one read costs one
        client write, not 19)."""
        take = self._sink
        if take is not None and self._buf and not take(self._unbuffer()):
            self._sink = None
            self._wake()

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


class Connection(asyncio.Protocol):
    """One upstream connection; `resp` is the response being received, None while idle."""

    def __init__(self, pool: ConnPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # connection_made
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Response | None = None
        self.closed = False
        self.uses = 0  # responses completed on this connection
        self.idle_since = 0.0  # set by the pool, on its clock (`Upstream.now`)
        self.got_bytes = False
        self._raw: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0  # bytes received while the response head is incomplete
        self._in_head = False
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
        self._in_head = True
        self._head_bytes = 0
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
        resp = self.resp
        if resp is None:
            self.abort()  # bytes nobody asked for (an idle connection): never reuse it
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse("a protocol upgrade nobody asked for")
            return
        except httptools.HttpParserError as e:
            cause = e.__context__
            self._refuse(str(cause) if isinstance(cause, ProtocolError) else f"malformed: {e}")
            return
        if self._in_head:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(f"headers exceed {MAX_HEAD_BYTES} bytes")
                return
        resp._flush()  # a sink gets what this read completed, in one piece

    def _refuse(self, why: str) -> None:
        resp = self.resp
        if resp is not None:
            resp._fail(ProtocolError(f"response refused: {why}"))
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
        raw = self._raw
        if len(raw) >= MAX_HEADERS:
            raise ProtocolError(f"more than {MAX_HEADERS} header fields")
        raw.append((name, value))

    def on_headers_complete(self) -> None:
        resp = self.resp
        if resp is None:
            return
        status = self.parser.get_status_code()
        if status == 101 or not 100 <= status <= 599:
            raise ProtocolError(f"status {status:03d}")  # 000 is no success, 101 no answer
        if status < 200:
            self._informational = True  # 100 Continue and friends: the real one follows
            return
        self._in_head = False
        resp.status = status
        h = resp.headers = Headers(self._raw)
        if status not in (204, 304) and "content-length" not in h:
            # Chunked framing only when `chunked` is the last coding (RFC 9112 6.3):
            # `chunked, gzip` is read to the end of the connection, as the parser does.
            te = h.get("transfer-encoding")
            resp._until_eof = te is None or not te.lower().rstrip().endswith("chunked")
        if not resp._head.done():
            resp._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        if resp is None or self._informational:
            return  # a 1xx has no body: bytes after its head are never the answer's
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
