"""The connect probe (`probers.dial`): a new TCP connection made, refused, or timed out
against a loopback listener whose accept queue is full (what a SYN drop looks like); where
its hosts resolve, kept for a while (`Addresses`)."""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import AsyncIterator, Iterator

import pytest

from pulsegate.clock import ManualClock, SystemClock
from pulsegate.probers.dial import Addresses, _connect_any, address, dial


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    yield s
    s.close()


def test_address_defaults_by_scheme() -> None:
    """The host and port a backend URL names; 80 and 443 when it names none."""
    assert address("http://10.0.0.1:8000/v1") == ("10.0.0.1", 8000)
    assert address("http://gpu-3") == ("gpu-3", 80)
    assert address("https://api.example.com") == ("api.example.com", 443)
    with pytest.raises(ValueError):
        address("http://:80")


@pytest.fixture
async def clock() -> AsyncIterator[SystemClock]:
    c = SystemClock(asyncio.get_running_loop())
    yield c
    c.close()


async def test_made(listener: socket.socket, clock: SystemClock) -> None:
    """A listener that takes the connection: ok."""
    port = listener.getsockname()[1]
    r = await dial(f"http://127.0.0.1:{port}", 1.0, clock)
    assert r is not None and r.ok and r.reason == ""


async def test_refused(clock: SystemClock) -> None:
    """Nothing listens: failed, in words."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    r = await dial(f"http://127.0.0.1:{port}", 1.0, clock)
    assert r is not None and not r.ok and r.reason == "connection refused"


async def test_full_accept_queue_times_out(clock: SystemClock) -> None:
    """A listener that never accepts, its backlog full: the SYN is dropped and the dial
    gives up at its timeout."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(0)
    port = s.getsockname()[1]
    fillers = []
    try:
        while True:
            f = socket.socket()
            f.settimeout(0.2)
            try:
                f.connect(("127.0.0.1", port))
            except OSError:
                f.close()
                break
            fillers.append(f)
            assert len(fillers) < 10
        r = await dial(f"http://127.0.0.1:{port}", 0.1, clock)
        assert r is not None and not r.ok and r.reason == "connect timed out after 100ms"
    finally:
        for f in fillers:
            f.close()
        s.close()


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return port


async def test_a_name_is_looked_up_once_per_ttl(listener: socket.socket) -> None:
    """`localhost` is resolved at the first dial and kept for the TTL (the same list, no new
    lookup), then resolved again; a literal is never looked up."""
    port = listener.getsockname()[1]
    c = ManualClock()
    addresses = Addresses(ttl_s=10.0)
    first = await addresses.of("localhost", port, c)
    assert (socket.AF_INET, ("127.0.0.1", port)) in first
    c.advance(9.9)
    assert await addresses.of("localhost", port, c) is first
    c.advance(0.2)
    again = await addresses.of("localhost", port, c)
    assert again is not first and again == first
    literal = await addresses.of("127.0.0.1", port, c)
    assert literal == [(socket.AF_INET, ("127.0.0.1", port))]
    c.advance(1e6)
    assert await addresses.of("127.0.0.1", port, c) is literal


async def test_a_failed_dial_looks_the_name_up_again(
    listener: socket.socket, clock: SystemClock
) -> None:
    """A made connection keeps the addresses; a refused one forgets them, so a backend that
    moved is found at the next dial, not a TTL later."""
    addresses = Addresses()
    port = listener.getsockname()[1]
    kept = await addresses.of("localhost", port, clock)
    r = await dial(f"http://localhost:{port}", 1.0, clock, addresses)
    assert r is not None and r.ok
    assert await addresses.of("localhost", port, clock) is kept
    closed = _closed_port()
    gone = await addresses.of("localhost", closed, clock)
    r = await dial(f"http://localhost:{closed}", 1.0, clock, addresses)
    assert r is not None and not r.ok and r.reason == "connection refused"
    assert await addresses.of("localhost", closed, clock) is not gone


async def test_each_address_is_tried_in_turn(listener: socket.socket) -> None:
    """As `create_connection` does for a name: the first address that takes the connection
    is enough; when none does, the first error is the one told."""
    port = listener.getsockname()[1]
    closed = _closed_port()
    await _connect_any(
        [(socket.AF_INET, ("127.0.0.1", closed)), (socket.AF_INET, ("127.0.0.1", port))]
    )
    with pytest.raises(OSError) as e:
        await _connect_any([(socket.AF_INET, ("127.0.0.1", closed))] * 2)
    assert e.value.errno == errno.ECONNREFUSED
