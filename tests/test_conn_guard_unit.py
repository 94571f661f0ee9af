"""The connection guard (`conn_guard.py`): the cap, the header deadline, the refusal's linger.

The pure part is driven with timestamps and stand-in transports (asyncio's, not ours); the
last tests run it on a real aiohttp server on loopback, in process, and fail loudly if an
aiohttp upgrade breaks what `runtime.client_site` relies on.
"""

from __future__ import annotations

import asyncio
import time

import orjson
from aiohttp import web

from pulsegate import runtime
from pulsegate.config.schema import GatewayConfig
from pulsegate.conn_guard import (
    REFUSAL_LINGER_S,
    REFUSALS_MAX,
    REFUSED_503,
    Conn,
    ConnGuard,
    Refusal,
    fd_cap,
    overdue,
    sweep_period,
)
from pulsegate.observe.metrics import Registry
from pulsegate.proxy.metrics import ProxyMetrics


class FakeTransport(asyncio.Transport):
    """What a protocol wrote and whether it was closed (asyncio's side of a connection)."""

    def __init__(self, protocol: asyncio.Protocol) -> None:
        super().__init__()
        self.protocol = protocol
        self.written = b""
        self.eof = False
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.protocol.connection_lost(None)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.protocol


class Inner(asyncio.Protocol):
    """Stands in for aiohttp's protocol: records the callbacks it was given."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.calls.append("made")

    def data_received(self, data: bytes) -> None:
        self.calls.append(f"data {data!r}")

    def eof_received(self) -> bool | None:
        self.calls.append("eof")
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.calls.append("lost")


class Payload:
    """A request body as the guard sees it: read to its end or not."""

    def __init__(self, eof: bool = True) -> None:
        self.eof = eof

    def is_eof(self) -> bool:
        return self.eof


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _guard(cap: int = 2, header: float = 1.0) -> tuple[ConnGuard, Clock, ProxyMetrics]:
    clock = Clock()
    metrics = ProxyMetrics(Registry())
    return ConnGuard(Inner, cap, header, clock, metrics), clock, metrics


def _accept(guard: ConnGuard) -> tuple[asyncio.Protocol, FakeTransport]:
    proto = guard.factory()
    t = FakeTransport(proto)
    proto.connection_made(t)
    return proto, t


def test_overdue_picks_what_reached_the_limit() -> None:
    """`overdue` keeps the keys whose time is `limit` or more before `now`, no others."""
    assert overdue({"a": 1.0, "b": 1.5, "c": 2.0}, 3.0, 1.5) == ["a", "b"]
    assert overdue({}, 3.0, 1.0) == []


def test_the_cap_leaves_room_for_upstream_connections() -> None:
    """A 1,024 open-file limit allows 448 clients (128 kept, half the rest for upstreams);
    a large one keeps what was asked; a tiny one still allows one."""
    assert fd_cap(10_000, 1024) == 448
    assert fd_cap(10_000, 1_048_576) == 10_000
    assert fd_cap(10_000, 100) == 1


def test_the_sweep_runs_four_times_a_header_timeout_within_bounds() -> None:
    """The sweep's period: a quarter of the header timeout, between 50 ms and 1 s."""
    assert sweep_period(10.0) == 1.0
    assert sweep_period(1.0) == 0.25
    assert sweep_period(0.1) == 0.05


def test_past_the_cap_a_connection_gets_the_503_and_its_side_shut() -> None:
    """The cap's next connection is a Refusal: a whole 503 (`overloaded`, Retry-After,
    Connection: close), our side shut; the open ones untouched; counted."""
    guard, _, metrics = _guard(cap=2)
    a, ta = _accept(guard)
    b, _ = _accept(guard)
    r, tr = _accept(guard)
    assert isinstance(a, Conn) and isinstance(b, Conn) and isinstance(r, Refusal)
    assert tr.written == REFUSED_503 and tr.eof and not tr.closed
    head, body = REFUSED_503.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 503 ")
    assert b"\r\nConnection: close" in head and b"\r\nRetry-After: 1" in head
    assert b"Content-Length: %d" % len(body) in head
    assert orjson.loads(body)["error"]["code"] == "overloaded"
    assert not ta.closed and ta.written == b""
    assert guard.open == 2 and guard.refused == 1
    assert metrics.client_connections.get() == 2
    assert metrics.client_connections_refused.get() == 1
    ta.close()  # one leaves: the next is served
    assert isinstance(_accept(guard)[0], Conn)
    assert metrics.client_connections.get() == 2


def test_a_refusal_lingers_until_the_client_closes_or_a_second_passed() -> None:
    """A refused client's bytes are read and dropped; its EOF closes, else the sweep does
    after REFUSAL_LINGER_S."""
    guard, clock, _ = _guard(cap=0)
    r1, _ = _accept(guard)
    r1.data_received(b"GET / HTTP/1.1\r\n\r\n")
    assert r1.eof_received() is False  # asyncio closes the transport on False
    _, t2 = _accept(guard)
    clock.t += REFUSAL_LINGER_S - 0.01
    guard.sweep(clock.t)
    assert not t2.closed
    clock.t += 0.01
    assert guard.sweep(clock.t) == (0, 2)  # r1 still listed: its transport closes it
    assert t2.closed and not guard.refusals


def test_past_the_lingering_bound_a_refusal_is_closed_after_its_503() -> None:
    """With REFUSALS_MAX refusals lingering, the next one gets its 503 and is closed at
    once: a flood of new connections holds a bounded number of fds."""
    guard, _, _ = _guard(cap=0)
    for _ in range(REFUSALS_MAX):
        assert not _accept(guard)[1].closed
    _, t = _accept(guard)
    assert t.written == REFUSED_503 and t.closed
    assert len(guard.refusals) == REFUSALS_MAX


def test_a_head_not_whole_in_time_gets_a_408_and_is_closed() -> None:
    """First byte at t, nothing else: no verdict before t + header_timeout, then a 408 in
    OpenAI's shape and the connection closed (aiohttp's protocol told)."""
    guard, clock, _ = _guard(header=1.0)
    c, t = _accept(guard)
    assert isinstance(c, Conn) and isinstance(c.inner, Inner)
    c.data_received(b"GET /healthz HTTP/1.1\r\n")
    clock.t += 0.5
    c.data_received(b"X")  # more of the same head: the deadline still runs from its start
    clock.t += 0.49
    assert guard.sweep(clock.t) == (0, 0) and not t.closed
    clock.t += 0.01
    assert guard.sweep(clock.t) == (1, 0)
    assert t.written.startswith(b"HTTP/1.1 408 Request Timeout\r\n") and t.closed
    assert orjson.loads(t.written.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert c.inner.calls[-1] == "lost" and guard.open == 0 and not guard.heads


def test_an_idle_connection_and_a_request_in_progress_are_never_timed() -> None:
    """No byte: no head. Bytes while a handler runs (a body, a stream's life): not a head.
    After the handler ends, the next byte starts the next head's deadline."""
    guard, clock, _ = _guard(header=1.0)
    c, t = _accept(guard)
    assert isinstance(c, Conn)
    clock.t += 60
    assert guard.sweep(clock.t) == (0, 0)  # idle: `client_idle_timeout`'s business
    c.data_received(b"POST /v1/chat/completions HTTP/1.1\r\n...\r\n\r\n")
    guard.begin(c)  # aiohttp parsed the head and started the handler
    assert not guard.heads
    c.data_received(b'{"model":')  # the body
    clock.t += 30
    assert guard.sweep(clock.t) == (0, 0) and not t.closed
    guard.end(c, Payload())
    clock.t += 30
    assert guard.sweep(clock.t) == (0, 0)  # keep-alive, idle again
    c.data_received(b"G")
    clock.t += 1.0
    assert guard.sweep(clock.t) == (1, 0) and t.closed


def test_the_rest_of_a_body_left_unread_is_not_a_head() -> None:
    """A handler answered before reading its body (a 413): the body's rest, arriving after,
    starts no deadline; once that body is at its end, the next byte does."""
    guard, clock, _ = _guard(header=1.0)
    c, t = _accept(guard)
    assert isinstance(c, Conn)
    c.data_received(b"POST / HTTP/1.1\r\nContent-Length: 5000000\r\n\r\n")
    guard.begin(c)
    body = Payload(eof=False)
    guard.end(c, body)
    c.data_received(b"x" * 65536)  # aiohttp's lingering read drops it
    clock.t += 5
    assert guard.sweep(clock.t) == (0, 0) and not guard.heads
    body.eof = True
    c.data_received(b"GET /healthz HTTP/1.1\r\n")
    clock.t += 1.0
    assert guard.sweep(clock.t) == (1, 0) and t.closed


def test_every_callback_reaches_aiohttps_protocol() -> None:
    """A Conn forwards made, data, EOF and lost, in order, to the protocol it wraps."""
    guard, _, _ = _guard()
    c, t = _accept(guard)
    assert isinstance(c, Conn) and isinstance(c.inner, Inner)
    c.data_received(b"x")
    c.eof_received()
    t.close()
    assert c.inner.calls == ["made", "data b'x'", "eof", "lost"]


# -- on a real aiohttp server: what runtime.client_site relies on -------------------------------


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    async with asyncio.timeout(5.0):
        return await reader.read()


async def test_on_aiohttp_the_guard_sees_each_request_and_bounds_heads_and_connections() -> None:
    """On aiohttp's real server: the request-handler wrapper takes (else this aiohttp broke
    `Server.request_handler`, and the gateway logs the header timeout off), a keep-alive
    request is answered and leaves no head pending, a trickled head gets the 408, and the
    connection past the cap gets the 503; the gauge follows."""

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/x", hello)
    runner = runtime.runner(app, 75.0)
    await runner.setup()
    metrics = ProxyMetrics(Registry())
    cfg = GatewayConfig(
        host="127.0.0.1", port=0, max_client_connections=2, client_header_timeout=0.3
    )
    site = runtime.client_site(runner, cfg, 0, metrics)
    guard = site.guard
    assert guard.header_timeout == 0.3, "aiohttp no longer reads Server.request_handler"
    await site.start()
    port = runtime.bound_port(site, 0)
    try:
        r1, w1 = await asyncio.open_connection("127.0.0.1", port)
        w1.write(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
        status = await asyncio.wait_for(r1.readline(), 5)
        assert status.startswith(b"HTTP/1.1 200"), status
        await asyncio.wait_for(r1.readuntil(b"ok"), 5)
        assert not guard.heads  # the handler's start ended the head
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
        w2.write(b"GET /x HTTP/1.1\r\n")  # and never the rest
        t0 = time.monotonic()
        got = await _read_all(r2)
        took = time.monotonic() - t0
        assert got.startswith(b"HTTP/1.1 408"), got[:80]
        assert 0.25 < took < 3.0, took
        _, w3 = await asyncio.open_connection("127.0.0.1", port)  # 2 open: r1 and r3
        await asyncio.sleep(0)
        r4, w4 = await asyncio.open_connection("127.0.0.1", port)
        got = await _read_all(r4)
        assert got.startswith(b"HTTP/1.1 503") and b'"overloaded"' in got, got[:80]
        assert metrics.client_connections_refused.get() == 1
        w1.write(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")  # an old one still works
        assert (await asyncio.wait_for(r1.readline(), 5)).startswith(b"HTTP/1.1 200")
        assert metrics.client_connections.get() == 2
        for w in (w1, w2, w3, w4):
            w.close()
    finally:
        await site.stop()
        await runner.cleanup()
