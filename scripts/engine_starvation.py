#!/usr/bin/env python3
"""Does a busy engine starve the other processes on this machine? (docs/real-engines.md,
finding 12)

    python scripts/engines.py start vllm            # prints its URL
    python scripts/engine_starvation.py http://127.0.0.1:PORT [--rounds 3]

Runs `--rounds` rounds of 8 concurrent 1,900-token generations against the engine while a
thread in this process sleeps 50 ms at a time and records how late each wake-up is. This
process has normal priority, like the gateway and the agent would. Prints each round's time
and the worst wake-up lag; a lag of seconds means everything else on the box stands still
while the engine computes. `scripts/engines.py` starts engines at the lowest CPU priority
(nice 19, and their session's autogroup at 19); to see the stalls it avoids, run
`echo 0 > /proc/PID/autogroup` for the engine's PID first.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request

TICK_S = 0.05
STALL_S = 0.2


def generate(url: str, model: str) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello world"}],
        "max_tokens": 1900,
        "temperature": 0,
    }
    req = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    lags: list[float] = []
    done = threading.Event()

    def sleeper() -> None:
        while not done.is_set():
            t = time.monotonic()
            time.sleep(TICK_S)
            lags.append(time.monotonic() - t - TICK_S)

    watch = threading.Thread(target=sleeper, daemon=True)
    watch.start()
    for r in range(args.rounds):
        t0 = time.monotonic()
        threads = [threading.Thread(target=generate, args=(args.url, args.model)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(f"round {r}: 8 x 1,900 tokens in {time.monotonic() - t0:.1f} s", flush=True)
    done.set()
    watch.join()
    stalls = [x for x in lags if x > STALL_S]
    print(
        f"wake-ups {len(lags)}, worst lag {max(lags, default=0.0) * 1000:.0f} ms, "
        f"stalls over {STALL_S * 1000:.0f} ms: {len(stalls)} (total {sum(stalls):.1f} s)"
    )


if __name__ == "__main__":
    main()
