"""CI subset of the chaos lab: three faults made for real against pulsegate, under load.

One lab (three engines with agents, each in its own network namespace, behind a router
namespace) for the module; each test starts a fresh gateway, puts 30 requests/s of mixed
streamed and non-streamed traffic through it, injects one fault on one backend and lifts it
(`chaos.scenario.run`, the same code as `make chaos`). Assertions are about correctness -
the right backend ejected for the right reason, no client error, nothing sent to it once it
was out - with generous deadlines only; the timing figures live in docs/chaos-results.md.
About 90 s in all.
"""

from __future__ import annotations

from typing import Any

import pytest
from chaos.faults import BY_KEY
from chaos.lab import Lab
from chaos.scenario import Settings, run
from chaos.tap import Tap

pytestmark = pytest.mark.slow


async def _scenario(lab: Lab, key: str, hold: float, recover_max: float) -> dict[str, Any]:
    fault = BY_KEY[key]
    settings = Settings(rate=30.0, pre=1.5, hold_scale=hold / fault.hold, recover_max=recover_max)
    tap = Tap().start()
    try:
        r = await run(lab, fault, "pulsegate", settings, tap, seed=7)
    finally:
        tap.stop()
    assert r["ok"], r.get("error")
    return r


def _no_leak(r: dict[str, Any]) -> None:
    assert r["detected"], f"never ejected; events: {r['events']}"
    assert r["client_errors"] == 0, r["error_kinds"]
    assert r["requests_during_fault"] > 50
    assert r["target_share_before_fault"] > 0  # the fault hit a node that carried traffic
    assert r["sent_after_detection"] == 0


async def test_agent_sigkill_ejects_by_heartbeat_and_returns_through_probation(lab: Lab) -> None:
    """Agent killed: ejected for `heartbeat`, no client error, nothing sent after; the new
    agent brings the backend back through probation to full weight."""
    r = await _scenario(lab, "agent_kill", hold=4.0, recover_max=60.0)
    _no_leak(r)
    assert r["detection_cause"] == "heartbeat"
    assert r["detection_s"] < 2.0  # functional bound; the figure is ~0.15-0.3 s
    assert r["back_to_full_weight_s"] is not None, "not back at full weight within 60 s"
    after = [e for e in r["events"] if e["backend"] == r["target"] and e["ts"] >= r["t_lift"]]
    assert [e["to"] for e in after][-2:] == ["probation", "ready"]


async def test_one_way_loss_is_detected_with_zero_client_errors(lab: Lab) -> None:
    """25% random loss towards one node: pulsegate ejects it while every client request
    still succeeds (the HTTP /health probe alone would stay green)."""
    r = await _scenario(lab, "loss_to", hold=8.0, recover_max=0.0)
    _no_leak(r)


async def test_large_packet_blackhole_is_detected_while_health_is_green(lab: Lab) -> None:
    """IP packets over 1000 bytes dropped on one node's link: its /health (a small GET)
    answers 200 throughout, yet the 6 KB canary gets it ejected, with no client error."""
    r = await _scenario(lab, "big_drop", hold=8.0, recover_max=0.0)
    _no_leak(r)
    assert r["health_during_fault"] == "200"
    assert r["detection_cause"] in ("canary", "micro_inference", "stalled", "consecutive_failures")
