"""What the per-try deadline costs a request: `asyncio.timeout` beside `proxy.deadline.Deadline`
(swept by the proxy's 50 ms watch loop: no timer per request).

    .venv/bin/python bench/perf/deadline_cost.py [--n 200000] [--reps 5]

On uvloop, as `pulsegate serve` runs: each repetition
times `--n` scopes of each kind (entered, the body one loop turn, left without
expiring: a request answered in time), the two interleaved. Prints the median µs
per scope and the ratio Deadline / asyncio.timeout of the same repetition.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from pulsegate.clock import SystemClock
from pulsegate.proxy.deadline import Deadline
from pulsegate.runtime import install_uvloop


async def _asyncio_scopes(n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        async with asyncio.timeout(5.0):
            await asyncio.sleep(0)  # a loop turn, as a real wait has
    return (time.perf_counter() - t0) / n * 1e6


async def _deadline_scopes(n: int, clock: SystemClock) -> float:
    waiting: set[Deadline] = set()  # a backend's attempts waiting, as in ProxyState
    t0 = time.perf_counter()
    for _ in range(n):
        async with Deadline(clock.now() + 5.0, waiting):
            await asyncio.sleep(0)  # a loop turn, as a real wait has
    return (time.perf_counter() - t0) / n * 1e6


async def main(n: int, reps: int) -> None:
    loop = asyncio.get_running_loop()
    clock = SystemClock(loop)
    old, new, ratio = [], [], []
    for _ in range(reps):
        a = await _asyncio_scopes(n)
        b = await _deadline_scopes(n, clock)
        old.append(a)
        new.append(b)
        ratio.append(b / a)
    print(f"asyncio.timeout: {statistics.median(old):.2f} µs per scope (median of {reps})")
    print(f"Deadline:        {statistics.median(new):.2f} µs per scope")
    print(f"Deadline / asyncio.timeout: {statistics.median(ratio):.2f} (the loop turn included)")
    saved = statistics.median(a - b for a, b in zip(old, new, strict=True))
    print(f"saved per request: {saved:.2f} µs")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    install_uvloop()
    asyncio.run(main(args.n, args.reps))
