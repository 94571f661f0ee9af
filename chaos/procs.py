"""The lab's processes: engines and agents inside their namespaces, the gateway beside us.

The pattern of tests/support.py (start with a known or zero port, read the `listening on`
line, stop by PID: SIGCONT, SIGTERM, wait, SIGKILL), plus a network namespace to run in
(`ip netns exec` execs, so the PID is the Python process itself) and a record of every
root-namespace PID in the lab's state file, so `chaos.cleanup` can stop what a crashed run
left. Processes inside a namespace need no record: cleanup kills `ip netns pids`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import yaml

from chaos import netlab
from pulsegate.announce import LISTENING, host_port, read_until

CURL = shutil.which("curl")


class Proc:
    """A pulsegate child process that announces `... listening on HOST:PORT` on stdout."""

    def __init__(
        self, args: list[str], log_path: Path, netns: str | None = None, start_timeout: float = 30
    ) -> None:
        self.args = args
        self.netns = netns
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        prefix = ["ip", "netns", "exec", netns] if netns else []
        self.popen = subprocess.Popen(
            [*prefix, sys.executable, "-m", "pulsegate", *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # a Ctrl-C on the lab must not reach the children first
        )
        self.pid = self.popen.pid
        if netns is None:
            try:
                netlab.record_pid(self.pid, args[0])
            except BaseException:  # unrecorded, no cleanup would find it: stop it now
                self.popen.kill()
                self.popen.wait(timeout=5)
                self._log.close()
                raise
        self.host, self.port = self._read_address(start_timeout)

    def _read_address(self, timeout: float) -> tuple[str, int]:
        assert self.popen.stdout is not None
        m, buf = read_until(self.popen.stdout, LISTENING, timeout)
        if m:
            return host_port(m)
        self.stop()
        tail = self.log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{self.args[0]} did not start: stdout={buf!r} log={tail}")

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.signal(signal.SIGKILL)
            self.popen.wait(timeout=5)

    def stop(self, timeout: float = 5.0) -> None:
        if self.popen.poll() is None:
            try:
                self.signal(signal.SIGCONT)
                self.signal(signal.SIGTERM)
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        self._log.close()
        if self.netns is None:
            netlab.forget_pid(self.pid)


class Engine(Proc):
    """`pulsegate sim` on the node's address, port 8000, inside the node's namespace."""

    def __init__(self, node: netlab.Node, logdir: Path, name: str, *extra: str) -> None:
        self.node = node
        self.name = name
        super().__init__(
            ["sim", "--host", "0.0.0.0", "--port", str(netlab.ENGINE_PORT), "--name", name,
             "--seed", str(node.index), *extra],
            logdir / f"engine-{name}.log",
            netns=node.ns,
        )  # fmt: skip
        self.url = node.engine_url

    def fault(self, mode: str, **params: Any) -> None:
        body = json.dumps({"mode": mode, **params})
        if CURL is None:
            r = httpx.post(f"{self.url}/sim/fault", content=body, timeout=5)
            r.raise_for_status()
            return
        # Sent by curl, not from this process, where it shares the interpreter with the load
        # client and the wire tap: from here the POST took 0.44-0.96 s at load average 10-13
        # (by curl 0.01-0.2 s), so the fault's start, taken before it, was that uncertain.
        p = subprocess.run(
            [CURL, "-sS", "--fail", "-m", "5", "-H", "content-type: application/json",
             "--data-binary", body, f"{self.url}/sim/fault"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if p.returncode != 0:
            raise RuntimeError(f"{self.name}: POST /sim/fault {body}: {p.stderr.strip()}")

    def arrivals(self, since: float) -> list[float]:
        """Wall times at which client (non-probe) inference requests reached this engine."""
        r = httpx.get(f"{self.url}/sim/requests", params={"since": since}, timeout=5)
        return [a["t"] for a in r.json()["requests"]]


class Agent(Proc):
    """`pulsegate agent` beside the engine, in the same namespace; it reaches the engine over
    the namespace's loopback, so a network fault on the node's link never reaches that hop."""

    def __init__(self, node: netlab.Node, logdir: Path, name: str) -> None:
        self.node = node
        self.name = name
        super().__init__(
            ["agent", "--engine", f"http://127.0.0.1:{netlab.ENGINE_PORT}",
             "--listen", f"0.0.0.0:{netlab.AGENT_PORT}", "--gpu", "engine"],
            logdir / f"agent-{name}.log",
            netns=node.ns,
        )  # fmt: skip


class AdminAPI:
    """What the lab reads from pulsegate's admin API at `admin_url` (`serve`, or `epp
    --admin`, which serves the same API): backends, one counter, the event log."""

    admin_url: str

    def backends(self) -> dict[str, dict[str, Any]]:
        r = httpx.get(f"{self.admin_url}/admin/backends", timeout=5)
        r.raise_for_status()
        return {b["name"]: b for b in r.json()["backends"]}

    def counter(self, name: str) -> dict[str, float]:
        """One counter of `/metrics`, by its one label's value (`outcome="hedge_won"` ->
        `hedge_won`); {} while it has no sample."""
        r = httpx.get(f"{self.admin_url}/metrics", timeout=5)
        r.raise_for_status()
        out: dict[str, float] = {}
        for line in r.text.splitlines():
            if line.startswith(name + "{"):
                labels, _, value = line[len(name) + 1 :].rpartition("} ")
                out[labels.split('"')[1] if '"' in labels else labels] = float(value)
        return out

    def events(self) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.admin_url}/admin/events", params={"limit": 2000}, timeout=5)
        r.raise_for_status()
        return r.json()["events"]  # type: ignore[no-any-return]


def config_file(logdir: Path, config: dict[str, Any], name: str) -> Path:
    """`config` with its admin/HTTP side on 127.0.0.1, port 0, written to `logdir/name`."""
    config = {**config}
    config["gateway"] = {**config.get("gateway", {}), "listen": "127.0.0.1:0"}
    path = logdir / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


class Gateway(AdminAPI, Proc):
    """`pulsegate serve` in the root namespace on 127.0.0.1, port 0."""

    def __init__(self, logdir: Path, config: dict[str, Any], tag: str) -> None:
        self.config_path = config_file(logdir, config, f"gateway-{tag}.yaml")
        super().__init__(["serve", "-c", str(self.config_path)], logdir / f"gateway-{tag}.log")
        self.url = self.admin_url = f"http://{self.host}:{self.port}"
        # `serve` names the backend that answered in `x-pulsegate-backend`: no endpoint map.
        self.endpoints: dict[str, str] = {}
