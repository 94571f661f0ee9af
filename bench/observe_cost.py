"""What the access log and the traces cost the proxy path: gateway CPU per request, on vs off.

    .venv/bin/python bench/observe_cost.py [--requests 2000] [--rounds 5] [--concurrency 8]
        [--stream] [--json FILE]

Starts one `pulsegate sim` (no token delay) and four real gateways in front of it, the same
config but for the keys under test: `off` (neither), `log` (`gateway.access_log: FILE`),
`trace` (`observability.otlp_endpoint`, exported to an OTLP/HTTP sink this process serves on
loopback, which answers 200 to every batch) and `both`. Each round drives `--requests`
non-streamed chat requests (or streams with `--stream`) through each gateway in turn, at
`--concurrency` in flight, and reads the gateway process's CPU time (user + system, all its
threads: the access log's writer and the exporter thread included) from /proc before and
after each round (so the work their threads do after a block is counted too), less the
gateway's idle CPU rate over the round. The figure per mode is the median over rounds of
CPU microseconds per request; each ratio is the median over rounds of that round's
mode / `off`, so load from elsewhere on the box (other test runs) shifts all modes alike.
Every child is stopped by PID at the end.

Then, in this process, the added work per request measured alone on the thread's CPU
clock (steady state, 20,000 calls): the access log's line, the tracer's request-path part
(ids, verdict, header) and its exporter-thread part (the spans, encoded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support import Gateway, Sim, backend_entry

# Slow active probes: the gateways' idle CPU (probes, timers) stays small next to the
# requests'; what is left is measured per gateway and subtracted.
SLOW_PROBES = {
    "readiness": {"interval": "20s", "interval_unstable": "20s"},
    "micro_inference": {"interval": "20s", "jitter": "0s"},
    "canary": {"interval": "20s"},
}
IDLE_S = 2.0
SETTLE_S = 1.5  # the exporter sends a batch every second; the log writes every 100 ms

CLK_TCK = os.sysconf("SC_CLK_TCK")
# `same`: a second gateway configured like `off` (an A/A check of the method itself).
ALL_MODES = ("off", "log", "trace", "both", "same")
_MESSAGES = [{"role": "user", "content": "Say hello in five words, please. Keep it short."}]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all threads (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Sink:
    """An OTLP/HTTP receiver that only counts: 200 with an empty protobuf answer."""

    def __init__(self) -> None:
        self.batches = 0
        self.bytes = 0
        self.port = 0

    async def _traces(self, request: web.Request) -> web.Response:
        self.bytes += len(await request.read())
        self.batches += 1
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return runner


async def drive(url: str, n: int, concurrency: int, stream: bool) -> int:
    """`n` requests, `concurrency` at a time; returns how many got a 200."""
    body = orjson.dumps(
        {"model": "demo-7b", "messages": _MESSAGES, "max_tokens": 16, "stream": stream}
    )
    ok = 0
    left = n
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def worker() -> None:
            nonlocal ok, left
            while left > 0:
                left -= 1
                async with s.post(
                    url, data=body, headers={"content-type": "application/json"}
                ) as r:
                    await r.read()
                    ok += r.status == 200

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok


def start(tmp: Path, sim: Sim, mode: str, sink_port: int) -> Gateway:
    cfg: dict[str, Any] = {
        "backends": [backend_entry(sim)],
        "probes": SLOW_PROBES,
        "gateway": {},
    }
    if mode in ("log", "both"):
        cfg["gateway"]["access_log"] = str(tmp / f"access-{mode}.log")
    if mode in ("trace", "both"):
        cfg["observability"] = {"otlp_endpoint": f"http://127.0.0.1:{sink_port}"}
    gw = Gateway(tmp, cfg, name=f"gw-{mode}")
    gw.wait_all_ready()
    return gw


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    modes = tuple(args.modes)  # this run's, "off" first
    sink = Sink()
    runner = await sink.start()
    sim = Sim(tmp, "a", "--ttft-ms", "0", "--itl-ms", "0")
    gws: dict[str, Gateway] = {}
    try:
        for m in modes:
            gws[m] = start(tmp, sim, m, sink.port)
        for gw in gws.values():  # warm-up: connections, caches, the first second's stamp
            await drive(f"{gw.url}/v1/chat/completions", 300, args.concurrency, args.stream)
        idle: dict[str, float] = {}  # CPU seconds per second, doing nothing
        t0 = {m: (cpu_s(gw.pid), time.monotonic()) for m, gw in gws.items()}
        await asyncio.sleep(IDLE_S)
        for m, gw in gws.items():
            idle[m] = (cpu_s(gw.pid) - t0[m][0]) / (time.monotonic() - t0[m][1])
        per: dict[str, list[float]] = {m: [] for m in modes}
        # Each round reads every gateway's CPU at its start and end: a gateway's block and
        # the work its threads do after it (the log's writes, the exporter's batch), while
        # the next gateways are driven, land in the same round. The order alternates.
        for rnd in range(args.rounds):
            order = modes if rnd % 2 == 0 else tuple(reversed(modes))
            before = {m: cpu_s(gw.pid) for m, gw in gws.items()}
            w0 = time.monotonic()
            for m in order:
                url = f"{gws[m].url}/v1/chat/completions"
                got = await drive(url, args.requests, args.concurrency, args.stream)
                assert got == args.requests, f"{m}: {got} of {args.requests} ok"
            await asyncio.sleep(SETTLE_S)  # the last one's batch
            wall = time.monotonic() - w0
            for m, gw in gws.items():
                used = cpu_s(gw.pid) - before[m] - idle[m] * wall
                per[m].append(used / args.requests * 1e6)
            print(
                f"round {rnd + 1}: " + "  ".join(f"{m} {per[m][-1]:.0f} us" for m in modes),
                flush=True,
            )
    finally:
        for gw in gws.values():
            gw.stop()
        sim.stop()
        await runner.cleanup()
    med = {m: statistics.median(v) for m, v in per.items()}
    # The ratio of each round (same seconds, same neighbours), then the median of those.
    ratio = {
        m: statistics.median(a / b for a, b in zip(per[m], per["off"], strict=True)) for m in modes
    }
    log_lines = sum(
        len((tmp / f"access-{m}.log").read_bytes().splitlines())
        for m in ("log", "both")
        if m in modes
    )
    return {
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "stream": args.stream,
        "cpu_us_per_request": {m: round(v, 1) for m, v in med.items()},
        "ratio_vs_off": {m: round(ratio[m], 3) for m in modes},
        "rounds_us": {m: [round(x, 1) for x in v] for m, v in per.items()},
        "idle_cpu_share": {m: round(idle[m], 4) for m in modes},
        "log_lines": log_lines,
        "otlp_batches": sink.batches,
        "otlp_bytes": sink.bytes,
    }


def micro(n: int = 20_000) -> dict[str, float]:
    """CPU microseconds per call of the added work, one exchange of one ok attempt."""
    import random

    from pulsegate.config import ObservabilityConfig, parse_config
    from pulsegate.health.verdict import State, Verdict
    from pulsegate.observe import spans
    from pulsegate.observe.access_log import AccessLog
    from pulsegate.observe.metrics import Counter
    from pulsegate.observe.traces import Tracer
    from pulsegate.proxy.exchange import Exchange
    from pulsegate.proxy.targets import target

    class Verdicts:
        def routable(self, model: str) -> tuple[Verdict, ...]:
            return (Verdict("b", State.READY, 95.0, 1.0), Verdict("a", State.READY, 97.0, 1.0))

    cfg = parse_config({"backends": [{"name": "a", "url": "http://127.0.0.1:8000"}]})
    tg = target(cfg.backends[0])
    tracer = Tracer(
        ObservabilityConfig("http://127.0.0.1:9/v1/traces"), Verdicts(), Counter("t", "")
    )
    with tempfile.TemporaryDirectory() as d:
        log = AccessLog(os.path.join(d, "a.log"), Counter("d", ""))

    def exchange() -> Exchange:
        ex = Exchange(100.0, time.time(), "/v1/chat/completions", "chat")
        ex.model = "demo-7b"
        ex.backends.append("a")
        a = ex.attempt("a", 100.001)
        tracer.headers(ex, tg)
        a.end, a.status, a.outcome = 100.02, 200, "ok"
        ex.status, ex.end, ex.ttft, ex.tokens_in, ex.tokens_out = 200, 100.03, 0.01, 12, 16
        return ex

    exs = [exchange() for _ in range(200)]
    clock = time.thread_time
    out = {}
    t0 = clock()
    for i in range(n):
        log.line(exs[i % 200])
    out["access_log_line_us"] = (clock() - t0) / n * 1e6
    t0 = clock()
    for i in range(n):
        ex = exs[i % 200]
        ex.trace = None
        tracer.headers(ex, tg)
    out["trace_request_path_us"] = (clock() - t0) / n * 1e6
    enc, rng = tracer._encoder, random.Random()
    t0 = clock()
    for i in range(n):
        ex = exs[i % 200]
        spans.spans(ex, tracer.ids(ex), enc, rng)
    out["trace_export_thread_us"] = (clock() - t0) / n * 1e6
    return {k: round(v, 2) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["log", "trace", "both"],
        choices=ALL_MODES,
        help="the gateways to start (fewer: less contention on a small box); off is added",
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.modes = ["off", *(m for m in ALL_MODES[1:] if m in args.modes)]
    with tempfile.TemporaryDirectory(prefix="observe-cost-") as d:
        out = asyncio.run(run(args, Path(d)))
    out["added_cpu_us_per_request"] = micro()
    print(json.dumps(out, indent=2))
    r = out["ratio_vs_off"]
    shown = ", ".join(f"{m} {r[m]:.3f}x" for m in args.modes[1:])
    print(f"CPU per request vs off: {shown} (median of {args.rounds} rounds of {args.requests})")
    m = out["added_cpu_us_per_request"]
    print(
        f"added work alone: log line {m['access_log_line_us']} us, trace on the request path "
        f"{m['trace_request_path_us']} us, spans encoded {m['trace_export_thread_us']} us; "
        f"the proxy path off: {out['cpu_us_per_request']['off']} us"
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
