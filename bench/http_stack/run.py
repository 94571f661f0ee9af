"""HTTP-stack shoot-out for the gateway: start upstream + every candidate proxy, load them
interleaved (A B C ... A B C ...), print medians/ratios, write bench/results/http_stack.json.

    .venv/bin/python bench/http_stack/run.py            # full run (~6-7 min)
    .venv/bin/python bench/http_stack/run.py --quick    # smoke run (~1.5 min)

Needs `wrk` on PATH (Debian: apt-get install wrk) and, in the venv, aiohttp, uvloop, orjson,
httptools, uvicorn, granian (bench-only; not gateway dependencies).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

from common import (  # noqa: E402
    COMPLETION_BODY,
    PATH_STR,
    REQUEST_BODY,
    SSE_CHUNKS,
    STREAM_REQUEST_BODY,
    install_uvloop,
)

CANDIDATES = ["aiohttp-web", "aiohttp-lowlevel", "uvicorn", "granian", "raw-aiohttp", "raw-raw"]
BASELINE = "aiohttp-web"
UPSTREAM_PORT = 18000
FIRST_PROXY_PORT = 18101
CLK_TCK = os.sysconf("SC_CLK_TCK")
HEADERS = {"Content-Type": "application/json"}


# ---------------------------------------------------------------------------------- processes


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry))
    return kids


def tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo and len(out) < 64:
        p = todo.pop()
        out.append(p)
        todo.extend(_children(p))
    return out


def tree_stats(pid: int) -> dict[str, float]:
    """CPU seconds, current RSS and peak RSS (VmHWM) summed over a process and its children."""
    cpu = rss = hwm = 0.0
    for p in tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / CLK_TCK
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) / 1024
                elif line.startswith("VmHWM:"):
                    hwm += int(line.split()[1]) / 1024
        except OSError:
            continue
    return {"cpu_s": cpu, "rss_mb": rss, "hwm_mb": hwm}


class Procs:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, args: list[str], env: dict[str, str]) -> int:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 (closed by the child exit)
        proc = subprocess.Popen(
            [sys.executable, *args], cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        self.procs[name] = proc
        return proc.pid

    def stop_all(self) -> None:
        for name, proc in self.procs.items():
            pids = tree(proc.pid) if proc.poll() is None else []
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            for p in pids[1:]:  # leftover children (e.g. a granian worker), by PID
                try:
                    os.kill(p, 9)
                except ProcessLookupError:
                    pass
            print(f"stopped {name} (pid {proc.pid}, rc={proc.returncode})", file=sys.stderr)


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process on :{port} exited rc={proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"port {port} not ready after {timeout}s")


# ---------------------------------------------------------------------------------- wrk


def _ms(value: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", value)
    if not m:
        return float("nan")
    return float(m[1]) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}[m[2]]


def wrk(url: str, conns: int, threads: int, duration: float) -> dict[str, float]:
    cmd = ["wrk", f"-t{threads}", f"-c{conns}", f"-d{duration}s", "--latency"]
    cmd += ["-s", str(HERE / "post.lua"), url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 30).stdout
    res = {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out)[1])}  # type: ignore[index]
    res["requests"] = float(re.search(r"(\d+) requests in", out)[1])  # type: ignore[index]
    for pct in ("50", "90", "99"):
        m = re.search(rf"^\s+{pct}(?:\.000)?%\s+(\S+)", out, re.M)
        res[f"p{pct}_ms"] = _ms(m[1]) if m else float("nan")
    errors = 0
    if m := re.search(r"Non-2xx or 3xx responses: (\d+)", out):
        errors += int(m[1])
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out):
        errors += sum(int(x) for x in m.groups())
    res["errors"] = errors
    return res


# ---------------------------------------------------------------------------------- clients


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"correctness check failed: {what}")


async def check_correct(session: Any, url: str) -> None:
    async with session.post(url, data=REQUEST_BODY, headers=HEADERS) as r:
        body = await r.read()
        _expect(r.status == 200, f"{url} status {r.status}")
        _expect(body == COMPLETION_BODY, f"{url} body {body[:80]!r}")
    async with session.post(url, data=STREAM_REQUEST_BODY, headers=HEADERS) as r:
        body = await r.read()
        _expect(r.status == 200, f"{url} stream status {r.status}")
        _expect(r.headers["Content-Type"].startswith("text/event-stream"), f"{url} stream ctype")
        _expect(body.count(b"data: ") == SSE_CHUNKS + 1, f"{url} {body.count(b'data: ')} events")
        _expect(body.endswith(b"data: [DONE]\n\n"), f"{url} stream tail")


async def fixed_rate(session: Any, url: str, rate: float, duration: float) -> dict[str, float]:
    """Open-loop load at `rate` req/s: a request is started on schedule even if others are
    still in flight; latency is measured from the request's start to the full body."""
    loop = asyncio.get_running_loop()
    lat: list[float] = []
    errors = 0

    async def one() -> None:
        nonlocal errors
        t0 = time.perf_counter()
        try:
            async with session.post(url, data=REQUEST_BODY, headers=HEADERS) as r:
                await r.read()
                if r.status != 200:
                    errors += 1
                    return
        except Exception:
            errors += 1
            return
        lat.append((time.perf_counter() - t0) * 1e3)

    n = int(rate * duration)
    start = loop.time() + 0.01
    tasks = []
    for i in range(n):
        delay = start + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=duration + 30)
    achieved = n / (loop.time() - start)
    return {
        "p50_ms": _pct(lat, 0.5),
        "p90_ms": _pct(lat, 0.9),
        "p99_ms": _pct(lat, 0.99),
        "achieved_rps": achieved,
        "errors": errors,
    }


async def stream_burst(session: Any, url: str, streams: int) -> dict[str, float]:
    """`streams` concurrent SSE requests; TTFT = first body bytes; tokens/s per stream."""

    async def one() -> tuple[float, float, int]:
        t0 = time.perf_counter()
        ttft = None
        parts = []
        async with session.post(url, data=STREAM_REQUEST_BODY, headers=HEADERS) as r:
            async for chunk in r.content.iter_any():
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(chunk)
        total = time.perf_counter() - t0
        return (ttft or total) * 1e3, total * 1e3, b"".join(parts).count(b"data: ")

    t0 = time.perf_counter()
    results = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(streams))), 60)
    wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    totals = [r[1] for r in results]
    chunks = sum(r[2] for r in results)
    per_stream_tps = [SSE_CHUNKS / max(1e-6, (tot - ttf) / 1e3) for ttf, tot, _ in results]
    return {
        "ttft_p50_ms": _pct(ttfts, 0.5),
        "ttft_p99_ms": _pct(ttfts, 0.99),
        "stream_p50_ms": _pct(totals, 0.5),
        "stream_max_ms": max(totals),
        "tok_s_per_stream_p50": _pct(per_stream_tps, 0.5),
        "chunks_per_s": chunks / wall,
        "incomplete": sum(1 for r in results if r[2] != SSE_CHUNKS + 1),
    }


# ---------------------------------------------------------------------------------- main


def med(runs: list[dict[str, float]], key: str) -> float:
    vals = [r[key] for r in runs if r.get(key) == r.get(key)]  # drop NaN
    return statistics.median(vals) if vals else float("nan")


async def bench(args: argparse.Namespace, targets: dict[str, tuple[str, int | None]]) -> dict:
    import aiohttp

    names = list(targets)
    res: dict[str, dict[str, Any]] = {
        n: {"throughput": [], "c1": [], "fixed_rate": [], "stream": []} for n in names
    }

    def order(r: int) -> list[str]:
        k = r % len(names)
        return names[k:] + names[:k]

    def cpu(name: str) -> float:
        pid = targets[name][1]
        return tree_stats(pid)["cpu_s"] if pid else float("nan")

    conn = aiohttp.TCPConnector(limit=256)
    async with aiohttp.ClientSession(connector=conn) as session:
        for name in names:
            await check_correct(session, targets[name][0])
        print("correctness check: all targets OK", file=sys.stderr)

        for name in names:  # warm-up (JIT-free Python, but pools/caches/allocators)
            await asyncio.to_thread(wrk, targets[name][0], args.conns, args.threads, 1)
        for name in names:
            if targets[name][1]:
                res[name]["idle_rss_mb"] = tree_stats(targets[name][1])["rss_mb"]

        for r in range(args.rounds):
            for name in order(r):
                c0 = cpu(name)
                run = await asyncio.to_thread(
                    wrk, targets[name][0], args.conns, args.threads, args.duration
                )
                run["cpu_us_per_req"] = (cpu(name) - c0) * 1e6 / max(1.0, run["requests"])
                res[name]["throughput"].append(run)
                print(f"[tput r{r}] {name:17s} {run['rps']:9.0f} req/s", file=sys.stderr)

        for r in range(args.lat_rounds):
            for name in order(r):
                run = await asyncio.to_thread(wrk, targets[name][0], 1, 1, args.lat_duration)
                res[name]["c1"].append(run)
                run2 = await fixed_rate(session, targets[name][0], args.rate, args.lat_duration)
                res[name]["fixed_rate"].append(run2)
                print(
                    f"[lat  r{r}] {name:17s} c1 p50 {run['p50_ms']:.3f} ms, "
                    f"{args.rate:.0f}/s p50 {run2['p50_ms']:.3f} p99 {run2['p99_ms']:.3f} ms",
                    file=sys.stderr,
                )

        for name in names:  # stream warm-up: grows every upstream pool to >= 64 connections
            await stream_burst(session, targets[name][0], args.streams)
        for r in range(args.stream_rounds):
            for name in order(r):
                c0 = cpu(name)
                run = await stream_burst(session, targets[name][0], args.streams)
                chunks = args.streams * (SSE_CHUNKS + 1)
                run["cpu_us_per_chunk"] = (cpu(name) - c0) * 1e6 / chunks
                res[name]["stream"].append(run)
                print(
                    f"[strm r{r}] {name:17s} ttft p50 {run['ttft_p50_ms']:.1f} ms, "
                    f"{run['chunks_per_s']:.0f} chunks/s",
                    file=sys.stderr,
                )

    for name in names:
        if targets[name][1]:
            res[name]["peak_rss_mb"] = tree_stats(targets[name][1])["hwm_mb"]
    return res


def summarize(res: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    summary: dict[str, dict[str, float]] = {}
    for name, r in res.items():
        t, c1, fr, st = r["throughput"], r["c1"], r["fixed_rate"], r["stream"]
        summary[name] = {
            "rps": med(t, "rps"),
            "rps_min": min(x["rps"] for x in t),
            "rps_max": max(x["rps"] for x in t),
            "cpu_us_per_req": med(t, "cpu_us_per_req"),
            "wrk16_p50_ms": med(t, "p50_ms"),
            "wrk16_p99_ms": med(t, "p99_ms"),
            "c1_p50_ms": med(c1, "p50_ms"),
            "c1_p99_ms": med(c1, "p99_ms"),
            "c1_rps": med(c1, "rps"),
            "fixed_p50_ms": med(fr, "p50_ms"),
            "fixed_p99_ms": med(fr, "p99_ms"),
            "ttft_p50_ms": med(st, "ttft_p50_ms"),
            "ttft_p99_ms": med(st, "ttft_p99_ms"),
            "stream_p50_ms": med(st, "stream_p50_ms"),
            "tok_s_per_stream": med(st, "tok_s_per_stream_p50"),
            "chunks_per_s": med(st, "chunks_per_s"),
            "cpu_us_per_chunk": med(st, "cpu_us_per_chunk"),
            "errors": sum(x["errors"] for x in t + c1 + fr) + sum(x["incomplete"] for x in st),
            "idle_rss_mb": r.get("idle_rss_mb", float("nan")),
            "peak_rss_mb": r.get("peak_rss_mb", float("nan")),
        }
    base = summary.get(BASELINE)
    direct = summary.get("direct")
    for s in summary.values():
        if base:
            s["rps_vs_aiohttp_web"] = s["rps"] / base["rps"]
        if direct:
            s["added_c1_p50_ms"] = s["c1_p50_ms"] - direct["c1_p50_ms"]
            s["added_fixed_p50_ms"] = s["fixed_p50_ms"] - direct["fixed_p50_ms"]
            s["added_fixed_p99_ms"] = s["fixed_p99_ms"] - direct["fixed_p99_ms"]
    return summary


def table(summary: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    def f(v: float, spec: str) -> str:
        return "-" if v != v else format(v, spec)

    lines = [
        f"Non-streaming (wrk -c{args.conns} {args.duration:g}s x{args.rounds} interleaved; "
        f"latency: wrk -c1 and open-loop {args.rate:g} req/s)",
        "| target | req/s (median) | vs aiohttp-web | CPU µs/req | c1 p50 ms (+added) "
        f"| {args.rate:g}/s p50 ms (+added) | {args.rate:g}/s p99 ms (+added) | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, s in summary.items():
        lines.append(
            f"| {n} | {f(s['rps'], '.0f')} ({f(s['rps_min'], '.0f')}..{f(s['rps_max'], '.0f')}) "
            f"| {f(s.get('rps_vs_aiohttp_web', float('nan')), '.2f')}x "
            f"| {f(s['cpu_us_per_req'], '.0f')} "
            f"| {f(s['c1_p50_ms'], '.3f')} (+{f(s.get('added_c1_p50_ms', 0), '.3f')}) "
            f"| {f(s['fixed_p50_ms'], '.2f')} (+{f(s.get('added_fixed_p50_ms', 0), '.2f')}) "
            f"| {f(s['fixed_p99_ms'], '.2f')} (+{f(s.get('added_fixed_p99_ms', 0), '.2f')}) "
            f"| {s['errors']:.0f} |"
        )
    lines += [
        "",
        f"Streaming ({args.streams} concurrent SSE streams x {SSE_CHUNKS} chunks, upstream "
        f"{args.chunk_delay_ms:g} ms/chunk, x{args.stream_rounds}) and memory",
        "| target | TTFT p50 ms | TTFT p99 ms | stream p50 ms | tok/s per stream | chunks/s "
        "| CPU µs/chunk | idle RSS MB | peak RSS MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, s in summary.items():
        lines.append(
            f"| {n} | {f(s['ttft_p50_ms'], '.1f')} | {f(s['ttft_p99_ms'], '.1f')} "
            f"| {f(s['stream_p50_ms'], '.0f')} | {f(s['tok_s_per_stream'], '.0f')} "
            f"| {f(s['chunks_per_s'], '.0f')} | {f(s['cpu_us_per_chunk'], '.1f')} "
            f"| {f(s['idle_rss_mb'], '.0f')} | {f(s['peak_rss_mb'], '.0f')} |"
        )
    return "\n".join(lines)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "cpus": str(os.cpu_count())}
    for pkg in ("aiohttp", "uvloop", "orjson", "httptools", "uvicorn", "granian"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "missing"
    wrk_v = subprocess.run(["wrk", "-v"], capture_output=True, text=True)
    out["wrk"] = (wrk_v.stdout + wrk_v.stderr).split("\n", 1)[0]
    out["loadavg_start"] = Path("/proc/loadavg").read_text().strip()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=float, default=5)
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="wrk threads")
    ap.add_argument("--lat-rounds", type=int, default=3)
    ap.add_argument("--lat-duration", type=float, default=3)
    ap.add_argument("--rate", type=float, default=400)
    ap.add_argument("--stream-rounds", type=int, default=5)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--chunk-delay-ms", type=float, default=5)
    ap.add_argument("--quick", action="store_true", help="2 short rounds of everything")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "http_stack.json")
    args = ap.parse_args()
    if args.quick:
        args.rounds = args.lat_rounds = args.stream_rounds = 2
        args.duration = args.lat_duration = 2
    if not shutil.which("wrk"):
        sys.exit("wrk not found: apt-get install -y wrk")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = args.out.parent / "http_stack_logs"
    log_dir.mkdir(exist_ok=True)
    env = {**os.environ, "BENCH_UPSTREAM_PORT": str(UPSTREAM_PORT), "PYTHONPATH": str(HERE)}
    env["BENCH_CHUNK_DELAY_MS"] = str(args.chunk_delay_ms)
    env.pop("AIOHTTP_NO_EXTENSIONS", None)

    procs = Procs(log_dir)
    targets: dict[str, tuple[str, int | None]] = {}
    try:
        procs.start("upstream", ["upstream.py", "--port", str(UPSTREAM_PORT)], env)
        wait_port(UPSTREAM_PORT, procs.procs["upstream"])
        targets["direct"] = (f"http://127.0.0.1:{UPSTREAM_PORT}{PATH_STR}", None)
        for i, kind in enumerate(args.candidates.split(",")):
            port = FIRST_PROXY_PORT + i
            pid = procs.start(kind, ["proxies.py", "--kind", kind, "--port", str(port)], env)
            wait_port(port, procs.procs[kind])
            targets[kind] = (f"http://127.0.0.1:{port}{PATH_STR}", pid)
        time.sleep(0.5)
        meta = versions()
        install_uvloop()
        raw = asyncio.run(bench(args, targets))
        meta["loadavg_end"] = Path("/proc/loadavg").read_text().strip()
    finally:
        procs.stop_all()

    summary = summarize(raw)
    text = table(summary, args)
    print(text)
    args.out.write_text(
        json.dumps(
            {"config": vars(args) | {"out": str(args.out)}, "env": meta, "summary": summary}
            | {"runs": raw},
            indent=2,
        )
    )
    print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
