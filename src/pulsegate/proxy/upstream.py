"""The proxy path's upstream client: HTTP/1.1 keep-alive pools on asyncio protocols + httptools.

Why not aiohttp's `ClientSession` here: it spent ~100 µs of the ~230 µs CPU per proxied
request (`docs/performance.md`), over its whole general-purpose path (payload registry, a
write task per request, cookie jar, multidicts). This client does one thing: POST a body to
a backend and hand back the status, headers and body, whole or as it arrives. Probers,
alerts and the baseline poll loop keep aiohttp.

    Upstream                 one per gateway: the pools, closed in Gateway.close()
      Pool                   one per backend: LIFO idle connections, stale-connection retry
        Connection           one TCP (or TLS) connection: an asyncio.Protocol + httptools
          Response           status, headers, body (whole or chunk by chunk)

This module holds the pools: opening connections, keeping and expiring idle ones, the
request head, the stale retry. `upstream_conn.py` holds one connection and its response
(the parsing, backpressure, linger) and the exceptions; this module re-exports what callers
import (`Response`, `Headers`, the exceptions, `HIGH_WATER`), so they import from here only.

Exceptions (library errors are translated once, here and in `upstream_conn.py`, which draws
the tree; `classify.py` maps them to outcomes): `UpstreamError` and under it `ConnectFailed`,
`ConnectTimeout`, `ConnectionLost`, `ProtocolError`.

Timeouts other than connect are the caller's: `asyncio.timeout()` around `post()` and the
body reads (cancellation aborts the connection, it is never reused half-read).

Stale connections: a server may close an idle keep-alive connection at any moment (uvicorn,
which vLLM runs on, after 5 s). A request written to a *reused* connection that then sees a
reset or EOF before any response byte is sent once more on a fresh connection, as nginx and
Envoy do. Never once a response byte arrived, never on a fresh connection.

Idle times are read from `Upstream(now=...)`, monotonic seconds (`pulsegate.clock`'s by
default, the gateway's clock); the sweep timer only sets how often they are looked at.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

from pulsegate import clock
from pulsegate.proxy.upstream_conn import (
    HIGH_WATER,
    LINGER_BYTES,
    LINGER_S,
    ConnectFailed,
    Connection,
    ConnectionLost,
    ConnectTimeout,
    Headers,
    ProtocolError,
    Response,
    UpstreamError,
)

__all__ = [
    "HIGH_WATER",
    "IDLE_TIMEOUT_S",
    "LINGER_BYTES",
    "LINGER_S",
    "MAX_IDLE",
    "ConnectFailed",
    "ConnectTimeout",
    "ConnectionLost",
    "Headers",
    "Pool",
    "ProtocolError",
    "Response",
    "Upstream",
    "UpstreamError",
]

# Idle keep-alive connections live this long (nginx's upstream `keepalive_timeout` is 60 s,
# uvicorn closes its side after 5 s: the stale retry covers the difference).
IDLE_TIMEOUT_S = 30.0
# Idle connections kept per backend beyond those in use (the bench's nginx: 256 per worker).
# Fewer would make a burst after a stall open new connections into a backend's full accept
# queue, where a dropped SYN costs its 1 s retransmit (docs/performance.md, findings).
MAX_IDLE = 256
# An https backend connects (TCP, then TLS) within at least this: `retry.connect_timeout`
# (250 ms) is tuned for engines on the LAN, where a lost SYN should move on at once; a hosted
# API 100 ms away needs ~300 ms for TCP + TLS before any fault.
TLS_CONNECT_MIN_S = 3.0


def connect_deadline(configured: float, tls: bool) -> float:
    """Seconds a new connection may take: `retry.connect_timeout`, at least
    `TLS_CONNECT_MIN_S` over TLS (a handshake is two more round trips, often far away)."""
    return max(configured, TLS_CONNECT_MIN_S) if tls else configured


_SKIP_HEADERS = frozenset(("host", "content-length", "transfer-encoding", "connection"))


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
        self._now = up.now
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
        self._idle: collections.deque[Connection] = collections.deque()
        self._conns: set[Connection] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        # Counters for tests and the bench: connections opened, requests on reused ones,
        # stale reused connections retried.
        self.connects = 0
        self.reuses = 0
        self.stale_retries = 0
        self.retired = False  # replaced by a reload: connections close when released

    @property
    def idle(self) -> int:
        return sum(1 for c in self._idle if not c.closed)

    async def post(
        self, path: str, body: bytes, extra: Mapping[str, str] | None = None
    ) -> Response:
        """POST `body` to the backend URL + `path`; returns once the headers arrived.
        `extra`: headers for this request only (the tracer's `traceparent`)."""
        head = self._heads.get(path)
        if head is None:
            head = self._head(path)
        if extra is None:
            head = head + b"%d\r\n\r\n" % len(body)
        else:
            head = head + b"%d\r\n" % len(body) + _extra_head(extra)
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

    def _take(self) -> Connection | None:
        idle = self._idle
        if not idle:
            return None
        now = self._now()
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport.is_closing():
                continue
            if now - conn.idle_since > self._up.idle_timeout:
                conn.close()
                continue
            return conn
        return None

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        timeout = connect_deadline(self._up.connect_timeout, tls=self._ssl is not None)
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    lambda: Connection(self),
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

    def _put(self, conn: Connection) -> None:
        conn.resp = None
        conn.uses += 1
        if conn.closed:
            return
        if self.retired:
            conn.close()
            return
        idle = self._idle
        if len(idle) >= self._up.max_idle:
            idle.popleft().close()  # the longest idle goes
        conn.idle_since = self._now()
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
        limit = self._now() - self._up.idle_timeout
        while idle and (idle[0].closed or idle[0].idle_since < limit):
            idle.popleft().close()
        if idle:
            self._arm()

    def _lost(self, conn: Connection) -> None:
        self._conns.discard(conn)

    def retire(self) -> None:
        """The backend was removed or changed by a reload: close the idle connections now;
        those carrying a request or a stream finish it and close when released."""
        self.retired = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        while self._idle:
            self._idle.popleft().close()

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._idle.clear()
        for conn in list(self._conns):
            conn.abort()


def _extra_head(extra: Mapping[str, str]) -> bytes:
    """`extra` as request-head lines, and the head's end; a line break in one is refused
    (it would smuggle a header or a request)."""
    lines = []
    for k, v in extra.items():
        if "\r" in k or "\n" in k or "\r" in v or "\n" in v:
            raise ValueError(f"header {k!r} contains a line break")
        lines.append(f"{k}: {v}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


class Upstream:
    """The proxy path's client: one `Pool` per backend, made on first use. `now`: monotonic
    seconds for connections' idle times (the gateway's clock; a fake one in tests)."""

    def __init__(
        self,
        connect_timeout: float,
        *,
        idle_timeout: float = IDLE_TIMEOUT_S,
        max_idle: int = MAX_IDLE,
        ssl_context: ssl.SSLContext | None = None,
        now: Callable[[], float] = clock.monotonic,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.max_idle = max_idle
        self.now = now
        self._ssl = ssl_context
        self._pools: dict[str, Pool] = {}

    def pool(self, name: str, url: str, headers: Mapping[str, str]) -> Pool:
        """The pool of backend `name` (made on first use from its URL and headers)."""
        p = self._pools.get(name)
        if p is None:
            p = self._pools[name] = Pool(self, url, headers)
        return p

    def retire(self, name: str) -> None:
        """Backend `name` was removed, or its URL or headers changed, by a reload: its pool
        takes no new request; the next `pool(name, ...)` makes a fresh one."""
        p = self._pools.pop(name, None)
        if p is not None:
            p.retire()

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
