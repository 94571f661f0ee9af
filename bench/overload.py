"""Issue #22, item 4: offered load 5x what the fleet can serve, then back to 0.5x.

    .venv/bin/python bench/overload.py [--sims 3] [--max-batch 4] [--ttft-ms 50] [--itl-ms 20]
        [--overload-s 30] [--after-s 15] [--phases chat,stream] [--queue-timeout S]
        [--queue-max N] [--json bench/results/overload.json]

The fleet: `--sims` `pulsegate sim`s with small batches (`--max-batch` sequences at once,
each `--ttft-ms` + max_tokens x `--itl-ms` long) behind one `pulsegate serve` whose backends
say `max_inflight: --max-batch` (without a limit the gateway never refuses: every request
goes on to an engine, whose own queue grows without bound). The routing knobs are the
gateway's defaults (`routing.queue_timeout` 2 s, `routing.queue_max` 1024) unless given.

Each phase (non-streamed chat, then streamed chat), with chaos/load.py's open-loop client:
  capacity  a short open-loop sweep (0.75x, 1.25x, 2x the fleet's nominal rate, 4 s each):
            capacity is the largest goodput seen (whole answers a second), the rate at which
            goodput stops growing;
  overload  5x capacity for `--overload-s`; meanwhile 30 side requests read the refusals'
            headers (the `Result` rows carry no headers) and the gateway's RSS, open fds and
            threads are sampled every 0.25 s;
  after     0.5x capacity for `--after-s`, started the moment the 5x load stops sending.

Targets (printed PASS/FAIL): goodput >= 90% of capacity under 5x; every refusal a 503 with
Retry-After; refusals' p99 < 50 ms; admitted requests' p99 <= queue_timeout + 2x the
unloaded p99; RSS peak <= before + 200 MB and after <= before + 50 MB; after the drop (from
its 3rd second on) no error and goodput within 10% of the offered 0.5x. Figures are from a
loopback run on a shared box: the load client, the gateway and the sims share its cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from chaos.load import Load, Result  # noqa: E402

from perf.fleet import wait_ready  # noqa: E402
from perf.procs import Child, Procs, free_port  # noqa: E402

MODEL = "demo-7b"
MAX_TOKENS = 16
RECOVER_S = 3.0  # the drop's first seconds: the 5x load's queued requests end (2 s at most)


# ------------------------------------------------------------------------- fleet and gateway


def start_sims(
    procs: Procs,
    n: int,
    *,
    max_batch: int = 32,
    ttft_ms: float = 30.0,
    itl_ms: float = 10.0,
    ports: list[int] | None = None,
) -> list[Child]:
    """`n` sims named s0..; on `ports` when given (a restart must find the same port)."""
    return [
        start_sim(procs, f"s{i}", (ports or [0] * n)[i], max_batch, ttft_ms, itl_ms, seed=i)
        for i in range(n)
    ]


def start_sim(
    procs: Procs,
    name: str,
    port: int,
    max_batch: int,
    ttft_ms: float,
    itl_ms: float,
    seed: int,
    label: str | None = None,
) -> Child:
    """One sim; `label` names its log (a restart keeps the sim's name, not its log)."""
    return procs.start(label or name, sim_argv(name, port, max_batch, ttft_ms, itl_ms, seed))


def sim_argv(
    name: str, port: int, max_batch: int, ttft_ms: float, itl_ms: float, seed: int
) -> list[str]:
    argv = [sys.executable, "-m", "pulsegate", "sim", "--port", str(port), "--name", name]
    argv += ["--model", MODEL, "--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms)]
    return [*argv, "--max-batch", str(max_batch), "--seed", str(seed)]


def start_gateway(
    procs: Procs, tmp: Path, backends: list[dict[str, Any]], routing: dict[str, Any] | None = None
) -> tuple[Child, str]:
    """`pulsegate serve` on a free port, once every backend is `ready`; (child, base URL)."""
    port = free_port()
    cfg: dict[str, Any] = {"gateway": {"listen": f"127.0.0.1:{port}"}, "backends": backends}
    if routing:
        cfg["routing"] = routing
    path = tmp / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    child = procs.start("gateway", [sys.executable, "-m", "pulsegate", "serve", "-c", str(path)])
    base = f"http://127.0.0.1:{child.port}"
    wait_ready(base, len(backends), 90.0)
    return child, base


# ------------------------------------------------------------------------- /proc sampling


def proc_sample(pid: int) -> dict[str, float]:
    """RSS (MB), open fds and threads of one process, now."""
    out = {"rss_mb": 0.0, "threads": 0.0, "fds": 0.0}
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        out["fds"] = float(len(os.listdir(f"/proc/{pid}/fd")))
    except OSError:
        return out
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            out["rss_mb"] = int(line.split()[1]) / 1024
        elif line.startswith("Threads:"):
            out["threads"] = float(line.split()[1])
    return out


def fd_kinds(pid: int, listen_port: int) -> dict[str, float]:
    """`pid`'s fds told apart: TCP sockets from clients (local port `listen_port`), other
    TCP sockets (to backends and agents; listeners excluded), and the rest (listeners,
    pipes, files, epoll, unix sockets): a leak shows in the kind that grows. `close_wait`:
    TCP sockets whose peer closed and which this process never closed."""
    inodes: list[str] = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                inodes.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    except OSError:
        return {}
    tcp: dict[str, tuple[int, str]] = {}  # inode -> (local port, state)
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]:
                f = line.split()
                tcp[f[9]] = (int(f[1].rsplit(":", 1)[1], 16), f[3])
    client = upstream = close_wait = 0
    for link in inodes:
        if link.startswith("socket:["):
            local = tcp.get(link[8:-1])
            if local is not None and local[1] != "0A":  # 0A: LISTEN
                if local[0] == listen_port:
                    client += 1
                else:
                    upstream += 1
                close_wait += local[1] == "08"  # the peer closed, we never did: a leak
    other = len(inodes) - client - upstream
    return {"fds_client": client, "fds_upstream": upstream, "fds_other": other,
            "close_wait": close_wait}  # fmt: skip


@dataclass
class Sampler:
    """Samples `pid` every `every` seconds into `rows` (each with its wall time `t`)."""

    pid: int
    every: float
    listen_port: int = 0  # when given, fds are also told apart (`fd_kinds`)
    # When given, the gateway's /metrics: its `pulsegate_event_loop_tasks` is sampled too.
    metrics_url: str = ""
    rows: list[dict[str, float]] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        # No keep-alive: the sampler's own connection must not count as a client's left open.
        connector = aiohttp.TCPConnector(force_close=True)
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            while True:
                row = {"t": time.time(), **proc_sample(self.pid)}
                if self.listen_port:
                    row |= fd_kinds(self.pid, self.listen_port)
                if self.metrics_url:
                    tasks = await _gauge(session, self.metrics_url, "pulsegate_event_loop_tasks")
                    if tasks is not None:
                        row["tasks"] = tasks
                self.rows.append(row)
                await asyncio.sleep(self.every)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def between(self, t0: float, t1: float) -> list[dict[str, float]]:
        return [r for r in self.rows if t0 <= r["t"] <= t1]


async def _gauge(session: aiohttp.ClientSession, url: str, name: str) -> float | None:
    """One unlabelled sample of `name` from the Prometheus text at `url` (None: not read)."""
    try:
        async with session.get(url) as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


# ------------------------------------------------------------------------- figures


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile (nearest rank) in ms of `values` in seconds; None when empty."""
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, max(0, round(q / 100 * len(s)) - 1))] * 1000, 1)


def goodput(results: list[Result], t0: float, t1: float) -> float:
    """Whole answers a second that ended within [t0, t1]."""
    n = sum(1 for r in results if r.ok and t0 <= r.t1 <= t1)
    return n / max(1e-9, t1 - t0)


async def run_load(base: str, rate: float, seconds: float, stream: bool, seed: int) -> list[Result]:
    load = Load(base, rate=rate, max_tokens=MAX_TOKENS, seed=seed, stream_share=float(stream))
    load.start()
    await asyncio.sleep(seconds)
    return await load.stop()


async def sweep(base: str, nominal: float, stream: bool) -> tuple[float, list[dict[str, Any]]]:
    """Open-loop steps up to 2x nominal; the largest goodput (the steps' last 3 s) wins."""
    steps: list[dict[str, Any]] = []
    for i, k in enumerate((0.75, 1.25, 2.0)):
        t0 = time.time()
        res = await run_load(base, k * nominal, 4.0, stream, seed=100 + i)
        g = goodput(res, t0 + 1.0, t0 + 4.0)
        ok = [r.latency for r in res if r.ok]
        steps.append(
            {"offered_rps": round(k * nominal, 1), "goodput_rps": round(g, 1),
             "sent": len(res), "ok": len(ok), "p50_ms": pct(ok, 50), "p99_ms": pct(ok, 99)}
        )  # fmt: skip
    return max(s["goodput_rps"] for s in steps), steps


async def side_requests(base: str, n: int, stream: bool) -> list[dict[str, Any]]:
    """`n` concurrent requests whose answers' status, Retry-After and latency are kept."""
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "stream": stream,
            "messages": [{"role": "user", "content": "side request"}]}  # fmt: skip
    data = orjson.dumps(body)
    timeout = aiohttp.ClientTimeout(total=15)
    async with aiohttp.ClientSession(timeout=timeout) as s:

        async def one(i: int) -> dict[str, Any]:
            t0 = time.monotonic()
            try:
                async with s.post(base + "/v1/chat/completions", data=data,
                                  headers={"content-type": "application/json"}) as r:  # fmt: skip
                    text = await r.read()
                    code = ""
                    if r.status != 200:
                        code = orjson.loads(text).get("error", {}).get("code", "")
                    ms = round((time.monotonic() - t0) * 1000, 1)
                    ra = r.headers.get("retry-after")
                    return {"status": r.status, "retry_after": ra, "code": code, "ms": ms}
            except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as e:
                return {"status": 0, "retry_after": None, "code": type(e).__name__,
                        "ms": round((time.monotonic() - t0) * 1000, 1)}  # fmt: skip

        return list(await asyncio.gather(*(one(i) for i in range(n))))


async def phase(
    base: str, gw_pid: int, stream: bool, nominal: float, args: argparse.Namespace
) -> dict[str, Any]:
    name = "stream" if stream else "chat"
    print(f"--- phase {name}: capacity sweep (nominal {nominal:.1f} req/s)", flush=True)
    capacity, steps = await sweep(base, nominal, stream)
    for s in steps:
        print(f"  offered {s['offered_rps']:6.1f}/s  goodput {s['goodput_rps']:6.1f}/s  "
              f"p50 {s['p50_ms']} ms  p99 {s['p99_ms']} ms", flush=True)  # fmt: skip
    unloaded_p99 = (steps[0]["p99_ms"] or 0.0) / 1000
    high, low = 5 * capacity, 0.5 * capacity
    print(f"  capacity {capacity:.1f}/s -> overload {high:.1f}/s for {args.overload_s:g} s, "
          f"then {low:.1f}/s for {args.after_s:g} s", flush=True)  # fmt: skip
    sampler = Sampler(gw_pid, 0.25)
    sampler.start()
    await asyncio.sleep(1.0)
    before = statistics.median(r["rss_mb"] for r in sampler.rows)
    over = Load(base, rate=high, max_tokens=MAX_TOKENS, seed=1, stream_share=float(stream))
    t_over = time.time()
    over.start()
    await asyncio.sleep(args.overload_s / 2)
    side = await side_requests(base, 30, stream)
    await asyncio.sleep(max(0.0, t_over + args.overload_s - time.time()))
    after = Load(base, rate=low, max_tokens=MAX_TOKENS, seed=2, stream_share=float(stream))
    t_drop = time.time()
    after.start()
    over_res = await over.stop()
    await asyncio.sleep(max(0.0, t_drop + args.after_s - time.time()))
    t_end = time.time()
    after_res = await after.stop()
    await asyncio.sleep(1.0)
    await sampler.stop()
    rss_after = statistics.median(r["rss_mb"] for r in sampler.between(t_end, time.time() + 1))
    rss_peak = max(r["rss_mb"] for r in sampler.rows)

    warm = 5.0  # the queue fills in the first seconds
    g_over = goodput(over_res, t_over + warm, t_drop)
    admitted = [r.latency for r in over_res if r.ok]
    rejected = [r for r in over_res if r.status not in (200, 0)]
    statuses: dict[str, int] = {}
    for r in over_res:
        key = str(r.status) if r.status else r.error
        statuses[key] = statuses.get(key, 0) + 1
    late = [r for r in after_res if r.t0 >= t_drop + RECOVER_S]
    early_errors = sum(1 for r in after_res if not r.ok and r.t0 < t_drop + RECOVER_S)
    late_errors = [r.error or str(r.status) for r in late if not r.ok]
    # Served a second of what was offered from the drop's 3rd s on (answers that end after
    # t_end count: the rate is of requests sent, so the window's tail is not lost).
    g_after = sum(1 for r in late if r.ok) / max(1e-9, t_end - t_drop - RECOVER_S)
    last_error = max((r.t0 - t_drop for r in after_res if not r.ok), default=None)
    refusals = [s for s in side if s["status"] != 200]
    out: dict[str, Any] = {
        "stream": stream,
        "capacity_rps": round(capacity, 1),
        "sweep": steps,
        "overload": {
            "offered_rps": round(high, 1),
            "seconds": args.overload_s,
            "sent": len(over_res),
            "statuses": statuses,
            "goodput_rps": round(g_over, 1),
            "goodput_vs_capacity": round(g_over / capacity, 3) if capacity else None,
            "admitted": len(admitted),
            "admitted_p50_ms": pct(admitted, 50),
            "admitted_p99_ms": pct(admitted, 99),
            "rejected": len(rejected),
            "rejected_p50_ms": pct([r.latency for r in rejected], 50),
            "rejected_p99_ms": pct([r.latency for r in rejected], 99),
            "rejected_max_ms": pct([r.latency for r in rejected], 100),
            "side_requests": side,
        },
        "after": {
            "offered_rps": round(low, 1),
            "seconds": args.after_s,
            "sent": len(after_res),
            "errors_first_3s": early_errors,
            "last_error_s_after_drop": None if last_error is None else round(last_error, 2),
            "sent_from_3s": len(late),
            "errors_from_3s": len(late_errors),
            "error_kinds_from_3s": sorted(set(late_errors)),
            "goodput_from_3s_rps": round(g_after, 1),
            "p50_ms": pct([r.latency for r in late if r.ok], 50),
            "p99_ms": pct([r.latency for r in late if r.ok], 99),
        },
        "rss_mb": {
            "before": round(before, 1),
            "peak": round(rss_peak, 1),
            "after": round(rss_after, 1),
        },
        "fds_peak": max(r["fds"] for r in sampler.rows),
        "samples": sampler.rows,
    }
    o, a = out["overload"], out["after"]
    bound = (args.queue_timeout or 2.0) + 2 * unloaded_p99
    checks = [
        (f"goodput under 5x >= 90% of capacity ({o['goodput_rps']} / {capacity:.1f} req/s)",
         g_over >= 0.9 * capacity),
        (f"every refusal is a 503 ({sorted(k for k in statuses if k != '200')}), "
         f"with Retry-After ({len([s for s in refusals if s['retry_after']])}/{len(refusals)} "
         "side refusals)",
         all(k in ("200", "503") for k in statuses)
         and all(s["status"] == 503 and s["retry_after"] for s in refusals)),
        (f"refusals' p99 < 50 ms ({o['rejected_p99_ms']} ms, p50 {o['rejected_p50_ms']} ms, "
         f"{o['rejected']} refusals)",
         o["rejected_p99_ms"] is not None and o["rejected_p99_ms"] < 50),
        (f"admitted p99 <= queue_timeout + 2x unloaded p99 ({o['admitted_p99_ms']} ms <= "
         f"{bound * 1000:.0f} ms; p50 {o['admitted_p50_ms']} ms)",
         o["admitted_p99_ms"] is not None and o["admitted_p99_ms"] <= bound * 1000),
        (f"RSS bounded (before {before:.0f} MB, peak {rss_peak:.0f}, after {rss_after:.0f})",
         rss_peak <= before + 200 and rss_after <= before + 50),
        (f"after the drop, from its 3rd s: 0 errors ({a['errors_from_3s']} of "
         f"{a['sent_from_3s']}; {early_errors} in the first 3 s)", not late_errors),
        (f"after the drop, goodput within 10% of the offered 0.5x ({a['goodput_from_3s_rps']} "
         f"/ {low:.1f} req/s; p99 {a['p99_ms']} ms)",
         abs(g_after - low) <= 0.1 * low),
    ]  # fmt: skip
    out["checks"] = [{"check": c, "pass": bool(p)} for c, p in checks]
    for c, p in checks:
        print(f"  {'PASS' if p else 'FAIL'} [{name}] {c}", flush=True)
    return out


async def run(args: argparse.Namespace, procs: Procs, tmp: Path) -> dict[str, Any]:
    sims = start_sims(procs, args.sims, max_batch=args.max_batch, ttft_ms=args.ttft_ms,
                      itl_ms=args.itl_ms)  # fmt: skip
    backends = [
        {"name": c.name, "url": f"http://127.0.0.1:{c.port}", "models": [MODEL],
         "max_inflight": args.max_batch}
        for c in sims
    ]  # fmt: skip
    routing: dict[str, Any] = {}
    if args.queue_timeout is not None:
        routing["queue_timeout"] = f"{args.queue_timeout}s"
    if args.queue_max is not None:
        routing["queue_max"] = args.queue_max
    gw, base = start_gateway(procs, tmp, backends, routing)
    service_s = (args.ttft_ms + MAX_TOKENS * args.itl_ms) / 1000
    nominal = args.sims * args.max_batch / service_s
    out: dict[str, Any] = {
        "fleet": {"sims": args.sims, "max_batch": args.max_batch, "ttft_ms": args.ttft_ms,
                  "itl_ms": args.itl_ms, "max_tokens": MAX_TOKENS, "max_inflight": args.max_batch,
                  "nominal_rps": round(nominal, 1), "routing": routing or "defaults"},
        "phases": {},
    }  # fmt: skip
    for name in args.phases.split(","):
        out["phases"][name] = await phase(base, gw.pid, name == "stream", nominal, args)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sims", type=int, default=3)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--ttft-ms", type=float, default=50.0)
    p.add_argument("--itl-ms", type=float, default=20.0)
    p.add_argument("--overload-s", type=float, default=30.0)
    p.add_argument("--after-s", type=float, default=15.0)
    p.add_argument("--phases", default="chat,stream")
    p.add_argument("--queue-timeout", type=float, default=None, help="routing.queue_timeout, s")
    p.add_argument("--queue-max", type=int, default=None, help="routing.queue_max")
    p.add_argument("--json", type=Path, default=ROOT / "bench/results/overload.json")
    args = p.parse_args()
    logs = ROOT / "bench/results/overload_logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs = Procs(logs)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = asyncio.run(run(args, procs, Path(tmp)))
    finally:
        procs.stop_all()
    out["argv"] = sys.argv[1:]
    checks = [c for ph in out["phases"].values() for c in ph["checks"]]
    out["passed"] = all(c["pass"] for c in checks)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{sum(c['pass'] for c in checks)}/{len(checks)} checks pass; wrote {args.json}")
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
