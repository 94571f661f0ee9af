"""One scenario: a fresh gateway in one mode, steady load, one fault held and lifted.

    gateway up (mode) -> all backends ready -> load at `rate` for `pre` s (or the fault's
    own, longer `pre`: a warm fleet for the faults judged against it) -> fault on the
    target -> held `fault.hold` s -> lifted -> watch the target until back to full weight
    (at most `recover_max` s) -> load stopped, in-flight requests drained -> figures

The gateway is new for every scenario (no ejection history carried over); the fleet is
repaired after every scenario whatever happened (`Lab.repair`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from chaos import measure
from chaos.faults import Fault
from chaos.lab import JUDGED, Lab
from chaos.load import Load, Result
from chaos.tap import Tap

HEDGES = "pulsegate_hedges_total"


@dataclass(frozen=True)
class Settings:
    rate: float = 50.0
    pre: float = 2.0
    # pulsegate: backoff, rejoin (the TTFT signal goes stale only 30 s after the last request)
    # and the 10 s probation fit in 45 s.
    recover_max: float = 45.0
    recover_max_baseline: float = 7.0  # polling: one 5 s poll; passive: the 5 s backoff
    hold_scale: float = 1.0  # --quick shortens the holds
    timeout: float = 10.0  # the client's own deadline per request
    # The backend to fault; "auto": the one that answered most client requests in the last
    # 1.5 s, so the fault always lands on a node that is carrying traffic (a backend the
    # balancer has stopped using would make every figure trivially good).
    target: str = "auto"
    raw_dir: Path | None = None  # every request of every scenario, for a closer look


def _full(b: dict[str, Any], mode: str) -> bool:
    if mode in JUDGED:
        return b["state"] == "ready" and (b.get("ramp") or 0.0) >= 1.0
    return b["state"] == "ready" and b.get("weight", 0.0) >= 1.0


async def run(
    lab: Lab, fault: Fault, mode: str, s: Settings, tap: Tap, seed: int
) -> dict[str, Any]:
    """Run one (fault, mode) scenario; returns its figures and timeline."""
    tag = f"{fault.key}-{mode}"
    try:
        gw = await asyncio.to_thread(lab.start_gateway, mode, tag, None, fault.gateway or None)
        ready_s = await asyncio.to_thread(lab.wait_all_ready, 40.0)
        load = Load(gw.url, rate=s.rate, max_tokens=fault.max_tokens, timeout=s.timeout, seed=seed,
                    endpoints=gw.endpoints)  # fmt: skip
        load.start()
        await asyncio.sleep(max(s.pre, fault.pre))
        target, share = _pick_target(s.target, load.results, lab)
        fleet = await asyncio.to_thread(_fleet_view, gw)
        hedges0 = await asyncio.to_thread(gw.counter, HEDGES)
        t_fault = time.time()
        await asyncio.to_thread(fault.inject, lab, target)
        t_injected = time.time()
        hold = max(1.0, fault.hold * s.hold_scale)
        await asyncio.sleep(hold / 2 - (t_injected - t_fault))
        health = await asyncio.to_thread(_health, lab.node(target).engine_url)
        await asyncio.sleep(max(0.0, t_fault + hold - time.time()))
        t_lift = time.time()
        await asyncio.to_thread(fault.lift, lab, target)
        t_lifted = time.time()
        cap = s.recover_max if mode in JUDGED else s.recover_max_baseline
        recovered_s = await _watch_recovery(lab, mode, target, t_lift, cap)
        results = await load.stop()
        t_end = time.time()
        events = await asyncio.to_thread(gw.events)
        hedges = measure.hedges_sent(hedges0, await asyncio.to_thread(gw.counter, HEDGES))
        node = lab.node(target)
        try:
            arrivals = await asyncio.to_thread(lab.engines[target].arrivals, t_fault - 1)
        except Exception:
            arrivals = []
        figures = measure.summarize(
            results=results,
            events=events,
            backend=target,
            t_fault=t_fault,
            t_lift=t_lift,
            t_end=t_end,
            sends=tap.client_sends(node.ip, t_fault, t_end),
            arrivals=arrivals,
            recovered_s=recovered_s,
        )
        if s.raw_dir is not None:
            s.raw_dir.mkdir(parents=True, exist_ok=True)
            raw = {"t_fault": t_fault, "t_lift": t_lift, "events": events,
                   "requests": [r.row() for r in results]}  # fmt: skip
            (s.raw_dir / f"{tag}.json").write_text(json.dumps(raw))
        return {
            "fault": fault.key,
            "mode": mode,
            "ok": True,
            "target": target,
            "target_share_before_fault": share,
            "fleet_before_fault": fleet,
            "ready_wait_s": round(ready_s, 2),
            "inject_cmd_s": round(t_injected - t_fault, 4),
            "lift_cmd_s": round(t_lifted - t_lift, 4),
            "hold_s": round(t_lift - t_fault, 2),
            "health_during_fault": health,
            "requests_total": len(results),
            "t_fault": t_fault,
            "t_lift": t_lift,
            "events": [e for e in events if e.get("ts", 0) >= t_fault - 1],
            **figures,
            # from the fault to the end of the run, against the requests sent in that time
            "hedges": hedges,
            "requests_since_fault": sum(1 for r in results if r.t0 >= t_fault),
            "timeline": measure.timeline(results, target, t_fault),
        }
    except Exception as e:  # one broken scenario must not lose the others' figures
        return {"fault": fault.key, "mode": mode, "ok": False, "error": f"{type(e).__name__}: {e}"}
    finally:
        await asyncio.to_thread(lab.stop_gateway)
        await asyncio.to_thread(lab.repair)


def _pick_target(want: str, results: list[Result], lab: Lab) -> tuple[str, float]:
    """The target and its share of the client requests answered in the last 1.5 s."""
    since = time.time() - 1.5
    recent = [r.backend for r in results if r.t1 >= since and r.backend]
    counts = {lab.name(i): recent.count(lab.name(i)) for i in range(lab.n)}
    if want == "auto":
        want = max(counts, key=lambda n: (counts[n], n == "b1"))
    return want, round(counts.get(want, 0) / len(recent), 3) if recent else 0.0


def _fleet_view(gw: Any) -> dict[str, dict[str, Any]]:
    """Each backend's state, weight, score and latency signals just before the fault."""
    out = {}
    for name, b in gw.backends().items():
        sig = b.get("signals") or {}
        out[name] = {
            "state": b["state"],
            "weight": b.get("weight"),
            "score": b.get("score"),
            "ttft_ms": sig.get("ttft_ms"),
            "latency_ratio": sig.get("latency_ratio"),
        }
    return out


def _health(url: str) -> str:
    """What the faulty engine's own /health says mid-fault, asked from the gateway's side."""
    try:
        return str(httpx.get(f"{url}/health", timeout=2.0).status_code)
    except httpx.TimeoutException:
        return "timeout"
    except httpx.HTTPError as e:
        return type(e).__name__


async def _watch_recovery(
    lab: Lab, mode: str, target: str, t_lift: float, cap: float
) -> float | None:
    """Seconds from the lift until the target is back at full weight; None past `cap`."""
    gw = lab.gateway
    assert gw is not None
    deadline = t_lift + cap
    while time.time() < deadline:
        try:
            b = (await asyncio.to_thread(gw.backends))[target]
            if _full(b, mode):
                return time.time() - t_lift
        except Exception:
            pass
        await asyncio.sleep(0.2)
    return None
