"""Issue 6's figure: the pause a client sees when its stream's backend fails mid-generation.

    .venv/bin/python bench/resume.py [--trials 50]

A fleet of 3 simulated engines (10 ms per token) behind the gateway (stall_timeout 1 s).
Each trial streams 80 tokens and, after the 20th, breaks the serving engine:
  kill   SIGKILL the engine process (it is restarted on the same port for later trials)
  stall  the engine stops sending tokens (`stall` fault; lifted after the trial)
The seam pause is the longest gap between tokens from the break on (tokens already in flight
still arrive just after it).
Each trial also checks the text is whole (equal to an uninterrupted run) with one [DONE].
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support import Gateway, Sim, backend_entry, fast_probes, wait_until

TOKENS = 80
BREAK_AT = 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def trial(gw: Gateway, sims: dict[str, Sim], how: str, i: int) -> dict[str, Any]:
    body = {
        "model": "demo-7b",
        "messages": [{"role": "user", "content": f"trial {i} tell a story"}],
        "max_tokens": TOKENS,
        "seed": i,
        "stream": True,
    }
    times: list[float] = []
    text: list[str] = []
    dones = errors = 0
    victim = ""
    buf = b""
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=30) as r:
        victim = r.headers["x-pulsegate-backend"]
        for chunk in r.iter_bytes():
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                data = ev.removeprefix(b"data: ")
                if data == b"[DONE]":
                    dones += 1
                    continue
                obj = orjson.loads(data)
                if "error" in obj:
                    errors += 1
                    continue
                piece = obj["choices"][0]["delta"].get("content") if obj["choices"] else None
                if piece:
                    text.append(piece)
                    times.append(time.perf_counter())
                    if len(text) == BREAK_AT:
                        if how == "kill":
                            sims[victim].kill()
                        else:
                            sims[victim].fault("stall", after_tokens=1)
    # Tokens already in flight still arrive after the break: the seam is the longest gap
    # from the break on.
    gaps = [b - a for a, b in itertools.pairwise(times[BREAK_AT - 1 :])]
    seam = max(gaps) if gaps else float("nan")
    healthy = next(s for n, s in sims.items() if n != victim and s.alive())
    full = httpx.post(
        f"{healthy.url}/v1/chat/completions", json={**body, "stream": False}, timeout=10
    ).json()["choices"][0]["message"]["content"]
    return {
        "victim": victim,
        "seam_s": seam,
        "tokens": len(text),
        "whole": "".join(text) == full,
        "dones": dones,
        "errors": errors,
    }


def heal(tmp: Path, sims: dict[str, Sim], ports: dict[str, int], victim: str, how: str) -> None:
    if how == "kill":
        sims[victim].stop()
        sims[victim] = Sim(tmp, victim, "--ttft-ms", "5", "--itl-ms", "10", port=ports[victim])
    else:
        sims[victim].fault("none")


def run(how: str, trials: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ports = {n: free_port() for n in ("a", "b", "c")}
        sims = {
            n: Sim(tmp, n, "--ttft-ms", "5", "--itl-ms", "10", port=p) for n, p in ports.items()
        }
        cfg = {
            "backends": [backend_entry(s) for s in sims.values()],
            "probes": fast_probes(),
            "health": {"probation": {"duration": "2s", "ramp_step": 0.1}, "ejection_base": "1s"},
            "streaming": {"stall_timeout": "1s"},
        }
        gw = Gateway(tmp, cfg)
        out = []
        try:
            gw.wait_all_ready(timeout=30)
            for i in range(trials):
                # Two routable backends at least, so a resume always has somewhere to go.
                wait_until(
                    lambda: sum(b["state"] in ("ready", "probation")
                                for b in gw.backends().values()) >= 2,
                    timeout=30,
                )  # fmt: skip
                r = trial(gw, sims, how, i)
                out.append(r)
                heal(tmp, sims, ports, r["victim"], how)
        finally:
            gw.stop()
            for s in sims.values():
                s.stop()
        return out


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    seams = sorted(r["seam_s"] for r in rows)
    return {
        "trials": len(rows),
        "seam_p50_ms": round(statistics.median(seams) * 1000, 1),
        "seam_p90_ms": round(seams[int(0.9 * (len(seams) - 1))] * 1000, 1),
        "seam_max_ms": round(seams[-1] * 1000, 1),
        "whole_text": sum(r["whole"] for r in rows),
        "all_tokens": sum(r["tokens"] == TOKENS for r in rows),
        "one_done": sum(r["dones"] == 1 for r in rows),
        "error_events": sum(r["errors"] for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--json", default="bench/results/resume.json")
    a = ap.parse_args()
    result = {}
    for how in ("kill", "stall"):
        result[how] = summary(run(how, a.trials))
        print(how, json.dumps(result[how]), flush=True)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
