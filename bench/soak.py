"""Issue #22, item 5: the soak. Mixed load for `--minutes`, a fault every minute, the
gateway's resources sampled; `make soak` (30 min), `make soak SOAK_ARGS=--minutes 3` in CI.

    .venv/bin/python bench/soak.py [--minutes 30] [--rate 30] [--fault-every 60]
        [--fault-hold 20] [--no-agent] [--json bench/results/soak.json]

The fleet: 3 `pulsegate sim`s on fixed ports (a killed one restarts on its own port), a
`pulsegate agent` beside the first (its heartbeats feed the gateway's verdicts), one
`pulsegate serve` with the default configuration.

The load, open loop at `--rate` requests a second: half of it chaos/load.py's chat client
(half streamed, half long prompts), half `Mixed` below: completions (streamed or not),
embeddings, and Responses (streamed or not), in equal shares. Every request gets 30 s to
end whole: a non-200, a transport error, a stream without its end (`[DONE]`, or
`response.completed` for Responses) or with an error event is a client error.

The faults: every `--fault-every` seconds (the first at half of it) the next of `FAULTS` on
the next sim, lifted after `--fault-hold` s: the sim's own runtime faults (`POST /sim/fault`,
`src/pulsegate/sim/faults.py`) and `kill`, a SIGKILL then, at the lift, a restart on the
same port.

Every 5 s the gateway's RSS (VmRSS), open fds (/proc/PID/fd, told apart: client TCP
connections, other TCP connections - backends, agent -, and the rest), threads
(/proc/PID/status) and asyncio tasks (`pulsegate_event_loop_tasks` in /metrics) are read.
Targets after the warm-up (the first 20%), printed PASS/FAIL: RSS growth <= 10% (the last
three samples' median against the first three's); fds flat: the fds that are not TCP
connections, the threads and the tasks no higher in the last third (median) than in the
first (highest) plus 2, 1 and max(5, 10%), no
TCP connection left in CLOSE_WAIT (the peer closed, the gateway never did: the classic fd
leak), and no client connection left open once the load's clients have closed theirs; 0
client errors; every stream whole. All fds together are shown, not judged: the connection
pools grow with the concurrency a fault or a busy box brings (a hang holds connections
open) and a killed engine's connections close.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from chaos.load import Load, Result, _prompt, _read_stream  # noqa: E402

from overload import (  # noqa: E402
    MODEL,
    Sampler,
    fd_kinds,
    proc_sample,
    sim_argv,
    start_gateway,
    start_sim,
)
from perf.procs import Child, Procs, free_port, wait_port  # noqa: E402

# Runtime faults of `pulsegate sim` and a kill, in this order (the 3-minute form gets the
# first three). Parameters chosen to hurt: every request, and a 5x slowdown.
FAULTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("kill", {}),
    ("hang", {}),
    ("stall", {"after_tokens": 3}),
    ("error", {"rate": 1.0}),
    ("reset", {"after_tokens": 3}),
    ("slow", {"factor": 5.0}),
    ("oom", {}),
    ("cuda_hang", {}),
    ("bad_utf8", {}),
    ("headers_reset", {}),
)
KINDS = ("completions", "completions_stream", "embeddings", "responses", "responses_stream")
TIMEOUT_S = 30.0
SAMPLE_S = 5.0


class Row(Result):
    """A `Result` that says which API it asked."""

    __slots__ = ("api",)
    api: str

    def row(self) -> dict[str, Any]:
        return {**super().row(), "api": getattr(self, "api", "chat")}


class Mixed(Load):
    """chaos/load.py's open-loop client, asking the other APIs in turn (`KINDS`)."""

    def __init__(self, base: str, rate: float, seed: int) -> None:
        super().__init__(base, rate=rate, max_tokens=16, timeout=TIMEOUT_S, seed=seed)
        self.base = base.rstrip("/")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        i = 0
        while not self._stop.is_set():
            delay = start + i / self.rate - loop.time()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
                    break
            kind = KINDS[i % len(KINDS)]
            t = loop.create_task(self._ask(kind, _prompt(self.rng, i, self.rng.random() < 0.5)))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
            self.sent += 1
            i += 1

    async def _ask(self, kind: str, text: str) -> None:
        assert self._session is not None
        stream = kind.endswith("_stream")
        api = kind.removesuffix("_stream")
        body: dict[str, Any] = {"model": MODEL}
        if api == "completions":
            body |= {"prompt": text, "max_tokens": self.max_tokens, "stream": stream}
        elif api == "embeddings":
            body |= {"input": text}
        else:
            body |= {"input": text, "max_output_tokens": self.max_tokens, "stream": stream}
        t0 = time.time()
        status, backend, attempts, error = 0, "", 0, ""
        ttft: float | None = None
        gap: float | None = None
        try:
            async with self._session.post(f"{self.base}/v1/{api}", json=body) as r:
                status = r.status
                backend = r.headers.get("x-pulsegate-backend", "")
                attempts = int(r.headers.get("x-pulsegate-attempts", "0") or 0)
                if status != 200:
                    await r.read()
                    error = "status"
                elif stream and api == "responses":
                    ttft, gap, error = await _read_typed(r, t0)
                elif stream:
                    ttft, gap, error = await _read_stream(r, t0)
                else:
                    doc = orjson.loads(await r.read())
                    ttft = time.time() - t0
                    key = {"completions": "choices", "embeddings": "data"}.get(api, "output")
                    if not doc.get(key):
                        error = "bad_body"
        except TimeoutError:
            error = "timeout"
        except (aiohttp.ClientError, OSError, orjson.JSONDecodeError) as e:
            error = f"transport:{type(e).__name__}"
        row = Row(t0, time.time(), stream, len(text) > 400, status, not error, error, backend,
                  attempts, ttft, gap)  # fmt: skip
        row.api = kind
        self.results.append(row)


async def _read_typed(r: aiohttp.ClientResponse, t0: float) -> tuple[float | None, float, str]:
    """A Responses stream: whole when `response.completed` came, no error event before."""
    ttft: float | None = None
    last: float | None = None
    gap = 0.0
    buf = b""
    async for chunk in r.content.iter_any():
        now = time.time()
        ttft = now - t0 if ttft is None else ttft
        gap = max(gap, now - last) if last is not None else gap
        last = now
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if b"event: response.completed" in event:
                return ttft, gap, ""
            if b"event: error" in event or b"event: response.failed" in event:
                return ttft, gap, "stream_error"
    return ttft, gap, "stream_cut"


# ------------------------------------------------------------------------- faults


class Faults:
    """Applies `FAULTS` in turn to the sims and lifts them; a log of what was done."""

    def __init__(self, procs: Procs, sims: list[Child], ports: list[int]) -> None:
        self.procs = procs
        self.sims = sims
        self.ports = ports
        self.log: list[dict[str, Any]] = []
        self.restarts = 0

    async def apply(self, k: int, session: aiohttp.ClientSession) -> tuple[int, str]:
        i = k % len(self.sims)
        mode, params = FAULTS[k % len(FAULTS)]
        if mode == "kill":
            os.kill(self.sims[i].pid, signal.SIGKILL)
            await asyncio.to_thread(self.sims[i].popen.wait, 10)
        else:
            await self._post(session, i, {"mode": mode, **params})
        self.log.append({"t": time.time(), "sim": f"s{i}", "fault": mode, **params})
        print(f"  {time.strftime('%H:%M:%S')} fault {mode} on s{i}", flush=True)
        return i, mode

    async def lift(self, i: int, mode: str, session: aiohttp.ClientSession) -> None:
        if mode == "kill":
            self.restarts += 1
            # Started from this (the main) thread: PR_SET_PDEATHSIG follows the thread that
            # forks, so a sim started from a worker thread would die with that thread.
            argv = sim_argv(f"s{i}", self.ports[i], 32, 30.0, 10.0, i)
            child = self.procs.start(f"s{i}-restart{self.restarts}", argv, announce=False)
            await asyncio.to_thread(wait_port, self.ports[i], child, 15.0)
            self.sims[i] = child
        else:
            await self._post(session, i, {"mode": "none"})
        self.log.append({"t": time.time(), "sim": f"s{i}", "fault": f"{mode} lifted"})

    async def _post(self, session: aiohttp.ClientSession, i: int, body: dict[str, Any]) -> None:
        url = f"http://127.0.0.1:{self.ports[i]}/sim/fault"
        async with session.post(url, json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"sim s{i}: fault {body} refused: {await r.text()}")


async def fault_cycle(
    faults: Faults, start: float, every: float, hold: float, until: float
) -> None:
    """A fault every `every` s from `start` (the first at `every` / 2), each lifted after
    `hold` s; none starts unless it can be lifted before `until`."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        k = 0
        while True:
            due = start + every / 2 + k * every
            if due + hold > until:
                return
            await asyncio.sleep(max(0.0, due - time.time()))
            i, mode = await faults.apply(k, session)
            await asyncio.sleep(hold)
            await faults.lift(i, mode, session)
            k += 1


# ------------------------------------------------------------------------- figures


def trend(rows: list[dict[str, float]], key: str) -> float:
    """Least-squares slope of `key` over time, per minute."""
    if len(rows) < 2:
        return 0.0
    ts = [r["t"] for r in rows]
    ys = [r[key] for r in rows]
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    den = sum((t - mt) ** 2 for t in ts)
    return 60 * sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / den if den else 0.0


def flat(rows: list[dict[str, float]], key: str, room_min: float, share: float) -> tuple[bool, str]:
    """Flat: the last third's median no higher than the first third's highest plus
    max(`room_min`, `share` of it). Pools and in-flight counts move with the faults (a
    hang holds connections open; a killed engine's connections close), so the test is
    against the level the run already reached, not its first sample."""
    n = max(1, len(rows) // 3)
    ref = max(r[key] for r in rows[:n])
    end = statistics.median(r[key] for r in rows[-n:])
    room = max(room_min, share * ref)
    peak = max(r[key] for r in rows)
    txt = f"first third's max {ref:.0f}, last third's median {end:.0f}, room {room:.0f}; "
    return end <= ref + room, txt + f"trend {trend(rows, key):+.2f}/min, peak {peak:.0f}"


async def run(args: argparse.Namespace, procs: Procs, tmp: Path) -> dict[str, Any]:
    ports = [free_port() for _ in range(3)]
    sims = [start_sim(procs, f"s{i}", ports[i], 32, 30.0, 10.0, i) for i in range(3)]
    backends: list[dict[str, Any]] = [
        {"name": f"s{i}", "url": f"http://127.0.0.1:{p}", "models": [MODEL]}
        for i, p in enumerate(ports)
    ]
    if not args.no_agent:
        argv = [sys.executable, "-m", "pulsegate", "agent", "--engine", backends[0]["url"]]
        agent = procs.start("agent", [*argv, "--listen", "127.0.0.1:0", "--gpu", "engine"])
        backends[0]["agent"] = f"127.0.0.1:{agent.port}"
    gw, base = start_gateway(procs, tmp, backends)
    sampler = Sampler(gw.pid, SAMPLE_S, gw.port or 0, metrics_url=f"{base}/metrics")
    sampler.start()
    seconds = args.minutes * 60
    chat = Load(base, rate=args.rate / 2, max_tokens=16, timeout=TIMEOUT_S, seed=1)
    mixed = Mixed(base, args.rate / 2, seed=2)
    t0 = time.time()
    chat.start()
    mixed.start()
    faults = Faults(procs, sims, ports)
    cycle = asyncio.get_running_loop().create_task(
        fault_cycle(faults, t0, args.fault_every, args.fault_hold, t0 + seconds)
    )
    while time.time() < t0 + seconds:
        await asyncio.sleep(min(60.0, max(0.0, t0 + seconds - time.time())))
        errs = sum(not r.ok for r in chat.results) + sum(not r.ok for r in mixed.results)
        last = sampler.rows[-1]
        print(f"  {(time.time() - t0) / 60:5.1f} min: sent {chat.sent + mixed.sent}, errors "
              f"{errs}, RSS {last['rss_mb']:.0f} MB, fds {last['fds']:.0f} (clients "
              f"{last.get('fds_client', 0):.0f}, upstream {last.get('fds_upstream', 0):.0f}, "
              f"other {last.get('fds_other', 0):.0f}), threads "
              f"{last['threads']:.0f}", flush=True)  # fmt: skip
    t_end = time.time()
    results: list[Result] = [*await chat.stop(), *await mixed.stop()]
    await cycle
    # The clients have closed their connections: the gateway must have closed its side.
    idle = proc_sample(gw.pid) | fd_kinds(gw.pid, gw.port or 0)
    deadline = time.time() + 10
    while idle.get("fds_client", 0) and time.time() < deadline:
        await asyncio.sleep(0.2)
        idle = proc_sample(gw.pid) | fd_kinds(gw.pid, gw.port or 0)
    await sampler.stop()
    return figures(args, t0, t_end, results, sampler, faults, idle)


def figures(
    args: argparse.Namespace,
    t0: float,
    t_end: float,
    results: list[Result],
    sampler: Sampler,
    faults: Faults,
    idle: dict[str, float],
) -> dict[str, Any]:
    warm = t0 + 0.2 * (t_end - t0)
    rows = sampler.between(warm, t_end + SAMPLE_S)
    apis: dict[str, dict[str, int]] = {}
    for r in results:
        api = r.row().get("api", "chat_stream" if r.stream else "chat")
        d = apis.setdefault(api, {"sent": 0, "errors": 0})
        d["sent"] += 1
        d["errors"] += not r.ok
    errors = [r for r in results if not r.ok]
    streams = [r for r in results if r.stream]
    rss0 = statistics.median(r["rss_mb"] for r in rows[:3])
    rss1 = statistics.median(r["rss_mb"] for r in rows[-3:])
    growth = rss1 / rss0 - 1
    _, fds_txt = flat(rows, "fds", 5, 0.1)
    other_ok, other_txt = flat(rows, "fds_other", 2, 0.0)
    half_closed = max(r.get("close_wait", 0) for r in rows)
    thr_ok, thr_txt = flat(rows, "threads", 1, 0.0)
    # One task per request in flight and per probe, so a fault's extra concurrency shows:
    # the end no higher than the first third's highest plus 10% (at least 5).
    task_rows = [r for r in rows if "tasks" in r]
    tasks_ok, tasks_txt = flat(task_rows, "tasks", 5, 0.1) if task_rows else (False, "not read")
    lat = sorted(r.latency for r in results if r.ok)
    checks = [
        (f"RSS growth after warm-up <= 10% ({rss0:.1f} -> {rss1:.1f} MB, {growth:+.1%}; "
         f"peak {max(r['rss_mb'] for r in rows):.1f})", growth <= 0.10),
        (f"fds other than TCP connections flat ({other_txt})", other_ok),
        (f"no TCP connection left half-closed (CLOSE_WAIT: at most {half_closed:.0f})",
         half_closed <= 2),
        (f"every client connection closed once the clients left ({idle.get('fds_client')} "
         f"left; {idle.get('fds_upstream')} upstream kept, {idle.get('fds')} fds in all)",
         idle.get("fds_client", 1) == 0),
        (f"threads flat ({thr_txt})", thr_ok),
        (f"asyncio tasks flat, pulsegate_event_loop_tasks ({tasks_txt})", tasks_ok),
        (f"0 client errors ({len(errors)} of {len(results)})", not errors),
        (f"every stream whole ({sum(r.ok for r in streams)} of {len(streams)})",
         all(r.ok for r in streams)),
    ]  # fmt: skip
    info = f"all fds, TCP connections included ({fds_txt}): pools follow load and faults"
    return {
        "info": [info],
        "idle_after": idle,
        "minutes": args.minutes,
        "rate_rps": args.rate,
        "fault_every_s": args.fault_every,
        "fault_hold_s": args.fault_hold,
        "agent": not args.no_agent,
        "sent": len(results),
        "apis": apis,
        "latency_ms": {
            "p50": round(lat[len(lat) // 2] * 1000, 1) if lat else None,
            "p99": round(lat[int(len(lat) * 0.99)] * 1000, 1) if lat else None,
            "max": round(lat[-1] * 1000, 1) if lat else None,
        },
        "retried": sum(r.attempts > 1 for r in results),
        "errors": [r.row() for r in errors[:50]],
        "error_kinds": sorted({r.error for r in errors}),
        "faults": faults.log,
        "warmup_until": warm,
        "asyncio_tasks": "pulsegate_event_loop_tasks from /metrics, every sample",
        "checks": [{"check": c, "pass": bool(p)} for c, p in checks],
        "passed": all(p for _, p in checks),
        "samples": sampler.rows,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--rate", type=float, default=30.0, help="requests a second, all APIs")
    p.add_argument("--fault-every", type=float, default=60.0)
    p.add_argument("--fault-hold", type=float, default=20.0)
    p.add_argument("--no-agent", action="store_true")
    p.add_argument("--json", type=Path, default=ROOT / "bench/results/soak.json")
    args = p.parse_args()
    logs = ROOT / "bench/results/soak_logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs = Procs(logs)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = asyncio.run(run(args, procs, Path(tmp)))
    finally:
        procs.stop_all()
    out["argv"] = sys.argv[1:]
    for c in out["checks"]:
        print(f"{'PASS' if c['pass'] else 'FAIL'} {c['check']}")
    for line in out["info"]:
        print(f"INFO {line}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{sum(c['pass'] for c in out['checks'])}/{len(out['checks'])} checks pass; "
          f"wrote {args.json}")  # fmt: skip
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
