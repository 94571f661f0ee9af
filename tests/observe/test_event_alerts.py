"""Which transitions page someone (the alert webhook's payloads), pure."""

from __future__ import annotations

from typing import Any

from pulsegate.observe.events import EventLog


def _log() -> tuple[EventLog, list[dict[str, Any]]]:
    sent: list[dict[str, Any]] = []
    return EventLog(alert=sent.append, wall=lambda: 1.0), sent


def test_a_slow_or_throttling_node_pages_a_score_dip_does_not() -> None:
    log, sent = _log()
    log.record("b1", "ready", "degraded", "3.4x slower than its peers", cause="slow")
    log.record("b2", "ready", "degraded", "thermal slowdown", cause="gpu_throttle")
    log.record("b3", "ready", "degraded", "score 58 < 60", cause="score")
    assert [a["event"]["backend"] for a in sent] == ["b1", "b2"]
    assert {a["alert"] for a in sent} == {"degraded"}
    assert sent[0]["text"] == "node b1 degraded (slow): 3.4x slower than its peers"


def test_ejection_and_recovery_still_page() -> None:
    log, sent = _log()
    log.record("b1", "ready", "ejected", "xid 79", cause="gpu_xid")
    log.record("b1", "probation", "ready", "rejoined", cause="cleared")
    log.record("b2", "degraded", "ready", "back within 1.5x", cause="cleared")
    got = [(a["event"]["backend"], a["alert"]) for a in sent]
    assert got == [("b1", "ejected"), ("b1", "recovered")]
