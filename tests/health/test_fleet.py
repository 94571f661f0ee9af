"""The fleet: routable verdicts per model, caching, models, snapshots, weights, panic mode."""

from __future__ import annotations

import random

import pytest

from pulsegate.health.events import PanicChange
from pulsegate.health.observations import (
    EngineFacts,
    Outcome,
    ProbeKind,
    ProbeResult,
    RequestResult,
)
from pulsegate.health.verdict import ROUTABLE, State

from .harness import FAIL, MICRO_OK, MISS, OK, READY, Harness, health_with

SNAPSHOT_SIGNALS = (
    "rtt_ms",
    "latency_ms",
    "ttft_ms",
    "error_rate",
    "queue",
    "running",
    "gpu_free",
    "gpu_used_mb",
    "gpu_total_mb",
    "gpu_temp_c",
    "kv_cache_usage",
    "prefix_cache_hit_rate",
    "heartbeat_misses",
    "consecutive_failures",
)


def test_routable_is_cached_until_something_changes(ready3: Harness) -> None:
    """The same tuple comes back until `version` moves; a change rebuilds it."""
    h = ready3
    first = h.fleet.routable("m")
    v = h.fleet.version
    h.obs("a", OK)
    assert h.fleet.version == v
    assert h.fleet.routable("m") is first
    h.fleet.drain("a", h.now)
    assert h.fleet.version > v
    assert {x.name for x in h.fleet.routable("m")} == {"b", "c"}


def test_ok_path_returns_nothing_and_changes_no_version(ready3: Harness) -> None:
    """An OK request is cheap: no transitions, no verdict change until the next evaluation."""
    h = ready3
    v = h.fleet.version
    for _ in range(100):
        assert not h.fleet.observe("a", OK, h.now)
    assert h.fleet.version == v


def test_unknown_model_routes_nowhere() -> None:
    """Unknown models get nothing (and are not cached); None means every backend."""
    h = Harness()
    h.make_ready()
    assert h.fleet.routable("nope") == ()
    assert len(h.fleet.routable(None)) == 3
    assert h.fleet.models() == {"m"}


def test_set_models_from_discovery() -> None:
    """Models discovered later route; the union is listed by models()."""
    h = Harness(models=())
    h.make_ready()
    assert h.fleet.routable("x") == ()
    h.fleet.set_models("a", ["x", "y"])
    h.fleet.set_models("b", ("y",))
    assert {v.name for v in h.fleet.routable("y")} == {"a", "b"}
    assert {v.name for v in h.fleet.routable("x")} == {"a"}
    assert h.fleet.models() == {"x", "y"}
    assert h.fleet.backend_models("a") == frozenset({"x", "y"})


def test_unknown_backend_name_is_ignored() -> None:
    """An observation for a backend not in the fleet (removed by a reload while a request on it
    was in flight) causes no transition and moves nothing."""
    h = Harness()
    v = h.fleet.version
    assert h.fleet.observe("zz", FAIL, 0.0) == ()
    assert h.fleet.version == v


def test_duplicate_names_rejected() -> None:
    """Backend names must be unique."""
    with pytest.raises(ValueError, match="unique"):
        Harness(names=("a", "a"))


def test_configured_weight_scales_verdict() -> None:
    """The configured weight multiplies the health weight; 0 never routes."""
    h = Harness(weights={"a": 2.0, "c": 0.0})
    h.make_ready()
    by_name = {v.name: v.weight for v in h.fleet.routable("m")}
    assert by_name == {"a": pytest.approx(2.0), "b": pytest.approx(1.0)}


def test_snapshot_has_the_admin_fields(ready3: Harness) -> None:
    """snapshot(name) carries state, score, weight, ramp, suspect, since, signals and more."""
    s = ready3.fleet.snapshot("a")
    for key in (
        "state",
        "score",
        "weight",
        "ramp",
        "suspect",
        "since",
        "signals",
        "ejections",
        "last_reason",
        "probation_progress",
        "panic",
    ):
        assert key in s, key
    assert s["state"] == "ready"
    assert isinstance(s["score"], float)
    assert set(SNAPSHOT_SIGNALS) <= set(s["signals"])  # type: ignore[arg-type]


def test_verdict_carries_balancer_inputs(ready3: Harness) -> None:
    """Verdicts carry zone, rtt (TTFT), free VRAM and prefix-cache hit rate."""
    h = ready3
    h.obs("a", EngineFacts(gpu_free_ratio=0.4, prefix_cache_hit_rate=0.7))
    h.run(1.0, h.healthy_traffic())
    v = next(x for x in h.fleet.routable("m") if x.name == "a")
    assert v.rtt_s == pytest.approx(0.1)
    assert v.gpu_free_ratio == 0.4
    assert v.prefix_cache_hit_rate == 0.7
    assert v.state is State.READY
    assert not v.panic


def test_a_3x_slow_backend_gets_under_15_percent_of_traffic(ready3: Harness) -> None:
    """End to end: b slows 3x (TTFT and micro); sampled by weight it gets < 15% among three."""
    h = ready3
    slow_ok = RequestResult(Outcome.OK, ttft_s=0.3)
    slow_micro = ProbeResult(ProbeKind.MICRO, ok=True, latency_s=0.15)

    def traffic(h: Harness) -> None:
        for n in ("a", "b", "c"):
            h.obs(n, slow_ok if n == "b" else OK)
            if int(h.now * 10) % 30 == 0:
                h.obs(n, slow_micro if n == "b" else MICRO_OK)

    h.run(30.0, traffic)
    verdicts = h.fleet.routable("m")
    weights = {v.name: v.weight for v in verdicts}
    share = weights["b"] / sum(weights.values())
    assert share < 0.15
    rng = random.Random(3)
    names = [v.name for v in verdicts]
    picks = rng.choices(names, weights=[v.weight for v in verdicts], k=20000)
    assert picks.count("b") / len(picks) < 0.15
    assert h.state("b") is State.READY  # slow is down-weighted, not ejected


def test_panic_entry_and_exit() -> None:
    """> 50% ejected: ejected-but-alive backends become routable (panic=True); exit on return."""
    h = Harness()
    h.make_ready()
    h.fleet.eject("a", h.now)
    assert not h.fleet.panic
    assert h.fleet.take_panic_changes() == []
    h.fleet.eject("b", h.now)
    assert h.fleet.panic
    assert h.fleet.panic_models == frozenset({"m"})
    changes = h.fleet.take_panic_changes()
    assert [(c.model, c.active, c.ejected, c.total) for c in changes] == [("m", True, 2, 3)]
    assert changes[0].cause == "panic"
    assert changes[0].reason.startswith("panic: 2/3 backends for m ejected")
    verdicts = {v.name: v for v in h.fleet.routable("m")}
    assert set(verdicts) == {"a", "b", "c"}
    assert verdicts["a"].panic and verdicts["b"].panic and not verdicts["c"].panic
    assert verdicts["a"].weight > 0
    assert h.fleet.snapshot("a")["panic"] is True
    h.fleet.drain("b", h.now)
    assert not h.fleet.panic
    exit_ = h.fleet.take_panic_changes()
    assert [(c.active, c.ejected, c.total) for c in exit_] == [(False, 1, 2)]
    assert isinstance(exit_[0], PanicChange)
    assert {v.name for v in h.fleet.routable("m")} == {"c"}


def test_panic_never_routes_dead_ones() -> None:
    """In panic a backend with a dead heartbeat (or not ready, or no VRAM) stays out."""
    h = Harness()
    h.make_ready()
    h.feed("a", MISS, 3)
    h.fleet.eject("b", h.now)
    h.fleet.eject("c", h.now)
    assert h.fleet.panic
    names = {v.name for v in h.fleet.routable("m")}
    assert names == {"b", "c"}


def test_half_ejected_is_not_panic() -> None:
    """Exactly max_ejected_fraction ejected is not panic (it must be exceeded)."""
    h = Harness(names=("a", "b"))
    h.make_ready()
    h.fleet.eject("a", h.now)
    assert not h.fleet.panic


def test_cold_backends_do_not_dilute_panic() -> None:
    """Only in-service backends count: one ready (then ejected) beside a cold one is panic."""
    h = Harness(names=("a", "b"))
    h.make_ready("a")
    h.fleet.eject("a", h.now)
    assert h.fleet.panic
    assert [(v.name, v.panic) for v in h.fleet.routable("m")] == [("a", True)]


def test_panic_fraction_is_configurable() -> None:
    """max_ejected_fraction 0 panics on the first ejection; 1.0 never panics."""
    h = Harness(health=health_with(max_ejected_fraction=0.0))
    h.make_ready()
    h.fleet.eject("a", h.now)
    assert h.fleet.panic
    h2 = Harness(health=health_with(max_ejected_fraction=1.0))
    h2.make_ready()
    for n in "abc":
        h2.fleet.eject(n, h2.now)
    assert not h2.fleet.panic
    assert h2.fleet.routable("m") == ()


def test_panic_is_per_model() -> None:
    """Panic in one model does not open the ejected backends of another."""
    h = Harness(names=("a", "b", "c", "d"))
    h.make_ready()
    h.fleet.set_models("a", ("m", "x"))
    h.fleet.set_models("c", ("m", "x"))
    h.fleet.set_models("d", ("x",))
    h.fleet.eject("a", h.now)
    h.fleet.eject("b", h.now)
    assert h.fleet.panic_models == frozenset({"m"})
    assert {v.name for v in h.fleet.routable("m")} == {"a", "b", "c"}
    assert {v.name for v in h.fleet.routable("x")} == {"c", "d"}


def test_routable_states_outside_panic(ready3: Harness) -> None:
    """Outside panic, every routable verdict is ready, degraded or probation with weight > 0."""
    h = ready3
    h.fleet.drain("a", h.now)
    h.obs("b", ProbeResult(ProbeKind.READINESS, ok=True, ready=False))
    for v in h.fleet.routable("m"):
        assert v.state in ROUTABLE
        assert v.weight > 0
    assert [v.name for v in h.fleet.routable("m")] == ["c"]
    h.obs("b", MICRO_OK)
    h.obs("b", READY)
    assert {v.name for v in h.fleet.routable("m")} == {"b", "c"}
