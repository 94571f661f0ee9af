"""A slow node against its peers (`health.slowness`): the reading, the window, the hysteresis,
and the fleet wiring, on plain floats and a fake clock (no sleep)."""

from __future__ import annotations

import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsegate.health import slowness
from pulsegate.health.machine import Event
from pulsegate.health.observations import Outcome, ProbeKind, ProbeResult, RequestResult
from pulsegate.health.rules import Fire
from pulsegate.health.signals import Signals
from pulsegate.health.slowness import CLEAR_RATIO, SLOW_RATIO, SLOW_WINDOW_S, Reading, SlowWatch
from pulsegate.health.verdict import State

from .harness import FAIL, MICRO_OK, OK, READY, Harness, health_with


def _sig(ttft: float | None = None, probe: float | None = None, at: float = 0.0) -> Signals:
    s = Signals(1.0)  # alpha 1: the smoothed value is the last sample
    if ttft is not None:
        s.record_request_ok(ttft, at)
    if probe is not None:
        s.record_probe(ProbeResult(ProbeKind.MICRO, ok=True, latency_s=probe), at)
    return s


def _peers(signals: list[Signals], now: float) -> slowness.Peers:
    return slowness.Peers.among(signals, now)


def _r(ratio: float) -> Reading:
    return Reading("ttft", ratio * 0.05, 0.05, 2, ratio)


# -- the reading ------------------------------------------------------------------------------


def test_compare_takes_the_peers_median_and_a_floor() -> None:
    r = slowness.compare("ttft", 0.5, [0.1, 0.1, 10.0])
    assert r is not None and r.ratio == pytest.approx(5.0) and r.peers_s == 0.1
    assert r.words() == "smoothed TTFT 500 ms is 5.0x its 3 peers' median (100 ms)"
    # 4 ms against 1 ms peers is loopback noise: taken against 10 ms, not 4x.
    tiny = slowness.compare("ttft", 0.004, [0.001])
    assert tiny is not None and tiny.ratio == pytest.approx(0.4)
    assert slowness.compare("ttft", None, [0.1]) is None
    assert slowness.compare("ttft", 0.1, []) is None


def test_read_takes_the_latest_probe_sample_and_falls_back_to_ttft() -> None:
    own = _sig(ttft=0.5, probe=0.2, at=0.0)
    peer = _sig(ttft=0.1, probe=0.05)
    peer.record_probe(ProbeResult(ProbeKind.CANARY, ok=True, latency_s=0.1), 0.0)
    r = slowness.read(own, _peers([peer, peer], 1.0), 1.0)
    assert r is not None and r.source == "micro" and r.ratio == pytest.approx(4.0)
    assert r.words() == "micro-inference 200 ms is 4.0x its 2 peers' median (50 ms)"
    # A canary came after it: the newest probe counts, the micro-inference outlier is gone.
    own.record_probe(ProbeResult(ProbeKind.CANARY, ok=True, latency_s=0.12), 0.5)
    r = slowness.read(own, _peers([peer], 1.0), 1.0)
    assert r is not None and r.source == "canary" and r.ratio == pytest.approx(1.2)
    assert "its peer's median" in r.words()
    # The latest sample, not the average: one 0.6 s canary after it reads 6x at once.
    own.record_probe(ProbeResult(ProbeKind.CANARY, ok=True, latency_s=0.6), 0.8)
    r = slowness.read(own, _peers([peer], 1.0), 1.0)
    assert r is not None and r.ratio == pytest.approx(6.0)
    # No peer has a probe latency: smoothed TTFT against smoothed TTFT.
    r = slowness.read(own, _peers([_sig(ttft=0.1), _sig(ttft=0.1)], 1.0), 1.0)
    assert r is not None and r.source == "ttft" and r.ratio == pytest.approx(5.0)
    assert slowness.read(own, _peers([], 1.0), 1.0) is None
    assert slowness.read(_sig(), _peers([_sig(ttft=0.1)], 1.0), 1.0) is None
    # Stale (30 s): unknown, no evidence.
    assert slowness.read(own, _peers([_sig(ttft=0.1)], 40.0), 40.0) is None


# -- the window and the hysteresis ------------------------------------------------------------


def _evals(w: SlowWatch, ratio: float, t0: float, t1: float, dt: float = 0.25) -> bool:
    """Evaluations every `dt` from `t0` to `t1` (both included) at `ratio`: slow at the end?"""
    slow, t = False, t0
    while t <= t1 + 1e-9:
        slow = w.update(_r(ratio), t)
        t += dt
    return slow


def test_slow_only_after_the_whole_window() -> None:
    w = SlowWatch(Signals(0.2))
    assert not _evals(w, 5.0, 0.0, SLOW_WINDOW_S - 0.25)
    assert w.update(_r(5.0), SLOW_WINDOW_S)


def test_the_window_allows_half_an_evaluation_late_or_early() -> None:
    """Evaluations 1 s apart, one of them a tick early: two of them still make 2 s."""
    assert SLOW_WINDOW_S == 2.0
    w = SlowWatch(Signals(0.2))
    assert not _evals(w, 5.0, 0.0, 1.0, dt=1.0)
    assert w.update(_r(5.0), 1.95)
    w2 = SlowWatch(Signals(0.2))
    assert not _evals(w2, 5.0, 0.0, 1.0, dt=1.0)
    assert not w2.update(_r(5.0), 1.4)  # more than half an evaluation short


def test_one_slow_probe_sample_is_never_enough() -> None:
    """The same slow sample read at every evaluation (no newer probe came) for twice the
    window: not slow; a second slow sample: slow."""
    w = SlowWatch(Signals(0.2))
    one = Reading("canary", 0.5, 0.05, 2, 10.0, at=0.0)
    for t in (0.0, 1.0, 2.0, 3.0, 4.0):
        assert not w.update(one, t)
    assert w.update(Reading("micro", 0.5, 0.05, 2, 10.0, at=4.2), 5.0)


def test_a_dip_under_3x_restarts_the_window() -> None:
    w = SlowWatch(Signals(0.2))
    _evals(w, 5.0, 0.0, 1.75)
    assert not w.update(_r(2.0), 2.0)  # not slow yet, and the spell is broken
    assert not _evals(w, 5.0, 2.25, 2.25 + SLOW_WINDOW_S - 0.25)
    assert w.update(_r(5.0), 2.25 + SLOW_WINDOW_S)


def test_hysteresis_clears_only_within_1_5x_for_the_window() -> None:
    w = SlowWatch(Signals(0.2))
    assert _evals(w, SLOW_RATIO, 0.0, SLOW_WINDOW_S)
    assert _evals(w, 2.0, 3.25, 10.0)  # between 1.5x and 3x: still slow, however long
    assert _evals(w, CLEAR_RATIO + 0.01, 10.25, 15.0)
    assert _evals(w, CLEAR_RATIO, 15.25, 15.25 + SLOW_WINDOW_S - 0.25)  # not for long enough
    assert not w.update(_r(CLEAR_RATIO), 15.25 + SLOW_WINDOW_S)
    assert not _evals(w, 2.9, 18.5, 30.0)  # not back to slow without a new 3x spell


def test_one_fast_sample_does_not_clear() -> None:
    w = SlowWatch(Signals(0.2))
    assert _evals(w, 5.0, 0.0, SLOW_WINDOW_S)
    assert _evals(w, 1.0, 3.25, 4.0)
    assert _evals(w, 5.0, 4.25, 5.0)  # the within-1.5x spell is broken
    assert _evals(w, 1.0, 5.25, 5.25 + SLOW_WINDOW_S - 0.25)
    assert not w.update(_r(1.0), 5.25 + SLOW_WINDOW_S)


def test_unknown_is_no_evidence() -> None:
    w = SlowWatch(Signals(0.2))
    w.update(_r(5.0), 0.0)
    assert w.update(_r(5.0), SLOW_WINDOW_S)
    assert not w.update(None, SLOW_WINDOW_S + 1)


# -- judge: what fires ------------------------------------------------------------------------


def _slow_watch(ratio: float = 5.0) -> tuple[SlowWatch, float]:
    """A watch whose backend is `ratio` x slower than two peers, judged slow already."""
    own = _sig(ttft=0.05 * ratio)
    peers = [_sig(ttft=0.05), _sig(ttft=0.05)]
    w = SlowWatch(own)
    w.peers = lambda now: _peers(peers, now)
    assert w.judge(State.READY, None, 0.0) is None
    return w, SLOW_WINDOW_S


def test_ready_and_slow_degrades_with_cause_slow() -> None:
    w, t = _slow_watch()
    f = w.judge(State.READY, None, t)
    assert f is not None and f.event is Event.DEGRADE and f.cause == "slow"
    assert f.reason == "slow: smoothed TTFT 250 ms is 5.0x its 2 peers' median (50 ms) for 2.0s"
    # The score's own degrade is replaced (the cause is the slowness) ...
    f = w.judge(State.READY, Fire("degraded", "score 55 < 60", Event.DEGRADE), t)
    assert f is not None and f.cause == "slow"
    # ... an ejection is not.
    eject = Fire("score", "score 20 < 30", Event.SCORE_LOW)
    assert w.judge(State.READY, eject, t) is eject


def test_degraded_and_slow_does_not_recover() -> None:
    w, t = _slow_watch()
    recover = Fire("cleared", "degraded conditions cleared (score 90)", Event.RECOVER)
    assert w.judge(State.DEGRADED, recover, t) is None
    assert w.judge(State.DEGRADED, None, t) is None


def test_not_slow_passes_the_other_rules_through() -> None:
    w, t = _slow_watch(ratio=2.5)
    recover = Fire("cleared", "x", Event.RECOVER)
    assert w.judge(State.DEGRADED, recover, t) is recover
    assert w.judge(State.READY, None, t) is None
    assert w.judge(State.PROBATION, None, t) is None


def test_a_lone_backend_has_no_peers_and_no_slowness() -> None:
    w = SlowWatch(_sig(ttft=5.0))
    assert w.judge(State.READY, None, 0.0) is None
    assert w.judge(State.READY, None, SLOW_WINDOW_S * 2) is None


# -- the fleet --------------------------------------------------------------------------------


def _traffic(slow: str | None, factor: float) -> object:
    def each(h: Harness) -> None:
        for n in ("a", "b", "c"):
            ttft = 0.05 * (factor if n == slow else 1.0)
            h.obs(n, RequestResult(Outcome.OK, ttft_s=ttft))
            h.obs(n, ProbeResult(ProbeKind.MICRO, ok=True, latency_s=ttft))

    return each


def test_fleet_degrades_a_5x_slow_backend_within_5s_and_readies_it_after() -> None:
    h = Harness()
    h.make_ready()
    h.run(10.0, _traffic(None, 1.0))  # type: ignore[arg-type]
    assert [h.state(n) for n in "abc"] == [State.READY] * 3
    t0 = h.now
    took = None
    for _ in range(100):
        h.run(0.1, _traffic("a", 5.0))  # type: ignore[arg-type]
        if h.state("a") is State.DEGRADED:
            took = h.now - t0
            break
    assert took is not None and took <= 5.0, took
    snap = h.snap("a")
    assert snap["last_cause"] == "slow"
    assert "x its 2 peers' median" in str(snap["last_reason"])
    assert h.state("b") is State.READY and h.state("c") is State.READY
    # Still 2x: stays degraded (hysteresis) however long.
    h.run(10.0, _traffic("a", 2.0))  # type: ignore[arg-type]
    assert h.state("a") is State.DEGRADED
    h.run(5.0, _traffic("a", 1.0))  # type: ignore[arg-type]
    assert h.state("a") is State.READY
    assert h.causes("a")[-2:] == ["slow", "cleared"]


def test_fleet_a_fleet_slow_together_is_not_slow() -> None:
    """Every backend 5x slower at once (a shared cause): no one is slow against its peers."""
    h = Harness()
    h.make_ready()
    h.run(10.0, _traffic(None, 1.0))  # type: ignore[arg-type]
    h.run(10.0, _traffic("none", 1.0))  # type: ignore[arg-type]
    h.run(10.0, lambda x: [x.obs(n, ProbeResult(ProbeKind.MICRO, True, 0.25)) for n in "abc"])
    assert "slow" not in h.causes("a") + h.causes("b") + h.causes("c")


# -- the peers, gathered once per model set and instant ----------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.001, 0.02, 0.05, 0.05, 0.3, 2.5]) | st.none(), max_size=9))
def test_the_median_less_one_member_is_the_median_of_the_others(ttfts: list[float | None]) -> None:
    """Each member's peers' median, read from the one sorted set, is the median of the others'
    values: repeated values, members with no value and an empty rest included."""
    members = {f"b{i}": _sig(ttft=v) for i, v in enumerate(ttfts)}
    latencies = slowness.Latencies(members, 1.0)
    for i, own in enumerate(ttfts):
        others = [v for j, v in enumerate(ttfts) if j != i and v is not None]
        want = (statistics.median(others), len(others)) if others else None
        assert latencies.median("ttft", own) == want
        assert slowness.Peers(latencies, member=True).median("ttft", own) == want
    known = [v for v in ttfts if v is not None]
    whole = (statistics.median(known), len(known)) if known else None
    assert latencies.median("ttft") == whole  # not a member: every value counts
    assert latencies.median("micro") is None  # no member has one


def _one_by_one(h: Harness, name: str) -> slowness.Peers:
    """`name`'s peers gathered the way the rule states them: every other backend that serves
    one of its models and is ready or degraded."""
    fleet = h.fleet
    me = fleet.backend(name)
    peers = [
        fleet.backend(n).signals
        for n in fleet.names()
        if n != name
        and fleet.backend_models(n) & me.models
        and fleet.state(n) in (State.READY, State.DEGRADED)
    ]
    return slowness.Peers.among(peers, h.now)


def test_the_fleets_shared_peers_read_as_the_peers_gathered_one_by_one() -> None:
    """Backends of two models and of both, in every state that counts or does not: what the
    fleet hands each one (one gathering per model set, kept while nothing moves) reads the
    same as its peers gathered one by one, also right after an observation or a state change
    at the same instant."""
    h = Harness(names=[f"b{i}" for i in range(12)], models=("m1",))
    for i, n in enumerate(h.fleet.names()):
        h.fleet.set_models(n, ("m1",) if i < 5 else ("m2",) if i < 9 else ("m1", "m2"))
    rng = random.Random(5)

    def same() -> None:
        for n in h.fleet.names():
            b = h.fleet.backend(n)
            shared, alone = b.slow.peers(h.now), _one_by_one(h, n)
            assert slowness.read(b.signals, shared, h.now) == slowness.read(b.signals, alone, h.now)
            assert slowness.smoothed(b.signals, shared, h.now) == slowness.smoothed(
                b.signals, alone, h.now
            )

    for n in h.fleet.names()[:-2]:  # the last two stay cold: no one's peers
        h.obs(n, READY)
    for _ in range(40):
        h.tick(0.1)
        for n in h.fleet.names():
            k = 4.0 if n in ("b1", "b6", "b10") else 1.0
            h.obs(n, ProbeResult(ProbeKind.MICRO, True, 0.05 * k * (1 + rng.random())))
            h.obs(n, RequestResult(Outcome.OK, ttft_s=0.1 * k * (1 + rng.random())))
        same()
    h.feed("b2", FAIL, 6)  # ejected at this same instant: no longer a peer
    assert h.fleet.state("b2") is State.EJECTED
    same()
    h.obs("b3", ProbeResult(ProbeKind.MICRO, True, 9.0))  # observed at this same instant
    same()
    assert h.fleet.backend("b0").slow.peers(h.now).median("micro", None) is not None


def test_a_backend_that_rejoins_in_a_tick_is_a_peer_for_the_backends_after_it() -> None:
    """`a` ends its probation in a tick (first in order): the others, evaluated in the same
    tick, already count it, as they did when each gathered its peers itself."""
    h = Harness(names=list("abcde"), health=health_with(evaluate_interval=0.1))
    h.make_ready()
    h.run(3.0, h.healthy_traffic())
    h.fleet.eject("a", h.now)

    def probes(h: Harness) -> None:
        for n in "abcde":
            h.obs(n, READY)
            h.obs(n, MICRO_OK)
            if n != "a":
                h.obs(n, OK)

    for _ in range(1000):
        back = [t for t in h.run(0.1, probes) if t.backend == "a" and t.to_state is State.READY]
        if back:
            break
    assert back, "a never came back"
    last = h.fleet.backend("e").slow.last
    assert last is not None and last.peers == 4


# -- the routing weight -----------------------------------------------------------------------


def test_peer_ratio_counts_only_past_the_slack() -> None:
    assert slowness.peer_ratio(None) is None
    assert slowness.peer_ratio(_r(slowness.PEER_SLACK)) is None  # a healthy spread
    assert slowness.peer_ratio(_r(50.0)) == pytest.approx(50.0 / slowness.PEER_SLACK)


def test_smoothed_reads_the_smoothed_probe_then_ttft() -> None:
    own, peer = Signals(0.5), _sig(ttft=0.1, probe=0.05)
    own.record_probe(ProbeResult(ProbeKind.MICRO, ok=True, latency_s=0.05), 0.0)
    own.record_probe(ProbeResult(ProbeKind.MICRO, ok=True, latency_s=0.45), 0.5)
    r = slowness.smoothed(own, _peers([peer, peer], 1.0), 1.0)
    # alpha 0.5: (0.05 + 0.45) / 2 = 0.25 against 0.05, where `read` sees the last 0.45.
    assert r is not None and r.source == "micro" and r.ratio == pytest.approx(5.0)
    r = slowness.smoothed(_sig(ttft=0.3), _peers([_sig(ttft=0.1)], 1.0), 1.0)
    assert r is not None and r.source == "ttft" and r.ratio == pytest.approx(3.0)
    assert slowness.smoothed(own, _peers([], 1.0), 1.0) is None


def test_fleet_a_backend_slow_from_its_start_gets_little_weight() -> None:
    """Its own baseline was learned slow (ratio 1 to itself), so only its peers show it: a
    first token 30x the others' gives it a weight a tenth of theirs, at the next evaluation,
    and the full weight back once it is as fast as they are."""
    h = Harness()
    h.make_ready()
    h.run(10.0, _traffic("a", 30.0))  # type: ignore[arg-type]
    assert h.weight("a") < 0.1 * h.weight("b"), (h.weight("a"), h.weight("b"))
    assert h.weight("b") == pytest.approx(h.weight("c"))
    h.run(20.0, _traffic("a", 1.0))  # type: ignore[arg-type]
    assert h.weight("a") == pytest.approx(h.weight("b"), rel=0.05)
