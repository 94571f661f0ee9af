"""The proxied POSTs served without aiohttp: a lean HTTP/1.1 server on each client connection.

aiohttp's server was the largest bucket of a proxied request's CPU (37-45 µs of ~105 on a
quiet box, docs/performance.md): its parser's callbacks, a `Request` with its multidicts, the
router, a `StreamWriter`, the response's header machinery. A proxied request needs little of
that: one head, a body of known length, one answer. `ClientConn` serves exactly that and
nothing else, beside aiohttp on the same connection (`conn_guard.Conn` owns both):

- At the start of each request head, `take` looks at the bytes. A head it serves is
  `POST <proxied path> HTTP/1.1` with a body of `Content-Length` (within
  `gateway.max_body_bytes`), well-formed token names and plain values, and no `Expect`,
  `Transfer-Encoding` or `Upgrade` (`parse_head`). Anything else goes to aiohttp exactly
  as it arrived, the bytes held so far included: other paths (admin, metrics, `/v1/models`),
  HTTP/1.0, a chunked upload, `100-continue`, an oversize body (aiohttp's 413), a malformed
  head (aiohttp's 400). So every refusal and every unusual case is aiohttp's, as before,
  and this file only ever sees the plain case.
- One request at a time per connection, as aiohttp: the forwarder (`forward.py`) reads it
  as an `Incoming` and answers a stream through `LeanStream` (a `StreamOut`) or with a
  whole `web.Response`, written here as one head-and-body write. Bytes that arrive after
  the body (a pipelined request) wait for the answer, then start the next head.
- A client that goes away cancels the request's task (aiohttp's `handler_cancellation`,
  which the relay relies on to close its upstream). An answer sent before its body
  arrived whole (a 401, the body timeout's 408) says `Connection: close` and closes: the
  rest of that body is never read as a head.
- aiohttp's idle timer (`client_idle_timeout`) still closes an idle connection: it is held
  off while a request is served here and restarted when its answer ends (`_Idle`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING, ClassVar, Protocol, cast

from aiohttp import web

from pulsegate.proxy.client_out import LIMIT, Whole
from pulsegate.proxy.errors import error_response, reshape
from pulsegate.proxy.request import API

if TYPE_CHECKING:
    from pulsegate.proxy.forward import Forwarder
    from pulsegate.proxy.state import ProxyState

log = logging.getLogger("pulsegate.proxy")

# A head longer than this is aiohttp's to refuse (its own line limit is 8,190 bytes).
MAX_HEAD = 64 * 1024
# Pipelined bytes held while an answer is made, before the connection stops reading.
MAX_HELD = 64 * 1024
# The header block of a head served here: `name: value` lines, names RFC 9110 tokens,
# values without control characters but tab. Anything else is aiohttp's.
_HEADERS = re.compile(rb"(?:[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t\x20-\x7e\x80-\xff]*\r\n)*")
# Headers whose presence sends the request to aiohttp.
_NOT_OURS = frozenset(("transfer-encoding", "expect", "upgrade"))
_HIDDEN = frozenset(("content-length", "transfer-encoding", "connection"))
_STATUS = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n" for s in HTTPStatus}


class Routes(Protocol):
    """The proxy side a lean connection serves (a reload replaces its forwarder)."""

    forwarder: Forwarder
    proxy: ProxyState


class Head:
    """A request head served here (a plain class: native when compiled, see `sse.Event`)."""

    __slots__ = ("close", "end", "headers", "length", "path")

    def __init__(
        self, path: str, headers: dict[str, str], length: int, close: bool, end: int
    ) -> None:
        self.path = path
        self.headers = headers
        self.length = length  # the body's Content-Length
        self.close = close  # the client said `Connection: close`
        self.end = end  # where the body starts in the bytes parsed


# What `parse_head` returns for a head not yet whole.
MORE = Head("", {}, 0, False, -1)


def parse_head(buf: bytes, paths: Mapping[bytes, str], max_body: int) -> Head | None:
    """The head at the start of `buf` if it is one served here, `MORE` if it may be but is
    not whole yet, None if it is aiohttp's. Header names in lower case, the first of
    repeated ones kept. Worked example: `POST /v1/chat/completions HTTP/1.1\\r\\nHost: x\\r\\n
    Content-Length: 2\\r\\n\\r\\n{}` is a head of path `/v1/chat/completions`, headers
    `{"host": "x", "content-length": "2"}`, length 2, body at 66."""
    line_end = buf.find(b"\r\n")
    if line_end < 0:
        return MORE if len(buf) < MAX_HEAD and _may_be_ours(buf) else None
    parts = buf[:line_end].split(b" ")
    if len(parts) != 3 or parts[0] != b"POST" or parts[2] != b"HTTP/1.1":
        return None
    path = paths.get(parts[1])
    if path is None:
        return None
    start = line_end + 2
    if buf.startswith(b"\r\n", start):
        end = start  # no header at all
    else:
        end = buf.find(b"\r\n\r\n", start)
        if end < 0:
            return MORE if len(buf) < MAX_HEAD else None
        end += 2
    if end > MAX_HEAD or _HEADERS.fullmatch(buf, start, end) is None:
        return None
    headers: dict[str, str] = {}
    length: int | None = None
    close = False
    # One decode for the block: its delimiters are ASCII, which never occur inside a UTF-8
    # sequence, so each value decodes as it would alone (names are ASCII: `_HEADERS`).
    for line in buf[start:end].decode("utf-8", "surrogateescape").split("\r\n")[:-1]:
        raw, _, value = line.partition(":")
        name = raw.lower()
        text = value.strip(" \t")
        if name == "content-length":
            if length is not None or not (text.isascii() and text.isdigit()):
                return None  # repeated or not a plain number: aiohttp's to judge
            length = int(text)
        elif name in _NOT_OURS:
            return None
        elif name == "connection":
            tokens = {t.strip() for t in text.lower().split(",")}
            if "upgrade" in tokens:
                return None
            close = "close" in tokens
        if name not in headers:
            headers[name] = text
    length = length or 0
    if length > max_body:
        return None  # aiohttp's 413, `Expect` or not
    return Head(path, headers, length, close, end + 2)


def _may_be_ours(buf: bytes) -> bool:
    """A request line still arriving may be a POST (aiohttp's otherwise, at once)."""
    return b"POST "[: len(buf)] == buf[:5]


class _Idle:
    """aiohttp's idle timer of one connection, held off while a request is served here,
    and whether aiohttp holds requests not yet answered (pipelined behind one it serves:
    a head after them is theirs to answer first). Five private attributes of aiohttp's
    `RequestHandler` (its keep-alive close time, the timer's handle, the method it runs,
    its queue of parsed requests, its idle timeout: the public property is an interpreted
    call per request), checked once by `usable` at start-up
    (`tests/proxy/test_client_conn.py` fails loudly on an aiohttp that changed them)."""

    ATTRS: ClassVar[tuple[str, ...]] = (
        "_next_keepalive_close_time",
        "_keepalive_handle",
        "_process_keepalive",
        "_messages",
        "_keepalive_timeout",
    )
    # "Not while served": the timer, if it fires, re-arms itself this far on.
    HOLD_S: ClassVar[float] = 1e9

    @classmethod
    def usable(cls, protocol: object) -> bool:
        return all(hasattr(protocol, a) for a in cls.ATTRS)

    @staticmethod
    def queued(p: web.RequestHandler) -> bool:
        return bool(p._messages)

    @staticmethod
    def hold(p: web.RequestHandler, now: float) -> None:
        p._next_keepalive_close_time = now + _Idle.HOLD_S

    @staticmethod
    def restart(p: web.RequestHandler, loop: asyncio.AbstractEventLoop) -> None:
        timeout: float = p._keepalive_timeout
        if not timeout:
            return
        close_at = loop.time() + timeout
        p._next_keepalive_close_time = close_at
        handle = p._keepalive_handle
        # A timer due sooner re-arms itself for `close_at` when it fires (aiohttp's own
        # rule); only one pushed out by `hold` (it fired during a long request) is moved
        # back. None: the connection is closing.
        if handle is not None and cast(asyncio.TimerHandle, handle).when() > close_at:
            handle.cancel()
            p._keepalive_handle = loop.call_at(close_at, p._process_keepalive)


def lean_usable(protocol: object) -> bool:
    """Whether aiohttp's protocol (one `web.Server` makes) has what `_Idle` uses."""
    return _Idle.usable(protocol)


class LeanServer:
    """What every lean connection of one listening socket shares, and the requests being
    served on them (aiohttp's shutdown waits for its own requests in progress, and knows
    nothing of these: `wait_served`)."""

    __slots__ = ("loop", "paths", "routes", "serving")

    def __init__(self, routes: Routes, loop: asyncio.AbstractEventLoop) -> None:
        self.routes = routes
        self.loop = loop
        self.paths = {p.encode(): p for p in API}
        self.serving: set[asyncio.Task[None]] = set()

    async def wait_served(self, within: float) -> int:
        """Until every request being served has its answer, at most `within` seconds (the
        rest are cut when the connections close); returns how many were still going."""
        if not self.serving:
            return 0
        _, pending = await asyncio.wait(list(self.serving), timeout=within)
        return len(pending)


class Owner(Protocol):
    """The connection a `ClientConn` serves on (`conn_guard.Conn`)."""

    inner: asyncio.Protocol

    def begin(self) -> None: ...

    def end(self) -> None: ...

    def data_received(self, data: bytes) -> None: ...


class ClientConn:
    """One client connection's lean side: `take` at each new head; `busy` while it holds
    a head still arriving or serves a request."""

    __slots__ = (
        "_body",
        "_body_wait",
        "_close",
        "_drained",
        "_held",
        "_need",
        "_task",
        "busy",
        "owner",
        "server",
        "transport",
    )

    def __init__(self, server: LeanServer, owner: Owner, transport: asyncio.Transport) -> None:
        self.server = server
        self.owner = owner
        self.transport = transport
        self.busy = False
        self._held = b""  # a head still arriving, or what came after the body being served
        self._body: list[bytes] = []
        self._need = 0  # body bytes still due
        self._body_wait: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._close = False

    # -- bytes in -------------------------------------------------------------------------

    def take(self, data: bytes) -> bool:
        """Bytes at (or after) the start of a head, or while busy; False: aiohttp's, and
        nothing of them was kept."""
        if self._task is not None:  # serving: the body, then a pipelined head
            self._more(data)
            return True
        if not self._held and _Idle.queued(self.owner.inner):  # type: ignore[arg-type]
            return False  # aiohttp answers the requests it holds first, in order
        buf = self._held + data if self._held else data
        forwarder = self.server.routes.forwarder
        head = parse_head(buf, self.server.paths, forwarder.limits.max_body)
        if head is None:
            self._held = b""
            self.busy = False
            if buf is not data:  # what was held is aiohttp's too, in order
                self.owner.inner.data_received(buf)
                return True
            return False
        if head is MORE:
            self._held = buf
            self.busy = True
            return True
        self._start(head, buf)
        return True

    def _more(self, data: bytes) -> None:
        need = self._need
        if need:
            part = data[:need]
            self._body.append(part)
            self._need = need - len(part)
            data = data[need:]
            if not self._need and self._body_wait is not None and not self._body_wait.done():
                self._body_wait.set_result(None)
        if data:
            self._held += data
            if len(self._held) > MAX_HELD:
                self.transport.pause_reading()  # resumed when the answer is out

    def _start(self, head: Head, buf: bytes) -> None:
        self.busy = True
        body = buf[head.end : head.end + head.length]
        self._body = [body]
        self._need = head.length - len(body)
        self._held = buf[head.end + head.length :]
        self._close = head.close
        self.owner.begin()
        _Idle.hold(self.owner.inner, self.server.loop.time())  # type: ignore[arg-type]
        req = LeanRequest(self, head)
        task = self._task = self.server.loop.create_task(self._serve(req))
        self.server.serving.add(task)

    # -- one request ----------------------------------------------------------------------

    async def _serve(self, req: LeanRequest) -> None:
        routes = self.server.routes
        path = req.path
        try:
            answer = await routes.forwarder.handle(req, path)
            if isinstance(answer, Whole):  # a backend's answer: the usual case
                closing = routes.proxy.shutting_down or self._need > 0
                self._write(answer.status, answer.headers.items(), answer.body, closing)
            elif isinstance(answer, web.Response):  # the gateway's own: an error, a refusal
                closing = routes.proxy.shutting_down or self._need > 0
                self._write_whole(reshape(answer, API[path]), closing)  # type: ignore[arg-type]
            elif self._need:
                self._close = True
            # A stream whose head said keep-alive stays open though the gateway began to
            # drain meanwhile: the client may already be sending its next request on it, and
            # a close now would reset that request. The next answer says `Connection: close`.
        except asyncio.CancelledError:
            self._close = True  # the client went away (or the gateway is closing)
            raise
        except ConnectionError:
            self._close = True
        except Exception:
            log.exception("unhandled error on %s", path)
            self._close = True
            if req.unanswered:
                self._write_whole(error_response(500, "internal error", "internal_error"), True)
        finally:
            self._finish()

    def _finish(self) -> None:
        if self._task is not None:
            self.server.serving.discard(self._task)
        self._task = None
        self.owner.end()
        t = self.transport
        if self._close or self._need or t.is_closing():
            self.busy = False
            self._held = b""
            t.close()  # flushes what was written first
            return
        _Idle.restart(self.owner.inner, self.server.loop)  # type: ignore[arg-type]
        self._body = []
        held, self._held = self._held, b""
        self.busy = False
        if len(held) > MAX_HELD:
            t.resume_reading()
        if held:  # a pipelined request: its head starts now
            self.owner.data_received(held)

    def _write_whole(self, resp: web.Response, close: bool) -> None:
        body = resp.body
        self._write(
            resp.status, resp.headers.items(), body if isinstance(body, bytes) else b"", close
        )

    def _write(
        self, status: int, headers: Iterable[tuple[str, str]], data: bytes, close: bool
    ) -> None:
        """A whole answer in one write."""
        self._close = self._close or close
        head = _head(status, headers, self._close)
        self.transport.write(b"%bContent-Length: %d\r\n\r\n%b" % (head, len(data), data))

    # -- the connection's events -------------------------------------------------------------

    def lost(self) -> None:
        """The connection is gone: the request's task is cancelled (and with it what it
        awaits: the body, a drain)."""
        if self._task is not None:
            self._task.cancel()

    def resume_writing(self) -> None:
        f = self._drained
        if f is not None and not f.done():
            f.set_result(None)

    async def drain(self) -> None:
        t = self.transport
        while t.get_write_buffer_size() > LIMIT and not t.is_closing():
            self._drained = self.server.loop.create_future()
            await self._drained
        if t.is_closing():
            raise ConnectionResetError("the client closed the connection")

    async def body(self) -> bytes:
        if self._need:
            self._body_wait = self.server.loop.create_future()
            await self._body_wait
        parts = self._body
        return parts[0] if len(parts) == 1 else b"".join(parts)


class LeanRequest:
    """A request served here, as the forwarder reads it (`client_out.Incoming`)."""

    __slots__ = ("_conn", "content_length", "headers", "path", "unanswered")

    def __init__(self, conn: ClientConn, head: Head) -> None:
        self._conn = conn
        self.path = head.path
        self.headers = head.headers
        self.content_length: int | None = head.length
        self.unanswered = True

    def body_arrived(self) -> bool:
        return not self._conn._need

    async def read(self) -> bytes:
        """The whole body (never too large: `parse_head` left those to aiohttp)."""
        return await self._conn.body()

    def stream_out(self, status: int, headers: Mapping[str, str], close: bool) -> LeanStream:
        self.unanswered = False
        return LeanStream(self._conn, status, headers, close)


class LeanStream:
    """A stream's answer on a lean connection: chunked, its head sent with the first
    chunk (one write, as aiohttp did)."""

    __slots__ = ("_conn", "_head", "_t", "status")

    def __init__(
        self, conn: ClientConn, status: int, headers: Mapping[str, str], close: bool
    ) -> None:
        self._conn = conn
        self._t = conn.transport
        self.status = status
        if close:
            conn._close = True
        self._head = _head(status, headers.items(), conn._close) + (
            b"Transfer-Encoding: chunked\r\n\r\n"
        )

    async def start(self) -> None:
        if self._t.is_closing():
            raise ConnectionResetError("the client closed the connection")

    @property
    def busy(self) -> bool:
        return self._t.get_write_buffer_size() > LIMIT

    def write(self, data: bytes) -> None:
        t = self._t
        if t.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        frame = b"%x\r\n%b\r\n" % (len(data), data)
        if self._head:
            frame, self._head = self._head + frame, b""
        t.write(frame)

    async def drain(self) -> None:
        await self._conn.drain()

    async def send(self, data: bytes) -> None:
        if data:
            self.write(data)
        if self.busy:
            await self.drain()

    async def end(self) -> None:
        t = self._t
        if t.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        t.write(self._head + b"0\r\n\r\n")
        self._head = b""


def _head(status: int, headers: Iterable[tuple[str, str]], close: bool) -> bytes:
    """A response's status line and headers, without the blank line and the body's
    length or framing. Made as one str, encoded once (per header, the bytes formatting
    cost twice as much)."""
    lines = [_STATUS.get(status) or f"HTTP/1.1 {status} Unknown\r\n"]
    typed = False
    for k, v in headers:
        low = k.lower()
        if low in _HIDDEN:
            continue
        if low == "content-type":
            typed = True
        lines.append(f"{k}: {v}\r\n")
    if not typed:
        lines.append("Content-Type: application/octet-stream\r\n")
    lines.append(_date())
    if close:
        lines.append("Connection: close\r\n")
    return "".join(lines).encode("latin-1", "replace")


_DATE: list[object] = [0, ""]


def _date(clock: Callable[[], float] = time.time) -> str:
    """The `Date` header line, made once a second."""
    now = int(clock())
    if _DATE[0] != now:
        _DATE[0], _DATE[1] = now, f"Date: {formatdate(now, usegmt=True)}\r\n"
    line = _DATE[1]
    assert isinstance(line, str)
    return line
