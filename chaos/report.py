"""The results as Markdown: the seeds' headline table with our figures beside it, then one
row per fault for pulsegate and one per fault for the other modes side by side (Envoy +
pulsegate epp, when run, beside pulsegate: a fault it cannot face says what of `serve` it
needs instead of a figure)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

MODE_NAMES = {
    "pulsegate": "pulsegate",
    "polling": "HTTP polling (5 s x 3)",
    "passive": "passive outlier (5 x 5xx)",
    "round_robin": "round-robin",
    "envoy-epp": "Envoy + pulsegate epp",
}
BASELINES = ("polling", "passive", "round_robin")
# Beside pulsegate in the tables: its own brain behind Envoy, then the baselines.
OTHERS = ("envoy-epp", *BASELINES)


def _ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:,.0f} ms" if x < 10 else f"{x:,.1f} s"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} s"


def _pct(r: dict[str, Any]) -> str:
    n, e = r.get("requests_during_fault"), r.get("client_errors")
    if not n:
        return "-"
    return f"{100 * e / n:.2f}% ({e}/{n})" if e else f"0 (0/{n})"


def _det(r: dict[str, Any] | None, with_cause: bool = True) -> str:
    if r is None or not r.get("ok"):
        return "run failed" if r is not None else "-"
    if not r.get("detected"):
        if r.get("degraded_s") is not None:  # still routable, but judged: a slow node
            out = f"degraded {_ms(r['degraded_s'])}"
            return f"{out} ({r['degraded_cause']})" if with_cause else out
        return "never"
    out = _ms(r["detection_s"])
    return f"{out} ({r['detection_cause']})" if with_cause and r.get("detection_cause") else out


def _needs(r: dict[str, Any] | None) -> str | None:
    """The cell of a fault not run in `envoy-epp`: what of `serve` it needs."""
    return f"needs serve ({r['needs_serve']})" if r and r.get("needs_serve") else None


def one_line(r: dict[str, Any]) -> str:
    if not r.get("ok"):
        return f"FAILED: {r.get('error')}"
    return (
        f"detect {_det(r)}, errors {_pct(r)}, p99 {_ms(r['p99_s'])}, "
        f"sent after {r['sent_after_detection']}, back {_s(r['back_to_full_weight_s'])}"
    )


def _find(runs: Iterable[dict[str, Any]], fault: str, mode: str) -> dict[str, Any] | None:
    for r in runs:
        if r["fault"] == fault and r["mode"] == mode:
            return r
    return None


def _run_line(meta: dict[str, Any]) -> str:
    load, itl = meta.get("loadavg_start"), meta.get("itl_ms")
    return (
        f"{meta['started']} at git `{meta['git']}`, kernel {meta['kernel']}, "
        f"{meta['cpus']} CPUs{f', load average {load[0]:.1f}' if load else ''}, "
        f"{meta['backends']} simulated engines with agents"
        f"{f' ({itl:g} ms between tokens)' if itl else ''}, "
        f"{meta['rate_rps']:g} client requests/s (half streamed, half with 3-5 KB prompts), "
        f"client timeout {meta['client_timeout_s']:g} s, took {meta['duration_s'] / 60:.1f} min"
        f"{' (--quick)' if meta.get('quick') else ''}"
    )


def _loaded(sources: list[dict[str, Any]]) -> list[str]:
    """A warning for the runs made on a busy box (load average over twice the CPUs)."""
    busy = [str(i + 1) for i, m in enumerate(sources)
            if (m.get("loadavg_start") or [0])[0] > 2 * (m.get("cpus") or 1)]  # fmt: skip
    if not busy:
        return []
    return [
        f"Run{'s' if len(busy) > 1 else ''} {', '.join(busy)} shared the box with other work "
        "(load average over twice the CPUs at the start): their timings are noisier than a "
        "quiet box's.",
        "",
    ]


def _labels(doc: dict[str, Any]) -> dict[str, str]:
    """Each source run's `started` -> its number in the header (merged results only)."""
    sources = doc["meta"].get("sources") or []
    return {m["started"]: str(i + 1) for i, m in enumerate(sources)} if len(sources) > 1 else {}


def markdown(doc: dict[str, Any]) -> str:
    meta, runs = doc["meta"], doc["runs"]
    modes = [m for m in meta["modes"]]
    faults = list(meta["faults"])
    labels = _labels(doc)
    if labels:
        head = [
            f"Merged from {len(labels)} runs of `chaos.run` (the run column names each row's; "
            "a fault rerun replaces its older figures):",
            "",
            *(f"{i + 1}. {_run_line(m)}." for i, m in enumerate(meta["sources"])),
            "",
            *_loaded(meta["sources"]),
            "Method and definitions: [chaos.md](chaos.md). Every figure: chaos-results.json.",
        ]
    else:
        head = [
            f"Run {_run_line(meta)}. "
            "Method and definitions: [chaos.md](chaos.md). Every figure: chaos-results.json."
        ]
    lines = ["# Chaos lab results", "", *head, ""]
    lines += _headline(runs, modes)
    lines += [
        "",
        "Every fault lands on the backend that answered most client requests in the 1.5 s "
        "before it (`target`, `target_share_before_fault` in the JSON). Error rates count "
        'requests sent during the fault; "within 1 s" also counts slow answers as failures; '
        '"sent to it" is the share of those requests the gateway put on the wire to the faulty '
        "node (round-robin: about 1/3).",
    ]
    if "pulsegate" in modes:
        lines += ["", "## Per fault: pulsegate", ""]
        run_col = (" run |", " --- |") if labels else ("", "")
        lines += [
            "| fault | detection (cause) | client errors | sent to it during fault "
            f"| sent after detection | p99 during fault | back to full weight |{run_col[0]}",
            f"| --- | --- | --- | --- | --- | --- | --- |{run_col[1]}",
        ]
        for f in faults:
            r = _find(runs, f, "pulsegate")
            title = meta["faults"][f]["title"]
            tail = f" {_source([r], labels)} |" if labels else ""
            if r is None or not r.get("ok"):
                lines.append(f"| {title} | {_det(r)} | - | - | - | - | - |{tail}")
                continue
            sent = r["sent_after_detection"]
            back = _s(r["back_to_full_weight_s"]) if r["detected"] else "-"
            lines.append(
                f"| {title} | {_det(r)} | {_pct(r)} | {_sent(r)} | {'-' if sent is None else sent} "
                f"| {_ms(r['p99_s'])} | {back} |{tail}"
            )
    others = [m for m in OTHERS if m in modes]
    if others:
        cols = ["pulsegate", *others] if "pulsegate" in modes else others
        lines += ["", "## Per fault: pulsegate and the baselines (detection / errors / p99)", ""]
        if "envoy-epp" in modes:
            lines += [
                "Envoy + pulsegate epp: a real Envoy on `deploy/envoy/envoy.yaml` carries the "
                "requests, `pulsegate epp` picks and judges (`chaos.run -m envoy-epp`, not in a "
                "full run's default modes). The faults about what `serve`'s proxy does after "
                'the first byte are not run there: "needs serve".',
                "",
            ]
        extra = ["run"] if labels else []
        lines.append("| fault | " + " | ".join([*(MODE_NAMES[m] for m in cols), *extra]) + " |")
        lines.append("| --- |" + " --- |" * (len(cols) + len(extra)))
        for f in faults:
            cells = []
            for m in cols:
                r = _find(runs, f, m)
                if r is None or not r.get("ok") or r.get("needs_serve"):
                    cells.append(_needs(r) or _det(r))
                    continue
                cells.append(f"{_det(r, with_cause=False)} / {_pct(r)} / {_ms(r['p99_s'])}")
            if labels:
                cells.append(_source([_find(runs, f, m) for m in cols], labels))
            lines.append(f"| {meta['faults'][f]['title']} | " + " | ".join(cells) + " |")
    if doc.get("heartbeat"):
        lines += ["", *heartbeat_section(doc["heartbeat"])]
    if doc.get("replicas"):
        lines += ["", *replicas_section(doc["replicas"])]
    if doc.get("fleet"):
        lines += ["", *fleet_section(doc["fleet"])]
    failed = [r for r in runs if not r.get("ok")]
    if failed:
        lines += ["", "## Runs that failed", ""]
        lines += [f"- {r['fault']} / {r['mode']}: {r.get('error')}" for r in failed]
    return "\n".join(lines) + "\n"


def _source(rs: Iterable[dict[str, Any] | None], labels: dict[str, str]) -> str:
    """The numbers of the runs the figures of one row come from."""
    return ", ".join(sorted({labels.get(r.get("source", ""), "?") for r in rs if r})) or "-"


def _headline(runs: list[dict[str, Any]], modes: list[str]) -> list[str]:
    """The seeds' table, row for row, with the fault each row is measured on; then issue 21's
    done-when rows, each with its target and, for pulsegate, PASS or MISS."""
    cols = [m for m in ("pulsegate", *OTHERS) if m in modes]
    rows: list[tuple[str, str, str, str, Any]] = [
        ("failure detection latency (hard failure)", "4,500 ms", "240 ms",
         "engine_kill|link_down", lambda r: _det(r, with_cause=False)),
        ("... engine frozen or hung, process and host alive (our addition)", "-", "-",
         "engine_stop|hang", lambda r: _det(r, with_cause=False)),
        ("end-to-end request error rate under node failure", "3.2%", "0.003%",
         "engine_kill|link_down", _pct),
        ("requests over 1 s / p99 while a node hangs (issue 10: <= 1 %, < 1 s)", "-", "-",
         "hang|cuda_hang|engine_stop", _tail),
        ("25% one-way packet loss on a node: detection", "never (HTTP probe green 10 min)",
         "4.2 s", "loss_to|loss_from", lambda r: _det(r, with_cause=False)),
        ("timeout error rate under that loss", "4.8%", "0.001%", "loss_to|loss_from",
         lambda r: _timeouts(r)),
        ("request success rate with a sub-healthy instance (within 1 s)", "~92%", ">= 99.5%",
         "error|slow", _success),
        ("mid-stream failure as seen by the user", "504 error", "< 1 s pause, stream continues",
         "stall", _midstream),
        *((what, before, target, fault, fmt) for what, before, target, fault, fmt, _ in DONE_WHEN),
    ]  # fmt: skip
    verdicts = {what: verdict for what, _, _, _, _, verdict in DONE_WHEN}
    out = [
        "## Headline (the seeds' table, then issue 21's done-when rows; our figures measured "
        "on the fault named)",
        "",
        "| what | before | target (the seeds' result, or the issue's) | fault | " + " | ".join(
            MODE_NAMES[m] for m in cols) + " |",
        "| --- | --- | --- | --- |" + " --- |" * len(cols),
    ]  # fmt: skip
    for what, before, seed, faults, fmt in rows:
        keys = faults.split("|")
        cells = []
        for m in cols:
            parts = []
            for k in keys:
                r = _find(runs, k, m)
                if r is None:
                    continue
                v = _needs(r) or (fmt(r) if r.get("ok") else "run failed")
                if m == "pulsegate" and what in verdicts and r.get("ok"):
                    v += ": **PASS**" if verdicts[what](r) else ": **MISS**"
                parts.append(f"{v}" if len(keys) == 1 else f"{k}: {v}")
            cells.append("; ".join(parts) or "-")
        head = f"| {what} | {before} | {seed} | {', '.join(keys)} | "
        out.append(head + " | ".join(cells) + " |")
    return out


def _timeouts(r: dict[str, Any]) -> str:
    n = r.get("requests_during_fault") or 0
    t = r.get("timeouts", 0)
    if not n:
        return "-"
    return f"{100 * t / n:.2f}% ({t}/{n})" if t else f"0 (0/{n})"


def _success(r: dict[str, Any]) -> str:
    n = r.get("requests_during_fault") or 0
    if not n:
        return "-"
    ok = n - r.get("client_errors", 0)
    fast = n - r.get("client_errors", 0) - r.get("slower_than_1s", 0)
    return f"{100 * ok / n:.2f}% ({100 * max(0, fast) / n:.1f}%; sent to it {_sent(r)})"


def _sent(r: dict[str, Any]) -> str:
    n = r.get("requests_during_fault") or 0
    k = r.get("sent_during_fault")
    return "-" if not n or k is None else f"{100 * k / n:.0f}%"


def _tail(r: dict[str, Any]) -> str:
    n = r.get("requests_during_fault") or 0
    if not n:
        return "-"
    slow = r.get("slower_than_1s", 0)
    return f"{100 * slow / n:.1f}% / {_ms(r.get('p99_s'))}"


def _midstream(r: dict[str, Any]) -> str:
    errs = r.get("client_errors", 0)
    gap = r.get("stream_max_gap_max_s")
    return f"max pause {_ms(gap)}, {errs} failed"


def _stall(r: dict[str, Any]) -> str:
    itl = r.get("itl_ms")
    return (
        f"pause p50 {_ms(r.get('stall_pause_p50_s'))}, max {_ms(r.get('stall_pause_max_s'))} "
        f"({r.get('stalled_streams', 0)} streams hit){f' at {itl:g} ms ITL' if itl else ''}, "
        f"{r.get('client_errors', 0)} failed"
    )


def _stall_ok(r: dict[str, Any]) -> bool:
    p50, top = r.get("stall_pause_p50_s"), r.get("stall_pause_max_s")
    return (
        p50 is not None
        and top is not None
        and p50 <= 0.25
        and top <= 0.4
        and r.get("client_errors", 0) == 0
    )


def hedge_share(r: dict[str, Any]) -> float | None:
    """Hedges sent over the requests sent from the fault to the end of the run."""
    n = r.get("requests_since_fault") or 0
    return (r.get("hedges") or {}).get("sent", 0) / n if n else None


def _late(r: dict[str, Any]) -> str:
    p99, healthy = r.get("ttft_p99_s"), r.get("healthy_ttft_p99_s")
    ratio = f" ({p99 / healthy:.1f}x)" if p99 and healthy else ""
    share = hedge_share(r)
    sent = (r.get("hedges") or {}).get("sent", 0)
    hedges = f"{sent} ({100 * share:.1f}%)" if share is not None else "-"
    return f"TTFT p99 {_ms(p99)} vs healthy {_ms(healthy)}{ratio}; hedges {hedges}"


def _late_ok(r: dict[str, Any]) -> bool:
    p99, healthy, share = r.get("ttft_p99_s"), r.get("healthy_ttft_p99_s"), hedge_share(r)
    return bool(p99 and healthy and share is not None and p99 <= 2 * healthy and share <= 0.05)


def _within(limit_s: float, cause: str | None = None) -> Any:
    def ok(r: dict[str, Any]) -> bool:
        s = r.get("detection_s")
        return s is not None and s <= limit_s and (cause is None or r["detection_cause"] == cause)

    return ok


def _slow_ok(r: dict[str, Any]) -> bool:
    s = r.get("degraded_s")
    return s is not None and s <= 5.0 and r.get("degraded_cause") == "slow"


def _slow(r: dict[str, Any]) -> str:
    s = r.get("degraded_s")
    return "never degraded" if s is None else f"degraded {_ms(s)} ({r.get('degraded_cause')})"


# Issue 21's done-when, one headline row each: what, before, target, fault, figure, verdict.
DONE_WHEN: tuple[tuple[str, str, str, str, Any, Any], ...] = (
    ("issue 21: mid-stream stall at 5 ms between tokens (client's pause)",
     "max pause 1,032 ms (the fixed 1 s rule, 2026-11-29)",
     "pause p50 <= 250 ms, max <= 400 ms, 0 failed", "stall", _stall, _stall_ok),
    ("issue 21: one backend's first token 1.5 s late, among three (retry.hedge on)",
     "TTFT p99 608 ms (2026-12-01, no hedge)",
     "TTFT p99 <= 2x the healthy fleet's, hedges <= 5% of requests", "late_first", _late,
     _late_ok),
    ("issue 21: TCP SYNs to a node dropped: detection", "never (2026-11-29)", "<= 2 s",
     "syn_drop", _det, _within(2.0)),
    ("issue 21: a node 5x slower: `degraded` (cause slow)",
     "never (ready, only down-weighted)", "<= 5 s", "slow", _slow, _slow_ok),
    ("issue 21: GPU Xid 79 in the sim: ejection", "- (found only once inference fails)",
     "<= 500 ms (cause gpu_xid)", "xid", _det, _within(0.5, "gpu_xid")),
)  # fmt: skip


def heartbeat_section(hb: dict[str, Any]) -> list[str]:
    """Issue 5's table: agent frozen / killed / cut off -> ejection by heartbeat."""
    meta = hb["meta"]
    target = meta["target"]
    out = [
        "## Agent heartbeat: fault -> ejection (issue 5)",
        "",
        f"`python -m chaos.heartbeat`, {meta['started']}, {meta['duration_s'] / 60:.1f} min: "
        f"5 backends, {meta['heartbeat']}, 20 client requests/s; target p50 <= "
        f"{target['p50_ms']:.0f} ms, max <= {target['max_ms']:.0f} ms. Latency runs from just "
        "before the signal or iptables command to the ejection event; the column after it "
        "runs from the command's return (the fault was surely in force by then). Client "
        "errors: requests sent from that fault's start to the next trial's.",
        "",
        "| agent fault | trials | ejected (cause heartbeat) | p50 | p90 | max "
        "| p50 / max from the command's return | client requests sent after ejection "
        "| client errors | back through probation |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    names = {
        "agent_stop": "SIGSTOP (lift: SIGCONT)",
        "agent_kill": "SIGKILL (lift: restart)",
        "agent_drop": "traffic dropped in the router (lift: rule removed)",
    }
    for kind, s in hb["summary"].items():
        out.append(
            f"| {names.get(kind, kind)} | {s['trials']} | {s['detected']} ({s['cause_heartbeat']}) "
            f"| {s['p50_ms']} ms | {s['p90_ms']} ms | {s['max_ms']} ms "
            f"| {s.get('p50_after_cmd_ms', '-')} / {s.get('max_after_cmd_ms', '-')} ms "
            f"| {s['sent_after_detection']} "
            f"| {s.get('client_errors', '-')}/{s.get('client_requests', '-')} "
            f"| {s['back_through_probation']}/{s['trials']} |"
        )
    return out


def fleet_section(doc: dict[str, Any]) -> list[str]:
    """Issue 21's fleet events (`chaos.run --fleet`): zone lost, rolling restart, two of three
    lost, in the events' own table (`chaos/fleet.py`)."""
    from chaos import fleet  # the events and their table; not needed by the fault tables

    meta = doc["meta"]
    la0, la1 = meta["loadavg_start"][0], meta["loadavg_end"][0]
    return [
        "## Fleet events (issue 21)",
        "",
        f"`python -m chaos.run --fleet`, {meta['started']}, git `{meta['git']}`, "
        f"{meta['cpus']} CPUs, load average {la0:.1f} -> {la1:.1f}, {meta['rate_rps']:g} "
        "client requests/s on loopback (no network fault: processes and the admin API). "
        "Method and findings: [fleet-events.md](fleet-events.md).",
        "",
        fleet.table(doc["events"]),
    ]


def replicas_section(doc: dict[str, Any]) -> list[str]:
    """Issue 17's table: Redis killed / stopped / cut off under 3 gateway replicas."""
    meta = doc["meta"]
    out = [
        "## Three gateway replicas, one Redis failing (issue 17)",
        "",
        f"`python -m chaos.run --replicas`, {meta['started']}, git `{meta['git']}`, "
        f"{meta['duration_s'] / 60:.1f} min: {meta['backends']} backends, 3 replicas, "
        f"{meta['rate_rps']:g} client requests/s spread over them, each fault held "
        f"{meta['hold_s']:g} s. Alone: each replica's `GET /admin/cluster`, polled every 50 ms. "
        "Client errors: requests sent from the fault to the end of the run. A flap is a "
        "backend leaving rotation on any replica.",
        "",
        "| Redis fault | client errors | p99 | alone (r0 / r1 / r2) | together after lift (last) "
        "| flaps | degraded dips |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["runs"]:
        if not r.get("ok"):
            out.append(f"| {r['title']} | run failed: {r.get('error')} | | | | | |")
            continue
        alone = " / ".join(_ms(v) for v in r["time_to_alone_s"].values())
        e, n = r["client_errors"], r["requests_since_fault"]
        out.append(
            f"| {r['title']} | {e}/{n} | {_ms(r['p99_since_fault_s'])} | {alone} "
            f"| {_ms(r['together_after_lift_max_s'])} | {len(r['flaps'])} | {r['degraded_dips']} |"
        )
    return out
