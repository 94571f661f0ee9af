"""From one scenario's raw records to its figures. Pure functions: no I/O, no clock.

Definitions (all times are wall clock on this one host, so the gateway's event `ts`, the
load client's timestamps and the wire tap's agree):

- detection: fault start -> the faulty backend's first transition into a state that takes
  no client traffic (ejected; warming/cold for a node that says it is not ready) while the
  fault is held. `first_reaction` is its first transition of any kind (degraded, say).
- client errors: requests that left during the fault ([fault, lift)) and did not get a
  complete, well-formed answer (load.Result.error), over all requests that left then.
- sent after detection: client requests the gateway put on the wire to the faulty backend
  (wire tap at the router) while it was out of rotation, from detection + a 50 ms in-flight
  allowance to the fault's lift or the backend's return, whichever comes first.
- p99: client latency (send -> complete answer or error) of the requests of the fault window.
- back to full weight: lift -> the backend is `ready` again at ramp 1.0 (pulsegate) or
  weight 1 (baselines); None when it never got there within the observation window.
- degraded: fault start -> the faulty backend's first transition to `degraded` (still
  routable: a slow or throttled node), with its cause.
- stall pause: the longest silence (time to the first chunk, or the longest pause between
  two chunks, whichever is longer) of each stream that the faulty backend started (its
  `x-pulsegate-backend`: the headers leave before any continuation) and that was still
  running at the fault's start (ended after it, sent before the lift): the streams a
  mid-stream fault hit. p50 and max over them.
- TTFT: streamed requests only (the client's first body chunk). The healthy fleet's p99 is
  that of the streams sent in the second half of the load before the fault (the first half
  is the gateway's start-up); "during" is over the fault window.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from chaos.load import Result

OUT_STATES = frozenset({"ejected", "warming", "cold", "drained"})
IN_FLIGHT_SLACK_S = 0.05


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def backend_events(events: Iterable[dict[str, Any]], backend: str) -> list[dict[str, Any]]:
    return sorted((e for e in events if e.get("backend") == backend), key=lambda e: e["id"])


def detection(
    events: Sequence[dict[str, Any]], t_fault: float, t_end: float
) -> dict[str, Any] | None:
    """The first transition out of rotation at or after the fault (events of one backend)."""
    for e in events:
        if t_fault <= e["ts"] < t_end and e["to"] in OUT_STATES:
            return e
    return None


def first_reaction(
    events: Sequence[dict[str, Any]], t_fault: float, t_end: float
) -> dict[str, Any] | None:
    for e in events:
        if t_fault <= e["ts"] < t_end and e["to"] != e["from"]:
            return e
    return None


def out_windows(
    events: Sequence[dict[str, Any]], t_fault: float, t_lift: float
) -> list[tuple[float, float]]:
    """Intervals within [t_fault, t_lift) during which the backend was out of rotation."""
    windows: list[tuple[float, float]] = []
    start: float | None = None
    for e in events:
        if e["ts"] < t_fault:
            continue
        if e["ts"] >= t_lift:
            break
        if e["to"] in OUT_STATES and start is None:
            start = e["ts"]
        elif e["to"] not in OUT_STATES and start is not None:
            windows.append((start, e["ts"]))
            start = None
    if start is not None:
        windows.append((start, t_lift))
    return windows


def count_in(times: Iterable[float], windows: Sequence[tuple[float, float]], slack: float) -> int:
    return sum(1 for t in times if any(a + slack <= t < b for a, b in windows))


def summarize(
    *,
    results: Sequence[Result],
    events: Sequence[dict[str, Any]],
    backend: str,
    t_fault: float,
    t_lift: float,
    t_end: float,
    sends: Sequence[float],
    arrivals: Sequence[float],
    recovered_s: float | None,
) -> dict[str, Any]:
    """Every figure of one (fault, mode) run."""
    mine = backend_events(events, backend)
    # A detection counts only while the fault is held: what happens after the lift is recovery.
    det = detection(mine, t_fault, t_lift)
    react = first_reaction(mine, t_fault, t_lift)
    windows = out_windows(mine, t_fault, t_lift)
    during = [r for r in results if t_fault <= r.t0 < t_lift]
    after = [r for r in results if r.t0 >= t_lift]
    before = [r for r in results if r.t0 < t_fault]
    errs = [r for r in during if not r.ok]
    lat = [r.latency for r in during]
    streams = [r for r in during if r.stream and r.max_gap is not None]
    gaps = [r.max_gap for r in streams if r.max_gap is not None]
    kinds: dict[str, int] = {}
    for r in errs:
        kinds[r.error] = kinds.get(r.error, 0) + 1
    others = sorted(
        {
            e["backend"]
            for e in events
            if e.get("backend") != backend
            and t_fault <= e["ts"] < t_lift
            and e["to"] in OUT_STATES
            and not str(e.get("backend", "")).startswith("model:")
        }
    )
    deg = reached(mine, "degraded", t_fault, t_lift)
    return {
        "detected": det is not None,
        "detection_s": round(det["ts"] - t_fault, 3) if det else None,
        "detection_cause": det.get("cause") if det else None,
        "detection_reason": det.get("reason") if det else None,
        "first_reaction_s": round(react["ts"] - t_fault, 3) if react else None,
        "first_reaction": _describe(react),
        "ejections_during_fault": sum(
            1 for e in mine if t_fault <= e["ts"] < t_lift and e["to"] in OUT_STATES
        ),
        "requests_during_fault": len(during),
        "client_errors": len(errs),
        "client_error_rate": round(len(errs) / len(during), 6) if during else None,
        "error_kinds": kinds,
        "timeouts": kinds.get("timeout", 0),
        "p50_s": _r(percentile(lat, 50)),
        "p99_s": _r(percentile(lat, 99)),
        "max_s": _r(max(lat) if lat else None),
        "slower_than_1s": sum(1 for x in lat if x > 1.0),
        "stream_max_gap_p99_s": _r(percentile(gaps, 99)),
        "stream_max_gap_max_s": _r(max(gaps) if gaps else None),
        "sent_after_detection": count_in(sends, windows, IN_FLIGHT_SLACK_S) if det else None,
        "arrived_after_detection": count_in(arrivals, windows, IN_FLIGHT_SLACK_S) if det else None,
        "sent_during_fault": sum(1 for t in sends if t_fault <= t < t_lift),
        "served_by_faulty_during_fault": sum(1 for r in during if r.backend == backend and r.ok),
        "back_to_full_weight_s": _r(recovered_s),
        "errors_before_fault": sum(1 for r in before if not r.ok),
        "requests_before_fault": len(before),
        "errors_after_lift": sum(1 for r in after if not r.ok),
        "requests_after_lift": len(after),
        "other_backends_ejected": others,
        "degraded_s": round(deg["ts"] - t_fault, 3) if deg else None,
        "degraded_cause": deg.get("cause") if deg else None,
        **stall_pauses(results, backend, t_fault, t_lift),
        **ttfts(results, t_fault, t_lift),
    }


def reached(
    events: Sequence[dict[str, Any]], state: str, t_fault: float, t_end: float
) -> dict[str, Any] | None:
    """The backend's first transition to `state` within [t_fault, t_end) (events of one)."""
    for e in events:
        if t_fault <= e["ts"] < t_end and e["to"] == state and e["from"] != state:
            return e
    return None


def stall_pauses(
    results: Sequence[Result], backend: str, t_fault: float, t_lift: float
) -> dict[str, Any]:
    """The longest silence of each stream the faulty backend started and the fault caught
    running, p50 and max. The time to the first chunk counts: a stream that waits 5 s for its
    first token on a node whose slots are all held by stalled requests paused 5 s. (The
    fault command can take a few hundred ms on a loaded box, so its return is no bound: a
    stream can be stalled and resumed before it.)"""
    gaps = [
        max(r.ttft, r.max_gap)
        for r in results
        if r.stream and r.backend == backend and r.t1 > t_fault and r.t0 < t_lift
        if r.ttft is not None and r.max_gap is not None
    ]
    return {
        "stalled_streams": len(gaps),
        "stall_pause_p50_s": _r(percentile(gaps, 50)),
        "stall_pause_max_s": _r(max(gaps) if gaps else None),
    }


def ttfts(results: Sequence[Result], t_fault: float, t_lift: float) -> dict[str, Any]:
    """Streams' time to first chunk: the healthy fleet's (late warm-up) against the fault's."""
    t_start = min((r.t0 for r in results), default=t_fault)
    warm = (t_start + t_fault) / 2
    streams = [(r.t0, r.ttft) for r in results if r.stream and r.ttft is not None]
    healthy = [x for t, x in streams if warm <= t < t_fault]
    during = [x for t, x in streams if t_fault <= t < t_lift]
    return {
        "healthy_streams": len(healthy),
        "healthy_ttft_p50_s": _r(percentile(healthy, 50)),
        "healthy_ttft_p99_s": _r(percentile(healthy, 99)),
        "ttft_p50_s": _r(percentile(during, 50)),
        "ttft_p99_s": _r(percentile(during, 99)),
    }


def hedges_sent(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """`pulsegate_hedges_total` by outcome, between two scrapes; `sent` adds up the hedges
    that went out (won, lost or failed; `no_budget` and `no_backend` sent nothing)."""
    out = {k: int(after.get(k, 0) - before.get(k, 0)) for k in after}
    out["sent"] = sum(out.get(k, 0) for k in ("hedge_won", "primary_won", "hedge_failed"))
    return out


def timeline(
    results: Sequence[Result], backend: str, t_fault: float, step: float = 1.0
) -> list[list[float]]:
    """Per `step` seconds from the fault (negative: before it), by request send time:
    [t, requests, errors, p99 ms, answered by the faulty backend]."""
    buckets: dict[int, list[Result]] = {}
    for r in results:
        buckets.setdefault(math.floor((r.t0 - t_fault) / step), []).append(r)
    out = []
    for k in sorted(buckets):
        rs = buckets[k]
        p99 = percentile([r.latency for r in rs], 99) or 0.0
        out.append([k * step, len(rs), sum(1 for r in rs if not r.ok), round(p99 * 1000),
                    sum(1 for r in rs if r.backend == backend)])  # fmt: skip
    return out


def _describe(e: dict[str, Any] | None) -> str | None:
    return f"{e['from']}->{e['to']} ({e.get('cause')})" if e else None


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
