"""Issue 2's figures: 1,000 requests through the gateway while one of three engines fails.

    .venv/bin/python bench/fallback.py [--requests 1000] [--concurrency 8]

Phases, each on a fresh fleet (3 simulated engines, the gateway, default probes):
  baseline  no fault: the normal latency
  error     one engine answers 500 to everything (injected once the fleet is ready)
  hang      one engine accepts and never answers
Prints successes, p50/p99/max latency, attempts, and the hang bound
per_try_timeout + 2 x normal p99. Uses the official openai client (async).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support import Gateway, Sim, backend_entry

PER_TRY = 1.0


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


async def load(url: str, n: int, conc: int) -> dict:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
    lat: list[float] = []
    attempts: dict[int, int] = {}
    errors: list[str] = []
    sem = asyncio.Semaphore(conc)

    async def one(i: int) -> None:
        async with sem:
            t0 = time.perf_counter()
            try:
                raw = await client.chat.completions.with_raw_response.create(
                    model="demo-7b",
                    messages=[{"role": "user", "content": f"question {i}"}],
                    max_tokens=8,
                )
                raw.parse()
                a = int(raw.headers["x-pulsegate-attempts"])
                attempts[a] = attempts.get(a, 0) + 1
            except openai.APIError as e:
                errors.append(type(e).__name__)
            lat.append(time.perf_counter() - t0)

    await asyncio.gather(*(one(i) for i in range(n)))
    await client.close()
    return {
        "requests": n,
        "ok": n - len(errors),
        "errors": len(errors),
        "p50_ms": round(statistics.median(lat) * 1000, 1),
        "p99_ms": round(pct(lat, 99) * 1000, 1),
        "max_ms": round(max(lat) * 1000, 1),
        "attempts": dict(sorted(attempts.items())),
    }


def phase(fault: str | None, n: int, conc: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        sims = [Sim(tmp, name, "--ttft-ms", "20", "--itl-ms", "5") for name in ("a", "b", "c")]
        gw = None
        try:
            gw = Gateway(
                tmp,
                {
                    "backends": [backend_entry(s) for s in sims],
                    "retry": {"per_try_timeout": f"{PER_TRY}s", "per_token_timeout": "0s"},
                },
            )
            gw.wait_all_ready(timeout=30)
            if fault == "error":
                sims[2].fault("error", rate=1.0)
            elif fault == "hang":
                sims[2].fault("hang")
            result = asyncio.run(load(gw.url, n, conc))
            result["bad_backend_state"] = gw.backends()["c"]["state"] if fault else None
            return result
        finally:
            if gw is not None:
                gw.stop()
            for s in sims:
                s.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--json", default="bench/results/fallback.json")
    a = ap.parse_args()
    out = {}
    for name in ("baseline", "error", "hang"):
        out[name] = phase(None if name == "baseline" else name, a.requests, a.concurrency)
        print(name, json.dumps(out[name]), flush=True)
    bound = PER_TRY * 1000 + 2 * out["baseline"]["p99_ms"]
    print(f"hang: p99 {out['hang']['p99_ms']} ms vs bound per_try + 2 x normal p99 = {bound} ms")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
