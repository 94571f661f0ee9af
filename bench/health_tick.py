"""The health core's tick against the size of the fleet: CPU per tick, per backend, and the
longest tick (the event loop stands still while it runs).

    .venv/bin/python bench/health_tick.py [--backends 10,100,500,1000] [--models 1]
        [--seconds 20] [--json FILE]

No process, no socket: one `Fleet` (the gateway's own health core) on a fake clock, fed what
the default probes feed it (a micro-inference every 3 s, a canary every 2 s, a readiness probe
every 10 s, spread over the backends) and one request outcome per backend per second, ticked
every 100 ms as `HealthService` does. After `--seconds / 4` of warm-up it measures the CPU
time of `tick` alone (`time.process_time`), so the figures are the health core's and nothing
else's. `--models K` spreads the backends over K models (peers are per model).

Each row is printed with its CPU per backend as a ratio to the smallest fleet's, measured in
the same run: 1.0x means the tick grows linearly with the fleet. (Each backend gathered its
own peers before 2026-12-08: the ratio at 1,000 backends was ~21x, 70 ms a tick.)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from pulsegate.config import BackendConfig, HealthConfig, ProbesConfig  # noqa: E402
from pulsegate.health.fleet import Fleet  # noqa: E402
from pulsegate.health.observations import (  # noqa: E402
    Observation,
    Outcome,
    ProbeKind,
    ProbeResult,
    RequestResult,
)

TICK_S = 0.1


def _feed(rng: random.Random) -> list[tuple[int, Observation]]:
    """What a backend is fed, each with every how many ticks (outside the measured tick)."""
    jitter = rng.random()
    return [
        (100, ProbeResult(ProbeKind.READINESS, True, 0.002, ready=True)),
        (30, ProbeResult(ProbeKind.MICRO, True, 0.05 + 0.01 * jitter)),
        (20, ProbeResult(ProbeKind.CANARY, True, 0.08 + 0.02 * jitter)),
        (10, RequestResult(Outcome.OK, ttft_s=0.1 + 0.02 * jitter)),
    ]


def measure(n: int, models: int, seconds: float, seed: int = 1) -> dict[str, float | int]:
    """One fleet of `n` backends over `models` models, `seconds` of fake time."""
    rng = random.Random(seed)
    configs = [
        BackendConfig(name=f"b{i}", url=f"http://b{i}", models=(f"m{i % models}",))
        for i in range(n)
    ]
    now = 0.0
    fleet = Fleet(configs, HealthConfig(), ProbesConfig(), random.Random(seed), now)
    names = fleet.names()
    steps = round(seconds / TICK_S)
    warm = steps // 4
    spent, longest, ticks = 0.0, 0.0, 0
    for step in range(steps):
        now = round(now + TICK_S, 6)
        for i, name in enumerate(names):
            phase = step + i  # each backend's probes at its own phase, as jitter spreads them
            for every, obs in _feed(rng):
                if phase % every == 0:
                    fleet.observe(name, obs, now)
        t0 = time.process_time()
        fleet.tick(now)
        took = time.process_time() - t0
        if step >= warm:
            spent += took
            longest = max(longest, took)
            ticks += 1
    ready = sum(1 for name in names if fleet.state(name).value == "ready")
    per_tick = spent / ticks
    return {
        "backends": n,
        "models": models,
        "tick_ms": per_tick * 1e3,
        "longest_tick_ms": longest * 1e3,
        "cpu_ms_per_s": per_tick / TICK_S * 1e3,
        "us_per_s_per_backend": per_tick / TICK_S / n * 1e6,
        "ready": ready,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--backends", default="10,100,500,1000")
    ap.add_argument("--models", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=20.0, help="fake time per fleet")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sizes = [int(x) for x in args.backends.split(",")]
    rows = [measure(n, args.models, args.seconds) for n in sizes]
    base = rows[0]["us_per_s_per_backend"]
    print(f"health core tick, every {TICK_S * 1e3:.0f} ms, {args.models} model(s)")
    print("| backends | CPU per tick, ms | longest tick, ms | CPU, ms/s | µs/s per backend | "
          f"per backend vs {rows[0]['backends']} | ready |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['backends']} | {r['tick_ms']:.2f} | {r['longest_tick_ms']:.2f} | "
            f"{r['cpu_ms_per_s']:.1f} | {r['us_per_s_per_backend']:.0f} | "
            f"{r['us_per_s_per_backend'] / base:.2f}x | {r['ready']} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
