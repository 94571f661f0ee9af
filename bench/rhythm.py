"""Issue 21's figures for the stall rule's rhythm (docs/stall-and-hedge.md).

    .venv/bin/python bench/rhythm.py micro            # ns per upstream chunk, before/after
    .venv/bin/python bench/rhythm.py gaps [--streams 16,64] [--itl-ms 5]
    .venv/bin/python bench/rhythm.py pause [--trials 20] [--itl-ms 5]
    .venv/bin/python bench/rhythm.py hedge [--requests 300]

micro  the watchdog's per-chunk work: before (two `touch`es: after the read, after the
       write) and after (`beat` feeding the backend's histogram, then `touch`), and the
       histogram's `add` and `quantile` alone. Thread CPU time, one core.
gaps   the gaps between content chunks a client sees from healthy sims (5 ms ITL) through
       the gateway at N concurrent streams: p50, p99, p99.9, max. The stall floor must be
       well above the max, or healthy streams are cut.
pause  a stream of 60 tokens whose engine stops after its 20th (`stall` fault, set on the
       backend serving it): the client's longest pause from there (cut + resume) per
       trial, and whether the text came whole (equal to an uninterrupted run).
hedge  three sims, one 1.5 s late to its first token; closed-loop streams (4 at a time)
       with `retry.hedge` off, then on (defaults): the client's TTFT p50/p99 and the
       hedges sent (`pulsegate_hedges_total`), against a fleet with no late backend.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from pulsegate.clock import SystemClock
from pulsegate.proxy.rhythm import Quantiles
from pulsegate.proxy.watchdog import Watchdog
from support import Gateway, Sim, backend_entry, fast_probes
from timing import ns_per_call


class _Upstream:
    def close(self) -> None:
        pass


def micro(calls: int) -> dict[str, float]:
    loop = asyncio.new_event_loop()
    clock = SystemClock(loop)
    try:
        old = Watchdog(clock, _Upstream(), 1.0)  # the landed code's per-chunk calls
        new = Watchdog(clock, _Upstream(), 1.0, rhythm=Quantiles())
        new.touch(1)  # armed: every chunk feeds the histogram

        def before() -> None:
            old.touch()
            old.touch()

        def after() -> None:
            new.beat()
            new.touch(2)

        q = Quantiles()
        for i in range(1000):
            q.add(0.004 + (i % 7) * 0.001)
        return {
            "chunk_before_ns": ns_per_call(before, calls),
            "chunk_after_ns": ns_per_call(after, calls),
            "add_ns": ns_per_call(lambda: q.add(0.005), calls),
            "quantile_cached_ns": ns_per_call(lambda: q.quantile(0.99), calls),
            "limit_ns": ns_per_call(new.limit, calls),
        }
    finally:
        old.stop()
        new.stop()
        clock.close()
        loop.close()


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _one_stream(gw: Gateway, i: int, tokens: int, out: list[float]) -> None:
    body = {
        "model": "demo-7b",
        "messages": [{"role": "user", "content": f"gaps {i}"}],
        "max_tokens": tokens,
        "stream": True,
    }
    last = None
    buf = b""
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=60) as r:
        for chunk in r.iter_bytes():
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                if b'"content":"' not in ev:
                    continue
                now = time.perf_counter()
                if last is not None:
                    out.append(now - last)
                last = now


def _fleet(tmp: Path, a: argparse.Namespace, n: int = 2) -> tuple[Gateway, list[Sim]]:
    sims = [Sim(tmp, f"s{i}", "--itl-ms", a.itl_ms) for i in range(n)]
    cfg = {
        "backends": [backend_entry(s, zone=f"z{i}") for i, s in enumerate(sims)],
        "probes": fast_probes(),
        "routing": {"prefer_zone": "z0"},
        "streaming": {"stall_floor": a.floor, "stall_factor": a.factor},
    }
    gw = Gateway(tmp, cfg)
    gw.wait_all_ready(timeout=30)
    return gw, sims


def _resumes(gw: Gateway) -> float:
    for line in httpx.get(f"{gw.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("pulsegate_stream_resumes_total "):
            return float(line.split()[1])
    return 0.0


def gaps(streams: list[int], a: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        gw, sims = _fleet(Path(d), a)
        try:
            for n in streams:
                out: list[float] = []
                before = _resumes(gw)
                threads = [
                    threading.Thread(target=_one_stream, args=(gw, i, 200, out)) for i in range(n)
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=120)
                rows.append(
                    {
                        "streams": n,
                        "gaps": len(out),
                        "p50_ms": _pct(out, 0.5) * 1000,
                        "p99_ms": _pct(out, 0.99) * 1000,
                        "p999_ms": _pct(out, 0.999) * 1000,
                        "max_ms": max(out) * 1000,
                        # Healthy streams cut by the stall rule (and resumed): should be 0.
                        "cut": _resumes(gw) - before,
                    }
                )
        finally:
            gw.stop()
            for s in sims:
                s.stop()
    return rows


def _stall_trial(gw: Gateway, sims: dict[str, Sim], i: int) -> dict[str, Any]:
    body = {
        "model": "demo-7b",
        "messages": [{"role": "user", "content": f"pause {i}"}],
        "max_tokens": 60,
        "stream": True,
    }
    times: list[float] = []
    text: list[str] = []
    buf = b""
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=30) as r:
        victim = sims[r.headers["x-pulsegate-backend"]]
        for chunk in r.iter_bytes():
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                data = ev.removeprefix(b"data: ")
                if data == b"[DONE]":
                    continue
                obj = orjson.loads(data)
                ch = obj.get("choices") or [{}]
                piece = (ch[0].get("delta") or {}).get("content")
                if piece:
                    text.append(piece)
                    times.append(time.perf_counter())
                    if len(text) == 20:
                        victim.fault("stall", after_tokens=1)  # silent from the next token
    victim.fault("none")
    healthy = next(s for s in sims.values() if s is not victim)
    full = httpx.post(
        f"{healthy.url}/v1/chat/completions", json={**body, "stream": False}, timeout=10
    ).json()["choices"][0]["message"]["content"]
    pause = max(b - a for a, b in itertools.pairwise(times[19:]))
    return {"pause_ms": pause * 1000, "whole": "".join(text) == full}


def pause(trials: int, a: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        gw, sims = _fleet(Path(d), a)
        try:
            named = {s.name: s for s in sims}
            rows = [_stall_trial(gw, named, i) for i in range(trials)]
        finally:
            gw.stop()
            for s in sims:
                s.stop()
    ps = sorted(r["pause_ms"] for r in rows)
    return {
        "trials": trials,
        "pause_p50_ms": statistics.median(ps),
        "pause_max_ms": ps[-1],
        "whole": sum(r["whole"] for r in rows),
    }


def _content_times(gw: Gateway, body: dict[str, Any], text: list[str] | None = None) -> list[float]:
    """When each content chunk of a streamed chat arrived (`text`: its pieces)."""
    times: list[float] = []
    buf = b""
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=30) as r:
        for chunk in r.iter_bytes():
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                data = ev.removeprefix(b"data: ")
                if data == b"[DONE]":
                    continue
                ch = orjson.loads(data).get("choices") or [{}]
                piece = (ch[0].get("delta") or {}).get("content")
                if piece:
                    times.append(time.perf_counter())
                    if text is not None:
                        text.append(piece)
    return times


def _ttfts(gw: Gateway, n: int, tag: str) -> list[float]:
    out: list[float] = []

    def worker(w: int) -> None:
        for j in range(w, n, 4):
            body = {
                "model": "demo-7b",
                "messages": [{"role": "user", "content": f"{tag} {j}"}],
                "max_tokens": 8,
                "stream": True,
            }
            t0 = time.perf_counter()
            times = _content_times(gw, body)
            out.append(times[0] - t0 if times else float("inf"))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return out


def _hedges(gw: Gateway) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{gw.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("pulsegate_hedges_total{"):
            key, _, v = line.rpartition(" ")
            out[key.split('"')[1]] = float(v)
    return out


def hedge(requests: int) -> list[dict[str, Any]]:
    probes = {
        **fast_probes(),
        "micro_inference": {"interval": "4s", "jitter": "200ms", "timeout": "4s"},
        "canary": {"interval": "4s", "timeout": "4s"},
    }
    rows = []
    for late, on in ((False, False), (True, False), (True, True)):
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            ttft = ("1530", "30", "30") if late else ("30", "30", "30")
            sims = [Sim(tmp, f"s{i}", "--ttft-ms", t) for i, t in enumerate(ttft)]
            cfg = {
                "backends": [backend_entry(s) for s in sims],
                "probes": probes,
                "retry": {"hedge": {"enabled": on}},
            }
            gw = Gateway(tmp, cfg)
            try:
                gw.wait_all_ready(timeout=30)
                xs = _ttfts(gw, requests, "hedge")
                rows.append(
                    {
                        "late_backend": late,
                        "hedge": on,
                        "requests": len(xs),
                        "ttft_p50_ms": _pct(xs, 0.5) * 1000,
                        "ttft_p99_ms": _pct(xs, 0.99) * 1000,
                        "hedges": _hedges(gw),
                    }
                )
            finally:
                gw.stop()
                for s in sims:
                    s.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("micro", "gaps", "pause", "hedge"))
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--calls", type=int, default=500_000)
    ap.add_argument("--streams", default="16,64")
    ap.add_argument("--itl-ms", default="5")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--floor", default="150ms", help="streaming.stall_floor")
    ap.add_argument("--factor", type=float, default=4.0, help="streaming.stall_factor")
    a = ap.parse_args()
    if a.what == "micro":
        out: Any = micro(a.calls)
    elif a.what == "gaps":
        out = gaps([int(x) for x in a.streams.split(",")], a)
    elif a.what == "pause":
        out = pause(a.trials, a)
    else:
        out = hedge(a.requests)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
