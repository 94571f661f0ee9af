"""Replacement with nothing lost: `pulsegate serve -c FILE --replace PID`.

The new process checks that PID is a pulsegate gateway, binds the same address beside it
(every gateway listens with SO_REUSEPORT, so both may), starts its health service and waits
until every backend has been judged (out of `cold`: ready, warming, ejected...; at most
`WARM_TIMEOUT_S`), so it routes from a warm view. Only then does it listen, and then it
sends PID `SIGTERM`: the old gateway stops accepting, closes the client connections it
holds idle (they reconnect, to the new one), lets its requests and streams finish within
`streaming.shutdown_grace`, and exits. A new process that cannot start (a bad config, the
port held by another program) exits before it touches PID: the old keeps serving.

Without `--replace` the address must be free: a listener that did not set SO_REUSEPORT,
or another gateway, makes `serve` fail with "address in use" rather than share the port.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
from pathlib import Path

from pulsegate.control.service import HealthService
from pulsegate.health.verdict import State

# Longest wait for the first verdict of every backend: a readiness probe's timeout (1 s),
# a micro-inference's (2 s) and slack; a backend still cold then is judged as it comes.
WARM_TIMEOUT_S = 10.0


class ReplaceError(Exception):
    """The replacement cannot go ahead; the old gateway was not touched."""


def check_target(pid: int) -> None:
    """PID must be a running pulsegate gateway (never signal a stranger's process)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        raise ReplaceError(f"--replace {pid}: no such process") from None
    if not (any(b"pulsegate" in part for part in cmdline) and b"serve" in cmdline):
        words = b" ".join(cmdline).decode("utf-8", "replace").strip()
        raise ReplaceError(f"--replace {pid}: not a pulsegate gateway ({words[:80]!r})")


def check_address(host: str, port: int, replacing: int | None) -> None:
    """Fail now if the gateway could not listen on host:port.

    Without --replace the address must be free (a plain bind, no SO_REUSEPORT, succeeds
    only then). With it (`replacing`: the PID), a bind with SO_REUSEPORT must succeed: it
    does beside another gateway (which set it too), and fails beside any other program."""
    if port == 0:
        return
    family, kind, proto, _, addr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if replacing is not None:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            if replacing is not None:
                raise ReplaceError(
                    f"cannot listen on {host}:{port} beside process {replacing}: the address "
                    "is held by a process that did not set SO_REUSEPORT"
                ) from None
            raise ReplaceError(
                f"cannot listen on {host}:{port}: address in use "
                "(to take over from a running gateway: serve --replace PID)"
            ) from None


async def warm(health: HealthService) -> int:
    """Wait until no backend is cold (every one judged: each leaves `cold` by a
    transition), at most `WARM_TIMEOUT_S`; returns how many are still cold."""
    fleet = health.fleet

    def cold() -> int:
        return sum(1 for n in fleet.names() if fleet.state(n) is State.COLD)

    moved = asyncio.Event()

    def on_transitions(_: object) -> None:
        moved.set()

    health.on_transitions.append(on_transitions)
    try:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(WARM_TIMEOUT_S):
                while cold():
                    moved.clear()
                    await moved.wait()
    finally:
        health.on_transitions.remove(on_transitions)
    return cold()


def retire(pid: int) -> None:
    """Tell the old gateway to drain and exit (its SIGTERM is the graceful shutdown)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass  # it is gone already: nothing to drain
