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
import ctypes
import errno
import os
import signal
import socket
import struct
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


SO_ATTACH_REUSEPORT_CBPF = 51  # <asm-generic/socket.h>
# After steering, the old process's loop accepts what its listener had queued: a loaded
# loop turn is well under this.
STEERED_S = 0.1
_BPF_RET_K = 0x06  # BPF_RET | BPF_K: "select the socket at index k"


def steer_to_self(sock: socket.socket, port: int) -> bool:
    """Make the kernel give every new connection on `port` to `sock` (the newest listener
    of the SO_REUSEPORT group) before the old gateway closes its own listener.

    When a listener of the group closes, Linux resets the connections queued on it that
    its process had not accepted yet (unless `net.ipv4.tcp_migrate_req=1`): under load a
    replacement lost one request that way. A classic BPF program on the group (one
    instruction: return our index; the group's sockets are indexed in the order they began
    to listen, ours last) sends nothing more to the old listener, which accepts what it has
    and closes with an empty queue. Once it has closed, our index is past the end and the
    kernel falls back to its usual hash. False: not steered (not Linux, or the count of
    listeners is not what we expect); the replacement goes on with the kernel's window."""
    listeners = _listeners(port)
    if listeners < 2:
        return False
    insn = struct.pack("HBBI", _BPF_RET_K, 0, 0, listeners - 1)
    buf = ctypes.create_string_buffer(insn, len(insn))
    prog = struct.pack("HP", 1, ctypes.addressof(buf))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, prog)
    except OSError:
        return False
    return True


def _listeners(port: int) -> int:
    """TCP sockets listening on `port` (IPv4 and IPv6), from /proc/net/tcp*."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 3 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                n += 1
    return n


def retire(pid: int) -> None:
    """Tell the old gateway to drain and exit (its SIGTERM is the graceful shutdown)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass  # it is gone already: nothing to drain
