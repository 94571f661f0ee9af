"""The pure balancer: eligibility, weighted p2c shares, topology tiers, affinity, prefix keys.

Distribution tests use a seeded ``random.Random`` and many picks; every figure asserted is
also written in the test's docstring as measured.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections import Counter, deque
from collections.abc import Container, Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsegate.balancer import Balancer, prefix_key
from pulsegate.config import RoutingConfig
from pulsegate.health.verdict import ROUTABLE, State, Verdict

READY = State.READY


def V(
    name: str,
    weight: float = 1.0,
    state: State = READY,
    *,
    zone: str = "",
    region: str = "",
    rtt: float | None = None,
    gpu: float | None = None,
    hit: float | None = None,
    cap: int = 0,
    panic: bool = False,
    aw: float | None = None,
) -> Verdict:
    return Verdict(
        name=name,
        state=state,
        score=90.0,
        weight=weight,
        zone=zone,
        region=region,
        rtt_s=rtt,
        gpu_free_ratio=gpu,
        prefix_cache_hit_rate=hit,
        max_inflight=cap,
        panic=panic,
        affinity_weight=weight if aw is None else aw,
    )


def balancer(seed: int = 1, **routing: object) -> Balancer:
    return Balancer(RoutingConfig(**routing), random.Random(seed))  # type: ignore[arg-type]


def shares(
    bal: Balancer,
    cands: Sequence[Verdict],
    n: int,
    inflight: Mapping[str, int] | None = None,
    exclude: Container[str] = (),
) -> dict[str, float]:
    counts: Counter[str] = Counter()
    for _ in range(n):
        v = bal.pick(cands, inflight or {}, exclude)
        assert v is not None
        counts[v.name] += 1
    return {k: c / n for k, c in counts.items()}


def closed_loop(
    bal: Balancer, cands: Sequence[Verdict], in_flight: int, n: int, seed: int = 7
) -> tuple[dict[str, float], dict[str, float]]:
    """Each pick holds a request for exactly `in_flight` picks (a fixed-concurrency load).
    Returns each backend's share of the picks and its mean in-flight over the second half
    (settled; a single snapshot swings by a request or two either way)."""
    inflight: Counter[str] = Counter()
    queue: deque[str] = deque()
    counts: Counter[str] = Counter()
    held: Counter[str] = Counter()
    for i in range(n):
        if len(queue) >= in_flight:
            inflight[queue.popleft()] -= 1
        v = bal.pick(cands, inflight)
        assert v is not None
        inflight[v.name] += 1
        queue.append(v.name)
        counts[v.name] += 1
        if i >= n // 2:
            held.update(inflight)
    settled = {k: h / (n - n // 2) for k, h in held.items()}
    return {k: c / n for k, c in counts.items()}, settled


PROBATION = (V("small", 0.15), V("a"), V("b"))
P_SMALL = 0.15 / 2.15  # 6.98%


# ---------------------------------------------------------------------------------------------
# Weighted p2c shares


def test_share_all_idle_is_exactly_the_weight_share() -> None:
    """At equal load a 0.15 backend next to two 1.0 ones gets p = 6.98% (measured 6.99%)."""
    got = shares(balancer(), PROBATION, 40_000)
    assert got["small"] == pytest.approx(P_SMALL, abs=0.005)
    assert got["a"] == pytest.approx(got["b"], abs=0.015)


def test_share_idle_low_weight_next_to_busy_peers_is_at_most_twice_its_share() -> None:
    """Idle 0.15 backend, busy peers (worst case, static): <= 2p = 13.95% (measured 13.94%)."""
    got = shares(balancer(), PROBATION, 40_000, inflight={"a": 5, "b": 5})
    assert P_SMALL < got["small"] <= 2 * P_SMALL + 0.005


def test_share_closed_loop_tracks_the_weight_share() -> None:
    """Closed loop, 20 in flight: the 0.15 backend gets ~p (measured 7.2%), never over 2p."""
    got, _ = closed_loop(balancer(), PROBATION, in_flight=20, n=40_000)
    assert got["small"] == pytest.approx(P_SMALL, abs=0.012)
    for depth in (1, 2, 5, 100):  # measured 6.8%, 9.4%, 8.8%, 6.6%
        got, _ = closed_loop(balancer(depth), PROBATION, in_flight=depth, n=10_000)
        assert 0.5 * P_SMALL < got["small"] < 2 * P_SMALL


def test_tiny_probation_weight_gets_about_its_ramp_step() -> None:
    """A 1% ramp next to 4 full backends: p = 0.25% idle (measured 0.24%), <= 2p loaded (0.42%)."""
    cands = (V("new", 0.01), *(V(f"b{i}") for i in range(4)))
    p = 0.01 / 4.01
    got = shares(balancer(), cands, 40_000)
    assert got.get("new", 0.0) == pytest.approx(p, abs=0.0015)
    got, _ = closed_loop(balancer(), cands, in_flight=40, n=40_000)
    assert got.get("new", 0.0) <= 2 * p + 0.0015


def test_equal_weights_always_compare_and_take_the_less_loaded() -> None:
    """With equal weights p2c always compares two distinct backends: the idle one always wins."""
    got = shares(balancer(), (V("a"), V("b")), 2_000, inflight={"a": 3})
    assert got == {"b": 1.0}


def test_lower_rtt_takes_proportionally_more() -> None:
    """RTT 10 ms vs 30 ms in a closed loop: the fast backend takes ~3/4 (load = rtt x (n+1))."""
    got, _ = closed_loop(balancer(), (V("fast", rtt=0.01), V("slow", rtt=0.03)), 20, 20_000)
    assert got["fast"] == pytest.approx(0.75, abs=0.03)


def test_inflight_settles_proportional_to_weight() -> None:
    """Closed loop, weights 2 vs 1, 60 in flight: in-flight settles at about 2:1 (measured
    2.02-2.03 over seeds 1-7)."""
    _, inflight = closed_loop(balancer(), (V("big", 2.0), V("one", 1.0)), 60, 10_000)
    assert inflight["big"] / inflight["one"] == pytest.approx(2.0, rel=0.15)


def test_unknown_rtt_is_never_better_than_a_known_one() -> None:
    """A backend without an RTT ties a measured one (50/50 idle), it does not win on it."""
    got = shares(balancer(), (V("new"), V("old", rtt=0.5)), 20_000)
    assert got["new"] == pytest.approx(0.5, abs=0.02)


def test_rtt_floor_makes_sub_millisecond_rtts_equal() -> None:
    """0.1 ms vs 0.9 ms are both 1 ms after the floor: the one with fewer in flight wins."""
    cands = (V("a", rtt=0.0001), V("b", rtt=0.0009))
    got = shares(balancer(), cands, 2_000, inflight={"a": 1})
    assert got == {"b": 1.0}


def test_cache_hit_and_free_vram_break_ties_but_not_load() -> None:
    """Idle, equal: the warm-cache, free-VRAM one always wins; one request more and it loses."""
    warm = V("warm", hit=0.9, gpu=0.8)
    cold = V("cold", hit=0.0, gpu=0.3)
    assert shares(balancer(), (warm, cold), 2_000) == {"warm": 1.0}
    assert shares(balancer(), (warm, cold), 2_000, inflight={"warm": 1}) == {"cold": 1.0}


# ---------------------------------------------------------------------------------------------
# Hard eligibility rules


def test_never_picks_excluded_backends() -> None:
    """Backends already tried for this request are never picked again (R15)."""
    cands = tuple(V(f"b{i}") for i in range(5))
    got = shares(balancer(), cands, 5_000, exclude={"b0", "b3"})
    assert set(got) == {"b1", "b2", "b4"}
    assert balancer().pick(cands, {}, {v.name for v in cands}) is None


def test_never_picks_non_routable_states_outside_panic() -> None:
    """Cold, warming, ejected and drained backends get nothing unless the fleet is in panic."""
    sick = [V(s.value, state=s) for s in State if s not in ROUTABLE]
    ok = [V(s.value, state=s) for s in State if s in ROUTABLE]
    got = shares(balancer(), (*sick, *ok), 5_000)
    assert set(got) == {s.value for s in ROUTABLE}
    assert balancer().pick(sick, {}) is None


def test_panic_admits_ejected_but_never_cold_warming_or_drained() -> None:
    """In panic an ejected backend may serve; warming/cold (R25) and drained ones never do."""
    cands = tuple(V(s.value, state=s, panic=True) for s in State if s not in ROUTABLE)
    got = shares(balancer(), cands, 2_000)
    assert got == {"ejected": 1.0}


def test_never_picks_a_gpu_with_under_5_percent_free() -> None:
    """gpu_free_ratio < 5% (or NaN) is never picked (R5); unknown (None) is allowed."""
    cands = (V("full", gpu=0.049), V("nan", gpu=math.nan), V("ok", gpu=0.05), V("unknown"))
    got = shares(balancer(), cands, 5_000)
    assert set(got) == {"ok"}  # 5% free still earns a sliver of the VRAM tie-break over unknown
    assert set(shares(balancer(), cands, 500, exclude={"ok"})) == {"unknown"}


def test_never_picks_a_backend_at_max_inflight() -> None:
    """A backend at its max_inflight limit is skipped; all at the limit -> None (queue/503)."""
    cands = (V("a", cap=2), V("b", cap=4), V("c"))
    got = shares(balancer(), cands, 5_000, inflight={"a": 2, "b": 3, "c": 3})
    assert set(got) == {"b", "c"}
    assert balancer().pick(cands[:2], {"a": 2, "b": 4}) is None


def test_zero_negative_and_non_finite_weights_are_never_picked() -> None:
    """weight <= 0 means do not pick; NaN or inf weights are garbage and skipped too."""
    cands = (V("zero", 0.0), V("neg", -1.0), V("nan", math.nan), V("inf", math.inf), V("ok"))
    assert shares(balancer(), cands, 1_000) == {"ok": 1.0}
    assert balancer().pick(cands[:4], {}) is None


def test_empty_candidates_give_none() -> None:
    """No candidates at all: None, with or without a session key."""
    assert balancer().pick((), {}) is None
    assert balancer().pick((), {}, (), "s") is None


# ---------------------------------------------------------------------------------------------
# Topology (R29)

FLEET = (
    V("a1", zone="east-1a", region="east"),
    V("a2", zone="east-1a", region="east"),
    V("b1", zone="east-1b", region="east"),
    V("w1", zone="west-1a", region="west"),
)


def test_no_cross_zone_pick_while_local_is_healthy() -> None:
    """Local zone eligible: 0 picks leave it, even when local is much busier than remote."""
    bal = balancer(prefer_zone="east-1a")
    got = shares(bal, FLEET, 5_000, inflight={"a1": 40, "a2": 40})
    assert set(got) == {"a1", "a2"}
    got, _ = closed_loop(bal, FLEET, in_flight=50, n=5_000)
    assert set(got) == {"a1", "a2"}


def test_spills_to_region_then_anywhere_when_local_is_excluded_or_saturated() -> None:
    """Local all excluded/saturated -> same region (learned from the zone); then anywhere."""
    bal = balancer(prefer_zone="east-1a")
    assert set(shares(bal, FLEET, 500, exclude={"a1", "a2"})) == {"b1"}
    capped = (V("a1", zone="east-1a", region="east", cap=1), *FLEET[1:])
    assert set(shares(bal, capped, 500, inflight={"a1": 1}, exclude={"a2"})) == {"b1"}
    assert set(shares(bal, FLEET, 500, exclude={"a1", "a2", "b1"})) == {"w1"}


def test_spills_when_local_is_unhealthy_and_comes_back_when_it_recovers() -> None:
    """Local backends ejected: traffic spills to the region; local ready again: all back home."""
    bal = balancer(prefer_zone="east-1a")
    sick = tuple(
        V(v.name, state=State.EJECTED, zone=v.zone, region=v.region) if v.zone == "east-1a" else v
        for v in FLEET
    )
    assert set(shares(bal, sick, 500)) == {"b1"}
    assert set(shares(bal, FLEET, 500)) == {"a1", "a2"}


def _probation(v: Verdict, ramp: float) -> Verdict:
    return Verdict(v.name, State.PROBATION, 90.0, ramp, v.zone, v.region, affinity_weight=ramp,
                   ramp=ramp)  # fmt: skip


def test_a_zone_coming_back_in_probation_takes_its_ramp_share_only() -> None:
    """Both local backends in probation at 10%: ~10% of the traffic stays home, the rest goes
    to the region (before: all of it went home at the first ramp step, untested). One of them
    ready: the whole zone tier again. Sessions keep one tier per key."""
    bal = balancer(prefer_zone="east-1a")
    back = tuple(_probation(v, 0.1) if v.zone == "east-1a" else v for v in FLEET)
    got = shares(bal, back, 5_000)
    home = got.get("a1", 0) + got.get("a2", 0)
    assert 0.07 < home < 0.13 and set(got) == {"a1", "a2", "b1"}, got
    half = tuple(_probation(v, 0.5) if v.zone == "east-1a" else v for v in FLEET)
    got = shares(bal, half, 5_000)
    assert 0.45 < got.get("a1", 0) + got.get("a2", 0) < 0.55, got
    one_ready = (FLEET[0], _probation(FLEET[1], 0.1), *FLEET[2:])
    assert set(shares(bal, one_ready, 500)) == {"a1", "a2"}
    for key in ("k1", "k2", "k3", "k4"):
        picks = {bal.pick(back, {}, (), key).name for _ in range(20)}  # type: ignore[union-attr]
        assert len(picks) == 1 or picks <= {"a1", "a2"}, (key, picks)


def test_region_of_the_zone_is_remembered_once_seen() -> None:
    """The zone's region, learned from any candidate list, still applies when the whole zone
    later drops out of the candidates (ejected); before it is ever seen there is no region tier."""
    cands = (V("b1", zone="east-1b", region="east"), V("w1", zone="west-1a", region="west"))
    fresh = balancer(prefer_zone="east-1a")
    assert set(shares(fresh, cands, 500)) == {"b1", "w1"}  # region unknown yet: anywhere
    bal = balancer(prefer_zone="east-1a")
    bal.pick(FLEET, {})
    assert set(shares(bal, cands, 500)) == {"b1"}


def test_prefer_region_without_zone() -> None:
    """prefer_region alone keeps traffic in the region while it has eligible backends."""
    bal = balancer(prefer_region="west")
    assert set(shares(bal, FLEET, 500)) == {"w1"}
    assert set(shares(bal, FLEET, 500, exclude={"w1"})) == {"a1", "a2", "b1"}


def test_no_preference_uses_everyone() -> None:
    """Without prefer_zone/region every eligible backend shares the traffic."""
    assert set(shares(balancer(), FLEET, 2_000)) == {"a1", "a2", "b1", "w1"}


# ---------------------------------------------------------------------------------------------
# Session affinity (R28)

FIVE = tuple(V(f"b{i}") for i in range(5))


def homes(bal: Balancer, cands: Sequence[Verdict], keys: Sequence[str]) -> dict[str, str]:
    out = {}
    for k in keys:
        v = bal.pick(cands, {}, (), k)
        assert v is not None
        out[k] = v.name
    return out


KEYS = [f"session-{i}" for i in range(3_000)]


def test_affinity_is_sticky_and_independent_of_rng_and_instance() -> None:
    """The same key always lands on the same backend, on any Balancer (gateway replicas agree)."""
    first = homes(balancer(1), FIVE, KEYS[:500])
    assert homes(balancer(99), FIVE, KEYS[:500]) == first
    assert homes(balancer(1), tuple(reversed(FIVE)), KEYS[:500]) == first


def test_affinity_hash_is_pinned() -> None:
    """The key -> backend map is a contract across versions and replicas: pinned values."""
    got = homes(balancer(), FIVE, ["alice", "bob", "carol", "dave", "erin", "frank"])
    assert got == PINNED_HOMES


PINNED_HOMES = {
    "alice": "b2",
    "bob": "b3",
    "carol": "b2",
    "dave": "b2",
    "erin": "b4",
    "frank": "b2",
}


def test_affinity_spreads_sessions_evenly() -> None:
    """3000 sessions over 5 equal backends: each holds 20% +- 2.5%."""
    counts = Counter(homes(balancer(), FIVE, KEYS).values())
    for name in (v.name for v in FIVE):
        assert counts[name] / len(KEYS) == pytest.approx(0.2, abs=0.025)


def test_affinity_weighted_share_follows_probation_weight() -> None:
    """Weighted rendezvous: a 0.25 backend next to two full ones homes ~1/9 of sessions (11.4%)."""
    counts = Counter(homes(balancer(), (V("new", 0.25), V("a"), V("b")), KEYS).values())
    assert counts["new"] / len(KEYS) == pytest.approx(0.25 / 2.25, abs=0.02)


def test_affinity_ignores_weight_jitter_within_an_octave() -> None:
    """Score jitter (weights 0.75-1.4) moves no session; a drop to 0.5 moves only some to others."""
    before = homes(balancer(), FIVE, KEYS)
    jitter = tuple(V(v.name, w) for v, w in zip(FIVE, (0.75, 1.0, 1.4, 0.9, 1.1), strict=True))
    assert homes(balancer(), jitter, KEYS) == before
    halved = (V("b0", 0.5), *FIVE[1:])
    after = homes(balancer(), halved, KEYS)
    moved = [k for k in KEYS if after[k] != before[k]]
    assert moved
    assert all(before[k] == "b0" for k in moved)


def test_affinity_minimal_disruption_when_one_backend_leaves() -> None:
    """One of 5 backends leaves: exactly its sessions move, spread over the other 4."""
    before = homes(balancer(), FIVE, KEYS)
    after = homes(balancer(), FIVE[:2] + FIVE[3:], KEYS)
    moved = {k for k in KEYS if after[k] != before[k]}
    assert moved == {k for k in KEYS if before[k] == "b2"}
    spread = Counter(after[k] for k in moved)
    assert set(spread) == {"b0", "b1", "b3", "b4"}
    # ... and when it comes back, exactly those sessions return.
    assert homes(balancer(), FIVE, KEYS) == before


def test_affinity_moves_only_when_home_leaves_or_overflows() -> None:
    """Home stays through other backends' exclusion/saturation; moves when excluded, capped or
    overflowing, always to its second choice in hash order."""
    bal = balancer()
    key = "conversation-42"
    home = bal.pick(FIVE, {}, (), key)
    assert home is not None
    others = [v.name for v in FIVE if v.name != home.name]
    second = bal.pick(FIVE, {}, {home.name}, key)
    assert second is not None and second.name != home.name
    # Other backends excluded, saturated or busy: the session stays home.
    assert bal.pick(FIVE, {}, set(others[:3]), key) == home
    capped = tuple(V(v.name, cap=1) for v in FIVE)
    assert bal.pick(capped, dict.fromkeys(others, 1), (), key) == capped[FIVE.index(home)]
    # Home at max_inflight: the second choice; home overflowing the bounded load: same.
    assert bal.pick(capped, {home.name: 1}, (), key) == capped[FIVE.index(second)]
    assert bal.pick(FIVE, {home.name: 2}, (), key) == second
    # Home removed from the candidate list (ejected by health): the second choice too.
    assert bal.pick(tuple(v for v in FIVE if v != home), {}, (), key) == second


def test_bounded_load_caps_every_backend_at_one_plus_epsilon_mean() -> None:
    """Every affinity pick lands where in-flight + 1 <= ceil(1.25 x (total + 1) / n)."""
    bal = balancer(affinity_epsilon=0.25)
    rng = random.Random(5)
    inflight: Counter[str] = Counter()
    queue: deque[str] = deque()
    hot = [f"hot-{i}" for i in range(5)]  # few sessions, so homes are lopsided
    for _ in range(5_000):
        if len(queue) >= 40:
            inflight[queue.popleft()] -= 1
        total = sum(inflight.values())
        v = bal.pick(FIVE, inflight, (), rng.choice(hot))
        assert v is not None
        assert inflight[v.name] + 1 <= math.ceil(1.25 * (total + 1) / len(FIVE))
        inflight[v.name] += 1
        queue.append(v.name)


def test_affinity_steady_state_stays_home() -> None:
    """300 sessions on 3 backends, 100 in flight: >= 95% of picks on the home (measured 98.9%;
    with only ~10 in flight per backend the (1 + 0.25) x mean bound moves ~6-10%)."""
    cands = (V("a"), V("b"), V("c"))
    keys = [f"s{i}" for i in range(300)]
    bal = balancer()
    home = homes(bal, cands, keys)
    rng = random.Random(3)
    inflight: Counter[str] = Counter()
    queue: deque[str] = deque()
    on_home = 0
    n = 10_000
    for _ in range(n):
        if len(queue) >= 100:
            inflight[queue.popleft()] -= 1
        key = rng.choice(keys)
        v = bal.pick(cands, inflight, (), key)
        assert v is not None
        on_home += v.name == home[key]
        inflight[v.name] += 1
        queue.append(v.name)
    assert on_home / n >= 0.95


def test_affinity_respects_zone_preference() -> None:
    """Sessions hash within the local zone; they spill out only when the zone is unavailable."""
    bal = balancer(prefer_zone="east-1a")
    assert set(homes(bal, FLEET, KEYS[:300]).values()) == {"a1", "a2"}
    got = {bal.pick(FLEET, {}, {"a1", "a2"}, k) for k in KEYS[:100]}
    assert {v.name for v in got if v} == {"b1"}


def test_empty_session_key_means_no_affinity() -> None:
    """An empty key is treated as none (else every keyless request would share one home)."""
    assert len(shares(balancer(), FIVE, 500)) == 5
    got = {balancer(s).pick(FIVE, {}, (), "") for s in range(50)}
    assert len(got) > 1


# ---------------------------------------------------------------------------------------------
# prefix_key


def test_prefix_key() -> None:
    """Same first K chars -> same key; different -> different; K <= 0 or empty body -> None."""
    a = prefix_key('{"messages": [{"role": "system", "content": "You are"}], "x": 1}', 50)
    b = prefix_key('{"messages": [{"role": "system", "content": "You are"}], "x": 2}', 50)
    c = prefix_key('{"messages": [{"role": "system", "content": "Be brief"}]}', 50)
    assert a is not None and a == b != c
    assert prefix_key("abc", 0) is None
    assert prefix_key("", 10) is None
    assert prefix_key("short", 1_000) == prefix_key("short", 5)
    assert prefix_key("\ud800 lone surrogate", 8) is not None  # never raises
    assert prefix_key("hello", 5) == "a7b6eda801e5347d"  # pinned: replicas must agree


# ---------------------------------------------------------------------------------------------
# Properties

STATES = list(State)
_zones = st.sampled_from(["", "z1", "z2", "z3"])
_region_of = {"": "", "z1": "r1", "z2": "r1", "z3": "r2"}


# Biased towards eligible backends, so that several tiers and both pick paths get exercised.
_weights = st.one_of(
    st.floats(0.001, 5.0),
    st.sampled_from([1.0, 0.01, 0.15]),
    st.sampled_from([0.0, -1.0, math.nan, math.inf, 1e-300, 1e300]),
)
_states = st.sampled_from([*STATES, *[State.READY] * 8, State.DEGRADED, State.PROBATION])
_gpus = st.one_of(
    st.none(), st.none(), st.floats(0.05, 1.0), st.floats(0.0, 0.1), st.just(math.nan)
)


@st.composite
def verdicts(draw: st.DrawFn) -> tuple[Verdict, ...]:
    n = draw(st.integers(0, 8))
    out = []
    for i in range(n):
        zone = draw(_zones)
        out.append(
            V(
                f"b{i}",
                draw(_weights),
                draw(_states),
                zone=zone,
                region=_region_of[zone],
                rtt=draw(st.one_of(st.none(), st.floats(0.0, 2.0), st.just(math.nan))),
                gpu=draw(_gpus),
                hit=draw(st.one_of(st.none(), st.floats(0.0, 1.0))),
                cap=draw(st.sampled_from([0, 0, 0, 0, 1, 2, 3])),
                panic=draw(st.booleans()),
            )
        )
    return tuple(out)


def eligible(v: Verdict, inflight: Mapping[str, int], exclude: Container[str]) -> bool:
    """The rules, restated independently of the implementation."""
    return (
        v.weight > 0
        and math.isfinite(v.weight)
        and (
            v.state in ROUTABLE
            or (
                v.panic and v.state in (State.READY, State.DEGRADED, State.PROBATION, State.EJECTED)
            )
        )
        and (v.gpu_free_ratio is None or v.gpu_free_ratio >= 0.05)
        and v.name not in exclude
        and not (v.max_inflight > 0 and inflight.get(v.name, 0) >= v.max_inflight)
    )


@settings(max_examples=200, deadline=None)
@given(
    cands=verdicts(),
    load=st.lists(st.integers(-1, 4), min_size=8, max_size=8),
    excluded=st.sets(st.integers(0, 7), max_size=3),
    key=st.one_of(st.none(), st.text(max_size=6)),
    zone=_zones,
    seed=st.integers(0, 2**32),
)
def test_pick_returns_an_eligible_candidate_in_the_best_tier_or_none(
    cands: tuple[Verdict, ...],
    load: list[int],
    excluded: set[int],
    key: str | None,
    zone: str,
    seed: int,
) -> None:
    """pick never returns an excluded/ineligible candidate, stays in the best topology tier,
    and returns None iff no candidate is eligible."""
    inflight = {f"b{i}": n for i, n in enumerate(load)}
    exclude = {f"b{i}" for i in excluded}
    bal = Balancer(RoutingConfig(prefer_zone=zone, affinity_epsilon=0.25), random.Random(seed))
    ok = [v for v in cands if eligible(v, inflight, exclude)]
    # A fresh Balancer knows the zone's region only from a candidate in that zone.
    local_region = _region_of[zone] if any(v.zone == zone for v in cands) else ""

    def tier(v: Verdict) -> int:
        if zone and v.zone == zone:
            return 0
        if local_region and v.region == local_region:
            return 1
        return 2

    for _ in range(3):
        got = bal.pick(cands, inflight, exclude, key)
        if not ok:
            assert got is None
            continue
        assert got is not None and got in ok
        # Panic candidates only when no healthy candidate is eligible; best tier within.
        healthy = [v for v in ok if v.state in ROUTABLE]
        assert (got.state in ROUTABLE) == bool(healthy)
        assert tier(got) == min(tier(v) for v in (healthy or ok))


@settings(max_examples=100, deadline=None)
@given(cands=verdicts(), key=st.text(min_size=1, max_size=8), seed=st.integers(0, 2**32))
def test_affinity_is_a_function_of_key_and_candidates(
    cands: tuple[Verdict, ...], key: str, seed: int
) -> None:
    """With no load, an affinity pick does not depend on the rng or on candidate order."""
    a = Balancer(RoutingConfig(), random.Random(seed)).pick(cands, {}, (), key)
    b = Balancer(RoutingConfig(), random.Random(seed + 1)).pick(cands[::-1], {}, (), key)
    assert a == b


# ---------------------------------------------------------------------------------------------
# Micro-benchmark (opt-in: PULSEGATE_BENCH=1; no timed asserts)


@pytest.mark.skipif(not os.environ.get("PULSEGATE_BENCH"), reason="set PULSEGATE_BENCH=1")
def test_benchmark_note() -> None:
    """Per-pick cost over 100k picks (CPython 3.11, a busy shared core, µs/pick), measured:
    3 candidates: p2c 2.0 equal weights, 2.6 mixed; with a session key 4.0 equal, 7.2 mixed.
    30 candidates: p2c 10.0 equal, 16.4 mixed; with a session key 29.8 equal, 42.8 mixed."""
    for n in (3, 30):
        inflight = {f"b{i}": 2 for i in range(n)}
        equal = tuple(V(f"b{i}", rtt=0.01, zone="z") for i in range(n))
        mixed = tuple(V(f"b{i}", 1.0 if i else 0.5, rtt=0.01, zone="z") for i in range(n))
        for label, cands, key in (
            ("p2c equal", equal, None),
            ("p2c mixed", mixed, None),
            ("affinity equal", equal, "session-42"),
            ("affinity mixed", mixed, "session-42"),
        ):
            bal = balancer(prefer_zone="z")
            t0 = time.perf_counter()
            for _ in range(100_000):
                bal.pick(cands, inflight, (), key)
            per_pick_us = (time.perf_counter() - t0) * 10.0
            print(f"{n:>2} candidates, {label}: {per_pick_us:.2f} µs/pick")


def test_rtt_noise_does_not_concentrate_light_traffic() -> None:
    """Idle backends 15 ms vs 17 ms share traffic by weight; 3x slower clearly loses."""
    near = shares(balancer(), (V("a", rtt=0.015), V("b", rtt=0.017)), 4_000)
    assert 0.45 < near["a"] < 0.55
    far = shares(balancer(), (V("a", rtt=0.015), V("b", rtt=0.045)), 4_000)
    assert far.get("b", 0.0) == 0.0


def test_affinity_ignores_score_only_weight_changes() -> None:
    """A score dip halves the effective weight but not the structural one: no session moves."""
    before = homes(balancer(), (V("a"), V("b"), V("c")), KEYS)
    after = homes(balancer(), (V("a", 0.4, aw=1.0), V("b"), V("c")), KEYS)
    assert before == after


def test_panic_candidates_never_starve_a_healthy_remote_backend() -> None:
    """Local backends ejected (panic) and a healthy remote one: the healthy one is in the mix."""
    bal = balancer(prefer_zone="z1")
    cands = (
        V("a", 0.3, State.EJECTED, zone="z1", panic=True),
        V("b", 0.3, State.EJECTED, zone="z1", panic=True),
        V("d", 1.0, zone="z2"),
    )
    got = shares(bal, cands, 3_000)
    assert got == {"d": 1.0}
    only_panic = shares(balancer(prefer_zone="z1"), cands[:2], 100)
    assert set(only_panic) == {"a", "b"}
