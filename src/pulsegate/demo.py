"""`pulsegate demo`: a whole fleet on loopback with nothing to configure.

Starts three simulated engines in two zones (each with its heartbeat agent when the agent
is available), the gateway in front of them, light traffic through the official endpoint,
and a fault cycle: one engine is broken after a while and mended later, so you can watch
the gateway route around it. Prints the URLs and one line per backend state change.
Ctrl-C (or --duration) stops every child process by its PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import yaml

from pulsegate.announce import LISTENING, host_port, read_until

# The fault cycle, in order: (backend, POST /sim/fault body, words for the operator).
FAULTS: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("east-b", {"mode": "error", "rate": 1.0}, "every request answers 500"),
    ("west-a", {"mode": "cuda_hang"}, "CUDA hang: /health stays 200, inference hangs"),
    ("east-a", {"mode": "slow", "factor": 3.0}, "3x slower (should be down-weighted, not ejected)"),
    ("east-b", {"mode": "blackhole", "over_bytes": 1024}, "drops requests over 1 KB (bad optic)"),
)

ENGINES = (
    ("east-a", "east-1a", "east"),
    ("east-b", "east-1b", "east"),
    ("west-a", "west-1a", "west"),
)


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    url: str = ""


@dataclass
class Demo:
    port: int
    duration: float | None
    fault_after: float
    fault_hold: float
    children: list[Child] = field(default_factory=list)
    tmp: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="pulsegate-demo-"))

    def spawn(self, name: str, args: list[str]) -> Child:
        log = open(os.path.join(self.tmp, f"{name}.log"), "wb")  # noqa: SIM115 - owned by child
        popen = subprocess.Popen(
            [sys.executable, "-m", "pulsegate", *args],
            stdout=subprocess.PIPE,
            stderr=log,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,  # Ctrl-C reaches us, and we stop children in order
        )
        child = Child(name, popen)
        self.children.append(child)
        child.url = self._address(child)
        return child

    def _address(self, child: Child, timeout: float = 30.0) -> str:
        assert child.popen.stdout is not None
        m, _ = read_until(child.popen.stdout, LISTENING, timeout)
        if m:
            host, port = host_port(m)
            return f"http://{host}:{port}"
        raise RuntimeError(f"{child.name} did not start; see {self.tmp}/{child.name}.log")

    def stop_all(self) -> None:
        for child in reversed(self.children):
            if child.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.popen.send_signal(signal.SIGTERM)
        for child in reversed(self.children):
            try:
                child.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.popen.kill()
                child.popen.wait(timeout=5)
            if child.popen.stdout:
                child.popen.stdout.close()


def _agent_available() -> bool:
    try:
        import pulsegate.agent.server  # noqa: F401
    except Exception:
        return False
    return True


def _config(demo: Demo, sims: list[Child], agents: dict[str, str]) -> dict[str, Any]:
    backends = []
    for child, (_, zone, region) in zip(sims, ENGINES, strict=True):
        b: dict[str, Any] = {
            "name": child.name,
            "url": child.url,
            "models": ["demo-7b"],
            "zone": zone,
            "region": region,
            "metrics_path": "/metrics",
        }
        if child.name in agents:
            b["agent"] = agents[child.name]
        backends.append(b)
    return {
        "gateway": {"listen": f"127.0.0.1:{demo.port}"},
        "backends": backends,
        "probes": {
            "readiness": {"interval": "2s", "interval_unstable": "500ms"},
            "micro_inference": {"interval": "2s", "jitter": "1s", "timeout": "1s"},
            "canary": {"interval": "1s", "timeout": "350ms"},
        },
        "health": {"probation": {"duration": "10s", "ramp_step": 0.05}, "ejection_base": "3s"},
        "routing": {"prefer_region": "east"},
        "retry": {"per_try_timeout": "1s", "per_token_timeout": "50ms"},
    }


async def _traffic(gw_url: str, stop: asyncio.Event, stats: dict[str, int]) -> None:
    """About 8 requests/s, mixed streaming and not, like a light production load."""
    async with aiohttp.ClientSession() as s:
        i = 0
        while not stop.is_set():
            i += 1
            body = {
                "model": "demo-7b",
                "messages": [{"role": "user", "content": f"demo question {i % 50}"}],
                "max_tokens": 16,
                "stream": i % 3 == 0,
            }
            try:
                async with s.post(
                    f"{gw_url}/v1/chat/completions",
                    json=body,
                    timeout=aiohttp.ClientTimeout(total=15),
                ) as r:
                    data = await r.read()
                    if r.status == 200 and b'"error"' in data[-400:]:
                        _failed(stats, f"stream ended with an error: {data[-300:]!r}")
                    elif r.status != 200:
                        _failed(stats, f"HTTP {r.status}: {data[:300]!r}")
                    else:
                        stats["ok"] += 1
                    backend = r.headers.get("x-pulsegate-backend", "?")
                    stats[f"via:{backend}"] = stats.get(f"via:{backend}", 0) + 1
            except (aiohttp.ClientError, TimeoutError) as e:
                _failed(stats, f"client error: {type(e).__name__}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.12)


async def _wait_ready(gw_url: str, stop: asyncio.Event) -> None:
    """Traffic starts once a backend is ready (before that the gateway rightly says 503)."""
    async with aiohttp.ClientSession() as s:
        for _ in range(300):  # 30 s at most
            try:
                async with s.get(f"{gw_url}/admin/backends") as r:
                    if any(b["state"] == "ready" for b in (await r.json())["backends"]):
                        return
            except (aiohttp.ClientError, TimeoutError, ValueError):
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)
                return


def _failed(stats: dict[str, int], why: str) -> None:
    stats["failed"] += 1
    print(f"!!! a client request failed: {why}", flush=True)


async def _events(gw_url: str, stop: asyncio.Event) -> None:
    """Print one line per backend state change, as the gateway reports it."""
    seen = 0
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            try:
                async with s.get(f"{gw_url}/admin/events?since={seen}") as r:
                    for ev in (await r.json())["events"]:
                        seen = max(seen, ev["id"])
                        stamp = time.strftime("%H:%M:%S", time.localtime(ev["ts"]))
                        print(
                            f"{stamp}  {ev['backend']:<8} {ev['from']:>9} -> {ev['to']:<9} "
                            f"{ev['reason']}",
                            flush=True,
                        )
            except (aiohttp.ClientError, TimeoutError, ValueError):
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)


async def _faults(demo: Demo, sims: dict[str, Child], stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as s:
        k = 0
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), demo.fault_after)
                return
            name, fault, words = FAULTS[k % len(FAULTS)]
            k += 1
            print(f"--- injecting fault into {name}: {words}", flush=True)
            await s.post(f"{sims[name].url}/sim/fault", json=fault)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), demo.fault_hold)
            print(f"--- lifting the fault on {name}", flush=True)
            with contextlib.suppress(aiohttp.ClientError):
                await s.post(f"{sims[name].url}/sim/fault", json={"mode": "none"})


async def _run(demo: Demo, gw_url: str, sims: dict[str, Child]) -> dict[str, int]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stats = {"ok": 0, "failed": 0}
    await _wait_ready(gw_url, stop)
    tasks = [
        asyncio.create_task(_traffic(gw_url, stop, stats)),
        asyncio.create_task(_events(gw_url, stop)),
        asyncio.create_task(_faults(demo, sims, stop)),
    ]
    if demo.duration is not None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), demo.duration)
        stop.set()
    else:
        await stop.wait()
    await asyncio.gather(*tasks, return_exceptions=True)
    return stats


def run_demo(port: int = 8080, duration: float | None = None, fault_after: float = 15.0,
             fault_hold: float = 15.0, agents: bool = True) -> int:  # fmt: skip
    demo = Demo(port, duration, fault_after, fault_hold)
    try:
        sims = [
            demo.spawn(name, ["sim", "--port", "0", "--name", name, "--ttft-ms", "40"])
            for name, _, _ in ENGINES
        ]
        agent_urls: dict[str, str] = {}
        if agents and _agent_available():
            for sim in sims:
                agent = demo.spawn(
                    f"agent-{sim.name}",
                    ["agent", "--engine", sim.url, "--listen", "127.0.0.1:0", "--gpu", "engine"],
                )
                agent_urls[sim.name] = agent.url.removeprefix("http://")
        cfg_path = os.path.join(demo.tmp, "gateway.yaml")
        with open(cfg_path, "w") as f:
            yaml.safe_dump(_config(demo, sims, agent_urls), f)
        gw = demo.spawn("gateway", ["serve", "-c", cfg_path])
        print(f"pulsegate demo: gateway  {gw.url}/v1  (OpenAI-compatible)", flush=True)
        print(f"                dashboard {gw.url}/dashboard", flush=True)
        print(f"                status    pulsegate status --url {gw.url}", flush=True)
        for sim in sims:
            extra = f", agent {agent_urls[sim.name]}" if sim.name in agent_urls else ""
            print(f"                engine   {sim.name:<7} {sim.url}{extra}", flush=True)
        print(f"                logs      {demo.tmp}   (Ctrl-C stops everything)", flush=True)
        stats = asyncio.run(_run(demo, gw.url, {c.name: c for c in sims}))
        print(f"pulsegate demo: {stats['ok']} requests ok, {stats['failed']} failed", flush=True)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        demo.stop_all()
