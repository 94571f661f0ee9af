"""The connect probe (`probers.dial`): a new TCP connection made, refused, or timed out
against a loopback listener whose accept queue is full (what a SYN drop looks like)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator

import pytest

from pulsegate.clock import SystemClock
from pulsegate.probers.dial import address, dial


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
