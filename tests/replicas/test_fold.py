"""A peer's messages folded into this replica's health service: evidence becomes
observations, ejections and drains are applied, and nothing folded is sent on again."""

from __future__ import annotations

import random

from pulsegate.clock import ManualClock
from pulsegate.config import parse_config
from pulsegate.control.service import HealthService
from pulsegate.health.observations import ProbeKind, ProbeResult
from pulsegate.health.verdict import State
from pulsegate.observe.metrics import Registry
from pulsegate.replicas import Replicas, codec

DOC = {
    "backends": [{"name": "a", "url": "http://127.0.0.1:9", "models": ["m"]}],
    "cluster": {"redis": "redis://127.0.0.1:1/0", "replica_id": "r1"},
}


def _service() -> tuple[HealthService, Replicas, ManualClock]:
    clock = ManualClock()
    svc = HealthService(parse_config(DOC), clock, random.Random(1), Registry())
    assert svc.replicas is not None
    svc.replicas.store.ok = True  # publishing is queued, as with a Redis that answers
    return svc, svc.replicas, clock


def _ready(svc: HealthService) -> None:
    svc.report("a", ProbeResult(ProbeKind.READINESS, True, 0.01, ready=True))
    svc.report("a", ProbeResult(ProbeKind.MICRO, True, 0.01))
    assert svc.fleet.state("a") is State.READY


def _outbox(rep: Replicas) -> list[codec.Message]:
    out = []
    while not rep._outbox.empty():
        m = codec.decode(rep._outbox.get_nowait())
        assert m is not None
        out.append(m)
    return out


def test_own_probe_results_and_ejections_are_published() -> None:
    """Its own micro-inference result and the ejection it decided both go out."""
    svc, rep, _ = _service()
    _ready(svc)
    sent = _outbox(rep)
    assert [m.kind for m in sent] == ["probe"]  # readiness is not shared
    svc.act("a", "eject")
    assert [(m.kind, m.fields["cause"]) for m in _outbox(rep)] == [("eject", "admin")]


def test_a_peers_evidence_is_folded_and_not_sent_on() -> None:
    """Two failing canaries from r2 eject here, by this replica's own rules; neither the
    results nor the ejection they caused are published again."""
    svc, rep, clock = _service()
    _ready(svc)
    _outbox(rep)
    fail = ProbeResult(ProbeKind.CANARY, False, None, "timeout after 250ms")
    for _ in range(2):
        m = codec.probe_message("r2", "a", fail, clock.wall())
        assert m is not None
        rep._message(codec.encode(m))
    assert svc.fleet.state("a") is State.EJECTED
    assert _outbox(rep) == []
    assert rep.received == 2 and rep.recent[-1]["folded"] is True


def test_a_peers_ejection_ejects_here_once() -> None:
    """r2 ejected on its own evidence: ejected here too, with r2 named in the reason."""
    svc, rep, clock = _service()
    _ready(svc)
    _outbox(rep)
    eject = codec.Message(
        "r2", "a", "eject", clock.wall(), {"cause": "consecutive_failures", "reason": "5 in a row"}
    )
    rep._message(codec.encode(eject))
    assert svc.fleet.state("a") is State.EJECTED
    assert "replica r2 saw consecutive_failures" in svc.fleet.snapshot("a")["last_reason"]  # type: ignore[operator]
    rep._message(codec.encode(eject))  # a second copy changes nothing
    assert [e["to"] for e in svc.events.since(0, "a", 100)].count("ejected") == 1
    assert _outbox(rep) == []


def test_a_peers_drain_and_undrain() -> None:
    """An operator's drain on r2 drains here; undrain returns it; a drained backend is not
    ejected by a peer (no such move)."""
    svc, rep, clock = _service()
    _ready(svc)
    rep._message(codec.encode(codec.Message("r2", "a", "drain", clock.wall())))
    assert svc.fleet.state("a") is State.DRAINED
    rep._message(codec.encode(codec.Message("r2", "a", "eject", clock.wall(), {"cause": "x"})))
    assert svc.fleet.state("a") is State.DRAINED
    rep._message(codec.encode(codec.Message("r2", "a", "undrain", clock.wall())))
    assert svc.fleet.state("a") is not State.DRAINED


def test_own_echo_unknown_backends_and_junk_are_ignored() -> None:
    """Its own messages coming back, a backend it does not have, and junk: nothing folded."""
    svc, rep, clock = _service()
    _ready(svc)
    rep._message(codec.encode(codec.Message("r1", "a", "drain", clock.wall())))
    rep._message(codec.encode(codec.Message("r2", "zz", "drain", clock.wall())))
    rep._message(b"not json")
    assert svc.fleet.state("a") is State.READY
    assert rep.recent[-1]["folded"] is False
