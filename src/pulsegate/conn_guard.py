"""Client connections of one gateway process: a cap on how many, a deadline for each head.

Issue #22: the landed gateway had no connection cap, and a request head trickled a byte at
a time held its socket for `gateway.client_idle_timeout` (75 s), since aiohttp has no
header timeout. `ConnGuard` is the protocol factory the listening socket is created with
(`runtime.GuardedSite`); every accepted connection passes through it:

- **The cap** (`gateway.max_client_connections`, per process): past it, a new connection
  is a `Refusal`: a whole `HTTP/1.1 503` with `Connection: close`, `Retry-After: 1` and
  OpenAI's error body (`overloaded`) is written at once, then our side is shut; what the
  client still sends is read and dropped until it closes, at most `REFUSAL_LINGER_S`
  (closing on unread bytes would send a reset, which can destroy the 503 before the client
  reads it). The connections already open are never touched.
- **The header deadline** (`gateway.client_header_timeout`): a `Conn` wraps aiohttp's own
  protocol, forwarding every callback, and notes when the first byte of a request head
  arrives while no request is being handled; the request's handler starting (`begin`, from
  the wrapper `runtime` puts around aiohttp's request handler) ends the head. A head still
  not done `header_timeout` after its first byte is answered 408 and the connection closed.
  A keep-alive connection with no byte of a new request is not timed here: aiohttp's idle
  timer (`client_idle_timeout`) closes it, as before.

Each head is offered first to the lean server of the proxied POSTs (`Conn.lean`,
`proxy/client_conn.py`), which takes the plain case and leaves the rest to aiohttp as it
arrived; its requests begin and end here too (`Conn.begin`, `Conn.end`), so the cap and
the header deadline are the same for both servers.

No timer per connection or request: `sweep(now)`, every `sweep_period` seconds, walks
only the heads still arriving (a handful: a head sent in one write is done within the loop
turn that read it) and the lingering refusals, and decides with `overdue`, a pure function
of `now`. Per `data_received` a `Conn` costs one attribute test, and per request one clock
read, one set insert and one removal (figures in docs/reliability.md).

Bytes that arrive once a handler has returned are taken for the next head, except while
the request's body is still unread (an answer sent before it, a 413 or the body timeout's
408): aiohttp reads and drops the rest for up to 10 s (its lingering read, then it closes),
and only the bytes after that body's end start a head.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar, cast

from pulsegate.proxy.client_conn import ClientConn, LeanServer
from pulsegate.proxy.errors import error_body
from pulsegate.proxy.metrics import ProxyMetrics

K = TypeVar("K")

# A refused connection's linger: long enough for a client to read the 503 and close, short
# enough that a flood of refused connections holds at most ~one second of accepts in fds.
REFUSAL_LINGER_S = 1.0
# What a refused or lingering client may send before it is closed without more ado.
REFUSAL_READ_MAX = 64 * 1024
# Refusals lingering at once, at most: past it a refusal is closed once its 503 is written
# (a flood of new connections must not spend the fds the cap keeps for upstreams).
REFUSALS_MAX = 64
# The sweep's period: a quarter of the header timeout (the 408 comes 0-25% late), at most
# a second, at least 50 ms.
SWEEP_MAX_S = 1.0
SWEEP_MIN_S = 0.05


class Body(Protocol):
    """A request body being read (aiohttp's `StreamReader`)."""

    def is_eof(self) -> bool: ...


def _raw_response(status: str, body: bytes, extra: str = "") -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n"
    )
    return head.encode("ascii") + body


REFUSED_503 = _raw_response(
    "503 Service Unavailable",
    error_body(503, "too many client connections; retry shortly", "overloaded"),
    "Retry-After: 1\r\n",
)


def head_408(seconds: float) -> bytes:
    msg = f"request head did not arrive within {seconds:g}s"
    return _raw_response("408 Request Timeout", error_body(408, msg, "request_timeout"))


def overdue(since: Mapping[K, float], now: float, limit: float) -> list[K]:
    """The keys whose time in `since` is `limit` or more before `now`."""
    cutoff = now - limit
    return [k for k, t in since.items() if t <= cutoff]


def fd_cap(wanted: int, nofile: int, reserve: int = 128) -> int:
    """The most client connections an open-file limit of `nofile` leaves room for: `reserve`
    fds for the process itself (listeners, logs, probes, pools' idle connections: ~30 in
    the soak) and the lingering refusals (`REFUSALS_MAX`), then
    half the rest, since a client connection with a request in flight holds an upstream
    connection too. Worked example: a 1,024 limit leaves (1,024 - 128) / 2 = 448."""
    return max(1, min(wanted, (nofile - reserve) // 2))


def sweep_period(header_timeout: float) -> float:
    return max(SWEEP_MIN_S, min(SWEEP_MAX_S, header_timeout / 4))


class ConnGuard:
    """The cap and the header deadline of one listening socket's connections. `inner` makes
    the protocol that serves a connection (aiohttp's `web.Server`); `lean`, when given,
    serves the proxied POSTs beside it (`proxy/client_conn.py`); `now` is the loop's
    clock."""

    def __init__(
        self,
        inner: Callable[[], asyncio.Protocol],
        cap: int,
        header_timeout: float,
        now: Callable[[], float],
        metrics: ProxyMetrics | None = None,
        lean: LeanServer | None = None,
    ) -> None:
        self.inner = inner
        self.lean = lean
        self.cap = cap
        self.header_timeout = header_timeout
        self.now = now
        self.open = 0
        self.refused = 0
        self.heads: dict[Conn, float] = {}  # connections whose request head is arriving: since
        self.refusals: dict[Refusal, float] = {}  # refused connections lingering: since
        # Made by the factory, `connection_made` not yet called (a protocol the loop drops
        # before that, when its transport could not be set up, would hold a count forever).
        self._unmade: set[Conn] = set()
        self._unmade_seen: set[Conn] = set()
        self._metrics = metrics
        self._408 = head_408(header_timeout)

    # -- the protocol factory -----------------------------------------------------------------

    def factory(self) -> asyncio.Protocol:
        """One accepted connection's protocol: served under the cap, refused past it. The
        count is taken here, not in `connection_made`: the loop calls the factory for a
        whole burst of accepts before any `connection_made`."""
        if self.open >= self.cap:
            self.refused += 1
            if self._metrics is not None:
                self._metrics.client_connections_refused.inc()
            return Refusal(self)
        conn = Conn(self, self.inner())
        self._unmade.add(conn)
        self._count(1)
        return conn

    def _count(self, delta: int) -> None:
        self.open += delta
        if self._metrics is not None:
            self._metrics.client_connections.set(self.open)

    def made(self, conn: Conn) -> None:
        self._unmade.discard(conn)

    def lost(self, conn: Conn) -> None:
        self.heads.pop(conn, None)
        if conn in self._unmade:  # pragma: no cover - lost without made: not by asyncio
            self._unmade.discard(conn)
        self._count(-1)

    # -- the sweep ------------------------------------------------------------------------------

    def sweep(self, now: float) -> tuple[int, int]:
        """Answer 408 to the heads past the deadline and close them, close the refusals past
        their linger; returns how many of each."""
        late = overdue(self.heads, now, self.header_timeout)
        for conn in late:
            del self.heads[conn]
            conn.expire(self._408)
        done = overdue(self.refusals, now, REFUSAL_LINGER_S)
        for r in done:
            r.close()
        # A connection still unmade at two sweeps in a row was dropped by the loop.
        dropped = self._unmade & self._unmade_seen
        if dropped:  # pragma: no cover - see `_unmade`
            self._unmade -= dropped
            self._count(-len(dropped))
        self._unmade_seen = set(self._unmade)
        return len(late), len(done)

    def close_refusals(self) -> None:
        """Close every refused connection still lingering (the listener is going away)."""
        for r in list(self.refusals):
            r.close()

    # -- requests ---------------------------------------------------------------------------------

    def begin(self, conn: Conn) -> None:
        """A request's handler starts on `conn`: its head is done, and bytes from now to
        the handler's end are the request's own (its body, or a pipelined next request)."""
        conn.active += 1
        if conn.head_since is not None:
            conn.head_since = None
            self.heads.pop(conn, None)

    def end(self, conn: Conn, body: Body | None = None) -> None:
        """The handler is done; `body` is its request's: bytes still due for it are not a
        head (None: a lean request's, which closes its connection then)."""
        conn.active -= 1
        if body is not None and not body.is_eof():
            conn.draining = body


class Conn(asyncio.Protocol):
    """A served connection: aiohttp's protocol, with the start of each head noted, and the
    lean server's side (`lean`) offered each head first."""

    __slots__ = ("active", "draining", "guard", "head_since", "inner", "lean", "transport")

    def __init__(self, guard: ConnGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.head_since: float | None = None
        self.active = 0  # request handlers running (aiohttp runs one at a time)
        self.draining: Body | None = None  # a body its handler left unread
        self.lean: ClientConn | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        t = self.transport = cast(asyncio.Transport, transport)
        g = self.guard
        g.made(self)
        self.inner.connection_made(transport)
        if g.lean is not None:
            self.lean = ClientConn(g.lean, self, t)

    def data_received(self, data: bytes) -> None:
        lean = self.lean
        if lean is not None and lean.busy:  # a head it holds, or its request's bytes
            lean.take(data)
            return
        if (
            self.head_since is None
            and not self.active
            and (self.draining is None or self.draining.is_eof())
        ):
            self.draining = None
            g = self.guard
            self.head_since = t = g.now()
            g.heads[self] = t
            if lean is not None and lean.take(data):
                return
        self.inner.data_received(data)

    def begin(self) -> None:
        """A lean request's head is whole (`client_conn.py`)."""
        self.guard.begin(self)

    def end(self) -> None:
        self.guard.end(self)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.lost(self)
        self.inner.connection_lost(exc)
        if self.lean is not None:
            self.lean.lost()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()
        if self.lean is not None:
            self.lean.resume_writing()

    def expire(self, answer: bytes) -> None:
        """The head took too long: `answer` (a 408), then closed. The transport flushes the
        answer before it closes, and tells aiohttp's protocol (`connection_lost`)."""
        self.head_since = None
        t = self.transport
        if t is not None and not t.is_closing():
            t.write(answer)
            t.close()


class Refusal(asyncio.Protocol):
    """A connection past the cap: the 503, our side shut, the client's bytes dropped."""

    __slots__ = ("guard", "read", "transport")

    def __init__(self, guard: ConnGuard) -> None:
        self.guard = guard
        self.transport: asyncio.Transport | None = None
        self.read = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        t = self.transport = cast(asyncio.Transport, transport)
        t.write(REFUSED_503)
        lingering = self.guard.refusals
        if len(lingering) >= REFUSALS_MAX:
            t.close()  # after the 503 is flushed
            return
        if t.can_write_eof():
            t.write_eof()
        lingering[self] = self.guard.now()

    def data_received(self, data: bytes) -> None:
        self.read += len(data)
        if self.read > REFUSAL_READ_MAX:
            self.close()

    def eof_received(self) -> bool:
        return False  # the client is done: close

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.refusals.pop(self, None)

    def close(self) -> None:
        self.guard.refusals.pop(self, None)
        if self.transport is not None:
            self.transport.close()
