"""Issue 17's figures: three gateway replicas sharing one Redis (docs/replicas.md).

    .venv/bin/python bench/replicas.py [--rounds 8] [--json bench/results/replicas.json]

counter    the cost a fleet-wide max_inflight would add per request with an atomic counter:
           INCR (before the pick: on the request's path) and INCR + DECR round trips to a
           loopback redis-server from redis-py's asyncio client (hiredis), 5,000 requests
           one at a time, p50/p99.
fleet      one redis-server, 3 sims, 3 `pulsegate serve` replicas (the tests' fast probes,
           quick ejection backoff), loopback.
  eject    `--rounds` times: one sim fails every inference (`error` fault, rate 1); for each
           round the spread of the three replicas' ejection timestamps (their event logs,
           ms) - the first replica is the one whose own probe failed, the others eject on its
           shared result; then the fault clears and the backend returns on all three.
           Also the publish -> folded delay of each round's first failing probe result on
           the replicas that did not run it, and of every message (each replica's
           /admin/cluster, since start).
channel    publish -> delivered through the store's own listener, two clients in this
           process, 2,000 messages: the channel's share of that delay.
  probes   inference probes reaching each sim over 10 s with 3 replicas, then with one (the
           other two stopped: the survivor owns every backend), each once every backend is
           ready and probed at the stable cadence on every replica.
  sessions 30 sessions x 20 requests, round robin over the 3 replicas: the share of each
           session's requests on its most used backend.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from pulsegate.replicas.store import RedisStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from replicas.redis_server import RedisServer, free_port
from support import Gateway, Proc, Sim, backend_entry, fast_probes, wait_until

MODEL = "demo-7b"


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s), max(1, math.ceil(p * len(s)))) - 1]  # nearest rank


async def counter_cost(url: str, n: int = 5000) -> dict[str, float]:
    c = aioredis.Redis.from_url(url)
    try:
        for _ in range(200):  # warm the connection and the parser
            await c.incr("bench:inflight")
            await c.decr("bench:inflight")
        both: list[float] = []
        incr: list[float] = []
        for _ in range(n):
            t0 = time.perf_counter()
            await c.incr("bench:inflight")
            t1 = time.perf_counter()
            await c.decr("bench:inflight")
            both.append(time.perf_counter() - t0)
            incr.append(t1 - t0)
    finally:
        await c.aclose()
    return {
        "incr_decr_p50_ms": round(pct(both, 0.5) * 1e3, 3),
        "incr_decr_p99_ms": round(pct(both, 0.99) * 1e3, 3),
        "incr_p50_ms": round(pct(incr, 0.5) * 1e3, 3),
        "incr_p99_ms": round(pct(incr, 0.99) * 1e3, 3),
        "n": n,
    }


async def channel_cost(url: str, n: int = 2000) -> dict[str, float]:
    """Publish -> delivered through two `RedisStore`s in this one process: the channel's own
    share of the propagation delay, without the gateways' scheduling."""
    pub, sub = RedisStore(url), RedisStore(url)
    delays: list[float] = []
    task = asyncio.create_task(
        sub.listen("bench:ch", lambda d: delays.append(time.time() - float(d)))
    )
    try:
        for _ in range(250):
            if sub.subscribed:
                break
            await asyncio.sleep(0.02)
        for _ in range(n):
            await pub.publish("bench:ch", str(time.time()).encode())
            await asyncio.sleep(0.002)
        for _ in range(100):
            if len(delays) >= n:
                break
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await pub.close()
        await sub.close()
    return {
        "p50_ms": round(pct(delays, 0.5) * 1e3, 3),
        "p99_ms": round(pct(delays, 0.99) * 1e3, 3),
        "n": len(delays),
    }


def cluster(gw: Gateway) -> dict[str, Any]:
    return httpx.get(f"{gw.url}/admin/cluster", timeout=5).json()  # type: ignore[no-any-return]


def state(gw: Gateway, name: str) -> str:
    return str(gw.backends()[name]["state"])


def eject_rounds(sims: list[Sim], gws: list[Gateway], rounds: int) -> dict[str, Any]:
    spreads: list[float] = []
    failing: list[float] = []
    for i in range(rounds):
        sim = sims[i % len(sims)]
        marks = [max((e["id"] for e in g.events()), default=0) for g in gws]
        started = time.time()
        sim.fault("error", rate=1.0)
        try:
            wait_until(lambda s=sim: all(state(g, s.name) == "ejected" for g in gws), timeout=15)
        finally:
            sim.fault("none")
        ts = []
        for g, m in zip(gws, marks, strict=True):
            ev = [
                e
                for e in g.events()
                if e["id"] > m and e["backend"] == sim.name and e["to"] == "ejected"
            ]
            ts.append(ev[0]["ts"])
        spreads.append((max(ts) - min(ts)) * 1000)
        for g in gws:  # the first failing result of this round each peer folded
            got = [
                m["delay_ms"]
                for m in cluster(g)["recent"]
                if m["backend"] == sim.name and m["message"] == "probe"
                and not m["fields"].get("ok", True) and m["at"] >= started
            ]  # fmt: skip
            if got:
                failing.append(got[-1])
        wait_until(lambda s=sim: all(state(g, s.name) == "ready" for g in gws), timeout=30)
    docs = [cluster(g)["propagation"] for g in gws]
    return {
        "rounds": rounds,
        "spread_ms": [round(s, 1) for s in spreads],
        "spread_p50_ms": statistics.median(spreads),
        "spread_max_ms": max(spreads),
        "failing_probe_delay_ms": failing,
        "messages": docs,
    }


def settled(gws: list[Gateway]) -> None:
    """Every backend ready and probed at the stable cadence on every replica (a backend
    just back from an ejection is probed 3x faster for a while: not the figure wanted)."""
    wait_until(
        lambda: all(
            b["state"] == "ready" and b["cadence"] == "stable"
            for g in gws
            for b in g.backends().values()
        ),
        timeout=120,
        interval=0.2,
        what="stable cadence everywhere",
    )


def probe_rate(sims: list[Sim], window: float) -> list[float]:
    before = [s.stats()["probe_requests_total"] for s in sims]
    t0 = time.monotonic()
    wait_until(lambda: time.monotonic() - t0 >= window, timeout=window + 5, interval=0.2)
    after = [s.stats()["probe_requests_total"] for s in sims]
    took = time.monotonic() - t0
    return [round((a - b) / took, 2) for a, b in zip(after, before, strict=True)]


def sessions(gws: list[Gateway], n: int = 30, per: int = 20) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    home = total = 0
    with httpx.Client(timeout=10) as c:
        for s in range(n):
            seen: collections.Counter[str] = collections.Counter()
            for i in range(per):
                r = c.post(
                    f"{gws[i % len(gws)].url}/v1/chat/completions",
                    json=body,
                    headers={"x-session-id": f"bench-{s}"},
                )
                if r.status_code == 200:
                    seen[r.headers["x-pulsegate-backend"]] += 1
            home += seen.most_common(1)[0][1] if seen else 0
            total += per
    return {"sessions": n, "requests": total, "home_pct": round(100 * home / total, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    redis = RedisServer(free_port(), tmp / "redis.log")
    redis.start()
    started: list[Proc] = []
    out: dict[str, Any] = {}
    try:
        out["counter"] = asyncio.run(counter_cost(redis.url))
        print("counter", out["counter"], flush=True)
        out["channel"] = asyncio.run(channel_cost(redis.url))
        print("channel", out["channel"], flush=True)
        sims = [Sim(tmp, f"s{i}") for i in range(3)]
        started += sims
        config = {
            "backends": [backend_entry(s) for s in sims],
            "probes": fast_probes(),
            "retry": {"max_attempts": 3, "budget_ratio": 1.0},
            "health": {"ejection_base": "1s", "ejection_max": "2s", "rejoin_after": 1,
                       "probation": {"duration": "1s"}},
        }  # fmt: skip
        gws = []
        for i in range(3):
            cfg = {**config, "cluster": {"redis": redis.url, "replica_id": f"r{i}"}}
            gws.append(Gateway(tmp, cfg, name=f"r{i}"))
            started.append(gws[-1])
        wait_until(lambda: all(len(cluster(g)["replicas"]) == 3 for g in gws), timeout=15)
        for g in gws:
            g.wait_all_ready()
        out["sessions"] = sessions(gws)
        print("sessions", out["sessions"], flush=True)
        out["eject"] = eject_rounds(sims, gws, args.rounds)
        print("eject", out["eject"], flush=True)
        settled(gws)
        three = probe_rate(sims, 10.0)
        for g in gws[1:]:
            g.stop()
        wait_until(lambda: len(cluster(gws[0])["replicas"]) == 1, timeout=5)
        settled(gws[:1])
        one = probe_rate(sims, 10.0)
        out["probes"] = {
            "per_sim_per_s_3": three,
            "per_sim_per_s_1": one,
            "ratio": round(sum(three) / sum(one), 3),
        }
        print("probes", out["probes"], flush=True)
    finally:
        for p in reversed(started):
            p.stop()
        redis.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
