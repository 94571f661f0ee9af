"""`pulsegate demo --replicas 3`: the demo fleet behind three gateway replicas sharing one Redis.

The same simulated engines, agents and fault cycle as `pulsegate demo` (`demo.py`), with a
`redis-server` (found on PATH) and N `pulsegate serve` replicas on N ports (`--port`,
`--port`+1, ...; 0: any free ports), each with `cluster.redis` pointing at it
(docs/replicas.md). Light traffic goes to every replica. Printed, per replica: its state
changes (a peer's ejection reads "ejected by operator: replica r1 saw ..."), the news it
heard from its peers that mattered (an ejection, a drain, a failed probe; from
`GET /admin/cluster`, `recent`), when it works alone or together, and at the end what it
served and heard. Ctrl-C (or --duration) stops every child process by its PID, Redis last.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from typing import Any

import aiohttp
import yaml

from pulsegate import demo as base

POLL_S = 0.5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_redis(demo: base.Demo, binary: str) -> str:
    """redis-server on a free loopback port, no persistence; the first child (stopped last)."""
    port = _free_port()
    log = open(os.path.join(demo.tmp, "redis.log"), "wb")  # noqa: SIM115 - owned by child
    popen = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    demo.children.append(base.Child("redis", popen, f"redis://127.0.0.1:{port}/0"))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and popen.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as c:
            c.sendall(b"PING\r\n")
            if c.recv(16).startswith(b"+PONG"):
                return f"redis://127.0.0.1:{port}/0"
        time.sleep(0.05)
    raise RuntimeError(f"redis-server did not start; see {demo.tmp}/redis.log")


def _say(rid: str, text: str, ts: float | None = None) -> None:
    stamp = time.strftime("%H:%M:%S", time.localtime(ts if ts is not None else time.time()))
    print(f"{stamp}  [{rid}] {text}", flush=True)


def _news(m: dict[str, Any], probes: dict[tuple[str, str, str], bool]) -> str | None:
    """A peer's message worth a line: an ejection, a drain, or a probe that starts failing or
    passes again (`probes`: the last outcome per peer, backend and probe kind)."""
    f = m.get("fields") or {}
    what = ""
    if m["message"] == "probe":
        key, ok = (m["replica"], m["backend"], str(f.get("kind"))), bool(f.get("ok", True))
        if probes.get(key, True) == ok:
            probes[key] = ok
            return None
        probes[key] = ok
        what = f"{key[2]} passes again" if ok else f"{key[2]} failed: {f.get('reason', '')}"
    if m["message"] == "eject":
        what = f"ejected ({f.get('cause', '')}: {f.get('reason', '')})"
    what = what or m["message"]
    folded = "folded" if m.get("folded") else "already known"
    return f"heard from {m['replica']}: {m['backend']} {what} ({m['delay_ms']:.1f} ms, {folded})"


async def _watch(rid: str, url: str, stop: asyncio.Event, seen: dict[str, Any]) -> None:
    """This replica's state changes, its peers' news and its alone/together, as lines."""
    last_event, heard, shown = 0, 0, None
    probes: dict[tuple[str, str, str], bool] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
        while not stop.is_set():
            try:
                async with s.get(f"{url}/admin/events?since={last_event}") as r:
                    for ev in (await r.json())["events"]:
                        last_event = max(last_event, ev["id"])
                        _say(rid, f"{ev['backend']:<8} {ev['from']:>9} -> {ev['to']:<9} "
                                  f"{ev['reason']}", ev["ts"])  # fmt: skip
                async with s.get(f"{url}/admin/cluster") as r:
                    doc = await r.json()
                peers = ", ".join(p["id"] for p in doc["replicas"])
                if (doc["alone"], peers) != shown:
                    shown = (doc["alone"], peers)
                    _say(rid, "alone: probing every backend, full limits" if doc["alone"]
                         else f"together with {peers}; probes {doc['probes']}")  # fmt: skip
                received = doc["messages"]["received"]
                fresh = doc["recent"][: max(0, received - heard)]  # `recent`: newest first
                heard = received
                for m in reversed(fresh):
                    line = _news(m, probes)
                    if line:
                        _say(rid, line, m["at"])
                seen.update(doc)
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), POLL_S)


async def _run(demo: base.Demo, urls: dict[str, str], sims: dict[str, base.Child]) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    for url in urls.values():
        await base._wait_ready(url, stop)
    stats = {rid: {"ok": 0, "failed": 0} for rid in urls}
    seen: dict[str, dict[str, Any]] = {rid: {} for rid in urls}
    tasks = [asyncio.create_task(base._traffic(u, stop, stats[r])) for r, u in urls.items()]
    tasks += [asyncio.create_task(_watch(r, u, stop, seen[r])) for r, u in urls.items()]
    tasks.append(asyncio.create_task(base._faults(demo, sims, stop)))
    if demo.duration is not None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), demo.duration)
        stop.set()
    else:
        await stop.wait()
    await asyncio.gather(*tasks, return_exceptions=True)
    for rid in urls:
        st, doc = stats[rid], seen[rid]
        prop, msgs = doc.get("propagation") or {}, doc.get("messages") or {}
        p50, p99 = prop.get("p50_ms", "-"), prop.get("p99_ms", "-")
        print(f"pulsegate demo: [{rid}] {st['ok']} requests ok, {st['failed']} failed; heard "
              f"{msgs.get('received', 0)} peer messages (publish -> folded p50 {p50} ms, "
              f"p99 {p99} ms)", flush=True)  # fmt: skip
    ok = sum(s["ok"] for s in stats.values())
    failed = sum(s["failed"] for s in stats.values())
    print(f"pulsegate demo: {ok} requests ok, {failed} failed", flush=True)
    return 0


def run_replicas_demo(
    port: int = 8080,
    duration: float | None = None,
    fault_after: float = 15.0,
    fault_hold: float = 15.0,
    agents: bool = True,
    replicas: int = 3,
) -> int:
    binary = shutil.which("redis-server")
    if binary is None:
        print("pulsegate demo --replicas: redis-server is not on PATH "
              "(apt-get install redis-server, or brew install redis)", flush=True)  # fmt: skip
        return 2
    demo = base.Demo(port, duration, fault_after, fault_hold)
    try:
        redis_url = _start_redis(demo, binary)
        sims = [
            demo.spawn(name, ["sim", "--port", "0", "--name", name, "--ttft-ms", "40"])
            for name, _, _ in base.ENGINES
        ]
        agent_urls: dict[str, str] = {}
        if agents and base._agent_available():
            for sim in sims:
                agent = demo.spawn(
                    f"agent-{sim.name}",
                    ["agent", "--engine", sim.url, "--listen", "127.0.0.1:0", "--gpu", "engine"],
                )
                agent_urls[sim.name] = agent.url.removeprefix("http://")
        urls: dict[str, str] = {}
        for i in range(replicas):
            rid = f"r{i}"
            cfg = base._config(demo, sims, agent_urls)
            cfg["gateway"]["listen"] = f"127.0.0.1:{port + i if port else 0}"
            cfg["cluster"] = {"redis": redis_url, "replica_id": rid}
            path = os.path.join(demo.tmp, f"gateway-{rid}.yaml")
            with open(path, "w") as f:
                yaml.safe_dump(cfg, f)
            urls[rid] = demo.spawn(f"gateway-{rid}", ["serve", "-c", path]).url
        print(f"pulsegate demo: {replicas} gateway replicas sharing {redis_url}", flush=True)
        for rid, url in urls.items():
            print(f"                [{rid}] {url}/v1   dashboard {url}/dashboard   "
                  f"cluster {url}/admin/cluster", flush=True)  # fmt: skip
        for sim in sims:
            extra = f", agent {agent_urls[sim.name]}" if sim.name in agent_urls else ""
            print(f"                engine   {sim.name:<7} {sim.url}{extra}", flush=True)
        print(f"                logs      {demo.tmp}   (Ctrl-C stops everything)", flush=True)
        return asyncio.run(_run(demo, urls, {c.name: c for c in sims}))
    except KeyboardInterrupt:
        return 0
    finally:
        demo.stop_all()
