"""Start and stop real pulsegate processes on loopback for integration tests.

Every process is started with `--port 0`; its first stdout line announces the real port.
Every process is stopped by its PID (terminate, wait, kill) in the fixture's finalizer.
Nothing here sleeps to let things settle: `wait_until` polls a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httptools
import httpx
import yaml

from pulsegate.announce import LISTENING, host_port, read_until

T = TypeVar("T")


def wait_until(
    cond: Callable[[], T | bool | None],
    timeout: float = 10.0,
    interval: float = 0.02,
    what: str = "",
) -> T:
    """Poll `cond` until it returns something truthy; fail with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            v = cond()
            if v:
                return v  # type: ignore[return-value]
        except Exception as e:  # a server still starting refuses connections
            last_exc = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or cond}: {last_exc}")


class Proc:
    """A child process that announced `... listening on HOST:PORT` on stdout."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "pulsegate", *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=full_env,
        )
        self.pid = self.popen.pid
        self.host, self.port = self._read_address(timeout=20.0)
        self.url = f"http://{self.host}:{self.port}"

    def _read_address(self, timeout: float) -> tuple[str, int]:
        assert self.popen.stdout is not None
        m, buf = read_until(self.popen.stdout, LISTENING, timeout)
        if m:
            return host_port(m)
        self.stop()
        raise RuntimeError(
            f"{self.args[0]} did not start: stdout={buf!r} log={self.log_path.read_text()[-2000:]}"
        )

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is None:
            try:
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGTERM)
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.popen.wait(timeout=5)
            except ProcessLookupError:
                pass
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        self._log.close()

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.popen.wait(timeout=5)


class Sim(Proc):
    def __init__(
        self, tmp: Path, name: str, *extra: str, model: str = "demo-7b", port: int = 0
    ) -> None:
        super().__init__(
            ["sim", "--port", str(port), "--name", name, "--model", model, *extra],
            tmp / f"sim-{name}.log",
        )
        self.name = name

    def fault(self, mode: str, **params: Any) -> None:
        r = httpx.post(f"{self.url}/sim/fault", json={"mode": mode, **params}, timeout=5)
        r.raise_for_status()

    def stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/sim/stats", timeout=5).json()  # type: ignore[no-any-return]


class Gateway(Proc):
    def __init__(
        self,
        tmp: Path,
        config: dict[str, Any],
        env: dict[str, str] | None = None,
        *,
        name: str = "gateway",
        args: tuple[str, ...] = (),
    ):
        self.config_path = tmp / f"{name}.yaml"
        self.write_config(config)
        super().__init__(["serve", "-c", str(self.config_path), *args], tmp / f"{name}.log", env)

    def write_config(self, config: dict[str, Any]) -> None:
        """(Re)write this gateway's config file (a reload reads it)."""
        config = {**config}
        gw = {**config.get("gateway", {})}
        gw.setdefault("listen", "127.0.0.1:0")
        config["gateway"] = gw
        tmp_path = self.config_path.with_suffix(".tmp")
        tmp_path.write_text(yaml.safe_dump(config))
        tmp_path.replace(self.config_path)  # whole or not at all, as an operator's deploy

    def reload(self) -> httpx.Response:
        return httpx.post(f"{self.url}/admin/reload", timeout=10)

    def backends(self, token: str | None = None) -> dict[str, dict[str, Any]]:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        r = httpx.get(f"{self.url}/admin/backends", headers=headers, timeout=5)
        r.raise_for_status()
        return {b["name"]: b for b in r.json()["backends"]}

    def events(self) -> list[dict[str, Any]]:
        return httpx.get(f"{self.url}/admin/events", timeout=5).json()["events"]  # type: ignore[no-any-return]

    def wait_state(self, name: str, *states: str, timeout: float = 15.0) -> dict[str, Any]:
        return wait_until(
            lambda: (b := self.backends()[name])["state"] in states and b,
            timeout=timeout,
            what=f"{name} in {states}",
        )

    def wait_all_ready(self, timeout: float = 15.0) -> None:
        wait_until(
            lambda: all(b["state"] == "ready" for b in self.backends().values()),
            timeout=timeout,
            what="all backends ready",
        )


def fast_probes() -> dict[str, Any]:
    """Probe settings that keep integration tests quick (same logic, shorter intervals)."""
    return {
        "readiness": {"interval": "300ms", "interval_unstable": "100ms", "timeout": "500ms"},
        "micro_inference": {"interval": "500ms", "jitter": "200ms", "timeout": "500ms"},
        "canary": {"interval": "300ms", "timeout": "250ms"},
        "metrics_interval": "200ms",
    }


def backend_entry(sim: Sim, **extra: Any) -> dict[str, Any]:
    return {"name": sim.name, "url": sim.url, "models": ["demo-7b"], **extra}


def sse_events(resp: httpx.Response) -> Iterator[bytes]:
    """The raw events of a streamed response (`data: ...`), as they complete."""
    buf = b""
    for chunk in resp.iter_bytes():
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            yield ev


class ClosedLoop:
    """Closed-loop clients until `stop()`: each worker makes its own client (`client()`) and
    calls `one(client, n)` (n unique per call) again and again; what it returns goes to
    `served`, an exception of the kinds in `errors` to `errors` (as its repr)."""

    def __init__(
        self,
        client: Callable[[], Any],
        one: Callable[[Any, int], str],
        errors: tuple[type[BaseException], ...],
        workers: int = 4,
    ) -> None:
        self.served: list[str] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(client, one, errors, w), daemon=True)
            for w in range(workers)
        ]
        for t in self._threads:
            t.start()

    def _run(
        self,
        client: Callable[[], Any],
        one: Callable[[Any, int], str],
        errors: tuple[type[BaseException], ...],
        w: int,
    ) -> None:
        c = client()
        i = 0
        while not self._stop.is_set():
            try:
                self.served.append(one(c, w * 100_000 + i))
            except errors as e:
                self.errors.append(repr(e))
            i += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=20)


class Reply:
    """The responses read on one raw socket, parsed (httptools), and whether the server
    closed it."""

    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.bodies: list[bytes] = []
        self.headers: list[dict[str, str]] = []
        self.closed = False
        self._body = b""
        self._head: dict[str, str] = {}
        self._name = b""
        self._p = httptools.HttpResponseParser(self)

    def feed(self, data: bytes) -> None:
        self._p.feed_data(data)

    def on_message_begin(self) -> None:
        self._body, self._head = b"", {}

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head[name.decode().lower()] = value.decode()

    def on_body(self, b: bytes) -> None:
        self._body += b

    def on_message_complete(self) -> None:
        self.statuses.append(self._p.get_status_code())
        self.bodies.append(self._body)
        self.headers.append(self._head)

    def code(self, i: int = -1) -> object:
        return json.loads(self.bodies[i])["error"]["code"]


def read_replies(s: socket.socket, reply: Reply, want: int, wait: float = 10.0) -> Reply:
    """Read until `want` responses in all or the gateway closed, within `wait` seconds."""
    s.settimeout(wait)
    deadline = time.monotonic() + wait
    while len(reply.statuses) < want and time.monotonic() < deadline:
        try:
            data = s.recv(65536)
        except ConnectionResetError:
            data = b""
        except TimeoutError:
            break
        if not data:
            reply.closed = True
            break
        reply.feed(data)
    return reply
