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
"""

from __future__ import annotations

import asyncio
import errno
from urllib.parse import urlsplit

from pulsegate import stall
from pulsegate.clock import Clock
from pulsegate.health.connects import OWN_ERRNOS
from pulsegate.health.observations import ConnectResult

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


async def dial(url: str, timeout_s: float, clock: Clock) -> ConnectResult | None:
    """Open a new TCP connection to `url`'s host and port and close it; None when it failed
    for want of our own resources (`OWN_ERRNOS`: no evidence). Never raises for anything
    the network or the backend does."""
    host, port = address(url)
    loop = asyncio.get_running_loop()
    try:
        async with stall.timeout(clock, timeout_s):
            transport, _ = await loop.create_connection(asyncio.Protocol, host, port)
    except TimeoutError:
        return ConnectResult(False, f"connect timed out after {timeout_s * 1000:.0f}ms")
    except OSError as e:  # refused, unreachable, DNS (gaierror)
        if e.errno in OWN_ERRNOS:
            return None
        words = _WORDS.get(e.errno or 0) or e.strerror or type(e).__name__
        return ConnectResult(False, words)
    transport.close()
    return _MADE
