"""The connect probe: one new TCP connection to the engine's port, closed at once.

Every other probe rides a connection that is already open (the probes' pool, the agent's
HTTP/2 stream), and so does nearly every client request (the proxy's keep-alive pools). A
node whose new connections fail - SYNs dropped on the way, a listener whose accept queue is
full - keeps all of those green. This probe opens a fresh connection every
`probes.connect.interval` (0.5 s) and reports a `ConnectResult`; the health core counts
them with the proxy's own new connections (`health/connects.py`).

Why a bare TCP connect and not a fresh canary: the canary runs every 2 s, too seldom to see
three failures within 2 s of the fault, and a 6 KB inference per look would cost the engine
work; a handshake costs it none (the connection is closed before a byte is sent). After a
failed connect the next comes half an interval later (`cadence`), so a streak is confirmed,
or a lost SYN cleared, within 0.25 s. TLS is not spoken: SYN drops and full accept queues
are TCP's, and the proxy's own connects see a TLS failure.

The deadline counts only time our own loop was running (`stall.timeout`): a gateway stall
never reads as a connect that timed out.

The backend's host is resolved once per `DNS_TTL_S` (`Addresses`, as the probes' HTTP
session does), not per dial: a dial connects to each address in turn, as `create_connection`
would try them for a name. Resolving at every dial cost 124 µs of CPU per dial to
`localhost` against 62 now (getaddrinfo in libuv's thread pool; `bench/probe_costs.py`), and
sent the resolver two lookups a second per backend.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket
from typing import Any
from urllib.parse import urlsplit

from pulsegate import stall
from pulsegate.clock import Clock
from pulsegate.health.connects import OWN_ERRNOS
from pulsegate.health.observations import ConnectResult

# How long a backend host's addresses are used before it is resolved again (the probes' HTTP
# session caches as long: `http.new_probe_session`).
DNS_TTL_S = 10.0

_MADE = ConnectResult(True)
_WORDS = {
    errno.ECONNREFUSED: "connection refused",
    errno.ECONNRESET: "connection reset",
    errno.EHOSTUNREACH: "host unreachable",
    errno.ENETUNREACH: "network unreachable",
}


def address(url: str) -> tuple[str, int]:
    """The host and port a backend URL names (80 / 443 by default)."""
    u = urlsplit(url)
    if not u.hostname:
        raise ValueError(f"backend URL has no host: {url!r}")
    return u.hostname, u.port or (443 if u.scheme == "https" else 80)


class Addresses:
    """Where backend hosts resolve, each looked up again `ttl_s` after its last lookup, or
    at the next dial after one failed (the host may have moved). Time is the probes'
    `Clock`. A lookup that fails is not kept either: the next dial asks again."""

    def __init__(self, ttl_s: float = DNS_TTL_S) -> None:
        self._ttl = ttl_s
        self._found: dict[tuple[str, int], tuple[float, list[tuple[int, Any]]]] = {}

    async def of(self, host: str, port: int, clock: Clock) -> list[tuple[int, Any]]:
        """(family, sockaddr) of every address of `host`, in the resolver's order. Raises
        OSError (`socket.gaierror`) when it does not resolve."""
        key = (host, port)
        now = clock.now()
        hit = self._found.get(key)
        if hit is not None and now < hit[0]:
            return hit[1]
        found: list[tuple[int, Any]]
        if _ipv4(host):  # nothing to look up, ever
            found, now = [(socket.AF_INET, (host, port))], float("inf")
        else:  # a name, or an IPv6 literal (getaddrinfo reads its scope)
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            )
            found = [(family, sockaddr) for family, _, _, _, sockaddr in infos]
        self._found[key] = (now + self._ttl, found)
        return found

    def forget(self, host: str, port: int) -> None:
        """Look `host` up again at the next dial."""
        self._found.pop((host, port), None)


def _ipv4(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 4
    except ValueError:
        return False


async def dial(
    url: str, timeout_s: float, clock: Clock, addresses: Addresses | None = None
) -> ConnectResult | None:
    """Open a new TCP connection to `url`'s host and port and close it; None when it failed
    for want of our own resources (`OWN_ERRNOS`: no evidence). Never raises for anything
    the network or the backend does. `addresses`: where hosts resolve (a fresh lookup
    without)."""
    host, port = address(url)
    addresses = addresses or Addresses(0.0)
    try:
        async with stall.timeout(clock, timeout_s):
            await _connect_any(await addresses.of(host, port, clock))
    except TimeoutError:
        addresses.forget(host, port)
        return ConnectResult(False, f"connect timed out after {timeout_s * 1000:.0f}ms")
    except OSError as e:  # refused, unreachable, DNS (gaierror)
        addresses.forget(host, port)
        if e.errno in OWN_ERRNOS:
            return None
        words = _WORDS.get(e.errno or 0) or e.strerror or type(e).__name__
        return ConnectResult(False, words)
    return _MADE


async def _connect_any(found: list[tuple[int, Any]]) -> None:
    """Connect to the first of `found` that takes it, and close at once; the first error
    when none does. (`create_connection` to an address, not `sock_connect`: uvloop's
    `sock_connect` resolves even a literal in its thread pool, 124 µs a dial here.)"""
    loop = asyncio.get_running_loop()
    first: OSError | None = None
    for family, sockaddr in found:
        try:
            transport, _ = await loop.create_connection(
                asyncio.Protocol, sockaddr[0], sockaddr[1], family=family
            )
        except OSError as e:
            first = first or e
            continue
        transport.close()
        return
    raise first or OSError(errno.EHOSTUNREACH, "no address")
