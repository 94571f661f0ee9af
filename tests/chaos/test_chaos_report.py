"""The lab's pure parts: issue 21's figures and verdicts, the merged publish, the catalogue.

No namespaces, no processes: records in, figures and Markdown out (milliseconds, no root).
"""

from __future__ import annotations

from typing import Any

import pytest
from chaos.faults import BY_KEY, FAULTS
from chaos.lab import Lab
from chaos.load import Result

from chaos import measure, publish, report
from pulsegate.sim.faults import Mode, first_token_delay, parse_fault, slowdown


def _res(t0: float, *, stream: bool = True, backend: str = "b1", ttft: float = 0.05,
         gap: float = 0.01, ok: bool = True) -> Result:  # fmt: skip
    return Result(t0, t0 + 0.2, stream, False, 200, ok, "" if ok else "timeout", backend, 1,
                  ttft, gap if stream else None)  # fmt: skip


def test_stall_pause_counts_only_streams_the_faulty_backend_started_and_the_fault_caught() -> None:
    """The pause figure is over the streams the faulty node started that were running at the
    fault's start or sent during it, not every stream."""
    rs = [_res(0.5, gap=0.01), _res(0.9, gap=0.18), _res(2, gap=0.19), _res(3, gap=0.30),
          _res(4, backend="b0"), _res(5, stream=False), _res(21, gap=0.01)]  # fmt: skip
    f = measure.stall_pauses(rs, "b1", t_fault=1.0, t_lift=20.0)
    assert f == {"stalled_streams": 3, "stall_pause_p50_s": 0.19, "stall_pause_max_s": 0.3}


def test_stall_pause_counts_a_late_first_chunk_as_a_pause() -> None:
    """A stream that waited 5 s for its first chunk paused 5 s, whatever its later gaps."""
    f = measure.stall_pauses([_res(2, ttft=5.0, gap=0.02)], "b1", t_fault=1.0, t_lift=20.0)
    assert f["stall_pause_max_s"] == 5.0


def test_ttft_healthy_is_the_warm_up_second_half_and_streams_only() -> None:
    """Healthy TTFT comes from streams sent in the second half of the warm-up; the fault's
    from the fault window; non-streamed requests count in neither."""
    rs = [_res(0, ttft=9.0), _res(6, ttft=0.05), _res(8, ttft=0.07), _res(9, stream=False, ttft=5),
          _res(10, ttft=1.6), _res(11, ttft=0.06), _res(25, ttft=7.0)]  # fmt: skip
    f = measure.ttfts(rs, t_fault=10.0, t_lift=20.0)
    assert f["healthy_streams"] == 2 and f["healthy_ttft_p99_s"] == 0.07
    assert f["ttft_p99_s"] == 1.6 and f["ttft_p50_s"] == 0.06


def test_degraded_is_the_first_move_into_degraded_during_the_fault() -> None:
    """`degraded_s` times the first transition into degraded within the fault, with its cause."""
    ev = [{"id": 1, "ts": 4.0, "from": "ready", "to": "degraded", "cause": "score"},
          {"id": 2, "ts": 5.0, "from": "degraded", "to": "ready", "cause": "cleared"},
          {"id": 3, "ts": 13.2, "from": "ready", "to": "degraded", "cause": "slow"}]  # fmt: skip
    assert measure.reached(ev, "degraded", 10.0, 20.0) == ev[2]
    assert measure.reached(ev, "ejected", 10.0, 20.0) is None


def test_hedges_sent_counts_hedges_that_went_out() -> None:
    """no_budget and no_backend are late streams that sent no hedge; the rest did."""
    before = {"hedge_won": 1.0}
    after = {"hedge_won": 4.0, "primary_won": 2.0, "hedge_failed": 1.0, "no_budget": 9.0}
    h = measure.hedges_sent(before, after)
    assert h["sent"] == 6 and h["no_budget"] == 9 and h["hedge_won"] == 3


def _run(fault: str, mode: str = "pulsegate", **figures: Any) -> dict[str, Any]:
    base = {"fault": fault, "mode": mode, "ok": True, "detected": False, "detection_s": None,
            "detection_cause": None, "requests_during_fault": 500, "client_errors": 0,
            "sent_during_fault": 5, "sent_after_detection": None, "p99_s": 0.2,
            "back_to_full_weight_s": None, "slower_than_1s": 0, "timeouts": 0,
            "stream_max_gap_max_s": 0.2}  # fmt: skip
    return {**base, **figures}


def _doc(runs: list[dict[str, Any]], started: str, git: str) -> dict[str, Any]:
    meta = {"started": started, "git": git, "kernel": "k", "cpus": 2, "backends": 3,
            "rate_rps": 50.0, "client_timeout_s": 10.0, "duration_s": 60.0,
            "modes": sorted({r["mode"] for r in runs}),
            "faults": {r["fault"]: {"title": BY_KEY[r["fault"]].title} for r in runs}}  # fmt: skip
    return {"meta": meta, "runs": runs}


def _row(md: str, start: str) -> str:
    return next(line for line in md.splitlines() if line.startswith(f"| {start}"))


@pytest.mark.parametrize(
    ("figures", "verdict"),
    [
        ({"stall_pause_p50_s": 0.19, "stall_pause_max_s": 0.35, "stalled_streams": 20}, "PASS"),
        ({"stall_pause_p50_s": 0.19, "stall_pause_max_s": 0.45, "stalled_streams": 20}, "MISS"),
        ({"stall_pause_p50_s": 0.19, "stall_pause_max_s": 0.3, "client_errors": 1}, "MISS"),
    ],
)
def test_stall_row_verdict(figures: dict[str, Any], verdict: str) -> None:
    """The stall row passes at p50 <= 250 ms, max <= 400 ms and no failure only."""
    md = report.markdown(_doc([_run("stall", **figures)], "2026-12-01 20:00:00", "abc"))
    assert f"**{verdict}**" in _row(md, "issue 21: mid-stream stall")


def test_late_first_row_weighs_ttft_against_the_healthy_fleet_and_the_hedge_share() -> None:
    """TTFT p99 within 2x the healthy fleet's and hedges within 5% of requests: PASS; either
    over: MISS."""
    ok = _run("late_first", ttft_p99_s=0.3, healthy_ttft_p99_s=0.2, requests_since_fault=1000,
              hedges={"sent": 40})  # fmt: skip
    md = report.markdown(_doc([ok], "2026-12-01 20:00:00", "abc"))
    assert "(1.5x); hedges 40 (4.0%): **PASS**" in _row(md, "issue 21: one backend")
    many = {**ok, "hedges": {"sent": 60}}
    assert "**MISS**" in _row(report.markdown(_doc([many], "s", "g")), "issue 21: one backend")


def test_slow_row_shows_time_to_degraded_as_detection() -> None:
    """A slow node is never ejected; its detection is the time to `degraded` (cause slow)."""
    r = _run("slow", degraded_s=4.2, degraded_cause="slow")
    md = report.markdown(_doc([r], "2026-12-01 20:00:00", "abc"))
    assert "degraded 4,200 ms (slow): **PASS**" in _row(md, "issue 21: a node 5x slower")
    assert "| degraded 4,200 ms (slow) |" in _row(md, BY_KEY["slow"].title)


def test_xid_row_needs_the_gpu_xid_cause_within_500_ms() -> None:
    """Xid 79 passes when ejected within 500 ms for cause gpu_xid, not for another cause."""
    good = _run("xid", detected=True, detection_s=0.31, detection_cause="gpu_xid")
    late = {**good, "detection_s": 0.61}
    other = {**good, "detection_cause": "canary"}
    for r, v in ((good, "PASS"), (late, "MISS"), (other, "MISS")):
        assert f"**{v}**" in _row(report.markdown(_doc([r], "s", "g")), "issue 21: GPU Xid")


def test_publish_merges_a_subset_run_keeping_older_rows_and_naming_each_rows_run() -> None:
    """A run of a few faults replaces only its (fault, mode) rows; the others stay with the
    run they came from, and the Markdown numbers the runs."""
    old = _doc([_run("loss_to"), _run("stall"), _run("stall", "polling")], "2026-11-29 20:39", "a1")
    old["heartbeat"] = {"kept": True}
    new = _doc([_run("stall", stall_pause_max_s=0.2), _run("xid")], "2026-12-01 20:10", "b2")
    doc = publish.merge(old, new, tuple(BY_KEY))
    got = {(r["fault"], r["mode"]): r["source"] for r in doc["runs"]}
    assert got == {("loss_to", "pulsegate"): "2026-11-29 20:39",
                   ("stall", "pulsegate"): "2026-12-01 20:10",
                   ("stall", "polling"): "2026-11-29 20:39",
                   ("xid", "pulsegate"): "2026-12-01 20:10"}  # fmt: skip
    assert [s["git"] for s in doc["meta"]["sources"]] == ["a1", "b2"]
    assert list(doc["meta"]["faults"]) == ["loss_to", "stall", "xid"]  # catalogue order
    assert doc["heartbeat"] == {"kept": True}
    md = report.markdown({**doc, "heartbeat": None})  # (a real one has its own table)
    assert "Merged from 2 runs" in md and "at git `b2`" in md
    assert _row(md, BY_KEY["loss_to"].title).endswith("| 1 |")
    assert _row(md, BY_KEY["xid"].title).endswith("| 2 |")
    # merged again over itself: a run no row comes from any more is dropped from the sources
    again = publish.merge(doc, _doc([_run("loss_to"), _run("stall"), _run("stall", "polling")],
                                    "2026-12-02 09:00", "c3"), tuple(BY_KEY))  # fmt: skip
    assert [s["git"] for s in again["meta"]["sources"]] == ["b2", "c3"]


def test_every_engine_fault_of_the_catalogue_is_one_the_sim_accepts() -> None:
    """Each `/sim/fault` body the catalogue sends parses (a typo would fail mid-run)."""
    sent: list[dict[str, Any]] = []

    class _Engine:
        def fault(self, mode: str, **params: Any) -> None:
            sent.append({"mode": mode, **params})

    lab = Lab.__new__(Lab)
    lab.engines = {"b0": _Engine()}  # type: ignore[dict-item]
    for f in FAULTS:
        if f.kind == "engine":
            f.inject(lab, "b0")
    faults = [parse_fault(body) for body in sent]
    assert {f.mode for f in faults} >= {Mode.XID, Mode.ECC, Mode.THROTTLE, Mode.LATE_FIRST}


def test_late_first_delays_only_the_first_token() -> None:
    """`late_first` adds its seconds to the first token and leaves the pace of the rest."""
    f = parse_fault({"mode": "late_first", "seconds": 1.5})
    assert first_token_delay(f) == 1.5 and slowdown(f) == 1.0
    assert parse_fault({"mode": "late_first"}).seconds == 1.5
    assert first_token_delay(parse_fault({"mode": "slow"})) == 0.0


def test_the_published_results_render_the_fleet_events_section() -> None:
    """docs/chaos-results.json as committed renders back to its Markdown, the fleet events'
    table (issue 21: zone lost, rolling restart, two of three lost) included."""
    import json
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    public = json.loads((docs / "chaos-results.json").read_text())
    md = report.markdown(public)
    assert md == (docs / "chaos-results.md").read_text()
    assert "## Fleet events (issue 21)" in md
    for event in ("zone_loss", "rolling_restart", "two_lost"):
        assert f"| {event} |" in md
