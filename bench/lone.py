"""What one request costs when it comes alone: latency and CPU, beside direct and the floor.

`make bench` measures CPU per request at saturation (wrk, 16 connections: every wake-up
serves several requests, the caches stay warm) and latency at a fixed 400 requests/s. A
request that arrives alone (the fixed rate is one every 2.5 ms) meets a sleeping process and
cold caches, and costs several times its saturated CPU; that, not the saturated figure, is
what the added latency at 400 requests/s is made of. This asks it directly: one keep-alive
connection, one request at a time (a raw socket client, no client library in the way),
`--gap` ms apart, against the first engine (direct), pulsegate (`serve`, the default probes,
four fast engines as in `make bench`), the same compiled when `make compiled` has built it
(`pulsegate-mypyc`) and the floor proxy (`perf/floor_proxy.py`), and the
gateway's CPU per request from /proc, less what it spends idle (measured before, for as
long) so the probes and timers are not charged to the requests.

`--busy` measures every gap twice: as above, then with one spinning process per CPU at
the idle scheduling class (SCHED_IDLE: it runs only where nothing else wants the CPU, so
no CPU ever goes idle, and it takes no time from the processes measured). What the busy
rows save is what waking a CPU from idle costs (on a VM, the vCPU's halt and its return),
apart from what the code itself costs when it runs cold.

    .venv/bin/python bench/lone.py                 # gaps 0 and 2.5 ms, 2,000 requests each
    .venv/bin/python bench/lone.py --gaps 0 --n 5000
    .venv/bin/python bench/lone.py --busy          # each gap also with no CPU ever idle
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from perf import fleet, load
from perf.procs import Procs, usage

# A spinner at the idle scheduling class: it takes a CPU only when nothing else wants it.
_SPIN = "import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\nwhile True: pass"

REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%b" % (len(load.ZERO_BODY), load.ZERO_BODY)
)


def _answer_done(buf: bytes) -> bool:
    """A whole answer of Content-Length framing is in `buf` (every target here sends one)."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return False
    for line in buf[:end].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(buf) >= end + 4 + int(value)
    raise RuntimeError("an answer without Content-Length: not what the engines send")


def one_at_a_time(port: int, n: int, gap_s: float) -> list[float]:
    """`n` requests on one connection, each after the last answer and `gap_s`; seconds each."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    took = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            s.sendall(REQUEST)
            buf = b""
            while not _answer_done(buf):
                chunk = s.recv(65536)
                if not chunk:
                    raise RuntimeError("the connection closed mid-answer")
                buf += chunk
            took.append(time.perf_counter() - t0)
            if gap_s:
                time.sleep(gap_s)
    finally:
        s.close()
    return sorted(took)


@contextlib.contextmanager
def cpus_kept_busy(on: bool) -> Iterator[None]:
    """With `on`, one idle-class spinner per CPU for the block, stopped by its PID after."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(os.cpu_count() or 1)
    ] if on else []  # fmt: skip
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait(5)


def _port(url: str) -> int:
    return int(url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gaps", default="0,2.5", help="ms between an answer and the next request")
    ap.add_argument("--n", type=int, default=2000, help="requests per gap and target")
    ap.add_argument("--busy", action="store_true", help="each gap again, no CPU ever idle")
    args = ap.parse_args()
    gaps = [float(g) / 1000 for g in args.gaps.split(",")]
    modes = (False, True) if args.busy else (False,)
    with tempfile.TemporaryDirectory(prefix="pulsegate-lone-") as tmp_name:
        tmp = Path(tmp_name)
        procs = Procs(tmp)
        try:
            zero = fleet.start_fleet(procs, "fast", 2, fleet.ZERO_MODEL, 0.0)
            strm = fleet.start_fleet(procs, "fast", 2, fleet.STREAM_MODEL, 5.0)
            pg = fleet.start_pulsegate(procs, tmp, zero, strm, 1, 40.0)
            floor = fleet.start_pyfloor(procs, zero, strm)
            targets = {"pulsegate": pg, "pyfloor": floor}
            if fleet.compiled_built():
                targets["pulsegate-mypyc"] = fleet.start_pulsegate(
                    procs, tmp, zero, strm, 1, 40.0, "pulsegate-mypyc", fleet.COMPILED
                )
            print(
                "| gap ms | CPUs | target | p50 ms | p99 ms | added p50 ms "
                "| CPU µs/request, net of idle |"
            )
            print("|---:|---|---|---:|---:|---:|---:|")
            for gap, busy in ((g, b) for g in gaps for b in modes):
                with cpus_kept_busy(busy):
                    _measure(args.n, gap, "kept busy" if busy else "may idle", zero, targets)
        finally:
            procs.stop_all()
    return 0


def _measure(
    n: int, gap: float, cpus: str, zero: list[str], targets: dict[str, fleet.Target]
) -> None:
    """A table row per target, direct first, at `gap` seconds between requests."""
    direct = one_at_a_time(_port(zero[0]), n, gap)
    d50 = direct[len(direct) // 2]
    print(f"| {gap * 1e3:g} | {cpus} | direct | {d50 * 1e3:.3f} | "
          f"{direct[int(len(direct) * 0.99)] * 1e3:.3f} | - | - |")  # fmt: skip
    for name, t in targets.items():
        pids = t.pids()
        one_at_a_time(_port(t.zero_url), 1, 0.0)  # the upstream pool warm first
        wall = time.monotonic()
        c0 = usage(pids).cpu_s
        took = one_at_a_time(_port(t.zero_url), n, gap)
        busy_s = usage(pids).cpu_s - c0
        wall = time.monotonic() - wall
        i0 = usage(pids).cpu_s
        time.sleep(min(wall, 10.0))
        idle_per_s = (usage(pids).cpu_s - i0) / min(wall, 10.0)
        net = (busy_s - idle_per_s * wall) / n
        p50 = took[len(took) // 2]
        print(f"| {gap * 1e3:g} | {cpus} | {name} | {p50 * 1e3:.3f} | "
              f"{took[int(len(took) * 0.99)] * 1e3:.3f} | +{(p50 - d50) * 1e3:.3f} | "
              f"{net * 1e6:.0f} |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
