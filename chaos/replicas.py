"""Issue 17's chaos figures: three gateway replicas sharing one Redis, and Redis failing.

    .venv/bin/python -m chaos.run --replicas [--replica-faults redis_kill,redis_stop,...]

The lab's three backends (engine + agent, each in its own namespace) behind THREE
`pulsegate serve` replicas in the root namespace (the lab's gateway config plus
`cluster.redis`, `replica_id` r0..r2), and one `redis-server` in a namespace of its own,
`pgx-redis`, wired to the lab's router like a backend:

    root ns: r0 r1 r2 (127.0.0.1:0), load --uplink-- [pgx-rtr] rds 10.200.99.1
                                                           | veth
                                         [pgx-redis] eth0 10.200.99.2: redis-server :6379

The client load is the lab's (`chaos/load.py`: open loop, half streamed, half 3-5 KB
prompts) split evenly over the three replicas (`rate` / 3 each, 50 requests/s in all).
Then, on a fresh set of replicas for each:

    redis_kill       SIGKILL redis-server        lift: a new, empty one on the same address
    redis_stop       SIGSTOP redis-server        lift: SIGCONT
    redis_partition  every packet to and from Redis dropped in the router (chain FR on
                     `rds`, as the lab's network faults on a backend's `b<i>`)
                                                 lift: the chain flushed

held 10 s, then watched until every replica is together again. Measured: client errors
(all requests sent from the fault to the end), each replica's time to `alone`
(`GET /admin/cluster` polled every 50 ms, so +- 50 ms), time from the lift to together
(seeing all three), and flaps: any backend leaving rotation on any replica (a transition out
of rotation; a score dip to `degraded`, still routable, is counted apart). Redis, its
namespace and its rule chain live in `pgx*` names, so `chaos.cleanup` removes whatever a
killed run left.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from chaos import netlab
from chaos.lab import Lab, gateway_config, wait_until
from chaos.load import Load, Result
from chaos.measure import percentile
from chaos.procs import Gateway

NS = f"{netlab.PREFIX}-redis"
IFACE = "rds"  # the router's side
CHAIN = "FR"
RTR_IP, REDIS_IP = "10.200.99.1", "10.200.99.2"
PORT = 6379
REPLICAS = 3
POLL_S = 0.05
HOLD_S = 10.0
TOGETHER_MAX_S = 20.0


@dataclass(frozen=True)
class Settings:
    rate: float = 50.0  # all replicas together
    pre: float = 2.0
    hold: float = HOLD_S
    post: float = 2.0  # load kept on after the replicas are together again
    timeout: float = 10.0
    raw_dir: Path | None = None


class Redis:
    """`redis-server` in its own namespace behind the lab's router; killed by its PID."""

    def __init__(self, logdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise netlab.LabError("redis-server is not installed (apt-get install redis-server)")
        self.binary = binary
        self.log = logdir / "redis.log"
        self.popen: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{REDIS_IP}:{PORT}/0"

    def build(self) -> None:
        """The namespace, its veth to the router, the root route and the fault chain."""
        netlab.sh("ip", "netns", "add", NS)
        netlab.sh("ip", "-n", netlab.RTR, "link", "add", IFACE, "type", "veth", "peer", "name",
                  "eth0", "netns", NS)  # fmt: skip
        netlab.sh("ip", "-n", netlab.RTR, "addr", "add", f"{RTR_IP}/30", "dev", IFACE)
        netlab.sh("ip", "-n", netlab.RTR, "link", "set", "dev", IFACE, "up")
        netlab.sh("ip", "-n", NS, "link", "set", "dev", "lo", "up")
        netlab.sh("ip", "-n", NS, "addr", "add", f"{REDIS_IP}/30", "dev", "eth0")
        netlab.sh("ip", "-n", NS, "link", "set", "dev", "eth0", "up")
        netlab.sh("ip", "-n", NS, "route", "add", "default", "via", RTR_IP)
        # Inside the lab's 10.200.0.0/16 blackhole guard; gone with the uplink at cleanup.
        netlab.sh("ip", "route", "replace", "10.200.99.0/30", "via", netlab.UPLINK_RTR_IP,
                  "dev", netlab.ROOT_LINK)  # fmt: skip
        netlab.iptables(netlab.RTR, "-N", CHAIN)
        netlab.iptables(netlab.RTR, "-A", "FORWARD", "-o", IFACE, "-j", CHAIN)
        netlab.iptables(netlab.RTR, "-A", "FORWARD", "-i", IFACE, "-j", CHAIN)

    def start(self) -> None:
        args = [self.binary, "--port", str(PORT), "--bind", REDIS_IP, "--save", "",
                "--appendonly", "no", "--protected-mode", "no"]  # fmt: skip
        # `ip netns exec` execs: the PID is redis-server's own.
        self.popen = subprocess.Popen(
            ["ip", "netns", "exec", NS, *args],
            stdout=open(self.log, "ab"),  # noqa: SIM115 - the child owns it
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_until(self._pong, 10.0, 0.02, "redis-server answers PING")

    def _pong(self) -> bool:
        with socket.create_connection((REDIS_IP, PORT), timeout=0.5) as c:
            c.sendall(b"PING\r\n")
            return c.recv(16).startswith(b"+PONG")

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(sig)

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGCONT)
            self.popen.kill()
            self.popen.wait(timeout=5)

    def repair(self) -> None:
        """Rules flushed, the process continued, or a new one when it is gone."""
        netlab.iptables(netlab.RTR, "-F", CHAIN)
        if self.popen is None or self.popen.poll() is not None:
            self.start()
        else:
            self.signal(signal.SIGCONT)
        wait_until(self._pong, 10.0, 0.05, "redis-server answers PING")


@dataclass(frozen=True)
class RedisFault:
    key: str
    title: str
    inject: Callable[[Redis], None]
    lift: Callable[[Redis], None]


def _cut(r: Redis) -> None:
    netlab.iptables(netlab.RTR, "-A", CHAIN, "-j", "DROP")


def _mend(r: Redis) -> None:
    netlab.iptables(netlab.RTR, "-F", CHAIN)


FAULTS = (
    RedisFault("redis_kill", "Redis SIGKILLed (lift: restarted empty)",
               lambda r: r.signal(signal.SIGKILL), lambda r: r.start()),
    RedisFault("redis_stop", "Redis SIGSTOPped (lift: SIGCONT)",
               lambda r: r.signal(signal.SIGSTOP), lambda r: r.signal(signal.SIGCONT)),
    RedisFault("redis_partition", "Redis cut off: every packet dropped in the router",
               _cut, _mend),
)  # fmt: skip
BY_KEY = {f.key: f for f in FAULTS}


def _cluster(gw: Gateway) -> dict[str, Any]:
    r = httpx.get(f"{gw.url}/admin/cluster", timeout=2)
    r.raise_for_status()
    return r.json()  # type: ignore[no-any-return]


def _together(gws: list[Gateway]) -> bool:
    docs = [_cluster(g) for g in gws]
    return all(not d["alone"] and len(d["replicas"]) == len(gws) for d in docs)


def _all_ready(gws: list[Gateway]) -> bool:
    return all(
        b["state"] == "ready" and b.get("ramp", 1.0) >= 1.0
        for g in gws
        for b in g.backends().values()
    )


class Poller:
    """Each replica's `alone` every POLL_S s, with the wall time of the answer."""

    def __init__(self, gws: list[Gateway]) -> None:
        self.gws = gws
        self.samples: list[tuple[float, str, bool, int]] = []  # (t, replica, alone, replicas)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=1.0) as c:
            while not self._stop.is_set():
                for i, g in enumerate(self.gws):
                    with contextlib.suppress(httpx.HTTPError, ValueError):
                        d = (await c.get(f"{g.url}/admin/cluster")).json()
                        self.samples.append((time.time(), f"r{i}", d["alone"], len(d["replicas"])))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), POLL_S)

    def first(self, replica: str, since: float, alone: bool) -> float | None:
        """The first sample at or after `since` with `alone` (and, together, all 3 seen)."""
        for t, r, a, n in self.samples:
            if r == replica and t >= since and a == alone and (alone or n == len(self.gws)):
                return t
        return None


def _start_replicas(lab: Lab, redis: Redis, tag: str) -> list[Gateway]:
    """r0..r2 started side by side; if one fails, the others are stopped."""

    def one(i: int) -> Gateway:
        cfg = gateway_config(lab.nodes, "pulsegate")
        cfg["cluster"] = {"redis": redis.url, "replica_id": f"r{i}"}
        return Gateway(lab.logdir, cfg, f"{tag}-r{i}")

    with ThreadPoolExecutor(REPLICAS) as ex:
        futures = [ex.submit(one, i) for i in range(REPLICAS)]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for f in futures:
            if f.exception() is None:
                f.result().stop()
        raise failed[0]  # type: ignore[misc]
    return [f.result() for f in futures]


async def run(lab: Lab, redis: Redis, fault: RedisFault, s: Settings, seed: int) -> dict[str, Any]:
    """One Redis fault under three fresh replicas; returns its figures."""
    gws: list[Gateway] = []
    try:
        gws = await asyncio.to_thread(_start_replicas, lab, redis, fault.key)
        t_up = time.monotonic()
        await asyncio.to_thread(wait_until, lambda: _together(gws), 20.0, 0.1, "together")
        await asyncio.to_thread(wait_until, lambda: _all_ready(gws), 40.0, 0.1, "all ready")
        ready_s = time.monotonic() - t_up
        loads = [Load(g.url, rate=s.rate / len(gws), timeout=s.timeout, seed=seed * 10 + i)
                 for i, g in enumerate(gws)]  # fmt: skip
        for ld in loads:
            ld.start()
        poller = Poller(gws)
        poller.start()
        await asyncio.sleep(s.pre)
        owners_before = (await asyncio.to_thread(_cluster, gws[0]))["probes"]
        t_fault = time.time()
        await asyncio.to_thread(fault.inject, redis)
        await asyncio.sleep(max(0.0, t_fault + s.hold - time.time()))
        t_lift = time.time()
        await asyncio.to_thread(fault.lift, redis)
        t_lifted = time.time()
        together_s: float | None = None
        with contextlib.suppress(TimeoutError):
            await asyncio.to_thread(
                wait_until, lambda: _together(gws), TOGETHER_MAX_S, POLL_S, "together again"
            )
            together_s = time.time() - t_lift
        await asyncio.sleep(s.post)
        owners_after = (await asyncio.to_thread(_cluster, gws[0]))["probes"]
        results = [r for ld in loads for r in await ld.stop()]
        await poller.stop()
        t_end = time.time()
        events = [
            {**e, "replica": f"r{i}"}
            for i, g in enumerate(gws)
            for e in await asyncio.to_thread(g.events)
        ]
        figures = summarize(results, events, poller, t_fault, t_lift, t_end, len(gws))
        if s.raw_dir is not None:
            s.raw_dir.mkdir(parents=True, exist_ok=True)
            raw = {"t_fault": t_fault, "t_lift": t_lift, "events": events,
                   "cluster": poller.samples, "requests": [r.row() for r in results]}  # fmt: skip
            (s.raw_dir / f"{fault.key}-replicas.json").write_text(json.dumps(raw))
        return {
            "fault": fault.key,
            "title": fault.title,
            "ok": True,
            "replicas": len(gws),
            "ready_wait_s": round(ready_s, 2),
            "hold_s": round(t_lift - t_fault, 2),
            "lift_cmd_s": round(t_lifted - t_lift, 4),
            "together_after_lift_s": None if together_s is None else round(together_s, 3),
            "probe_owners_before": owners_before,
            "probe_owners_after": owners_after,
            "t_fault": t_fault,
            "t_lift": t_lift,
            **figures,
        }
    except Exception as e:  # one broken scenario must not lose the others' figures
        why = " ".join(str(e).split())[-300:]  # one line for the table (a log tail)
        return {"fault": fault.key, "title": fault.title, "ok": False,
                "error": f"{type(e).__name__}: {why}"}  # fmt: skip
    finally:
        await asyncio.gather(*(asyncio.to_thread(g.stop) for g in gws), return_exceptions=True)
        await asyncio.to_thread(redis.repair)


def summarize(
    results: list[Result],
    events: list[dict[str, Any]],
    poller: Poller,
    t_fault: float,
    t_lift: float,
    t_end: float,
    n: int,
) -> dict[str, Any]:
    """Client errors, time to alone and back, and flaps, over the three replicas."""
    since = [r for r in results if r.t0 >= t_fault]
    errs = [r for r in since if not r.ok]
    kinds: dict[str, int] = {}
    for r in errs:
        kinds[r.error] = kinds.get(r.error, 0) + 1
    alone: dict[str, float | None] = {}
    back: dict[str, float | None] = {}
    for i in range(n):
        a = poller.first(f"r{i}", t_fault, alone=True)
        alone[f"r{i}"] = None if a is None else round(a - t_fault, 3)
        b = poller.first(f"r{i}", t_lift, alone=False)
        back[f"r{i}"] = None if b is None else round(b - t_lift, 3)
    moves = [e for e in events if e.get("kind") == "transition" and e.get("ts", 0) >= t_fault - 1]
    flaps = [
        {"replica": e["replica"], "backend": e["backend"], "to": e["to"], "reason": e.get("reason")}
        for e in moves
        # A backend's first readiness (from cold, a replica just started) is not a flap.
        if e["to"] != "degraded" and e.get("cause") != "cleared" and e.get("from") != "cold"
    ]
    lat = [r.latency for r in since]
    known = [v for v in alone.values() if v is not None]
    mended = [v for v in back.values() if v is not None]
    return {
        "requests_total": len(results),
        "requests_since_fault": len(since),
        "client_errors": len(errs),
        "error_kinds": kinds,
        "errors_before_fault": sum(1 for r in results if r.t0 < t_fault and not r.ok),
        "p99_since_fault_s": percentile(lat, 99) if lat else None,
        "time_to_alone_s": alone,
        "time_to_alone_max_s": max(known) if len(known) == n else None,
        "together_after_lift_per_replica_s": back,
        # From the samples (each stamped at its answer), not from the wait: that one's sync
        # calls share this loaded process with the load client and run late.
        "together_after_lift_max_s": max(mended) if len(mended) == n else None,
        "flaps": flaps,
        "degraded_dips": sum(1 for e in moves if e["to"] == "degraded"),
        "answered_by": _counts(r.backend for r in since if r.ok),
    }


def _counts(names: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in names:
        out[x] = out.get(x, 0) + 1
    return dict(sorted(out.items()))


async def run_all(lab: Lab, keys: list[str], s: Settings) -> list[dict[str, Any]]:
    """Redis in its namespace, then every fault in `keys` in turn; prints one line each."""
    redis = Redis(lab.logdir)
    await asyncio.to_thread(redis.build)
    await asyncio.to_thread(redis.start)
    runs: list[dict[str, Any]] = []
    try:
        for n, key in enumerate(keys, 1):
            print(f"[{n}/{len(keys)}] {key} / 3 replicas ...", end=" ", flush=True)
            r = await run(lab, redis, BY_KEY[key], s, seed=100 + n)
            runs.append(r)
            print(one_line(r), flush=True)
    finally:
        await asyncio.to_thread(redis.kill)
    return runs


def one_line(r: dict[str, Any]) -> str:
    if not r.get("ok"):
        return f"FAILED: {r.get('error')}"
    alone = r["time_to_alone_max_s"]
    back = r["together_after_lift_max_s"]
    return (
        f"errors {r['client_errors']}/{r['requests_since_fault']}, "
        f"alone within {'-' if alone is None else f'{alone * 1000:.0f} ms'} (max of 3), "
        f"together {'-' if back is None else f'{back * 1000:.0f} ms'} after lift (last of 3), "
        f"flaps {len(r['flaps'])}, degraded dips {r['degraded_dips']}"
    )
