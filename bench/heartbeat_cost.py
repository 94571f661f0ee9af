"""What the heartbeat costs the gateway: CPU of N `HeartbeatClient`s pinging N agents.

    .venv/bin/python bench/heartbeat_cost.py [--agents 100] [--seconds 10] [--interval 0.1]
        [--agent-procs 2] [--no-uvloop] [--tls] [--json FILE]

Starts one `pulsegate sim` (the engine every agent watches), `--agent-procs` processes
hosting the N agents between them (real `Agent` components, each its own gRPC server and
port), then, in this process - the "gateway" - N clients with the default probe settings
(ping every `--interval`, 80 ms timeout, micro-inference every 3-5 s) on uvloop like
`pulsegate serve`. After a warm-up it measures this process's CPU time (user + system, all
threads: gRPC's own threads included) over `--seconds` and prints it as a share of one
core, with pongs/s, misses and RTT percentiles. Agents refresh their engine snapshot every
2 s here (instead of 150 ms) so that their load, which is not the gateway's, disturbs the
measurement less on a small machine. Every child is stopped by PID at the end.

`--tls` measures twice in the same run, against the same agent processes: first the N
clients in plaintext, then N clients over mutual TLS (`agent_tls` with a CA, a client
certificate and key) to N more agents serving ``--tls-cert/--tls-key/--tls-client-ca``,
and prints the TLS / plaintext CPU ratio. The certificates are made with the `openssl`
commands of docs/agent-tls.md, so the bench also checks that those commands work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _make_certs(d: Path) -> None:
    """A CA, the agents' certificate (SAN 127.0.0.1) and the gateway's client certificate,
    with the openssl commands docs/agent-tls.md gives."""

    def sh(*argv: str) -> None:
        subprocess.run(argv, cwd=d, check=True, capture_output=True)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    sh("openssl", "req", "-x509", *ec, "-days", "1", "-subj", "/CN=bench CA",
       "-keyout", "ca.key", "-out", "ca.pem")  # fmt: skip
    exts = {
        "agent": "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        "gateway": "extendedKeyUsage=clientAuth\n",
    }
    for name, ext in exts.items():
        (d / f"{name}.ext").write_text(ext)
        sh("openssl", "req", *ec, "-subj", f"/CN={name}", "-keyout", f"{name}.key",
           "-out", f"{name}.csr")  # fmt: skip
        sh("openssl", "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem",
           "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
           "-extfile", f"{name}.ext", "-out", f"{name}.pem")  # fmt: skip


def _agents_main(engine: str, count: int, refresh: float, certs: str) -> None:
    """Child process: `count` in-process agents (and, with a `certs` folder, `count` more
    serving mutual TLS); prints their ports, runs until SIGTERM."""
    from pulsegate.agent.server import Agent
    from pulsegate.agent.tls import read_server_files

    async def main() -> None:
        agents = [Agent(engine, "127.0.0.1:0", gpu="engine", refresh=refresh) for _ in range(count)]
        if certs:
            d = Path(certs)
            files = read_server_files(str(d / "agent.pem"), str(d / "agent.key"), str(d / "ca.pem"))
            agents += [
                Agent(engine, "127.0.0.1:0", gpu="engine", refresh=refresh, tls=files)
                for _ in range(count)
            ]
        ports = [await a.start() for a in agents]
        print("ports " + " ".join(map(str, ports)), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        for a in agents:
            await a.stop(grace=0)

    asyncio.run(main())


def _read_line(proc: subprocess.Popen[bytes], pattern: str, timeout: float = 60.0) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode()
        if not line:
            break
        if re.search(pattern, line):
            return line.strip()
    raise RuntimeError(f"child did not print {pattern!r}")


async def _gateway(
    ports: list[int], args: argparse.Namespace, certs: Path | None = None
) -> dict[str, float]:
    from pulsegate.clock import SystemClock
    from pulsegate.config import AgentTlsConfig, HeartbeatConfig, MicroInferenceConfig
    from pulsegate.health.observations import Heartbeat, Observation, ProbeResult
    from pulsegate.probers.heartbeat import HeartbeatClient

    counts = {"good": 0, "miss": 0, "micro": 0}
    rtts: list[float] = []

    def emit(name: str, obs: Observation) -> None:
        if isinstance(obs, Heartbeat):
            if obs.rtt_s is None:
                counts["miss"] += 1
            else:
                counts["good"] += 1
                if len(rtts) < 200_000:
                    rtts.append(obs.rtt_s)
        elif isinstance(obs, ProbeResult):
            counts["micro"] += 1

    cfg = HeartbeatConfig(interval=args.interval, timeout=0.08, misses_to_dead=3)
    clock = SystemClock(asyncio.get_running_loop())
    tls = None
    if certs is not None:
        tls = AgentTlsConfig(
            ca=str(certs / "ca.pem"),
            cert=str(certs / "gateway.pem"),
            key=str(certs / "gateway.key"),
        )
    clients = [
        HeartbeatClient(
            f"b{i}", f"127.0.0.1:{p}", cfg, MicroInferenceConfig(), emit, clock=clock, tls=tls
        )
        for i, p in enumerate(ports)
    ]
    tasks = [asyncio.create_task(c.run()) for c in clients]
    await asyncio.sleep(args.warmup)
    c0 = {k: v for k, v in counts.items()}
    rtts.clear()
    t0, w0 = os.times(), time.monotonic()
    await asyncio.sleep(args.seconds)
    t1, w1 = os.times(), time.monotonic()
    c1 = {k: v for k, v in counts.items()}
    await asyncio.gather(*(c.close() for c in clients))
    await asyncio.gather(*tasks, return_exceptions=True)
    clock.close()
    wall = w1 - w0
    q = statistics.quantiles(rtts, n=100) if len(rtts) > 100 else [float("nan")] * 99
    return {
        "agents": len(ports),
        "interval_s": args.interval,
        "seconds": wall,
        "cpu_pct_of_core": 100 * ((t1.user - t0.user) + (t1.system - t0.system)) / wall,
        "user_pct": 100 * (t1.user - t0.user) / wall,
        "sys_pct": 100 * (t1.system - t0.system) / wall,
        "pongs_per_s": (c1["good"] - c0["good"]) / wall,
        "misses": c1["miss"] - c0["miss"],
        "micro_results": c1["micro"] - c0["micro"],
        "rtt_p50_ms": q[49] * 1e3,
        "rtt_p99_ms": q[98] * 1e3,
    }


def _line(r: dict[str, float], label: str) -> str:
    return (
        f"{label}{r['agents']} agents @ {r['interval_s'] * 1e3:.0f} ms: gateway CPU "
        f"{r['cpu_pct_of_core']:.1f}% of one core (user {r['user_pct']:.1f}%, "
        f"sys {r['sys_pct']:.1f}%) over {r['seconds']:.1f}s; "
        f"{r['pongs_per_s']:.0f} pongs/s, {r['misses']} misses, "
        f"{r['micro_results']} micro results, RTT p50 {r['rtt_p50_ms']:.2f} ms "
        f"p99 {r['rtt_p99_ms']:.2f} ms"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--agents", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--interval", type=float, default=0.1)
    ap.add_argument("--agent-procs", type=int, default=2)
    ap.add_argument("--agent-refresh", type=float, default=2.0)
    ap.add_argument("--no-uvloop", action="store_true")
    ap.add_argument("--tls", action="store_true", help="plaintext, then mutual TLS: the ratio")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--_agents", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._agents:
        engine, count, refresh, certs = args._agents
        _agents_main(engine, int(count), float(refresh), certs)
        return 0

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    children: list[subprocess.Popen[bytes]] = []
    tmp = tempfile.TemporaryDirectory(prefix="pulsegate-bench-tls-")
    certs = Path(tmp.name) if args.tls else None
    results: dict[str, dict[str, float]] = {}
    try:
        if certs is not None:
            _make_certs(certs)
        sim = subprocess.Popen(
            [sys.executable, "-m", "pulsegate", "sim", "--port", "0", "--name", "bench"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        children.append(sim)
        engine = re.search(r"http://\S+", _read_line(sim, "listening on")).group(0)  # type: ignore[union-attr]
        per = [args.agents // args.agent_procs] * args.agent_procs
        for i in range(args.agents % args.agent_procs):
            per[i] += 1
        plain: list[int] = []
        secure: list[int] = []
        procs = []
        for n in per:
            if n == 0:
                continue
            cmd = [sys.executable, __file__, "--_agents", engine, str(n), str(args.agent_refresh)]
            p = subprocess.Popen(
                [*cmd, str(certs or "")], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
            )
            children.append(p)
            procs.append((p, n))
        for p, n in procs:
            got = [int(x) for x in _read_line(p, r"^ports ").split()[1:]]
            plain += got[:n]
            secure += got[n:]

        runs = [("plaintext", plain, None)] + ([("mtls", secure, certs)] if certs else [])
        for label, ports, folder in runs:
            if args.no_uvloop:
                results[label] = asyncio.run(_gateway(ports, args, folder))
            else:
                import uvloop

                with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                    results[label] = runner.run(_gateway(ports, args, folder))
            results[label]["uvloop"] = not args.no_uvloop
    finally:
        for p in reversed(children):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
        for p in reversed(children):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
        tmp.cleanup()
    out: dict[str, object] = dict(results["plaintext"])
    if "mtls" in results:
        ratio = results["mtls"]["cpu_pct_of_core"] / max(
            results["plaintext"]["cpu_pct_of_core"], 1e-9
        )
        print(_line(results["plaintext"], "plaintext: "))
        print(_line(results["mtls"], "mutual TLS: "))
        print(f"TLS / plaintext gateway CPU: {ratio:.2f}x")
        out = {"plaintext": results["plaintext"], "mtls": results["mtls"], "tls_ratio": ratio}
    else:
        print(_line(results["plaintext"], ""))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
