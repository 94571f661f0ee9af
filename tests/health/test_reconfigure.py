"""Hot reload: `Fleet.reconfigure` sorts backends into added, removed, restarted and kept, and a
kept backend keeps what is known under its new config."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from pulsegate.config import MAX_INFLIGHT_AUTO, BackendConfig, HealthConfig, ProbationConfig
from pulsegate.health.fleet import Reconfigured
from pulsegate.health.observations import EngineFacts
from pulsegate.health.reload import classify
from pulsegate.health.verdict import State

from .harness import CANARY_OK, FAIL, MICRO_FAIL, MICRO_OK, OK, READY, Harness, health_with


def _reload(
    h: Harness,
    configs: Sequence[BackendConfig],
    health: HealthConfig | None = None,
) -> Reconfigured:
    """Reconfigure the harness's fleet at its current time (and follow its backend list)."""
    h.configs = list(configs)
    if health is not None:
        h.health = health
    return h.fleet.reconfigure(configs, h.health, h.probes, h.now)


def _with(h: Harness, name: str, **kw: object) -> list[BackendConfig]:
    """The harness's backend list with backend `name`'s config fields replaced."""
    return [replace(c, **kw) if c.name == name else c for c in h.configs]  # type: ignore[arg-type]


def _routable(h: Harness, model: str | None = "m") -> set[str]:
    return {v.name for v in h.fleet.routable(model)}


def _recovering(h: Harness) -> None:
    """Probes only for `a` (ejected: no traffic), healthy traffic for the others."""
    if abs(h.now - round(h.now)) < 1e-6:
        for o in (READY, MICRO_OK, CANARY_OK):
            h.obs("a", o)
        for n in ("b", "c"):
            h.obs(n, MICRO_OK)
    for n in ("b", "c"):
        h.obs(n, OK)


# -- classification -------------------------------------------------------------------------


def test_classification_by_name_and_url() -> None:
    """New name: added; gone: removed; other url: restarted; same url: kept (new order)."""
    h = Harness(names=("a", "b", "c", "d"))
    new = [
        BackendConfig(name="e", url="http://e", models=("m",)),
        h.configs[3],
        replace(h.configs[2], url="http://c-2"),
        h.configs[0],
    ]
    out = _reload(h, new)
    assert out == Reconfigured(added=("e",), removed=("b",), restarted=("c",), kept=("d", "a"))
    assert h.fleet.names() == ("e", "d", "c", "a")
    assert [v.name for v in h.fleet.verdicts()] == ["e", "d", "c", "a"]


def test_classify_is_pure_and_keeps_the_old_order_for_removed() -> None:
    """`classify` reads a name -> url map; removed names come in the old config's order."""
    urls = {"x": "http://x", "a": "http://a", "y": "http://y"}
    out = classify(urls, [BackendConfig(name="a", url="http://a")])
    assert out == Reconfigured(removed=("x", "y"), kept=("a",))


def test_repeated_name_rejected_and_nothing_changes(ready3: Harness) -> None:
    """A new list naming a backend twice raises ValueError before anything is touched."""
    h = ready3
    before = h.fleet.verdicts()
    v = h.fleet.version
    new = [*h.configs, BackendConfig(name="d", url="http://d"), BackendConfig(name="d", url="x")]
    with pytest.raises(ValueError, match="unique"):
        h.fleet.reconfigure(new, h.health, h.probes, h.now)
    assert h.fleet.names() == ("a", "b", "c")
    assert h.fleet.verdicts() == before
    assert h.fleet.version == v


def test_added_backend_is_cold_and_routes_once_ready(ready3: Harness) -> None:
    """An added backend starts cold like at start, then becomes ready the usual way."""
    h = ready3
    out = _reload(h, [*h.configs, BackendConfig(name="d", url="http://d", models=("m",))])
    assert out.added == ("d",)
    assert h.state("d") is State.COLD
    assert _routable(h) == {"a", "b", "c"}
    h.make_ready("d")
    assert h.state("d") is State.READY
    assert _routable(h) == {"a", "b", "c", "d"}


# -- kept -----------------------------------------------------------------------------------


def test_kept_ejected_backend_stays_ejected_with_its_backoff(ready3: Harness) -> None:
    """Kept while ejected: still ejected, same since, same ejection count and end of backoff;
    the new ejection_base shapes the next ejection only."""
    h = ready3
    h.feed("a", MICRO_FAIL, 2)
    assert h.state("a") is State.EJECTED
    b = h.fleet.backend("a")
    n, total, until = b.backoff.n, b.backoff.total, b.backoff.until
    t_eject = h.now
    h.run(1.0, _recovering)
    out = _reload(h, h.configs, health_with(ejection_base=20.0, ejection_max=600.0))
    assert out.kept == ("a", "b", "c")
    assert h.state("a") is State.EJECTED
    assert h.snap("a")["since"] == t_eject
    assert (b.backoff.n, b.backoff.total, b.backoff.until) == (n, total, until)
    assert b.backoff.duration() == 20.0  # the next ejection: new base x n
    assert "a" not in _routable(h)
    # Its backoff (5 s, +10%) ends as before: it rejoins on the old schedule, not 20 s later.
    h.run(15.0, _recovering)
    assert h.state("a") is State.PROBATION


def test_kept_ready_backend_keeps_its_signals_and_state(ready3: Harness) -> None:
    """Kept while ready: same state, since, signals, evidence and score; new weight, zone and
    max_inflight show in its verdict (and routable) at once, without a tick."""
    h = ready3
    b = h.fleet.backend("a")
    signals, evidence = b.signals, b.evidence
    snap = h.snap("a")
    old = b.verdict()
    assert old.max_inflight == 0
    fleet_v = h.fleet.version
    new = _with(h, "a", weight=2.0, max_inflight=7, zone="z1", region="r1")
    _reload(h, new, health_with(ewma_alpha=0.5))
    v = b.verdict()
    assert h.fleet.backend("a") is b
    assert b.signals is signals and b.evidence is evidence
    assert h.state("a") is State.READY
    assert h.snap("a")["since"] == snap["since"]
    assert h.snap("a")["signals"] == snap["signals"]
    assert v.score == old.score
    assert v.weight == pytest.approx(2.0 * old.weight)
    assert (v.max_inflight, v.zone, v.region) == (7, "z1", "r1")
    assert h.fleet.version > fleet_v
    assert {x.name: x for x in h.fleet.routable("m")}["a"] == v
    assert b.config is new[0]
    assert signals.rtt.alpha == signals.micro.ewma.alpha == 0.5


def test_kept_backend_keeps_a_learned_auto_limit(ready3: Harness) -> None:
    """A learned `auto` in-flight limit survives a reload; a number replaces it at once."""
    h = ready3
    configs = _with(h, "a", max_inflight=MAX_INFLIGHT_AUTO)
    _reload(h, configs)
    h.obs("a", EngineFacts(capacity=16))
    assert h.fleet.backend("a").verdict().max_inflight == 16
    _reload(h, _with(h, "a", zone="z2"))
    assert h.fleet.backend("a").verdict().max_inflight == 16
    _reload(h, _with(h, "a", max_inflight=4))
    assert h.fleet.backend("a").verdict().max_inflight == 4


def test_changed_eject_below_applies_at_the_next_evaluation(ready3: Harness) -> None:
    """A stricter eject_below changes nothing at reload time; the next evaluation judges with
    it (here: above any score, after one evaluation)."""
    h = ready3
    strict = health_with(eject_below=101.0, eject_after=1)
    out = _reload(h, h.configs, strict)
    assert out.kept == ("a", "b", "c")
    assert h.state("a") is State.READY
    assert h.tick(h.fleet.next_tick(h.now) - h.now - 0.01) == []
    moved = h.tick(0.01)
    assert [(t.backend, t.to_state, t.cause) for t in moved] == [
        (n, State.EJECTED, "score") for n in ("a", "b", "c")
    ]


def test_shorter_evaluate_interval_brings_the_next_evaluation_forward() -> None:
    """From 10 s to 1 s: the next evaluation is at most 1 s away, not 10."""
    h = Harness(health=health_with(evaluate_interval=10.0))
    h.make_ready()
    h.now = 2.0
    assert h.fleet.next_tick(h.now) == pytest.approx(10.0)
    _reload(h, h.configs, health_with(evaluate_interval=1.0))
    assert h.fleet.next_tick(h.now) == pytest.approx(3.0)


def test_kept_probation_keeps_its_progress(ready3: Harness) -> None:
    """Kept on probation: still on probation from the same start, its ramp following the new
    duration from there."""
    h = ready3
    h.feed("a", MICRO_FAIL, 2)
    while h.state("a") is not State.PROBATION:
        h.run(0.1, _recovering)
    h.run(6.0, _recovering)  # 10% into a 60 s probation
    b = h.fleet.backend("a")
    started, micro_ok = b.probation.started, b.probation.micro_ok
    assert b.ramp == pytest.approx(0.1)
    health = health_with(probation=ProbationConfig(duration=12.0, ramp_step=0.1))
    _reload(h, h.configs, health)
    assert h.state("a") is State.PROBATION
    assert (b.probation.started, b.probation.micro_ok) == (started, micro_ok)
    assert b.probation.progress(h.now) == pytest.approx(0.5)
    h.run(0.1, _recovering)
    assert b.ramp == pytest.approx(0.5)
    h.run(6.0, _recovering)
    assert h.state("a") is State.READY


def test_discovered_models_kept_when_the_config_lists_none() -> None:
    """Models found at runtime (set_models) stay for a kept backend whose config lists none;
    a config that lists models wins."""
    h = Harness(models=())
    h.make_ready()
    h.fleet.set_models("a", ["x"])
    h.fleet.set_models("b", ["x"])
    _reload(h, h.configs)
    assert h.fleet.backend_models("a") == frozenset({"x"})
    assert _routable(h, "x") == {"a", "b"}
    _reload(h, _with(h, "b", models=("y",)))
    assert h.fleet.backend_models("b") == frozenset({"y"})
    assert _routable(h, "x") == {"a"}
    assert h.fleet.models() == {"x", "y"}


# -- restarted and removed ------------------------------------------------------------------


def test_restarted_backend_is_cold(ready3: Harness) -> None:
    """Same name, other url: another engine, so a fresh health - cold, no signals, no history."""
    h = ready3
    h.feed("a", MICRO_FAIL, 2)
    assert h.state("a") is State.EJECTED
    old = h.fleet.backend("a")
    out = _reload(h, _with(h, "a", url="http://a-new"))
    assert out.restarted == ("a",)
    b = h.fleet.backend("a")
    assert b is not old
    assert h.state("a") is State.COLD
    assert b.backoff.total == 0
    assert h.snap("a")["signals"]["latency_ms"] is None  # type: ignore[index]
    assert h.snap("a")["since"] == h.now
    assert _routable(h) == {"b", "c"}
    h.make_ready("a")
    assert h.state("a") is State.READY


def test_removed_backend_leaves_routable_and_panic() -> None:
    """Removed: out of names, models and routable at once; panic is judged without it; a
    late observation for it is ignored."""
    h = Harness()
    h.make_ready()
    h.fleet.eject("a", h.now)
    h.fleet.eject("b", h.now)
    assert h.fleet.panic_models == frozenset({"m"})
    assert _routable(h) == {"a", "b", "c"}  # a and b in panic
    h.fleet.take_panic_changes()
    out = _reload(h, h.configs[1:])
    assert out == Reconfigured(removed=("a",), kept=("b", "c"))
    assert h.fleet.names() == ("b", "c")
    assert not h.fleet.panic  # 1 of 2 ejected: not over 50%
    changes = h.fleet.take_panic_changes()
    assert [(c.model, c.active, c.ejected, c.total) for c in changes] == [("m", False, 1, 2)]
    assert _routable(h) == {"c"}
    assert _routable(h, None) == {"c"}
    v = h.fleet.version
    assert h.fleet.observe("a", FAIL, h.now) == ()
    assert h.fleet.version == v
    assert _routable(h) == {"c"}


def test_removing_every_backend_of_a_model_ends_its_panic() -> None:
    """A model no backend serves any more leaves models() and panic, with an exit record."""
    h = Harness(names=("a", "b", "c"))
    h.make_ready()
    h.fleet.set_models("a", ["solo"])
    h.fleet.eject("a", h.now)
    assert "solo" in h.fleet.panic_models
    h.fleet.take_panic_changes()
    _reload(h, h.configs[1:])
    assert "solo" not in h.fleet.models()
    assert h.fleet.routable("solo") == ()
    assert not h.fleet.panic
    changes = h.fleet.take_panic_changes()
    assert [(c.model, c.active) for c in changes] == [("solo", False)]


# -- identical config -----------------------------------------------------------------------


def test_identical_config_is_a_no_op_for_verdicts(ready3: Harness) -> None:
    """Reloading the same config (equal copies) changes no verdict, state or snapshot."""
    h = ready3
    h.feed("b", MICRO_FAIL, 2)
    h.obs("c", EngineFacts(gpu_free_ratio=0.5, queue_waiting=0.0))
    before = h.fleet.verdicts()
    routable = h.fleet.routable("m")
    snaps = {n: h.snap(n) for n in ("a", "b", "c")}
    nxt = h.fleet.next_tick(h.now)
    copies = [replace(c) for c in h.configs]
    out = h.fleet.reconfigure(copies, replace(h.health), replace(h.probes), h.now)
    assert out == Reconfigured(kept=("a", "b", "c"))
    assert h.fleet.verdicts() == before
    assert h.fleet.routable("m") == routable
    assert {n: h.snap(n) for n in ("a", "b", "c")} == snaps
    assert h.fleet.next_tick(h.now) == nxt
    assert h.fleet.take_panic_changes() == []


def test_models_discovered_for_a_removed_backend_are_ignored() -> None:
    """The old prober's last readiness answer may land after the reload: no error."""
    h = Harness(names=("a", "b"))
    _reload(h, [c for c in h.configs if c.name == "a"])
    h.fleet.set_models("b", ("m2",))
    assert h.fleet.names() == ("a",)
    assert "m2" not in h.fleet.models()
