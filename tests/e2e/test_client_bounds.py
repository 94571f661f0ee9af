"""The gateway's front: its open-file limit raised at start, idle client connections bounded.

Found on the landed code (issue #22): idle client connections were kept 3,630 s (aiohttp's
default) and the fd limit never raised, so 300 idle sockets under a 256-fd limit locked new
clients out.
"""

from __future__ import annotations

import resource
import socket
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from support import Gateway, Sim, backend_entry, fast_probes


def _soft_nofile(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    raise AssertionError("no open-file limit in /proc")


@pytest.fixture
def low_fd_limit() -> Iterator[None]:
    """Processes started in the test inherit a soft open-file limit of 256."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_open_file_limit_is_raised_and_idle_sockets_lock_nobody_out(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway], low_fd_limit: None
) -> None:
    """A gateway started under a soft limit of 256 raises it to the hard limit, so 300 idle
    client sockets leave room for a new client's request."""
    sim = start_sim("a")
    gw = start_gateway({"backends": [backend_entry(sim)], "probes": fast_probes()})
    resource.setrlimit(
        resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    )
    gw.wait_all_ready()
    assert _soft_nofile(gw.pid) > 256
    idle = [socket.create_connection((gw.host, gw.port), timeout=5) for _ in range(300)]
    try:
        r = httpx.get(f"{gw.url}/healthz", timeout=5)
        assert r.status_code == 200
    finally:
        for s in idle:
            s.close()


def test_an_idle_keep_alive_client_is_closed_after_the_idle_timeout(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """After one answer, a keep-alive client that sends nothing more is closed by the
    gateway after `gateway.client_idle_timeout`."""
    sim = start_sim("a")
    gw = start_gateway(
        {
            "gateway": {"client_idle_timeout": 0.5},
            "backends": [backend_entry(sim)],
            "probes": fast_probes(),
        }
    )
    with socket.create_connection((gw.host, gw.port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        t0 = time.monotonic()
        while True:  # the answer, then the server's close: b""
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
            assert time.monotonic() - t0 < 10, "never closed"
        elapsed = time.monotonic() - t0
    assert got.startswith(b"HTTP/1.1 200"), got[:100]
    assert 0.4 < elapsed < 5.0, elapsed
