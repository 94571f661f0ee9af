"""Leased shares of max_inflight and split probing, as a HealthService's replicas apply them
(no Redis needed: the live set is set as a renewal would)."""

from __future__ import annotations

import random

from pulsegate.clock import ManualClock
from pulsegate.config import parse_config
from pulsegate.control.service import HealthService
from pulsegate.observe.metrics import Registry
from pulsegate.replicas import Replicas
from pulsegate.replicas.membership import Members
from pulsegate.replicas.rendezvous import owner

DOC = {
    "backends": [
        {"name": "a", "url": "http://127.0.0.1:9", "models": ["m"], "max_inflight": 10},
        {"name": "b", "url": "http://127.0.0.1:10", "models": ["m"]},
    ],
    "cluster": {"redis": "redis://:pw@127.0.0.1:1/0", "replica_id": "r1"},
}
THREE = [b"1000", b"r1", b"4000", b"0", b"r2", b"4000", b"0", b"r3", b"4000", b"0"]


def _limits(svc: HealthService) -> dict[str, int]:
    return {v.name: v.max_inflight for v in svc.fleet.verdicts()}


def _service() -> tuple[HealthService, Replicas, ManualClock]:
    clock = ManualClock()
    svc = HealthService(parse_config(DOC), clock, random.Random(1), Registry())
    assert svc.replicas is not None
    return svc, svc.replicas, clock


def _join(rep: Replicas, clock: ManualClock, reply: list[bytes]) -> None:
    rep.store.ok = rep.store.subscribed = True  # as after a renewal that answered
    rep.members = Members.read(reply)
    rep._renewed_at = clock.now()
    rep.refresh()


def test_alone_enforces_the_full_limit_and_probes_everything() -> None:
    """Before any renewal: alone, limit 10, every backend probed here."""
    svc, rep, _ = _service()
    assert rep.alone and _limits(svc) == {"a": 10, "b": 0}
    assert rep.owns("a") and rep.owns("b")


def test_three_replicas_share_the_limit_and_the_probes() -> None:
    """With 3 live replicas this one enforces its part (3 or 4 of 10; 0 stays unlimited)
    and probes only the backends rendezvous gives it."""
    svc, rep, clock = _service()
    _join(rep, clock, THREE)
    assert not rep.alone
    assert _limits(svc)["a"] in (3, 4) and _limits(svc)["b"] == 0
    for n in ("a", "b"):
        assert rep.owns(n) == (owner(n, ["r1", "r2", "r3"]) == "r1")


def test_going_alone_restores_the_full_limit() -> None:
    """Redis stops answering: the next refresh is alone, with the full limit."""
    svc, rep, clock = _service()
    _join(rep, clock, THREE)
    rep.store.ok = False
    rep.refresh()
    assert rep.alone and _limits(svc)["a"] == 10 and rep.owns("a") and rep.owns("b")


def test_a_stale_lease_is_alone() -> None:
    """No renewal answered for over a second: alone, even if the last one said together."""
    svc, rep, clock = _service()
    _join(rep, clock, THREE)
    clock.advance(2.0)
    rep.refresh()
    assert rep.alone and _limits(svc)["a"] == 10


def test_a_reload_keeps_the_share() -> None:
    """A reload puts the file's limit (now 20) back in the fleet; the share follows it."""
    svc, rep, clock = _service()
    _join(rep, clock, THREE)
    doc = {**DOC, "backends": [{**DOC["backends"][0], "max_inflight": 20}, DOC["backends"][1]]}  # type: ignore[index]
    svc.apply(parse_config(doc))
    assert _limits(svc)["a"] in (6, 7)


def test_the_admin_view_hides_the_password() -> None:
    """GET /admin/cluster's document names the Redis without its password."""
    _, rep, clock = _service()
    _join(rep, clock, THREE)
    view = rep.view()
    assert view["redis"]["url"] == "redis://127.0.0.1:1/0" and "pw" not in repr(view)
    assert [r["id"] for r in view["replicas"]] == ["r1", "r2", "r3"]
    assert view["max_inflight"]["a"]["fleet"] == 10
