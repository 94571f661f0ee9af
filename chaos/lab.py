"""The lab: namespaces, a fleet of engines with agents, gateways by mode, and their teardown.

`Lab` owns everything it starts. `close()` stops it all and runs `netlab.cleanup()`, and is
called from `with Lab(...)`, from atexit, and from the SIGINT/SIGTERM handlers that
`install_signal_handlers()` sets up, so a failure or Ctrl-C never leaves a namespace, a rule,
a qdisc or a process behind. (Faults live in namespaces the lab deletes; nothing is ever
installed in the root namespace's netfilter or qdiscs.)
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from chaos import netlab
from chaos.envoyepp import EnvoyEpp
from chaos.procs import Agent, Engine, Gateway, Proc

MODES = ("pulsegate", "round_robin", "polling", "passive")
# Envoy as the data plane, `pulsegate epp` as its picker (chaos/envoyepp.py). Not in a full
# run's default modes: its ~20 scenarios would add ~20 min to `make chaos`; `-m envoy-epp`.
ENVOY_EPP = "envoy-epp"
ALL_MODES = (*MODES, ENVOY_EPP)
# The modes judged by pulsegate's health service (probation ramp, ~45 s way back).
JUDGED = frozenset({"pulsegate", ENVOY_EPP})
MODEL = "demo-7b"

# The lab's gateway settings. Detection runs on the defaults (heartbeat 100 ms / 80 ms / 3
# misses, canary every 2 s with a 350 ms timeout, micro-inference every 3-5 s, readiness
# every 10 s / 2 s when unstable, 5 s ejection base). Only the way back is shortened, so that
# 22 faults x 4 modes fit in ~35 min: probation 10 s in 10% steps instead of 60 s in 1%.
LAB_HEALTH: dict[str, Any] = {"probation": {"duration": "10s", "ramp_step": 0.1}}
# The "traditional" baseline polls /health every 5 s (3 failures eject, gateway.mode polling).
POLLING_PROBES: dict[str, Any] = {"readiness": {"interval": "5s", "timeout": "1s"}}


def gateway_config(
    nodes: list[netlab.Node],
    mode: str,
    health: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The gateway's config for `mode`: identical for every mode apart from the mode itself
    and, for polling, the poll interval. `extra` (a fault's `gateway`) is merged over it.
    The picker of `envoy-epp` takes pulsegate's config as is."""
    cfg: dict[str, Any] = {
        "gateway": {"mode": "pulsegate" if mode == ENVOY_EPP else mode},
        "backends": [
            {
                "name": f"b{n.index}",
                "url": n.engine_url,
                "models": [MODEL],
                "agent": n.agent_addr,
                "metrics_path": "/metrics",
            }
            for n in nodes
        ],
        "health": health if health is not None else LAB_HEALTH,
    }
    if mode == "polling":
        cfg["probes"] = POLLING_PROBES
    return _merged(cfg, extra or {})


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` merged into a copy of `base`, mapping by mapping."""
    out = {**base}
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class Lab:
    """`n` backends b0..b<n-1>, each an engine and an agent in its own namespace."""

    def __init__(self, n: int, logdir: Path, engine_args: tuple[str, ...] = ()) -> None:
        self.n = n
        self.logdir = logdir
        self.engine_args = engine_args
        self.nodes: list[netlab.Node] = []
        self.engines: dict[str, Engine] = {}
        self.agents: dict[str, Agent] = {}
        self.gateway: Gateway | EnvoyEpp | None = None
        self.helpers: list[subprocess.Popen[bytes]] = []
        self._lock = netlab.Lock()
        self._closed = False
        self._close_lock = threading.Lock()

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> Lab:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        reason = netlab.why_unavailable()
        if reason:
            raise netlab.LabError(reason)
        if not self._lock.acquire(wait=30):
            raise netlab.LabError(
                f"another chaos lab holds {netlab.LOCK_FILE}; wait for it (or stop it)"
            )
        atexit.register(self.close)
        netlab.cleanup()  # whatever a crashed earlier run left
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.nodes = netlab.build(self.n)
        with ThreadPoolExecutor(self.n) as ex:
            list(ex.map(self._start_engine, range(self.n)))
            list(ex.map(self._start_agent, range(self.n)))

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        procs: list[Proc | EnvoyEpp] = []
        if self.gateway is not None:
            procs.append(self.gateway)
        procs += list(self.agents.values()) + list(self.engines.values())
        for p in procs:
            with contextlib.suppress(Exception):
                p.kill()
                p.stop()
        for h in self.helpers:
            with contextlib.suppress(Exception):
                h.kill()
                h.wait(5)
        netlab.cleanup()
        self._lock.release()

    def install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM: tear everything down, then exit 130/143."""

        def handler(signum: int, _frame: object) -> None:
            print(f"\nchaos: signal {signum}, cleaning up", file=sys.stderr, flush=True)
            self.close()
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    # -- the fleet ------------------------------------------------------------------------

    def name(self, i: int) -> str:
        return f"b{i}"

    def node(self, name: str) -> netlab.Node:
        return self.nodes[int(name[1:])]

    def _start_engine(self, i: int) -> Engine:
        e = Engine(self.nodes[i], self.logdir, self.name(i), *self.engine_args)
        self.engines[self.name(i)] = e
        return e

    def _start_agent(self, i: int) -> Agent:
        a = Agent(self.nodes[i], self.logdir, self.name(i))
        self.agents[self.name(i)] = a
        return a

    def restart_engine(self, name: str) -> None:
        old = self.engines.get(name)
        if old is not None:
            old.kill()
            old.stop()
        self._start_engine(int(name[1:]))

    def restart_agent(self, name: str) -> None:
        old = self.agents.get(name)
        if old is not None:
            old.kill()
            old.stop()
        self._start_agent(int(name[1:]))

    def repair(self) -> None:
        """Back to a healthy fleet after a fault: every network fault flushed, links up,
        MTUs restored, processes continued or restarted, engine faults cleared."""
        if self._closed:
            return  # torn down already (Ctrl-C): nothing left to repair
        for i in range(self.n):
            netlab.iptables(netlab.RTR, "-F", netlab.fault_chain(i))
        netlab.iptables(netlab.RTR, "-F", "FOUT")
        for node in self.nodes:
            netlab.sh("ip", "-n", netlab.RTR, "link", "set", "dev", node.iface, "up",
                      "mtu", str(netlab.MTU))  # fmt: skip
        for h in self.helpers:
            with contextlib.suppress(Exception):
                h.terminate()
                h.wait(5)
        self.helpers.clear()
        for name, e in list(self.engines.items()):
            if not e.alive():
                self.restart_engine(name)
            else:
                e.signal(signal.SIGCONT)
        for name, a in list(self.agents.items()):
            if not a.alive():
                self.restart_agent(name)
            else:
                a.signal(signal.SIGCONT)
        for e in self.engines.values():
            _retry(lambda e=e: e.fault("none"), what=f"{e.name} fault none")

    def start_helper(self, args: list[str], ready: bytes) -> subprocess.Popen[bytes]:
        """A helper (e.g. the NFQUEUE delay line) inside the router namespace."""
        p = subprocess.Popen(
            ["ip", "netns", "exec", netlab.RTR, sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=open(self.logdir / "helpers.log", "ab"),  # noqa: SIM115 - child owns it
            start_new_session=True,
        )
        self.helpers.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()
        if ready not in line:
            raise netlab.LabError(f"helper {args} did not start: {line!r}")
        return p

    # -- gateways -------------------------------------------------------------------------

    def start_gateway(
        self,
        mode: str,
        tag: str,
        health: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Gateway | EnvoyEpp:
        self.stop_gateway()
        cfg = gateway_config(self.nodes, mode, health, extra)
        if mode == ENVOY_EPP:
            self.gateway = EnvoyEpp(self.logdir, cfg, tag, self.nodes)
        else:
            self.gateway = Gateway(self.logdir, cfg, tag)
        return self.gateway

    def stop_gateway(self) -> None:
        if self.gateway is not None and not self._closed:
            self.gateway.stop()
            self.gateway = None

    def wait_all_ready(self, timeout: float = 30.0) -> float:
        """Until every backend is ready at full ramp; returns the seconds waited."""
        assert self.gateway is not None
        gw = self.gateway
        t0 = time.monotonic()

        def ready() -> bool:
            bs = gw.backends()
            return all(b["state"] == "ready" and b.get("ramp", 1.0) >= 1.0 for b in bs.values())

        wait_until(ready, timeout, what="all backends ready")
        return time.monotonic() - t0


def wait_until(
    cond: Callable[[], Any], timeout: float, interval: float = 0.1, what: str = ""
) -> Any:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            v = cond()
            if v:
                return v
        except Exception as e:
            last = e
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}: {last}")


def _retry(fn: Callable[[], Any], what: str, timeout: float = 10.0) -> None:
    wait_until(lambda: fn() or True, timeout, 0.1, what)
