"""Issue 5's figures: agent frozen, killed, or cut off -> backend ejected (cause heartbeat).

    .venv/bin/python -m chaos.heartbeat [--trials 20] [--faults agent_stop,agent_kill,agent_drop]

Five backends b0..b4 (engine + agent, each in its own namespace), one pulsegate gateway with
the DEFAULT heartbeat (ping every 100 ms, 80 ms timeout, 3 misses), light client load
(20 requests/s). Each trial picks a backend that is ready at full weight, then:

    agent_stop  SIGSTOP the agent            lift: SIGCONT
    agent_kill  SIGKILL the agent            lift: start a new agent on the same address
    agent_drop  drop the agent's traffic (TCP port 50051, both ways) in the router namespace
                                             lift: remove the rule
    engine_kill SIGKILL the engine, the agent lives (on request only: --faults engine_kill)
                                             lift: start a new engine on the same address

and measures fault -> the backend's ejection event (`/admin/events` wall time; the fault time
is taken just before the signal or the iptables command). It holds the fault 0.5 s past the
ejection, counting the client requests the gateway puts on the wire to that backend after
the ejection (wire tap in the router), then lifts it; the backend must come back through
`probation` to `ready` (checked at the end for every trial). Trials rotate over the five
backends so recovery overlaps the next trials; only the way back is shortened (ejection base
1 s, probation 6 s: it must outlast one 3-5 s micro-inference period), detection runs on the
defaults. About 3 minutes for 3 x 20 trials.
Writes JSON (--out) and prints p50 / p90 / max per fault.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from chaos import netlab, report
from chaos.lab import Lab
from chaos.load import Load, Result
from chaos.measure import percentile
from chaos.tap import Tap

KINDS = ("agent_stop", "agent_kill", "agent_drop")
# Not a heartbeat fault: the agent lives and sees its engine's port refuse (cause engine_down).
EXTRA_KINDS = ("engine_kill",)
HEALTH: dict[str, Any] = {"ejection_base": "1s", "probation": {"duration": "6s", "ramp_step": 0.25}}
TARGET_P50_S, TARGET_MAX_S = 0.240, 0.400
HOLD_AFTER_S = 0.5
SLACK_S = 0.05


def _inject(lab: Lab, kind: str, name: str) -> None:
    if kind == "agent_stop":
        lab.agents[name].signal(signal.SIGSTOP)
    elif kind == "agent_kill":
        lab.agents[name].signal(signal.SIGKILL)
    elif kind == "engine_kill":
        lab.engines[name].signal(signal.SIGKILL)
    else:
        # Both directions in one iptables-restore transaction: one commit, one instant.
        chain = netlab.fault_chain(lab.node(name).index)
        port = netlab.AGENT_PORT
        rules = (
            f"*filter\n-A {chain} -p tcp --dport {port} -j DROP\n"
            f"-A {chain} -p tcp --sport {port} -j DROP\nCOMMIT\n"
        )
        p = subprocess.run(
            ["ip", "netns", "exec", netlab.RTR, "iptables-restore", "--noflush"],
            input=rules, capture_output=True, text=True, timeout=15,
        )  # fmt: skip
        if p.returncode != 0:
            raise netlab.LabError(f"iptables-restore: {p.stderr.strip()}")


def _lift(lab: Lab, kind: str, name: str) -> None:
    if kind == "agent_stop":
        lab.agents[name].signal(signal.SIGCONT)
    elif kind == "agent_kill":
        lab.restart_agent(name)
    elif kind == "engine_kill":
        lab.restart_engine(name)
    else:
        netlab.iptables(netlab.RTR, "-F", netlab.fault_chain(lab.node(name).index))


def _events(lab: Lab, backend: str) -> list[dict[str, Any]]:
    assert lab.gateway is not None
    return [e for e in lab.gateway.events() if e["backend"] == backend]


async def _wait_candidate(lab: Lab, order: list[str], within: float = 60.0) -> str:
    """The next backend in rotation that is ready at full ramp, with at most one other backend
    out of rotation (2 of 5 out is under the 50 % panic threshold: no trial is ever measured
    in panic mode, where ejected backends may be routed to)."""
    assert lab.gateway is not None
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        bs = await asyncio.to_thread(lab.gateway.backends)
        out = [n for n, b in bs.items() if b["state"] not in ("ready", "degraded", "probation")]
        for name in order:
            b = bs[name]
            if b["state"] == "ready" and (b.get("ramp") or 0) >= 1.0 and len(out) <= 1:
                order.remove(name)
                order.append(name)
                return name
        await asyncio.sleep(0.1)
    raise TimeoutError("no backend became ready at full weight within 60 s")


async def trial(lab: Lab, tap: Tap, kind: str, name: str) -> dict[str, Any]:
    t_fault = time.time()
    await asyncio.to_thread(_inject, lab, kind, name)
    cmd_s = time.time() - t_fault
    ejection = None
    deadline = time.monotonic() + 5.0
    while ejection is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        evs = await asyncio.to_thread(_events, lab, name)
        ejection = next((e for e in evs if e["to"] == "ejected" and e["ts"] >= t_fault), None)
    await asyncio.sleep(HOLD_AFTER_S)
    t_lift = time.time()
    await asyncio.to_thread(_lift, lab, kind, name)
    sends = []
    if ejection is not None:
        sends = tap.client_sends(lab.node(name).ip, ejection["ts"] + SLACK_S, t_lift)
    return {
        "kind": kind,
        "backend": name,
        "t_fault": t_fault,
        "t_lift": t_lift,
        "inject_cmd_s": round(cmd_s, 4),
        "detected": ejection is not None,
        # From just before the signal / iptables command (an upper bound) ...
        "detection_s": round(ejection["ts"] - t_fault, 4) if ejection else None,
        # ... and from its return (a lower bound: the fault was in force by then).
        "detection_after_cmd_s": round(ejection["ts"] - t_fault - cmd_s, 4) if ejection else None,
        "cause": ejection["cause"] if ejection else None,
        "reason": ejection["reason"] if ejection else None,
        "sent_after_detection": len(sends),
    }


def _recovery(events: list[dict[str, Any]], t: dict[str, Any]) -> None:
    """Fill in how the backend came back after the lift: probation, then ready."""
    mine = [e for e in events if e["backend"] == t["backend"] and e["ts"] >= t["t_lift"]]
    probation = next((e for e in mine if e["to"] == "probation"), None)
    ready = next((e for e in mine if e["to"] == "ready"), None)
    t["probation_after_lift_s"] = round(probation["ts"] - t["t_lift"], 3) if probation else None
    t["ready_after_lift_s"] = round(ready["ts"] - t["t_lift"], 3) if ready else None
    t["back_through_probation"] = bool(probation and ready and probation["ts"] <= ready["ts"])


def _attribute_errors(trials: list[dict[str, Any]], results: list[Result]) -> None:
    """Each client error goes to the trial whose fault it was sent during or after (before
    the next trial's fault); its kind and the backend that answered are kept."""
    starts = sorted(t["t_fault"] for t in trials)
    for t in trials:
        t["client_errors"] = []
        t["client_requests"] = 0
    by_start = {t["t_fault"]: t for t in trials}
    for r in results:
        prior = [s for s in starts if s <= r.t0]
        if not prior:
            continue
        t = by_start[prior[-1]]
        t["client_requests"] += 1
        if not r.ok:
            t["client_errors"].append(
                {"t": round(r.t0 - t["t_fault"], 3), "error": r.error, "backend": r.backend,
                 "stream": r.stream, "latency_s": round(r.latency, 3)}
            )  # fmt: skip


async def run_trials(
    lab: Lab,
    kinds: tuple[str, ...],
    trials: int,
    rate: float = 20.0,
    settle: float = 30.0,
    raw: Path | None = None,
) -> list[dict[str, Any]]:
    """`trials` trials of each kind on a running lab (gateway started here); every trial's
    figures, with its way back filled in from the events at the end."""
    gw = await asyncio.to_thread(lab.start_gateway, "pulsegate", "heartbeat", HEALTH)
    await asyncio.to_thread(lab.wait_all_ready, 40.0)
    tap = Tap().start()
    load = Load(gw.url, rate=rate, seed=5)
    load.start()
    order = [lab.name(i) for i in range(lab.n)]
    out: list[dict[str, Any]] = []
    stopped = False
    try:
        for kind in kinds:
            for i in range(trials):
                name = await _wait_candidate(lab, order)
                t = await trial(lab, tap, kind, name)
                out.append(t)
                det = "never" if t["detection_s"] is None else f"{t['detection_s'] * 1000:.0f} ms"
                print(f"  {kind} #{i + 1} on {name}: {det} ({t['cause']}), "
                      f"sent after {t['sent_after_detection']}", flush=True)  # fmt: skip
        # Let the last trials finish their probation before reading the way back.
        deadline = time.monotonic() + settle
        while time.monotonic() < deadline:
            bs = await asyncio.to_thread(gw.backends)
            if all(b["state"] == "ready" and (b.get("ramp") or 0) >= 1 for b in bs.values()):
                break
            await asyncio.sleep(0.2)
        events = await asyncio.to_thread(gw.events)
        for t in out:
            _recovery(events, t)
        results = await load.stop()
        stopped = True
        _attribute_errors(out, results)
        if raw is not None:
            doc = json.dumps({"trials": out, "requests": [r.row() for r in results]})
            await asyncio.to_thread(raw.write_text, doc)
    finally:
        tap.stop()
        if not stopped:
            await load.stop()
        await asyncio.to_thread(lab.stop_gateway)
    return out


def summarize(trials: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for kind in sorted({t["kind"] for t in trials}):
        ts = [t for t in trials if t["kind"] == kind]
        det = [t["detection_s"] for t in ts if t["detection_s"] is not None]
        out[kind] = {
            "trials": len(ts),
            "detected": len(det),
            "cause_heartbeat": sum(1 for t in ts if t["cause"] == "heartbeat"),
            "p50_ms": round(statistics.median(det) * 1000, 1) if det else None,
            "p50_after_cmd_ms": _ms([t["detection_after_cmd_s"] for t in ts], 50),
            "max_after_cmd_ms": _ms([t["detection_after_cmd_s"] for t in ts], 100),
            "inject_cmd_max_ms": round(max(t["inject_cmd_s"] for t in ts) * 1000, 1),
            "p90_ms": round((percentile(det, 90) or 0) * 1000, 1) if det else None,
            "max_ms": round(max(det) * 1000, 1) if det else None,
            "min_ms": round(min(det) * 1000, 1) if det else None,
            "sent_after_detection": sum(t["sent_after_detection"] for t in ts),
            "client_errors": sum(len(t.get("client_errors", [])) for t in ts),
            "client_requests": sum(t.get("client_requests", 0) for t in ts),
            "back_through_probation": sum(1 for t in ts if t.get("back_through_probation")),
            "ready_after_lift_p50_s": _med([t.get("ready_after_lift_s") for t in ts]),
        }
    return out


def _ms(xs: list[float | None], q: float) -> float | None:
    v = [x for x in xs if x is not None]
    p = percentile(v, q) if v else None
    return None if p is None else round(p * 1000, 1)


def _med(xs: list[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return round(statistics.median(v), 2) if v else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="chaos.heartbeat", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--faults", default=",".join(KINDS))
    ap.add_argument("--out", type=Path, default=Path("artifacts/chaos/heartbeat.json"))
    ap.add_argument(
        "--publish", action="store_true", help="add the figures to docs/chaos-results.{md,json}"
    )
    args = ap.parse_args(argv)
    kinds = tuple(args.faults.split(","))
    if any(k not in KINDS + EXTRA_KINDS for k in kinds):
        print(f"faults: choose from {', '.join(KINDS + EXTRA_KINDS)}", file=sys.stderr)
        return 2
    netlab.ensure_tools()
    reason = netlab.why_unavailable()
    if reason:
        print(f"chaos.heartbeat: cannot run: {reason}", file=sys.stderr)
        return 2
    lab = Lab(5, args.out.parent / "logs-heartbeat")
    lab.install_signal_handlers()
    t0 = time.time()
    load_start = os.getloadavg()
    with lab:
        raw = args.out.with_suffix(".requests.json")
        trials = asyncio.run(run_trials(lab, kinds, args.trials, raw=raw))
    summary = summarize(trials)
    doc = {
        "meta": {
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(t0)),
            "duration_s": round(time.time() - t0, 1),
            "heartbeat": "defaults: interval 100ms, timeout 80ms, misses_to_dead 3",
            "health": HEALTH,
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "target": {"p50_ms": TARGET_P50_S * 1000, "max_ms": TARGET_MAX_S * 1000},
        },
        "summary": summary,
        "trials": trials,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print()
    print("| fault | trials | ejected (cause heartbeat) | p50 | p90 | max | sent after | "
          "back via probation |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind, s in summary.items():
        print(f"| {kind} | {s['trials']} | {s['detected']} ({s['cause_heartbeat']}) "
              f"| {s['p50_ms']} ms | {s['p90_ms']} ms | {s['max_ms']} ms "
              f"| {s['sent_after_detection']} | {s['back_through_probation']} |")  # fmt: skip
    print(f"\nwritten to {args.out}")
    if args.publish:
        _publish(doc)
    return 0


def _publish(doc: dict[str, Any]) -> None:
    docs = Path(__file__).resolve().parent.parent / "docs"
    path = docs / "chaos-results.json"
    results = json.loads(path.read_text()) if path.exists() else {"meta": None, "runs": []}
    results["heartbeat"] = doc
    path.write_text(json.dumps(results, indent=1))
    if results.get("meta"):
        (docs / "chaos-results.md").write_text(report.markdown(results))
    print(f"published to {path}")


if __name__ == "__main__":
    raise SystemExit(main())
