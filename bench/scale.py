"""`make bench-scale`: the scale of one gateway process (issue 23, item 4), on loopback.

    .venv/bin/python bench/scale.py            # full sweep, ~3 min; bench/results/scale.json
    .venv/bin/python bench/scale.py --quick    # smallest points, < 60 s; scale-quick.json
    .venv/bin/python bench/scale.py --backends 10,100 --streams 500 --itl-ms 50

Two sweeps, each point on a fresh `pulsegate serve` with the default health machinery
(`perf/fleet.py:start_pulsegate`: readiness, micro-inference, canary, connect probes and
the `/metrics` scrape on every backend):

- **probing**: N backends (default 10, 50, 200), all ports of one `perf/fast_engine.py`
  process (`--ports N`), no client load. Over `--idle-s` the gateway's CPU (from
  /proc, % of one core), hence µs of CPU per second per backend, its RSS, and whether
  every backend stayed `ready` (an overloaded loop times its own probes out).
- **streams**: S concurrent streams (default 64, 250, 1000) over `--stream-backends`
  backends (one engine process), `--tokens` tokens at `--itl-ms` each, started evenly
  over `--ramp-s` so all S are open at once in the window [ramp end, shortest stream's
  end]. The same load straight to one engine port first ("direct"), then through the
  gateway. Client-side TTFT p50/p99 (every stream), tokens/s in the window, gateway RSS
  before and at its peak (per stream = delta / S), open fds, gateway CPU µs per token.
  The client runs in `--client-procs` processes (aiohttp), so its own CPU is measured
  and reported beside the gateway's: a bend is the gateway's only if the client is not
  at its own core's limit. Connect times (aiohttp's trace) and the kernel's listen-drop
  and SYN-retransmit counters say whether waiting happened before the gateway's accept.

`--compiled`: every gateway runs `make compiled`'s build (the proxy path compiled by
mypyc; `build/compiled`, as `make bench`'s pulsegate-mypyc).

`--pyspy`: after the largest probing point's window, py-spy on that gateway (where the
probing CPU goes). 1,000 streams hold ~2,000 sockets in the gateway: `pulsegate serve`
raises its soft RLIMIT_NOFILE to the hard limit itself (`runtime.raise_fd_limit`); this
script raises its own (the clients inherit it); a hard limit under ~4,096 needs `ulimit -Hn`
raised first. Every child is stopped by PID at the end, on Ctrl-C and after
`--max-seconds`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from perf import fleet, load, profiling  # noqa: E402
from perf.fleet import CHAT, STREAM_MODEL, ZERO_MODEL, Target  # noqa: E402
from perf.procs import Child, Procs, interrupted, stop_on_signals, usage  # noqa: E402

clock = time.monotonic  # CLOCK_MONOTONIC: one clock for the bench and its client processes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--backends", default="10,50,200", help="probing sweep: backend counts")
    ap.add_argument("--streams", default="64,250,1000", help="stream sweep: concurrent streams")
    ap.add_argument("--stream-backends", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    ap.add_argument("--itl-ms", type=float, default=40.0, help="engine's inter-token gap")
    ap.add_argument("--ramp-s", type=float, default=2.0, help="streams start over this long")
    ap.add_argument("--idle-s", type=float, default=10.0, help="probing: measured window")
    ap.add_argument("--warm-s", type=float, default=3.0, help="probing: unmeasured, first")
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--ready-timeout", type=float, default=60.0)
    ap.add_argument("--max-seconds", type=int, default=600, help="hard limit for the whole run")
    ap.add_argument("--pyspy", action="store_true", help="py-spy the largest probing point")
    ap.add_argument(
        "--compiled", action="store_true", help="run make compiled's build (build/compiled)"
    )
    ap.add_argument("--quick", action="store_true", help="smallest points, < 60 s")
    ap.add_argument("--out", type=Path, default=None, help="JSON results file")
    ap.add_argument("--client", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.backends, args.streams = args.backends.split(",")[0], args.streams.split(",")[0]
        args.tokens, args.idle_s, args.warm_s = 100, 3.0, 1.0
        args.max_seconds = min(args.max_seconds, 120)
    args.backends = [int(x) for x in str(args.backends).split(",") if x]
    args.streams = [int(x) for x in str(args.streams).split(",") if x]
    if args.tokens * args.itl_ms / 1000 < args.ramp_s + 1:
        ap.error("--tokens x --itl-ms must outlast --ramp-s by 1 s: no window with all open")
    if args.compiled and not fleet.compiled_built():
        ap.error("--compiled: no build/compiled (run `make compiled` first)")
    args.src = fleet.COMPILED if args.compiled else None
    name = "scale-quick.json" if args.quick else "scale.json"
    args.out = args.out or REPO / "bench" / "results" / name
    return args


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def raise_nofile() -> int:
    """Soft open-file limit to the hard one: 1,000 streams are 1,000 client sockets here."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1 << 20 if hard == resource.RLIM_INFINITY else hard  # above nr_open: EPERM
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            log(f"open-file limit stays {soft} ({e}): 1,000 streams need `ulimit -n 4096`")
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


# ---------------------------------------------------------------------------------- client


async def _client(spec: dict[str, Any]) -> dict[str, Any]:
    """Streams `spec["indices"]` of `spec["total"]`, stream i started at t0 + ramp x i/total."""
    body = load.stream_body(spec["tokens"])
    t0, ramp, total = spec["t0"], spec["ramp_s"], spec["total"]
    w0, w1 = spec["w0"], spec["w1"]
    ttfts: list[float] = []
    late: list[float] = []
    c = {"tokens": 0, "window_tokens": 0, "incomplete": 0, "errors": 0}
    kinds: Counter[str] = Counter()

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        due = t0 + ramp * i / total
        await asyncio.sleep(max(0.0, due - clock()))
        start = clock()
        late.append((start - due) * 1e3)
        events, done, ttft = 0, False, None
        try:
            async with session.post(spec["url"], data=body, headers=load.HEADERS) as r:
                if r.status != 200:
                    await r.read()
                    kinds[f"HTTP {r.status}"] += 1
                    c["errors"] += 1
                    return
                async for chunk in r.content.iter_any():
                    now = clock()
                    n = chunk.count(b"\n\n")  # one event each; the fast engine never splits one
                    tok = n - (1 if events == 0 and n else 0)  # the role chunk
                    if chunk.endswith(b"data: [DONE]\n\n"):
                        tok, done = tok - 1, True
                    events += n
                    c["tokens"] += tok
                    if w0 <= now <= w1:
                        c["window_tokens"] += tok
                    if ttft is None and events >= 2:
                        ttft = now - start
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            kinds[type(e).__name__] += 1
            c["errors"] += 1
            return
        if ttft is not None:
            ttfts.append(ttft * 1e3)
        if not done or events != spec["tokens"] + 2:
            c["incomplete"] += 1

    connects: list[float] = []

    async def started(_s: object, ctx: Any, _p: object) -> None:
        ctx.t = clock()

    async def made(_s: object, ctx: Any, _p: object) -> None:
        connects.append((clock() - ctx.t) * 1e3)

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_start.append(started)
    trace.on_connection_create_end.append(made)
    n = len(spec["indices"])
    session = aiohttp.ClientSession(
        trace_configs=[trace],
        connector=aiohttp.TCPConnector(limit=n + 8, keepalive_timeout=60),
        timeout=aiohttp.ClientTimeout(total=spec["timeout_s"], sock_connect=10),
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
    )
    async with session:
        await asyncio.gather(*(one(session, i) for i in spec["indices"]))
    return {
        **c,
        "ttfts_ms": ttfts,
        "connects_ms": connects,
        "late_p99_ms": load.pct(late, 0.99),
        "error_kinds": dict(kinds),
    }


def client_main(path: Path) -> int:
    """`--client SPEC.json`: run the streams it names, write the result beside it."""
    import uvloop

    spec = json.loads(path.read_text())
    result = uvloop.run(_client(spec))
    path.with_suffix(".out.json").write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------------- phases


def start_engine(
    procs: Procs, tmp: Path, name: str, ports: int, model: str, itl: float
) -> tuple[Child, list[str]]:
    """One fast engine process on `ports` ports; it and their base URLs."""
    pf = tmp / f"{name}.ports"
    argv = [sys.executable, str(HERE / "perf" / "fast_engine.py"), "--ports", str(ports)]
    argv += ["--ports-file", str(pf), "--name", name, "--model", model, "--itl-ms", str(itl)]
    child = procs.start(name, argv)
    return child, [f"http://127.0.0.1:{p}" for p in pf.read_text().split()]


def stop(procs: Procs, t: Target) -> None:
    for c in t.roots:
        procs.children.remove(c)
        procs.stop(c)


def _until(when: float) -> None:
    time.sleep(max(0.0, when - clock()))


def _backends(base: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(base + "/admin/backends", timeout=5) as r:
        return list(json.loads(r.read())["backends"])


def _ejections(t: Target) -> int:
    return sum(c.log.read_text(errors="replace").count('"to":"ejected"') for c in t.roots)


def probing(
    args: argparse.Namespace, procs: Procs, tmp: Path, n: int, urls: list[str]
) -> dict[str, Any]:
    """One gateway on `n` backends, no client load: CPU and RSS over `idle_s`."""
    t = fleet.start_pulsegate(procs, tmp, urls[:n], [], 1, args.ready_timeout, f"pg-b{n}", args.src)
    pid = t.roots[0].pid
    base = t.zero_url.removesuffix(CHAT)
    _until(clock() + args.warm_s)
    u0, w0, la0 = usage([pid]), clock(), loadavg()
    _until(w0 + args.idle_s)
    u1, w1 = usage([pid]), clock()
    states = Counter(b["state"] for b in _backends(base))
    share = (u1.cpu_s - u0.cpu_s) / (w1 - w0)
    row = {
        "backends": n,
        "cpu_pct": share * 100,
        "us_per_s_per_backend": share * 1e6 / n,
        "rss_mb": u1.rss_mb,
        "fds": fds(pid),
        "states": dict(states),
        "ejections": _ejections(t),
        "loadavg": f"{la0} -> {loadavg()}",
    }
    if args.pyspy and n == max(args.backends):
        row["pyspy"] = _pyspy(pid, args.idle_s, args.out.parent / f"scale-pyspy-b{n}.txt")
    stop(procs, t)
    return row


def _pyspy(pid: int, seconds: float, out: Path) -> dict[str, Any]:
    """Where the idle gateway's probing CPU goes: py-spy's inclusive top functions."""
    spy = profiling.start_pyspy(pid, seconds, out, 100)
    _, err = spy.communicate(timeout=seconds + 60)
    if spy.returncode != 0:
        return {"error": err.decode(errors="replace")[-300:]}
    roots = [REPO / "src", Path(aiohttp.__file__).parent.parent, Path(os.__file__).parent]
    found = profiling.categorize(out, roots)
    return {"samples": found["samples"], "inclusive": found["inclusive"][:15]}


def run_streams(
    args: argparse.Namespace, procs: Procs, tmp: Path, url: str, s: int, pid: int, engine: int
) -> dict[str, Any]:
    """`s` streams at `url` from the client processes; `pid` (the target: gateway, or the
    engine when direct) sampled for RSS and fds; its, the engine's and the clients' CPU
    over the window."""
    stream_s = args.tokens * args.itl_ms / 1000
    t0 = clock() + 2.0  # the clients import aiohttp and connect meanwhile
    w0, w1 = t0 + args.ramp_s + 0.2, t0 + stream_s - 0.2
    k = max(1, min(args.client_procs, s))
    specs = []
    for j in range(k):
        spec = {"url": url, "indices": list(range(j, s, k)), "total": s, "t0": t0, "w0": w0}
        spec |= {"w1": w1, "ramp_s": args.ramp_s, "tokens": args.tokens}
        spec["timeout_s"] = stream_s * 4 + 30
        path = tmp / f"client-{s}-{j}.json"
        path.write_text(json.dumps(spec))
        specs.append(path)
    argv = [sys.executable, str(Path(__file__).resolve()), "--client"]
    tcp0 = _tcp_counters()
    clients = [procs.start(p.stem, [*argv, str(p)], announce=False) for p in specs]
    cpids = [c.pid for c in clients]
    # Until t0 the clients only start up: the target's CPU then is its idle (probing) share.
    i0, it0 = usage([pid]), clock()
    _until(t0 - 0.05)
    idle = (usage([pid]).cpu_s - i0.cpu_s) / (clock() - it0)
    rss0 = usage([pid]).rss_mb
    _until(w0)
    u0, e0, c0, la0 = usage([pid]), usage([engine]), usage(cpids), loadavg()
    peak_rss, peak_fds = rss0, 0
    while clock() < w1:
        peak_rss = max(peak_rss, usage([pid]).rss_mb)
        peak_fds = max(peak_fds, fds(pid))
        time.sleep(0.1)
    u1, e1, c1 = usage([pid]), usage([engine]), usage(cpids)
    for c in clients:
        _wait(procs, c, stream_s * 4 + 60)
    outs = [json.loads(p.with_suffix(".out.json").read_text()) for p in specs]
    ttfts = [x for o in outs for x in o["ttfts_ms"]]
    connects = [x for o in outs for x in o["connects_ms"]]
    tcp = {k: v - tcp0.get(k, 0) for k, v in _tcp_counters().items()}
    window_tokens = sum(o["window_tokens"] for o in outs)
    cpu = u1.cpu_s - u0.cpu_s
    return {
        "streams": s,
        "ttft_p50_ms": load.pct(ttfts, 0.5),
        "ttft_p99_ms": load.pct(ttfts, 0.99),
        "connect_p50_ms": load.pct(connects, 0.5),
        "connect_p99_ms": load.pct(connects, 0.99),
        "tokens_per_s": window_tokens / (w1 - w0),
        "cpu_pct": cpu / (w1 - w0) * 100,
        "cpu_us_per_token": cpu * 1e6 / max(1, window_tokens),
        "idle_cpu_pct": idle * 100,
        "cpu_us_per_token_net": (cpu - idle * (w1 - w0)) * 1e6 / max(1, window_tokens),
        "engine_cpu_pct": (e1.cpu_s - e0.cpu_s) / (w1 - w0) * 100,
        "client_cpu_pct": (c1.cpu_s - c0.cpu_s) / (w1 - w0) * 100 / k,
        "client_late_p99_ms": max(o["late_p99_ms"] for o in outs),
        "rss_before_mb": rss0,
        "rss_peak_mb": peak_rss,
        "kb_per_stream": (peak_rss - rss0) * 1024 / s,
        "peak_fds": peak_fds,
        "tokens": sum(o["tokens"] for o in outs),
        "errors": sum(o["errors"] for o in outs),
        "incomplete": sum(o["incomplete"] for o in outs),
        "error_kinds": dict(sum((Counter(o["error_kinds"]) for o in outs), Counter())),
        "loadavg": f"{la0} -> {loadavg()}",
        "tcp": tcp,
    }


def _tcp_counters() -> dict[str, int]:
    """The kernel's TcpExt counters that say a listener dropped or a SYN was sent again
    (the whole host's: loopback here, but other work on the box counts too)."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    names, values = lines[0].split()[1:], lines[1].split()[1:]
    keep = ("ListenOverflows", "ListenDrops", "TCPSynRetrans", "TCPReqQFullDrop")
    return {k: int(v) for k, v in zip(names, values, strict=True) if k in keep}


def _wait(procs: Procs, c: Child, timeout: float) -> None:
    rc = c.popen.wait(timeout=timeout)
    procs.children.remove(c)
    c.fh.close()
    if rc != 0:
        raise RuntimeError(f"{c.name} exited rc={rc}:\n{c.log.read_text(errors='replace')[-2000:]}")


def streams(
    args: argparse.Namespace, procs: Procs, tmp: Path, s: int, urls: list[str], engine: int
) -> dict[str, Any]:
    """`s` streams direct to one engine port, then through a fresh gateway on every port."""
    direct = run_streams(args, procs, tmp, urls[0] + CHAT, s, engine, engine)
    t = fleet.start_pulsegate(procs, tmp, [], urls, 1, args.ready_timeout, f"pg-s{s}", args.src)
    pid = t.roots[0].pid
    # A few streams first: lazy imports and the first pools are start-up, not per stream.
    asyncio.run(_warm(t.stream_url))
    gw = run_streams(args, procs, tmp, t.stream_url, s, pid, engine)
    gw["ejections"] = _ejections(t)
    stop(procs, t)
    offered = s * 1000 / args.itl_ms  # every stream at full pace
    return {"streams": s, "offered_tokens_per_s": offered, "direct": direct, "gateway": gw}


async def _warm(url: str) -> None:
    async with load.new_session() as session:
        for _ in range(8):
            async with session.post(url, data=load.stream_body(4), headers=load.HEADERS) as r:
                await r.read()


# ---------------------------------------------------------------------------------- report


def _f(x: float, spec: str = ".0f") -> str:
    return "-" if x != x else format(x, spec)  # NaN: no sample


def probing_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| backends | gateway CPU, % of a core | CPU per backend, µs/s | RSS MB | fds "
        "| states at end | ejections | load avg |",
        "|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        states = ", ".join(f"{k} {v}" for k, v in sorted(r["states"].items()))
        out.append(
            f"| {r['backends']} | {_f(r['cpu_pct'], '.1f')} | {_f(r['us_per_s_per_backend'])} "
            f"| {_f(r['rss_mb'], '.1f')} | {r['fds']} | {states} | {r['ejections']} "
            f"| {r['loadavg']} |"
        )
    for r in rows:
        if r.get("pyspy", {}).get("inclusive"):
            out += ["", f"py-spy, {r['backends']} backends idle: inclusive share of samples", ""]
            out += ["| function | share |", "|---|---:|"]
            out += [f"| `{k}` | {v:.1%} |" for k, v in r["pyspy"]["inclusive"]]
    return "\n".join(out)


def streams_table(points: list[dict[str, Any]]) -> str:
    """One row per point; "CPU to keep up": the offered tokens/s x net µs/token, the share
    of a core the gateway would need for every token to leave on time."""
    out = [
        "| streams | TTFT p50 / p99 ms, gateway | direct | tokens/s, gateway | direct "
        "| gateway CPU, % of a core | CPU to keep up | µs/token (net of idle) "
        "| RSS before → peak MB | KB/stream | peak fds | connect p99 ms "
        "| listen drops / SYN resent "
        "| client CPU % (each) | errors / incomplete | load avg |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in points:
        g, d = p["gateway"], p["direct"]
        out.append(
            f"| {p['streams']} | {_f(g['ttft_p50_ms'], '.1f')} / {_f(g['ttft_p99_ms'], '.1f')} "
            f"| {_f(d['ttft_p50_ms'], '.1f')} / {_f(d['ttft_p99_ms'], '.1f')} "
            f"| {_f(g['tokens_per_s'])} | {_f(d['tokens_per_s'])} | {_f(g['cpu_pct'])} "
            f"| {_f(p['offered_tokens_per_s'] * g['cpu_us_per_token_net'] / 1e4)} "
            f"| {_f(g['cpu_us_per_token'])} ({_f(g['cpu_us_per_token_net'])}) "
            f"| {_f(g['rss_before_mb'], '.1f')} → {_f(g['rss_peak_mb'], '.1f')} "
            f"| {_f(g['kb_per_stream'], '.1f')} | {g['peak_fds']} | {_f(g['connect_p99_ms'])} "
            f"| {g['tcp'].get('ListenDrops', 0)} / {g['tcp'].get('TCPSynRetrans', 0)} "
            f"| {_f(g['client_cpu_pct'])} "
            f"| {g['errors']} / {g['incomplete']} | {g['loadavg']} |"
        )
    return "\n".join(out)


# ---------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client is not None:
        return client_main(args.client)
    nofile = raise_nofile()
    log_dir = args.out.parent / "scale_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    stop_on_signals(args.max_seconds)
    env = {"cpus": str(os.cpu_count()), "nofile": str(nofile), "loadavg_start": loadavg()}
    procs = Procs(log_dir)
    rows: list[dict[str, Any]] = []
    points: list[dict[str, Any]] = []
    t_start = clock()
    with tempfile.TemporaryDirectory(prefix="pulsegate-scale-") as tmp_name:
        tmp = Path(tmp_name)
        try:
            if args.backends:
                eng, urls = start_engine(
                    procs, tmp, "probe-engine", max(args.backends), ZERO_MODEL, 0
                )
                for n in args.backends:
                    rows.append(probing(args, procs, tmp, n, urls))
                    r = rows[-1]
                    log(
                        f"probing {n:4d} backends: {r['cpu_pct']:.1f} % of a core, "
                        f"{r['us_per_s_per_backend']:.0f} µs/s each, RSS {r['rss_mb']:.0f} MB"
                    )
                procs.children.remove(eng)
                procs.stop(eng)
            if args.streams:
                eng, urls = start_engine(
                    procs, tmp, "stream-engine", args.stream_backends, STREAM_MODEL, args.itl_ms
                )
                for s in args.streams:
                    points.append(streams(args, procs, tmp, s, urls, eng.pid))
                    g, d = points[-1]["gateway"], points[-1]["direct"]
                    log(
                        f"streams {s:5d}: TTFT p99 {g['ttft_p99_ms']:.1f} ms "
                        f"(direct {d['ttft_p99_ms']:.1f}), {g['tokens_per_s']:.0f} tok/s "
                        f"(direct {d['tokens_per_s']:.0f}), {g['kb_per_stream']:.1f} KB/stream"
                    )
        except KeyboardInterrupt:
            return interrupted()
        finally:
            signal.alarm(0)
            procs.stop_all()
    env["loadavg_end"] = loadavg()
    env["wall_s"] = f"{clock() - t_start:.0f}"
    cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    tables = [probing_table(rows)] if rows else []
    print("\n\n".join(tables + ([streams_table(points)] if points else [])))
    doc = {"config": cfg, "env": env, "probing": rows, "streams": points}
    args.out.write_text(json.dumps(doc, indent=2, default=str))
    print(
        f"\nwrote {args.out} (logs: {log_dir}); load avg {env['loadavg_start']} -> "
        f"{env['loadavg_end']} on {env['cpus']} CPUs",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
