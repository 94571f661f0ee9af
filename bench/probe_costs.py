"""What a probe loop's two most frequent small costs take: a pause's wait, and a connect probe.

    .venv/bin/python bench/probe_costs.py [--n 2000]

One process on uvloop, loopback only, CPU time (`time.process_time`, best of 3 rounds):

- **wait**: a `cadence.pause` wait that times out (every backend's loops wait about 8 times a
  second), on the probers' `Wake`, against the baseline an `asyncio.Event` under
  `asyncio.timeout` (what the probers used before 2026-12-08), in the same run;
- **dial**: the connect probe (`probers.dial`, twice a second per backend) to a listener of
  this process (its accept included), by IP literal, by name with the probers' `Addresses`
  (resolved once per 10 s), and by name resolved at every dial (the baseline: what
  `create_connection` to a name does, and what the probe did before 2026-12-08).

Prints µs of CPU each and the ratio to the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from pulsegate import stall  # noqa: E402
from pulsegate.clock import Clock, SystemClock  # noqa: E402
from pulsegate.probers.dial import Addresses, dial  # noqa: E402
from pulsegate.probers.waits import Wake  # noqa: E402

ROUNDS = 3
WAITERS = 100  # loops waiting at once, as many backends' do


async def _event_wait(clock: Clock, event: asyncio.Event, seconds: float) -> bool:
    """The baseline: an Event's wait under `asyncio.timeout`, expired by the clock's timer."""
    try:
        async with asyncio.timeout(None) as cm:
            handle = clock.call_later(seconds, stall.expire, cm)
            try:
                await event.wait()
            finally:
                handle.cancel()
        return True
    except TimeoutError:
        return False


async def _best(n: int, each: Callable[[], Awaitable[object]], parallel: int = 1) -> float:
    """µs of CPU per call of `each`, best of `ROUNDS`, `parallel` callers at once."""

    async def caller(k: int) -> None:
        for _ in range(k):
            await each()

    best = float("inf")
    for _ in range(ROUNDS):
        t0 = time.process_time()
        await asyncio.gather(*(caller(n // parallel) for _ in range(parallel)))
        best = min(best, (time.process_time() - t0) / n * 1e6)
    return best


async def main(n: int) -> None:
    loop = asyncio.get_running_loop()
    clock = SystemClock(loop)
    event, wake = asyncio.Event(), Wake()
    base = await _best(n * 10, lambda: _event_wait(clock, event, 1e-4), WAITERS)
    new = await _best(n * 10, lambda: wake.wait(clock, 1e-4), WAITERS)
    print("| wait that times out | µs of CPU | vs baseline |\n|---|---:|---:|")
    print(f"| asyncio.Event under asyncio.timeout (baseline) | {base:.1f} | 1.00x |")
    print(f"| Wake.wait | {new:.1f} | {new / base:.2f}x |")

    server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cached = Addresses()
    kinds = [
        ("by name, resolved at every dial (baseline)", "localhost", None),
        ("by name, `Addresses` (once per 10 s)", "localhost", cached),
        ("by IP literal", "127.0.0.1", cached),
    ]
    rows = []
    for label, host, addresses in kinds:
        url = f"http://{host}:{port}"

        async def one(url: str = url, addresses: Addresses | None = addresses) -> None:
            r = await dial(url, 1.0, clock, addresses)
            assert r is not None and r.ok, r

        rows.append((label, await _best(n, one)))
    server.close()
    clock.close()
    print("\n| connect probe | µs of CPU per dial | vs baseline |\n|---|---:|---:|")
    for label, us in rows:
        print(f"| {label} | {us:.0f} | {us / rows[0][1]:.2f}x |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="dials per round (waits: 10x)")
    uvloop.run(main(ap.parse_args().n))
