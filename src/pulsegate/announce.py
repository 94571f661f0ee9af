"""Reading a child process's start-up announcement (`... listening on HOST:PORT`) from its
stdout pipe, within a deadline: the demo, the tests, the chaos lab, the benchmarks and the
screenshot script all start pulsegate processes this way."""

from __future__ import annotations

import os
import re
import selectors
import subprocess
import time
from typing import IO

# `pulsegate serve|sim|agent` and the benchmarks' engines print this once they listen.
LISTENING = re.compile(rb"listening on (?:http://)?([\w.\-\[\]]+):(\d+)")


def read_until(
    pipe: IO[bytes],
    pattern: re.Pattern[bytes],
    timeout: float,
    proc: subprocess.Popen[bytes] | None = None,
) -> tuple[re.Match[bytes] | None, bytes]:
    """Read `pipe` until `pattern` matches what was read, the pipe closes, `proc` (if given)
    exits, or `timeout` seconds pass. Returns the match (None if none) and every byte read."""
    sel = selectors.DefaultSelector()
    sel.register(pipe, selectors.EVENT_READ)
    buf = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and (proc is None or proc.poll() is None):
            wait = max(0.0, deadline - time.monotonic())
            if not sel.select(timeout=wait if proc is None else min(wait, 0.2)):
                continue
            chunk = os.read(pipe.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
            m = pattern.search(buf)
            if m:
                return m, buf
    finally:
        sel.close()
    return None, buf


def host_port(m: re.Match[bytes]) -> tuple[str, int]:
    """HOST (brackets of an IPv6 literal removed) and PORT of a `LISTENING` match."""
    return m.group(1).decode().strip("[]"), int(m.group(2))
