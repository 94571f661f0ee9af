"""The bench's children: started with a deadline, stopped by PID, measured from /proc.

Every child runs in its own session (a terminal Ctrl-C reaches only the bench, which then
stops them in order) and gets SIGTERM from the kernel if the bench itself dies uncleanly
(PR_SET_PDEATHSIG), so a killed bench leaves no engine or proxy behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pulsegate.announce import LISTENING, host_port, read_until

CLK_TCK = os.sysconf("SC_CLK_TCK")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the bench's main thread goes away."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    fh: IO[bytes]
    port: int | None = None
    pids: list[int] = field(default_factory=list)  # the tree, refreshed by `tree()`

    @property
    def pid(self) -> int:
        return self.popen.pid


class Procs:
    """Every process the bench starts, stopped in reverse order by `stop_all()`."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []

    def start(
        self,
        name: str,
        argv: list[str],
        *,
        announce: bool = True,
        env: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> Child:
        """Start `argv`; with `announce`, wait for its `listening on HOST:PORT` line."""
        log = self.log_dir / f"{name}.log"
        fh = open(log, "wb")  # noqa: SIM115 - closed in stop_all()
        popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE if announce else fh,
            stderr=fh,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
            preexec_fn=_die_with_parent,  # servers start from the main thread only
        )
        child = Child(name, popen, log, fh)
        self.children.append(child)
        if announce:
            child.port = _read_port(child, timeout)
        return child

    def stop_all(self) -> None:
        while self.children:
            self.stop(self.children.pop())

    def stop(self, child: Child) -> None:
        """SIGTERM, up to 5 s of grace, then SIGKILL; leftover descendants by PID."""
        p = child.popen
        pids = tree(p.pid) if p.poll() is None else []
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        for pid in pids[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        child.fh.close()


def _read_port(child: Child, timeout: float) -> int:
    p = child.popen
    assert p.stdout is not None
    m, buf = read_until(p.stdout, LISTENING, timeout)
    child.fh.write(buf)
    if m:
        # Keep draining stdout so a chatty child never blocks on a full pipe.
        threading.Thread(target=_drain, args=(p.stdout, child.fh), daemon=True).start()
        return host_port(m)[1]
    child.fh.flush()
    tail = child.log.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"{child.name} did not announce its port within {timeout:g}s:\n{tail}")


def _drain(src: IO[bytes], dst: IO[bytes]) -> None:
    with contextlib.suppress(OSError, ValueError):
        for line in src:
            dst.write(line)


def wait_port(port: int, child: Child, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.popen.poll() is not None:
            tail = child.log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{child.name} exited rc={child.popen.returncode}:\n{tail}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{child.name}: port {port} not accepting after {timeout:g}s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------- /proc


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (at most 64)."""
    out: list[int] = []
    todo = [pid]
    while todo and len(out) < 64:
        p = todo.pop()
        out.append(p)
        todo.extend(_children(p))
    return out


@dataclass(frozen=True, slots=True)
class Usage:
    cpu_s: float  # user + system, summed over the processes
    rss_mb: float  # summed
    hwm_mb: float  # peak RSS (VmHWM), summed
    hwm_max_mb: float  # the largest single process's peak RSS


def usage(pids: list[int]) -> Usage:
    cpu = rss = hwm = hwm_max = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        cpu += (int(fields[11]) + int(fields[12])) / CLK_TCK
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                rss += int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
                hwm += peak
                hwm_max = max(hwm_max, peak)
    return Usage(cpu, rss, hwm, hwm_max)


# -- stopping a bench: Ctrl-C, SIGTERM or its --max-seconds alarm ------------------------------

_WHY: list[str] = []


def _interrupt(signum: int, _frame: object) -> None:
    """SIGTERM or the alarm: act as Ctrl-C, which asyncio's runner turns into cancelling the
    measurement, so every child is stopped on the way out."""
    _WHY.append(signal.Signals(signum).name)
    signal.raise_signal(signal.SIGINT)


def stop_on_signals(max_seconds: int) -> None:
    """Ctrl-C (even if the bench started ignoring it), SIGTERM and an alarm in `max_seconds`
    all raise KeyboardInterrupt in the bench; `interrupted()` then says which."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGALRM, _interrupt)
    signal.alarm(max_seconds)


def interrupted() -> int:
    """After the KeyboardInterrupt: one line saying why, and the exit code (124 for the
    alarm, as `timeout` says, else 130)."""
    why = _WHY[0] if _WHY else "SIGINT"
    print(f"interrupted ({why}): stopping every child", file=sys.stderr)
    return 124 if why == "SIGALRM" else 130
