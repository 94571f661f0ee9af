"""Issue 3's figures: how fast the health brain ejects, what leaks past it, down-weighting,
and the way back through probation - on the simulated fleet, with DEFAULT probe and health
settings (canary every 2 s with a 350 ms timeout, micro-inference every 3-5 s, 60 s probation).

    .venv/bin/python bench/health_figures.py [--trials 5] [--idle-trials 3] [--quick]

Phases (3 simulated engines a, b, c; the fault always on c):
  detect    `cuda_hang` and `blackhole`: time from the fault to c's ejection event, each trial
            on a fresh gateway (the fault lands at a random phase of the probe schedule);
            under steady client load, and idle (probes alone)
  leak      client requests that reached c after its ejection event (its own arrival log,
            wall clock, same host), with load kept on for 2 s after the ejection
  slow      c slowed x3 under steady streamed load: c's share of requests once down-weighted
  recover   c hung, ejected, the fault lifted: time to rejoin (probation), probation length,
            time to full weight, the ramp as sampled from /admin/backends
Writes bench/results/health_figures.json and prints a table. About 4-5 minutes
(`--quick`: 2 trials, no idle trials, a shorter share window: about 3 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support import Gateway, Sim, backend_entry, wait_until

RESULTS = Path(__file__).resolve().parent / "results" / "health_figures.json"
# Default settings the targets are stated against (config.py defaults, not set here).
CANARY_INTERVAL_S = 2.0
CANARY_TIMEOUT_S = 0.35
DETECT_TARGET_S = 2 * CANARY_INTERVAL_S + CANARY_TIMEOUT_S  # 4.4 s
SHARE_TARGET = 0.15
AFTER_EJECTION_S = 2.0  # load kept on after the ejection, to see whether any request leaks
# A request the gateway had already picked c for and was writing when c was ejected reaches
# c a few ms after the ejection event; later than this counts as a leak.
IN_FLIGHT_SLACK_S = 0.05
WARMUP_MAX_S = 40.0  # slow phase: longest wait for the latency baselines to settle


# ---------------------------------------------------------------------------------------------
# Client load: `workers` closed-loop clients on their own thread and event loop


class Load:
    def __init__(self, url: str, workers: int, stream: bool = False, max_tokens: int = 8):
        self.url = url
        self.workers = workers
        self.stream = stream
        self.max_tokens = max_tokens
        self.results: list[tuple[float, float, str, int]] = []  # t0, t1 (wall), backend, status
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, float, str, int]]:
        self._stop.set()
        self._thread.join(timeout=30)
        return list(self.results)

    def count(self, backend: str, after: float = 0.0) -> int:
        return sum(1 for t0, _, b, _ in list(self.results) if b == backend and t0 > after)

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=self.workers * 2)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            await asyncio.gather(*(self._worker(client, w) for w in range(self.workers)))

    async def _worker(self, client: httpx.AsyncClient, w: int) -> None:
        i = 0
        while not self._stop.is_set():
            body = {
                "model": "demo-7b",
                "messages": [{"role": "user", "content": f"question {w}-{i}"}],
                "max_tokens": self.max_tokens,
                "stream": self.stream,
            }
            t0 = time.time()
            backend, status = "", 0
            try:
                async with client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
                    backend, status = r.headers.get("x-pulsegate-backend", ""), r.status_code
                    async for _ in r.aiter_raw():
                        pass
            except httpx.HTTPError:
                status = 0
            self.results.append((t0, time.time(), backend, status))
            i += 1


# ---------------------------------------------------------------------------------------------
# Helpers


def start_sims(tmp: Path, *args: str) -> dict[str, Sim]:
    sims: dict[str, Sim] = {}
    try:
        for n in "abc":
            sims[n] = Sim(tmp, n, *args)
    except BaseException:
        for s in sims.values():
            s.stop()
        raise
    return sims


def start_gateway(tmp: Path, sims: dict[str, Sim], **sections: Any) -> Gateway:
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = {"backends": [backend_entry(s) for s in sims.values()], **sections}
    return Gateway(tmp, cfg)


def ejection(gw: Gateway, name: str) -> dict[str, Any] | None:
    return next((e for e in gw.events() if e["backend"] == name and e["to"] == "ejected"), None)


def arrivals(sim: Sim, since: float) -> list[float]:
    r = httpx.get(f"{sim.url}/sim/requests", params={"since": since}, timeout=5)
    return [a["t"] for a in r.json()["requests"]]


def summary(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "max": None, "min": None}
    return {
        "p50": round(statistics.median(xs), 3),
        "max": round(max(xs), 3),
        "min": round(min(xs), 3),
    }


# ---------------------------------------------------------------------------------------------
# Phases


def detect_trial(
    tmp: Path, sims: dict[str, Sim], fault: str, with_load: bool, rng: random.Random
) -> dict[str, Any]:
    """One fault on c with a fresh gateway: seconds to the ejection event, and the leak."""
    bad = sims["c"]
    gw = start_gateway(tmp, sims)
    lo: Load | None = None
    try:
        gw.wait_all_ready(timeout=30)
        if with_load:
            lo = Load(gw.url, workers=6).start()
            wait_until(lambda: all(lo.count(n) >= 3 for n in sims), timeout=20, what="load")
        time.sleep(rng.uniform(0.0, CANARY_INTERVAL_S * 1.1))  # a random canary phase
        t_fault = time.time()
        bad.fault(fault)
        ev = wait_until(lambda: ejection(gw, "c"), timeout=30, what=f"c ejected ({fault})")
        out: dict[str, Any] = {
            "detect_s": round(ev["ts"] - t_fault, 3),
            "cause": ev["cause"],
            "reason": ev["reason"],
        }
        if lo is not None:
            time.sleep(AFTER_EJECTION_S)  # traffic keeps flowing; c must hear none of it
            results = lo.stop()
            late = [round(t - ev["ts"], 4) for t in arrivals(bad, ev["ts"])]
            out.update(
                after_ejection=len(late),
                after_slack=sum(1 for d in late if d > IN_FLIGHT_SLACK_S),
                after_ejection_delays_s=late[:10],
                client_errors=sum(1 for *_, st in results if st != 200),
                # A request already on c when it hung waits for the retry timeout (5 s +
                # 0.1 s per token by default): what the slowest client saw.
                client_max_s=round(max(t1 - t0 for t0, t1, _, _ in results), 2),
                requests=len(results),
                served_after_by_others=sum(
                    1 for t0, _, b, _ in results if t0 > ev["ts"] and b in ("a", "b")
                ),
            )
        return out
    finally:
        if lo is not None:
            lo.stop()
        gw.stop()
        bad.fault("none")


def detect_phase(trials: int, idle_trials: int, rng: random.Random) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        sims = start_sims(tmp, "--ttft-ms", "30", "--itl-ms", "5")
        try:
            for fault in ("cuda_hang", "blackhole"):
                per: dict[str, Any] = {}
                for mode, n in (("load", trials), ("idle", idle_trials)):
                    runs = []
                    for i in range(n):
                        r = detect_trial(
                            tmp / f"{fault}-{mode}-{i}", sims, fault, mode == "load", rng
                        )
                        leak = r.get("after_ejection")
                        print(
                            f"  {fault:9} {mode:4} trial {i + 1}: {r['detect_s']:.2f} s "
                            f"({r['cause']})"
                            + (
                                ""
                                if leak is None
                                else f", {leak} after it {r['after_ejection_delays_s']}"
                            ),
                            flush=True,
                        )
                        runs.append(r)
                    if runs:
                        per[mode] = {
                            "trials": runs,
                            "detect_s": summary([r["detect_s"] for r in runs]),
                            "causes": dict(Counter(r["cause"] for r in runs)),
                        }
                        if mode == "load":
                            per[mode]["after_ejection_total"] = sum(
                                r["after_ejection"] for r in runs
                            )
                            per[mode]["after_slack_total"] = sum(r["after_slack"] for r in runs)
                            per[mode]["client_errors"] = sum(r["client_errors"] for r in runs)
                            per[mode]["client_max_s"] = max(r["client_max_s"] for r in runs)
                out[fault] = per
        finally:
            for s in sims.values():
                s.stop()
    return out


def slow_phase(window_s: float) -> dict[str, Any]:
    """c slowed x3 among three under steady streamed load: its share once down-weighted."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        # 100 ms time to first token, 5 ms per token: a small model on a busy GPU.
        sims = start_sims(tmp, "--ttft-ms", "100", "--itl-ms", "5")
        gw: Gateway | None = None
        lo: Load | None = None
        try:
            gw = start_gateway(tmp / "gw", sims)
            gw.wait_all_ready(timeout=30)
            # Non-streamed load: the sim writes a stream's role chunk before its prefill wait,
            # so a streamed "time to first byte" on the sim is ~1 ms of header time, not TTFT
            # (see docs/health-figures.md); with whole answers the latency signal is the probes'.
            lo = Load(gw.url, workers=12, max_tokens=16).start()
            # The canary repeats one prompt, so after its first (cache-miss, 100 ms) answer it
            # hits the prefix cache (30 ms); its EWMA (alpha 0.2, one sample per 2 s) needs
            # ~20 s to settle there. Judge the slowdown against a settled baseline: wait until
            # every canary EWMA is under 45 ms (1.5 x 30), for at most WARMUP_MAX_S (a busy
            # host may hover above it; the ratio is then lower and the share higher).
            t_warm = time.time()
            try:
                wait_until(
                    lambda: all(
                        b["signals"]["latency_ratio"] is not None
                        and (b["signals"]["canary_ms"] or 1e9) < 45
                        for b in gw.backends().values()
                    ),
                    timeout=WARMUP_MAX_S,
                    interval=0.25,
                    what="canary latency settled on the prefix cache",
                )
            except AssertionError:
                pass
            warmup_s = time.time() - t_warm
            time.sleep(3.0)  # a few more evaluations of steady traffic before the fault
            canary_ms = {n: b["signals"]["canary_ms"] for n, b in gw.backends().items()}
            before = {n: b["weight"] for n, b in gw.backends().items()}
            t_fault = time.time()
            sims["c"].fault("slow", factor=3.0)

            def down() -> dict[str, Any] | None:
                bs = gw.backends()
                ok = bs["c"]["weight"] < 0.5 * min(bs["a"]["weight"], bs["b"]["weight"])
                return bs if ok else None

            wait_until(down, timeout=60, interval=0.1, what="c down-weighted")
            t_down = time.time()
            time.sleep(window_s)
            t_end = time.time()
            bs = gw.backends()
            results = lo.stop()
            window = Counter(b for t0, _, b, st in results if t_down <= t0 < t_end and st == 200)
            total = sum(window.values())
            since_fault = Counter(b for t0, _, b, st in results if t_fault <= t0 < t_end)
            ejected = [e for e in gw.events() if e["backend"] == "c" and e["to"] == "ejected"]
            return {
                "window_s": round(t_end - t_down, 1),
                "requests": total,
                "by_backend": dict(sorted(window.items())),
                "share_c": round(window["c"] / total, 4) if total else None,
                "share_c_since_fault": round(since_fault["c"] / sum(since_fault.values()), 4),
                "down_weighted_after_s": round(t_down - t_fault, 2),
                "warmup_s": round(warmup_s, 1),
                "canary_ms_at_fault": canary_ms,
                "weights_before": before,
                "c": {k: bs["c"][k] for k in ("state", "score", "weight")}
                | {"latency_ratio": bs["c"]["signals"]["latency_ratio"]},
                "weights_after": {n: b["weight"] for n, b in bs.items()},
                "c_ejected": bool(ejected),
                "client_errors": sum(1 for *_, st in results if st != 200),
            }
        finally:
            if lo is not None:
                lo.stop()
            if gw is not None:
                gw.stop()
            for s in sims.values():
                s.stop()


def recover_phase() -> dict[str, Any]:
    """c hung until ejected, then healed: rejoin, probation ramp, time to full weight."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        sims = start_sims(tmp, "--ttft-ms", "30", "--itl-ms", "5")
        gw: Gateway | None = None
        lo: Load | None = None
        try:
            gw = start_gateway(tmp / "gw", sims)
            gw.wait_all_ready(timeout=30)
            lo = Load(gw.url, workers=4).start()
            sims["c"].fault("cuda_hang")
            wait_until(lambda: ejection(gw, "c"), timeout=30, what="c ejected")
            t_lift = time.time()
            sims["c"].fault("none")
            samples: list[dict[str, Any]] = []

            def full() -> bool:
                c = gw.backends()["c"]
                samples.append({"t": round(time.time() - t_lift, 2)} | {
                    k: c[k] for k in ("state", "ramp", "weight", "probation_progress")
                })  # fmt: skip
                return c["state"] == "ready" and c["weight"] >= 0.9 and c["ramp"] == 1.0

            wait_until(full, timeout=150, interval=0.25, what="c back at full weight")
            t_full = time.time()
            results = lo.stop()
            evs = [e for e in gw.events() if e["backend"] == "c"]
            # A probation that fails (any failed probe or request) ejects again and starts over:
            # the figures are for the probation that passed, and the failures are listed.
            passed = next(e for e in evs if e["from"] == "probation" and e["to"] == "ready")
            rejoins = [e for e in evs if e["to"] == "probation"]
            rejoin = rejoins[-1]
            failed = [e for e in evs if e["from"] == "probation" and e["to"] == "ejected"]
            start = rejoin["ts"] - t_lift
            prob = [s for s in samples if s["state"] == "probation" and s["t"] >= start]
            ramps = [s["ramp"] for s in prob]
            in_prob = [b for t0, _, b, _ in results if rejoin["ts"] <= t0 < passed["ts"]]
            checkpoints = {}
            for q in (0.25, 0.5, 0.75, 0.95):
                s = next((s for s in prob if (s["probation_progress"] or 0) >= q), None)
                if s is not None:
                    checkpoints[f"{q:.0%}"] = {"ramp": s["ramp"], "weight": s["weight"]}
            return {
                "lift_to_first_rejoin_s": round(rejoins[0]["ts"] - t_lift, 2),
                "probation_failures": [f"{e['cause']}: {e['reason']}" for e in failed],
                "probation_s": round(passed["ts"] - rejoin["ts"], 2),
                "lift_to_full_weight_s": round(t_full - t_lift, 2),
                "rejoin_reason": rejoin["reason"],
                "passed_reason": passed["reason"],
                "ramp_monotone": ramps == sorted(ramps),
                "max_ramp_in_probation": max(ramps) if ramps else None,
                "max_weight_in_probation": max((s["weight"] for s in prob), default=None),
                "ramp_checkpoints": checkpoints,
                "share_c_in_probation": round(in_prob.count("c") / len(in_prob), 4)
                if in_prob
                else None,
                "samples": len(samples),
                "events_c": [
                    {
                        "t": round(e["ts"] - t_lift, 2),
                        "move": f"{e['from']} -> {e['to']}",
                        "cause": e["cause"],
                        "reason": e["reason"],
                    }
                    for e in evs
                ],
            }
        finally:
            if lo is not None:
                lo.stop()
            if gw is not None:
                gw.stop()
            for s in sims.values():
                s.stop()


# ---------------------------------------------------------------------------------------------
# Report


def table(res: dict[str, Any]) -> str:
    rows: list[tuple[str, str, str]] = []
    for fault in ("cuda_hang", "blackhole"):
        for mode in ("load", "idle"):
            p = res["detect"].get(fault, {}).get(mode)
            if not p:
                continue
            s = p["detect_s"]
            causes = ", ".join(f"{k} {v}" for k, v in p["causes"].items())
            rows.append(
                (
                    f"{fault} fault -> ejected ({mode}, {len(p['trials'])} trials)",
                    f"<= {DETECT_TARGET_S:.2f} s",
                    f"p50 {s['p50']:.2f} s, max {s['max']:.2f} s ({causes})",
                )
            )
            if mode == "load":
                late = p["after_slack_total"]
                within = p["after_ejection_total"] - late
                rows.append(
                    (
                        f"{fault}: client requests reaching c after ejection",
                        "0",
                        f"{late} later than {IN_FLIGHT_SLACK_S * 1000:.0f} ms ({within} within "
                        f"it) in {len(p['trials'])} x {AFTER_EJECTION_S:.0f} s of load; client "
                        f"errors {p['client_errors']}, slowest client {p['client_max_s']:.1f} s",
                    )
                )
    sl = res.get("slow")
    if sl:
        rows.append(
            (
                "share of traffic, c slowed x3 among three",
                f"< {SHARE_TARGET:.0%}",
                f"{sl['share_c']:.1%} of {sl['requests']} in {sl['window_s']:.0f} s "
                f"(state {sl['c']['state']}, weight {sl['c']['weight']:.2f} vs "
                f"{sl['weights_after']['a']:.2f}/{sl['weights_after']['b']:.2f})",
            )
        )
    rc = res.get("recover")
    if rc:
        rows.append(
            (
                "fault lifted -> rejoin (probation starts)",
                "-",
                f"{rc['lift_to_first_rejoin_s']:.1f} s",
            )
        )
        fails = len(rc["probation_failures"])
        rows.append(
            (
                "probation duration (default 60 s)",
                ">= 60 s",
                f"{rc['probation_s']:.1f} s"
                + (f" (after {fails} failed probation(s), see JSON)" if fails else ""),
            )
        )
        rows.append(
            (
                "fault lifted -> full weight",
                "only via probation",
                f"{rc['lift_to_full_weight_s']:.1f} s (max ramp in probation "
                f"{rc['max_ramp_in_probation']}, monotone {rc['ramp_monotone']})",
            )
        )
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{'figure':<{w0}}  {'target':<{w1}}  measured", "-" * (w0 + w1 + 40)]
    lines += [f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5, help="detection trials under load")
    ap.add_argument("--idle-trials", type=int, default=3, help="detection trials without load")
    ap.add_argument("--window", type=float, default=15.0, help="slow-share window, seconds")
    ap.add_argument("--quick", action="store_true", help="2 trials, no idle, 10 s window")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.quick:
        args.trials, args.idle_trials, args.window = 2, 0, 10.0
    rng = random.Random(args.seed)
    t0 = time.time()
    res: dict[str, Any] = {
        "settings": {
            "probes": "defaults (canary 2 s / 350 ms, micro 3-5 s / 2 s, readiness 10 s)",
            "health": "defaults (probation 60 s, ramp_step 0.01, ejection_base 5 s)",
            "trials": args.trials,
            "idle_trials": args.idle_trials,
        }
    }
    print("detection (fresh gateway per trial, fault at a random canary phase)", flush=True)
    res["detect"] = detect_phase(args.trials, args.idle_trials, rng)
    print("slow x3 share", flush=True)
    res["slow"] = slow_phase(args.window)
    print("recovery through probation (60 s)", flush=True)
    res["recover"] = recover_phase()
    res["runtime_s"] = round(time.time() - t0, 1)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2) + "\n")
    print()
    print(table(res))
    print(f"\nruntime {res['runtime_s']:.0f} s; written to {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
