"""Medians over repetitions, ratios to direct, nginx and Envoy, the issues' targets, the table."""

from __future__ import annotations

import statistics
from typing import Any

NAN = float("nan")
# Not pulsegate: the baselines, measured beside it and checked against no target.
PEERS = ("direct", "nginx", "envoy", "smg", "pyfloor")

# Issue 4's targets and issue 23's, checked for every pulsegate target: (key, label, op, bound).
TARGETS: list[tuple[str, str, str, float]] = [
    ("rps_vs_nginx", "non-streaming throughput vs nginx", ">=", 0.3),
    ("rps_vs_envoy", "issue 23: non-streaming throughput vs Envoy", ">=", 1.0),
    ("added_rate_p50_ms", "added median latency at the fixed rate (ms)", "<=", 0.3),
    ("ttft_p50_ms", "64 streams: TTFT p50 (ms)", "<=", 3.0),
    ("tok_s_vs_direct", "64 streams: tokens/s vs direct", ">=", 0.95),
    ("peak_rss_max_mb", "peak RSS per process (MB)", "<=", 100.0),
]


def med(values: list[float]) -> float:
    vals = [v for v in values if v == v]  # drop NaN
    return statistics.median(vals) if vals else NAN


def summarize(raw: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, r in raw.items():
        t, fr, st = r["tput"], r["rate"], r["stream"]
        s: dict[str, Any] = {
            "note": r.get("note", ""),
            "rps": med([x["rps"] for x in t]),
            "rps_min": min((x["rps"] for x in t), default=NAN),
            "rps_max": max((x["rps"] for x in t), default=NAN),
            "sat_p50_ms": med([x["p50_ms"] for x in t]),
            "sat_p99_ms": med([x["p99_ms"] for x in t]),
            "cpu_us_per_req": med([x.get("cpu_us_per_req", NAN) for x in t]),
            # The least-disturbed repetition: the best estimate of the intrinsic cost.
            "cpu_us_per_req_min": min((x.get("cpu_us_per_req", NAN) for x in t), default=NAN),
            "rate_p50_ms": med([x["p50_ms"] for x in fr]),
            "rate_p99_ms": med([x["p99_ms"] for x in fr]),
            "ttft_p50_ms": med([x["ttft_p50_ms"] for x in st]),
            "ttft_p99_ms": med([x["ttft_p99_ms"] for x in st]),
            "stream_p50_ms": med([x["stream_p50_ms"] for x in st]),
            "tokens_per_s": med([x["tokens_per_s"] for x in st]),
            "cpu_us_per_token": med([x.get("cpu_us_per_token", NAN) for x in st]),
            "cpu_us_per_token_min": min((x.get("cpu_us_per_token", NAN) for x in st), default=NAN),
            "errors": sum(x["errors"] for x in t + fr + st) + sum(x["incomplete"] for x in st),
            "peak_rss_mb": r.get("peak_rss_mb", NAN),
            "peak_rss_max_mb": r.get("peak_rss_max_mb", NAN),
            "processes": r.get("processes", 0),
            "ejections": r.get("ejections", 0),
        }
        out[name] = s
    direct, nginx, envoy = raw.get("direct"), raw.get("nginx"), raw.get("envoy")
    for name, s in out.items():
        r = raw[name]
        if direct is not None and name != "direct":
            # Paired per repetition (same round, minutes apart at most), then the median:
            # the machine's load drifts between rounds, far less within one.
            s["added_rate_p50_ms"] = _paired(r["rate"], direct["rate"], "p50_ms", _minus)
            s["added_rate_p99_ms"] = _paired(r["rate"], direct["rate"], "p99_ms", _minus)
            s["rps_vs_direct"] = _paired(r["tput"], direct["tput"], "rps", _over)
            s["tok_s_vs_direct"] = _paired(r["stream"], direct["stream"], "tokens_per_s", _over)
        if nginx is not None and name not in ("direct", "nginx"):
            s["rps_vs_nginx"] = _paired(r["tput"], nginx["tput"], "rps", _over)
            s["tok_s_vs_nginx"] = _paired(r["stream"], nginx["stream"], "tokens_per_s", _over)
        if envoy is not None and name not in ("direct", "envoy"):
            s["rps_vs_envoy"] = _paired(r["tput"], envoy["tput"], "rps", _over)
            s["tok_s_vs_envoy"] = _paired(r["stream"], envoy["stream"], "tokens_per_s", _over)
    if direct is not None and direct["tput"]:
        # The quietest repetition (direct fastest): least disturbed by other work.
        q = max(range(len(direct["tput"])), key=lambda i: direct["tput"][i]["rps"])
        for name, s in out.items():
            t = raw[name]["tput"]
            s["quiet_rep"] = q
            s["quiet_rps"] = t[q]["rps"] if q < len(t) else NAN
            if nginx is not None and q < len(nginx["tput"]) and q < len(t):
                s["quiet_rps_vs_nginx"] = s["quiet_rps"] / nginx["tput"][q]["rps"]
    return out


def _minus(a: float, b: float) -> float:
    return a - b


def _over(a: float, b: float) -> float:
    return a / b if b else NAN


def _paired(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str, op: Any) -> float:
    return med([op(x[key], y[key]) for x, y in zip(a, b, strict=False)])


def check_targets(summary: dict[str, dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    verdicts: dict[str, list[dict[str, Any]]] = {}
    for name, s in summary.items():
        if name in PEERS:
            continue
        rows = []
        for key, label, op, bound in TARGETS:
            v = s.get(key, NAN)
            if v != v:
                status = "n/a"
            elif op == ">=":
                status = "PASS" if v >= bound else "MISS"
            else:
                status = "PASS" if v <= bound else "MISS"
            target = f"{label} {op} {bound:g}"
            rows.append({"key": key, "target": target, "value": v, "status": status})
        verdicts[name] = rows
    return verdicts


def _f(v: Any, spec: str) -> str:
    if not isinstance(v, int | float) or v != v:
        return "-"
    return format(v, spec)


def table(summary: dict[str, dict[str, Any]], cfg: dict[str, Any]) -> str:
    rate = cfg["rate"]
    lines = [
        f"Non-streaming: wrk -t1 -c{cfg['conns']} {cfg['duration']:g}s; open loop {rate:g} req/s "
        f"for {cfg['rate_duration']:g}s; medians of {cfg['reps']} interleaved repetitions",
        "",
        f"| target | req/s (min..max) | vs direct | vs nginx | vs envoy | CPU µs/req (min) "
        f"| {rate:g}/s p50 ms "
        f"| {rate:g}/s p99 ms | added p50 ms | added p99 ms | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, s in summary.items():
        lines.append(
            f"| {n} | {_f(s['rps'], '.0f')} ({_f(s['rps_min'], '.0f')}..{_f(s['rps_max'], '.0f')})"
            f" | {_f(s.get('rps_vs_direct'), '.2f')} | {_f(s.get('rps_vs_nginx'), '.2f')}"
            f" | {_f(s.get('rps_vs_envoy'), '.2f')}"
            f" | {_f(s['cpu_us_per_req'], '.0f')} ({_f(s['cpu_us_per_req_min'], '.0f')})"
            f" | {_f(s['rate_p50_ms'], '.3f')} | {_f(s['rate_p99_ms'], '.2f')}"
            f" | {_f(s.get('added_rate_p50_ms'), '+.3f')}"
            f" | {_f(s.get('added_rate_p99_ms'), '+.2f')}"
            f" | {s['errors']} |"
        )
    lines += [
        "",
        f"Streaming: {cfg['streams']} concurrent closed-loop streams x {cfg['tokens']} tokens, "
        f"engine ITL {cfg['itl_ms']:g} ms, {cfg['stream_duration']:g}s window; memory",
        "",
        "| target | TTFT p50 ms | TTFT p99 ms | stream p50 ms | tokens/s | vs direct | vs nginx "
        "| vs envoy | CPU µs/token (min) | peak RSS MB (sum) | largest process MB | processes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, s in summary.items():
        lines.append(
            f"| {n} | {_f(s['ttft_p50_ms'], '.2f')} | {_f(s['ttft_p99_ms'], '.2f')}"
            f" | {_f(s['stream_p50_ms'], '.0f')} | {_f(s['tokens_per_s'], '.0f')}"
            f" | {_f(s.get('tok_s_vs_direct'), '.3f')} | {_f(s.get('tok_s_vs_nginx'), '.3f')}"
            f" | {_f(s.get('tok_s_vs_envoy'), '.3f')}"
            f" | {_f(s['cpu_us_per_token'], '.1f')} ({_f(s['cpu_us_per_token_min'], '.1f')})"
            f" | {_f(s['peak_rss_mb'], '.0f')} | {_f(s['peak_rss_max_mb'], '.0f')}"
            f" | {s['processes'] or '-'} |"
        )
    notes = [f"- {n}: {s['note']}" for n, s in summary.items() if s.get("note")]
    notes += [
        f"- {n}: {s['ejections']} ejection(s) by its health machinery during the run "
        "(see bench/results/bench_logs): routing was not to the whole fleet"
        for n, s in summary.items()
        if s.get("ejections")
    ]
    quiet = [
        f"{n} {s['quiet_rps']:.0f}"
        + (f" ({s['quiet_rps_vs_nginx']:.2f}x nginx)" if "quiet_rps_vs_nginx" in s else "")
        for n, s in summary.items()
        if "quiet_rps" in s
    ]
    if quiet:
        rep = next(iter(summary.values()))["quiet_rep"]
        notes.append(f"- quietest repetition ({rep}, direct fastest), req/s: " + ", ".join(quiet))
    if notes:
        lines += ["", *notes]
    return "\n".join(lines)


def targets_table(verdicts: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| pulsegate target | issue 4 / 23 target | measured | status |", "|---|---|---:|---|"]
    for name, rows in verdicts.items():
        for r in rows:
            lines.append(f"| {name} | {r['target']} | {_f(r['value'], '.3f')} | {r['status']} |")
    return "\n".join(lines)
