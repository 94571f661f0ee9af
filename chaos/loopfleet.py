"""A loopback fleet for `chaos/fleet.py`: `pulsegate sim`s on fixed ports, one gateway.

A restart must find the same address, so every sim gets a free port up front and keeps it
(`SimSpec.port`). Processes start in their own session and are stopped by PID (SIGTERM,
then SIGKILL); nothing is recorded in the lab's state file, so a lab's cleanup never stops a
bench it did not start. The admin API is read with a blocking httpx client: async callers
run it in a thread (`wait_for`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from pulsegate.announce import LISTENING, host_port, read_until

MODEL = "demo-7b"


class Child:
    """A pulsegate child that announces `listening on HOST:PORT`; stopped by its PID."""

    def __init__(self, args: list[str], log: Path) -> None:
        self._log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "pulsegate", *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
        assert self.popen.stdout is not None
        m, buf = read_until(self.popen.stdout, LISTENING, 30.0)
        if not m:
            self.stop()
            raise RuntimeError(f"{args[0]} did not start: {buf!r}; see {log}")
        self.port = host_port(m)[1]

    @property
    def pid(self) -> int:
        return self.popen.pid

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.popen.wait(timeout=5)

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        self._log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class SimSpec:
    name: str
    zone: str = ""
    max_batch: int = 32
    ttft_ms: float = 30.0
    itl_ms: float = 10.0
    port: int = field(default_factory=free_port)

    def argv(self) -> list[str]:
        return ["sim", "--port", str(self.port), "--name", self.name, "--model", MODEL,
                "--ttft-ms", str(self.ttft_ms), "--itl-ms", str(self.itl_ms),
                "--max-batch", str(self.max_batch)]  # fmt: skip


class Fleet:
    """Sims on fixed ports and one gateway in front of them; everything stopped by `close`."""

    def __init__(
        self, specs: list[SimSpec], logdir: Path, health: dict[str, Any], extra: dict[str, Any]
    ) -> None:
        self.specs = {s.name: s for s in specs}
        self.logdir = logdir
        logdir.mkdir(parents=True, exist_ok=True)
        self.sims: dict[str, Child] = {}
        self.gw: Child | None = None
        try:
            for s in specs:
                self.start_sim(s.name)
            cfg: dict[str, Any] = {
                "gateway": {"listen": "127.0.0.1:0"},
                "health": health,
            }
            cfg["backends"] = [
                {"name": s.name, "url": f"http://127.0.0.1:{s.port}", "models": [MODEL],
                 **({"zone": s.zone} if s.zone else {})}
                for s in specs
            ]  # fmt: skip
            for k, v in extra.items():
                if k == "backends":
                    for b in cfg["backends"]:
                        b.update(v)
                else:
                    cfg[k] = {**cfg.get(k, {}), **v}
            path = logdir / "gateway.yaml"
            path.write_text(yaml.safe_dump(cfg, sort_keys=False))
            self.gw = Child(["serve", "-c", str(path)], logdir / "gateway.log")
        except BaseException:
            self.close()
            raise
        self.url = f"http://127.0.0.1:{self.gw.port}"
        self.http = httpx.Client(base_url=self.url, timeout=5)

    def start_sim(self, name: str) -> None:
        self.sims[name] = Child(self.specs[name].argv(), self.logdir / f"sim-{name}.log")

    def close(self) -> None:
        if self.gw is not None:
            self.gw.stop()
        for c in self.sims.values():
            c.stop()
        with contextlib.suppress(AttributeError):
            self.http.close()

    def backends(self) -> dict[str, dict[str, Any]]:
        r = self.http.get("/admin/backends")
        r.raise_for_status()
        return {b["name"]: b for b in r.json()["backends"]}

    def events(self) -> list[dict[str, Any]]:
        return self.http.get("/admin/events", params={"limit": 5000}).json()["events"]  # type: ignore[no-any-return]

    def admin(self, name: str, verb: str) -> None:
        self.http.post(f"/admin/backends/{name}/{verb}").raise_for_status()

    def counter(self, metric: str) -> float:
        """The sum of every sample of `metric` in /metrics."""
        total = 0.0
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(metric) and line[len(metric) : len(metric) + 1] in ("{", " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def full(self, names: list[str] | None = None) -> bool:
        """Every backend in `names` (default: all) ready at full ramp."""
        bs = self.backends()
        return all(bs[n]["state"] == "ready" and bs[n]["ramp"] >= 1.0 for n in names or list(bs))


async def wait_for(cond: Callable[[], Any], within: float, what: str, every: float = 0.1) -> float:
    """Poll `cond` (blocking, run in a thread) until truthy; the wall time it became so."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if await asyncio.to_thread(cond):
                return time.time()
        await asyncio.sleep(every)
    raise TimeoutError(f"{what}: not within {within:g} s")
