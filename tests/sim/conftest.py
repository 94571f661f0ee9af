"""Process helpers for the sim tests: start a real `pulsegate sim` on a loopback port.

The lead will factor the generic parts (start, wait for the listening line, stop by PID)
into tests/support.py; until then they live here.
"""

from __future__ import annotations

import os
import re
import selectors
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

_LISTENING = re.compile(r"^sim (\S+) listening on (http://\S+)$")
START_TIMEOUT_S = 15.0  # cold interpreter + aiohttp import on a busy 2-core box


@dataclass
class SimProc:
    """A running sim process and its base URL (without /v1)."""

    proc: subprocess.Popen[str]
    url: str
    name: str

    def fault(self, mode: str, **params: object) -> httpx.Response:
        """Set a fault; raises unless the sim accepted it."""
        r = httpx.post(f"{self.url}/sim/fault", json={"mode": mode, **params}, timeout=5)
        r.raise_for_status()
        return r

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = httpx.get(f"{self.url}/sim/stats", timeout=5).json()
        return out

    def metrics(self) -> dict[str, float]:
        """/metrics as {"name{labels}": value}."""
        out: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out


def start_sim_process(*args: str, name: str = "sim") -> SimProc:
    """Start `python -m pulsegate sim --port 0 ...` and wait for its listening line."""
    cmd = [sys.executable, "-m", "pulsegate", "sim", "--port", "0", "--name", name, *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or proc.poll() is not None:
                stop_process(proc)
                raise RuntimeError(f"sim {name!r} did not start (rc={proc.returncode})")
            if sel.select(timeout=left):
                line = proc.stdout.readline().strip()
                m = _LISTENING.match(line)
                if m:
                    return SimProc(proc=proc, url=m.group(2), name=m.group(1))
    finally:
        sel.close()


def stop_process(proc: subprocess.Popen[str], timeout: float = 5.0) -> int:
    """SIGTERM, wait, then SIGKILL if it will not go. Returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode


def wait_until(pred: Callable[[], object], timeout: float = 5.0, every: float = 0.02) -> object:
    """Poll ``pred`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s: {pred}")
        time.sleep(every)


@pytest.fixture(scope="module")
def sim_factory() -> Iterator[Callable[..., SimProc]]:
    """Start sims with given CLI args; all are stopped when the module's tests are done."""
    procs: list[SimProc] = []

    def start(*args: str, name: str = "sim") -> SimProc:
        sp = start_sim_process(*args, name=name)
        procs.append(sp)
        return sp

    yield start
    for sp in procs:
        stop_process(sp.proc)


@pytest.fixture(scope="module")
def fast_sim(sim_factory: Callable[..., SimProc]) -> SimProc:
    """A quick engine (5 ms TTFT, 1 ms ITL) shared by a module's tests."""
    return sim_factory("--ttft-ms", "5", "--itl-ms", "1", name="fast")


@pytest.fixture
def sim(fast_sim: SimProc) -> Iterator[SimProc]:
    """The module's fast sim, with any fault lifted after the test."""
    yield fast_sim
    fast_sim.fault("none")
