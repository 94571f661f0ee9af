"""Issue 7's figures: session affinity, topology and capacity on the simulated fleet.

    .venv/bin/python bench/routing.py [--quick] [--json bench/results/routing.json]

Every phase starts a fresh fleet (`pulsegate sim` processes behind one `pulsegate serve`, default
probe and health settings, loopback) and drives it with an asyncio client in this process.

affinity  3 backends, sims at --ttft-ms 100 --itl-ms 5 (a prefix-cache hit: 0.3 x, 30 ms). 50 live
          chat sessions, 16 requests in flight (closed loop); a session is a conversation of
          `--turns` turns (one request at a time) with its own ~1.5 KB system prompt, and is
          replaced by a new one when it ends. Modes: no session key; `x-session-id` with the
          default affinity_epsilon 0.25 and with 1.0; no key but prefix_affinity_chars 256.
          `--rounds` (2) runs of 700 requests per mode, the modes interleaved, pooled.
          Home share: requests served by the session's rendezvous home (all backends ready),
          after the first 10% of each run. TTFT: client-side, to the first content token.
          Prefix-cache hit rate: the sims' own counters (a few probe requests included).
zones     4 backends: a, b in z1/r1 (prefer_zone z1), c in z2/r1, d in z3/r2. The same session
          load on a faster sim; `error` faults (500 to everything) on a and b, then on c too.
capacity  3 backends with max_inflight 8, c answering 500 from the start (onset included).
          Open-loop Poisson arrivals sized to 80%, 100% and 120% of the two survivors' limits
          (rate = u x 16 / service time, the service time measured for 3 s at 16 in flight
          before the fault); routing.queue_timeout 2 s (default). The gateway's
          in-flight count per backend is sampled every ~10 ms from /admin/backends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from pulsegate.balancer import Balancer, prefix_key
from pulsegate.config import RoutingConfig
from pulsegate.health.verdict import State, Verdict
from support import Gateway, Sim, backend_entry

clock = time.perf_counter
PREFIX_CHARS = 256
TTFT_MS = 100.0  # the affinity sims' time to first token on a prefix-cache miss
HIT_FACTOR = 0.3  # pulsegate.sim.server.PREFIX_HIT_TTFT
OCTAVE_EDGE = 0.5**0.5  # balancer._octave: weights under this hash as the next octave down
BACKENDS = ["a", "b", "c"]
FILLER = (
    "Answer precisely, cite the policy section you rely on, never invent order numbers, and "
    "ask one clarifying question when the request is ambiguous. "
) * 12  # ~1.5 KB: the long, per-session system prompt a prefix cache is for


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def ms(x: float) -> float:
    return round(x * 1000, 1)


# ---------------------------------------------------------------------------------- fleets


@contextlib.contextmanager
def fleet(
    entries: dict[str, dict[str, Any]], sim_args: tuple[str, ...], **sections: Any
) -> Iterator[tuple[Gateway, dict[str, Sim]]]:
    """Sims named by `entries` (their extra backend keys) behind a gateway; stopped on exit."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        sims: dict[str, Sim] = {}
        gw: Gateway | None = None
        try:
            for name in entries:
                sims[name] = Sim(tmp, name, *sim_args)
            config = {
                "backends": [backend_entry(sims[n], **extra) for n, extra in entries.items()],
                **sections,
            }
            gw = Gateway(tmp, config)
            gw.wait_all_ready(timeout=30)
            yield gw, sims
        finally:
            if gw is not None:
                gw.stop()
            for s in sims.values():
                s.stop()


def homes(names: list[str], keys: list[str]) -> dict[str, str]:
    """Each key's rendezvous home with every backend ready, by the gateway's own balancer."""
    balancer = Balancer(RoutingConfig(), random.Random(0))
    vs = [Verdict(n, State.READY, 100.0, 1.0) for n in names]
    out = {}
    for k in keys:
        v = balancer.pick(vs, {}, session_key=k)
        assert v is not None
        out[k] = v.name
    return out


def prefix_hits(sims: dict[str, Sim]) -> tuple[int, int]:
    """Prefix-cache (hits, queries) summed over the sims (probes included: a handful)."""
    hits = queries = 0
    for s in sims.values():
        for line in httpx.get(f"{s.url}/metrics", timeout=5).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += int(float(line.split()[-1]))
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += int(float(line.split()[-1]))
    return hits, queries


def metric(gw: Gateway, name: str) -> float:
    for line in httpx.get(f"{gw.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name):
            return float(line.split()[-1])
    return 0.0


# ---------------------------------------------------------------------------------- client


@dataclass(slots=True)
class Result:
    t: float  # issued, seconds since the load started
    status: int
    backend: str
    attempts: int
    ttft: float | None
    latency: float
    session: str = ""


def new_client() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=60, sock_connect=5),
    )


async def chat(
    client: aiohttp.ClientSession,
    url: str,
    messages: list[dict[str, str]],
    *,
    tokens: int,
    stream: bool,
    session: str | None = None,
    t0: float = 0.0,
) -> Result:
    """One chat request; a stream's TTFT is taken at its first non-empty content delta (the
    role chunk the engine sends first is not a token)."""
    body = {"model": "demo-7b", "messages": messages, "max_tokens": tokens, "stream": stream}
    headers = {"x-session-id": session} if session else None
    start = clock()
    ttft = None
    try:
        async with client.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            if r.status == 200 and stream:
                async for line in r.content:
                    if ttft is None and b'"content":"' in line and b'"content":""' not in line:
                        ttft = clock() - start
            else:
                await r.read()
            status = r.status
            backend = r.headers.get("x-pulsegate-backend", "")
            attempts = int(r.headers.get("x-pulsegate-attempts", "0"))
    except (aiohttp.ClientError, TimeoutError):
        status, backend, attempts = 0, "", 0
    return Result(start - t0, status, backend, attempts, ttft, clock() - start, session or "")


@dataclass
class SessionLoad:
    """`sessions` live conversations of `turns` turns, `concurrency` requests in flight; a
    finished conversation is replaced by a new one."""

    url: str
    send_key: bool
    sessions: int = 50
    concurrency: int = 16
    turns: int = 4
    tokens: int = 16
    seed: int = 1
    results: list[Result] = field(default_factory=list)
    systems: dict[str, str] = field(default_factory=dict)

    def _new(self, n: int) -> list[Any]:
        sid = f"s{n:05d}"
        self.systems[sid] = f"[session {sid}] You are the support assistant. {FILLER}"
        return [sid, 0]

    async def run(self, until: float | None = None, requests: int | None = None) -> None:
        rng = random.Random(self.seed)
        made = self.sessions
        live = [self._new(i) for i in range(self.sessions)]
        free = list(range(self.sessions))
        issued = 0
        t0 = clock()

        async def worker(client: aiohttp.ClientSession) -> None:
            nonlocal issued, made
            while (requests is None or issued < requests) and (until is None or clock() < until):
                issued += 1
                slot = free.pop(rng.randrange(len(free)))
                sid, turn = live[slot]
                messages = [{"role": "system", "content": self.systems[sid]}]
                for i in range(turn):
                    messages.append({"role": "user", "content": f"question {i} about my order"})
                    messages.append({"role": "assistant", "content": f"answer {i}"})
                messages.append({"role": "user", "content": f"question {turn} about my order"})
                r = await chat(
                    client,
                    self.url,
                    messages,
                    tokens=self.tokens,
                    stream=True,
                    session=sid if self.send_key else None,
                    t0=t0,
                )
                r.session = sid
                self.results.append(r)
                if turn + 1 >= self.turns:
                    live[slot] = self._new(made)
                    made += 1
                else:
                    live[slot][1] = turn + 1
                free.append(slot)

        async with new_client() as client:
            await asyncio.gather(*(worker(client) for _ in range(self.concurrency)))


# ---------------------------------------------------------------------------------- phases


AFFINITY_MODES: dict[str, dict[str, Any]] = {
    "none": {"key": False, "routing": {}},
    "session eps=0.25": {"key": True, "routing": {}},
    "session eps=1.0": {"key": True, "routing": {"affinity_epsilon": 1.0}},
    "prefix 256": {"key": False, "routing": {"prefix_affinity_chars": PREFIX_CHARS}},
}


@dataclass
class AffinityRun:
    results: list[Result]  # steady state: the first 10% of requests dropped
    keys: dict[str, str]  # session id -> the affinity key the gateway hashes for it
    hits: int
    queries: int
    low_weight: float  # share of weight samples with some backend below the 0.71 octave edge


def affinity_run(mode: str, requests: int, turns: int, seed: int) -> AffinityRun:
    spec = AFFINITY_MODES[mode]
    entries: dict[str, dict[str, Any]] = {n: {} for n in BACKENDS}
    with fleet(
        entries, ("--ttft-ms", f"{TTFT_MS:g}", "--itl-ms", "5"), routing=spec["routing"]
    ) as (
        gw,
        sims,
    ):
        load = SessionLoad(gw.url, send_key=spec["key"], turns=turns, seed=seed)
        h0, q0 = prefix_hits(sims)
        low_weight = asyncio.run(_with_weights(gw, load.run(requests=requests)))
        h1, q1 = prefix_hits(sims)
    if spec["routing"].get("prefix_affinity_chars"):
        # The gateway's key: a hash of the prompt's head, here the session's system prompt.
        keys = {sid: prefix_key(text, PREFIX_CHARS) or "" for sid, text in load.systems.items()}
    else:  # the session id (for "none", the home it would have had: the 1-in-3 baseline)
        keys = {sid: sid for sid in load.systems}
    steady = load.results[len(load.results) // 10 :]
    return AffinityRun(steady, keys, h1 - h0, q1 - q0, low_weight)


async def _with_weights(gw: Gateway, load: Coroutine[Any, Any, None]) -> float:
    """Run `load` while sampling effective weights every 250 ms; the share of samples in which
    some backend's weight was under 1/sqrt(2), i.e. in a lower rendezvous octave than a healthy
    peer's: those moments reshuffle part of its sessions by design."""
    task = asyncio.create_task(load)
    low = n = 0
    async with aiohttp.ClientSession() as s:
        while not task.done():
            async with s.get(f"{gw.url}/admin/backends") as r:
                weights = [b["weight"] for b in (await r.json())["backends"]]
            n += 1
            low += min(weights) < OCTAVE_EDGE
            await asyncio.wait({task}, timeout=0.25)
    await task
    return low / max(1, n)


def affinity_summary(runs: list[AffinityRun]) -> dict[str, Any]:
    """Pooled over rounds; `ttft_p50_by_round_ms` shows the spread between them."""
    ok = [r for run in runs for r in run.results if r.status == 200]
    at_home = 0
    per_session: dict[str, set[str]] = {}
    for i, run in enumerate(runs):
        home = homes(BACKENDS, sorted(set(run.keys.values())))
        for r in run.results:
            if r.status == 200:
                at_home += r.backend == home[run.keys[r.session]]
                per_session.setdefault(f"{i}/{r.session}", set()).add(r.backend)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    hit_rate = sum(run.hits for run in runs) / max(1, sum(run.queries for run in runs))
    return {
        "requests": sum(len(run.results) for run in runs),
        "errors": sum(1 for run in runs for r in run.results if r.status != 200),
        "home_share": round(at_home / max(1, len(ok)), 4),
        "sessions_on_one_backend": round(
            sum(1 for v in per_session.values() if len(v) == 1) / max(1, len(per_session)), 4
        ),
        "ttft_p50_ms": ms(pct(ttfts, 0.50)),
        "ttft_p90_ms": ms(pct(ttfts, 0.90)),
        "ttft_p99_ms": ms(pct(ttfts, 0.99)),
        "ttft_mean_ms": ms(statistics.fmean(ttfts)) if ttfts else None,
        "ttft_p50_by_round_ms": [
            ms(pct([r.ttft for r in run.results if r.ttft is not None], 0.5)) for run in runs
        ],
        "prefix_hit_rate": round(hit_rate, 4),
        # What the engines themselves spent on first tokens, from the hit rate alone: free of
        # the scheduling noise a shared machine adds to the client-side figures.
        "engine_ttft_mean_ms": round(TTFT_MS * (1 - (1 - HIT_FACTOR) * hit_rate), 1),
        "by_backend": dict(sorted(Counter(r.backend for r in ok).items())),
        "low_weight_share": round(statistics.fmean(run.low_weight for run in runs), 3),
    }


ZONES = {
    "a": {"zone": "z1", "region": "r1"},
    "b": {"zone": "z1", "region": "r1"},
    "c": {"zone": "z2", "region": "r1"},
    "d": {"zone": "z3", "region": "r2"},
}
TIER = {"a": "zone", "b": "zone", "c": "region", "d": "remote"}


def zones(step_s: float) -> dict[str, Any]:
    with fleet(ZONES, ("--ttft-ms", "10", "--itl-ms", "2"), routing={"prefer_zone": "z1"}) as (
        gw,
        sims,
    ):
        load = SessionLoad(gw.url, send_key=True, tokens=8)
        marks: dict[str, float] = {}

        async def script() -> None:
            t0 = clock()
            task = asyncio.create_task(load.run(until=t0 + 3 * step_s))
            await asyncio.sleep(step_s)
            marks["local zone fails"] = clock() - t0
            await asyncio.gather(
                asyncio.to_thread(sims["a"].fault, "error", rate=1.0),
                asyncio.to_thread(sims["b"].fault, "error", rate=1.0),
            )
            await asyncio.sleep(step_s)
            marks["region fails too"] = clock() - t0
            await asyncio.to_thread(sims["c"].fault, "error", rate=1.0)
            await task

        asyncio.run(script())
        states = {n: b["state"] for n, b in gw.backends().items()}
        panic = httpx.get(f"{gw.url}/admin/backends", timeout=5).json()["panic"]
    steps: dict[str, Any] = {}
    bounds = [("healthy", 0.0), *marks.items(), ("end", float("inf"))]
    for (name, lo), (_, hi) in itertools.pairwise(bounds):
        rs = [r for r in load.results if lo <= r.t < hi]
        ok = [r for r in rs if r.status == 200]
        tiers = Counter(TIER[r.backend] for r in ok)
        steps[name] = {
            "requests": len(rs),
            "errors": len(rs) - len(ok),
            "error_rate": round((len(rs) - len(ok)) / max(1, len(rs)), 4),
            "cross_zone_share": round((len(ok) - tiers["zone"]) / max(1, len(ok)), 4),
            "tiers": dict(tiers),
            "retried": sum(1 for r in ok if r.attempts > 1),
        }
    return {"steps": steps, "final_states": states, "panic": panic}


async def _sample_peaks(gw: Gateway, stop: asyncio.Event, peaks: dict[str, int]) -> int:
    n = 0
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            async with s.get(f"{gw.url}/admin/backends") as r:
                for b in (await r.json())["backends"]:
                    peaks[b["name"]] = max(peaks.get(b["name"], 0), b["inflight"])
            n += 1
            await asyncio.sleep(0.01)
    return n


async def _open_loop(url: str, rate: float, seconds: float, tokens: int) -> list[Result]:
    rng = random.Random(7)
    msgs = [{"role": "user", "content": "summarise my order history"}]
    tasks: list[asyncio.Task[Result]] = []
    async with new_client() as client:
        t0 = clock()
        due = t0
        while due < t0 + seconds:
            due += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, due - clock()))
            coro = chat(client, url, msgs, tokens=tokens, stream=False, t0=t0)
            tasks.append(asyncio.create_task(coro))
        return list(await asyncio.gather(*tasks))


def capacity(utilisation: float, seconds: float, limit: int = 8, tokens: int = 20) -> dict:
    entries = {n: {"max_inflight": limit} for n in "abc"}
    with fleet(entries, ("--ttft-ms", "20", "--itl-ms", "10")) as (gw, sims):

        async def measure() -> tuple[float, list[Result], dict[str, int], int]:
            # Service time with 2 x limit in flight (the survivors' combined limit), before the
            # fault: measured under load, so a busy machine sizes the offered rate to itself.
            msgs = [{"role": "user", "content": "hello"}]
            lat: list[float] = []
            async with new_client() as client:
                end = clock() + 3.0

                async def worker() -> None:
                    while clock() < end:
                        r = await chat(client, gw.url, msgs, tokens=tokens, stream=False)
                        lat.append(r.latency)

                await asyncio.gather(*(worker() for _ in range(2 * limit)))
            service = statistics.fmean(lat)
            await asyncio.to_thread(sims["c"].fault, "error", rate=1.0)
            rate = utilisation * 2 * limit / service
            stop = asyncio.Event()
            peaks: dict[str, int] = {}
            sampler = asyncio.create_task(_sample_peaks(gw, stop, peaks))
            results = await _open_loop(gw.url, rate, seconds, tokens)
            stop.set()
            return service, results, peaks, await sampler

        service, res, peaks, samples = asyncio.run(measure())
        queued = metric(gw, "pulsegate_queued_total")
        c_state = gw.backends()["c"]["state"]
    ok = [r for r in res if r.status == 200]
    codes = Counter(r.status for r in res)
    lat = [r.latency for r in ok]
    return {
        "utilisation": utilisation,
        "service_ms": ms(service),
        "rate_rps": round(utilisation * 2 * limit / service, 1),
        "requests": len(res),
        "ok": len(ok),
        "rejected_503": codes.get(503, 0),
        "rejection_rate": round(codes.get(503, 0) / max(1, len(res)), 4),
        "other_errors": {str(k): v for k, v in sorted(codes.items()) if k not in (200, 503)},
        "limit": limit,
        "peak_inflight": dict(sorted(peaks.items())),
        "limit_held": all(v <= limit for v in peaks.values()),
        "samples": samples,
        "queued": int(queued),
        "latency_p50_ms": ms(pct(lat, 0.5)),
        "latency_p99_ms": ms(pct(lat, 0.99)),
        "c_state": c_state,
    }


# ---------------------------------------------------------------------------------- report


def table(out: dict[str, Any]) -> str:
    load = ", ".join(f"{k} {v[0]}-{v[1]}" for k, v in out["load_avg"].items())
    lines = [f"machine: {out['cpus']} cpus, 1-min load average per phase: {load}"]
    lines += ["", f"affinity (3 backends, 50 sessions of {out['turns']} turns, 16 in flight,"]
    lines[-1] += f" TTFT {TTFT_MS:g} ms, {TTFT_MS * HIT_FACTOR:g} ms on a prefix hit)"
    lines.append(
        f"  {'mode':<18}{'home':>7}{'1-home':>8}{'hit':>7}{'engine':>8}{'p50':>7}{'p90':>7}"
        f"{'p99':>7}{'mean':>7}{'err':>5}{'w<.71':>7}"
    )
    for mode, r in out["affinity"].items():
        lines.append(
            f"  {mode:<18}{r['home_share']:>7.1%}{r['sessions_on_one_backend']:>8.1%}"
            f"{r['prefix_hit_rate']:>7.1%}{r['engine_ttft_mean_ms']:>8}{r['ttft_p50_ms']:>7}"
            f"{r['ttft_p90_ms']:>7}{r['ttft_p99_ms']:>7}{r['ttft_mean_ms']:>7}{r['errors']:>5}"
            f"{r['low_weight_share']:>7.0%}"
        )
    lines += ["", "zones (a, b local z1; c same region; d other region)"]
    lines.append(f"  {'step':<18}{'reqs':>6}{'errors':>8}{'cross-zone':>12}{'retried':>9}  tiers")
    for step, r in out["zones"]["steps"].items():
        lines.append(
            f"  {step:<18}{r['requests']:>6}{r['errors']:>8}{r['cross_zone_share']:>12.1%}"
            f"{r['retried']:>9}  {r['tiers']}"
        )
    lines += ["", "capacity (max_inflight 8; c answers 500 from the start; queue_timeout 2 s)"]
    lines.append(
        f"  {'load':<6}{'rps':>7}{'reqs':>6}{'503':>6}{'reject':>8}{'other':>10}"
        f"{'peak a/b/c':>12}{'queued':>8}{'p50':>7}{'p99':>8}"
    )
    for r in out["capacity"]:
        p = r["peak_inflight"]
        peak = "/".join(str(p.get(n, 0)) for n in "abc")
        lines.append(
            f"  {r['utilisation']:<6.0%}{r['rate_rps']:>7}{r['requests']:>6}"
            f"{r['rejected_503']:>6}{r['rejection_rate']:>8.1%}{json.dumps(r['other_errors']):>10}"
            f"{peak:>12}{r['queued']:>8}{r['latency_p50_ms']:>7}{r['latency_p99_ms']:>8}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a third of the requests and time")
    ap.add_argument("--turns", type=int, default=4, help="requests per conversation")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each affinity mode")
    ap.add_argument("--json", default="bench/results/routing.json")
    a = ap.parse_args()
    scale = 1 / 3 if a.quick else 1.0
    started = time.time()
    out: dict[str, Any] = {
        "turns": a.turns,
        "rounds": a.rounds,
        "cpus": os.cpu_count(),
        "load_avg": {},
        "affinity": {},
        "capacity": [],
    }

    def loadavg() -> float:
        return round(os.getloadavg()[0], 1)

    # Rounds interleave the modes so that a busy spell on a shared machine hits all of them.
    runs: dict[str, list[AffinityRun]] = {mode: [] for mode in AFFINITY_MODES}
    before = loadavg()
    for i in range(a.rounds):
        for mode in AFFINITY_MODES:
            runs[mode].append(affinity_run(mode, int(700 * scale), a.turns, seed=i + 1))
    for mode, rs in runs.items():
        out["affinity"][mode] = affinity_summary(rs)
        print(mode, json.dumps(out["affinity"][mode]), flush=True)
    out["load_avg"]["affinity"] = [before, before := loadavg()]
    out["zones"] = zones(6.0 * scale)
    out["load_avg"]["zones"] = [before, before := loadavg()]
    print("zones", json.dumps(out["zones"]), flush=True)
    for u in (0.8, 1.0, 1.2):
        out["capacity"].append(capacity(u, 10.0 * scale))
        print("capacity", json.dumps(out["capacity"][-1]), flush=True)
    out["load_avg"]["capacity"] = [before, loadavg()]
    out["wall_s"] = round(time.time() - started, 1)
    print(table(out))
    print(f"\n{out['wall_s']} s; written to {a.json}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
