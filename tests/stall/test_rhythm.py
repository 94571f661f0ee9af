"""The rhythm estimator, the stall rule and the hedge's budget: pure, on a ManualClock."""

from __future__ import annotations

import random

from pulsegate.clock import ManualClock
from pulsegate.config.schema import HedgeConfig
from pulsegate.proxy.budget import RetryBudget
from pulsegate.proxy.cuts import CutKind
from pulsegate.proxy.hedge import BURST, FLOOR_S, hedge_after, refusal
from pulsegate.proxy.request import ProxyRequest
from pulsegate.proxy.rhythm import MIN_SAMPLES, Quantiles, Rhythms, stall_limit
from pulsegate.proxy.watchdog import Watchdog


class _Upstream:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_a_quantile_is_within_one_bucket_above_the_true_one() -> None:
    """p99 of 10,000 draws reads at or just above the exact p99 (12.5% buckets)."""
    rng = random.Random(7)
    xs = [rng.expovariate(1 / 0.005) for _ in range(10_000)]
    q = Quantiles()
    for x in xs:
        q.add(x)
    # Decay weighs the last ~1,000 most: compare with their exact p99.
    recent = sorted(xs[-1024:])
    exact = recent[int(0.99 * len(recent))]
    got = q.quantile(0.99)
    assert got is not None
    assert exact * 0.8 <= got <= exact * 1.4


def test_too_few_samples_is_unknown() -> None:
    """Below MIN_SAMPLES the quantile is None: a fresh backend is judged by the cap."""
    q = Quantiles()
    for _ in range(MIN_SAMPLES - 1):
        q.add(0.005)
    assert q.quantile(0.99) is None
    for _ in range(40):
        q.add(0.005)
    assert q.quantile(0.99) is not None


def test_the_distribution_follows_a_backend_that_slowed_down() -> None:
    """5 ms gaps, then 50 ms ones: within ~2,000 samples the p99 is the slow one's."""
    q = Quantiles()
    for _ in range(3000):
        q.add(0.005)
    assert (q.quantile(0.99) or 0) < 0.006
    for _ in range(2000):
        q.add(0.05)
    assert 0.05 <= (q.quantile(0.5) or 0) < 0.057


def test_the_fleet_usual_ttft_ignores_one_slow_backend() -> None:
    """Lower median of per-backend p95s: one of three (or two) slow backends does not move it."""
    r = Rhythms()
    for _ in range(100):
        r.first_token("a", 1.5)
        r.first_token("b", 0.03)
        r.first_token("c", 0.04)
    usual = r.usual_ttft(["a", "b", "c"], 0.95)
    assert usual is not None and 0.04 <= usual < 0.046
    two = r.usual_ttft(["a", "b"], 0.95)
    assert two is not None and two < 0.035
    assert r.usual_ttft(["x"], 0.95) is None


def test_the_stall_rule_worked_examples() -> None:
    """max(floor, k x max(p99, own)), capped; nothing known: the cap."""
    assert stall_limit(1.0, 0.15, 4.0, None, None) == 1.0
    assert stall_limit(1.0, 0.15, 4.0, 0.009, 0.03) == 0.15
    assert abs(stall_limit(1.0, 0.15, 4.0, 0.2, None) - 0.8) < 1e-9
    assert stall_limit(1.0, 0.15, 4.0, 0.009, 0.4) == 1.0
    assert abs(stall_limit(1.0, 0.15, 4.0, None, 0.05) - 0.2) < 1e-9


def _steady(clock: ManualClock, w: Watchdog, gap: float, n: int, tokens: int = 1) -> int:
    """`n` chunks `gap` apart, each with one token written to the client."""
    for _ in range(n):
        clock.advance(gap)
        w.beat()
        tokens += 1
        w.touch(tokens)
    return tokens


def test_a_stall_at_5ms_rhythm_is_cut_at_the_floor_not_at_the_cap() -> None:
    """After 20 tokens 5 ms apart, silence is cut after 150 ms (floor), not 1 s."""
    clock, up, q = ManualClock(), _Upstream(), Quantiles()
    w = Watchdog(clock, up, 1.0, rhythm=q, floor=0.15, factor=4.0)
    w.touch(1)  # the first token went out
    _steady(clock, w, 0.005, 20)
    clock.advance(0.14)
    assert up.closed == 0
    clock.advance(0.02)
    assert up.closed == 1 and w.cut_by is not None and w.cut_by.kind is CutKind.STALLED


def test_a_slow_but_steady_stream_is_never_cut() -> None:
    """200 ms between tokens, 40 tokens: never cut; its limit is 4 x its own gap."""
    clock, up, q = ManualClock(), _Upstream(), Quantiles()
    w = Watchdog(clock, up, 1.0, rhythm=q, floor=0.15, factor=4.0)
    w.touch(1)
    _steady(clock, w, 0.2, 40)
    assert up.closed == 0
    assert abs(w.limit() - 0.8) < 0.01
    w.stop()


def test_a_slow_stream_on_a_fast_backend_is_judged_by_its_own_pace() -> None:
    """Backend p99 5 ms, this stream 100 ms apart: its own longest gap sets the limit."""
    clock, up, q = ManualClock(), _Upstream(), Quantiles()
    for _ in range(500):
        q.add(0.005)
    w = Watchdog(clock, up, 1.0, rhythm=q, floor=0.15, factor=4.0)
    w.touch(1)
    _steady(clock, w, 0.1, 30)
    assert up.closed == 0 and abs(w.limit() - 0.4) < 0.01
    w.stop()


def test_a_long_prefill_is_judged_by_stall_timeout_only() -> None:
    """Before the first token (a 2 s prefill) the limit is the cap, whatever the rhythm."""
    clock, up, q = ManualClock(), _Upstream(), Quantiles()
    for _ in range(500):
        q.add(0.005)
    w = Watchdog(clock, up, 3.0, rhythm=q, floor=0.15, factor=4.0)
    clock.advance(0.01)
    w.touch(0)  # the role chunk: no token yet
    clock.advance(2.0)
    assert up.closed == 0 and not w.armed
    w.beat()
    w.touch(1)  # the first token, 2 s later
    assert w.armed and up.closed == 0
    clock.advance(0.16)  # backend p99 5 ms: the floor now
    assert up.closed == 1


def test_our_own_stall_is_still_not_the_engines_silence() -> None:
    """A 300 ms stall of our loop past a 150 ms limit: the stream gets its running time."""
    clock, up, q = ManualClock(), _Upstream(), Quantiles()
    w = Watchdog(clock, up, 1.0, rhythm=q, floor=0.15, factor=4.0)
    w.touch(1)
    _steady(clock, w, 0.005, 20)
    clock.advance(0.05)
    clock.stall(0.3)
    assert up.closed == 0  # 50 ms of running time only
    clock.advance(0.11)
    assert up.closed == 1


def test_without_a_rhythm_the_fixed_rule_stands() -> None:
    """rhythm None (stall_factor 0): cut at stall_timeout even at a 5 ms pace."""
    clock, up = ManualClock(), _Upstream()
    w = Watchdog(clock, up, 1.0)
    w.touch(1)
    _steady(clock, w, 0.005, 20)
    clock.advance(0.9)
    assert up.closed == 0
    clock.advance(0.11)
    assert up.closed == 1


def test_hedge_after_worked_examples() -> None:
    """factor x the smaller p95, at least FLOOR_S; nothing known: no hedge."""
    assert hedge_after(2.0, None, None) is None
    assert abs((hedge_after(2.0, 1.5, 0.04) or 0) - 0.08) < 1e-9
    assert hedge_after(2.0, 0.02, 0.02) == FLOOR_S
    assert abs((hedge_after(3.0, None, 0.1) or 0) - 0.3) < 1e-9


def test_the_hedge_budget_holds_hedges_to_five_percent() -> None:
    """1,000 late streams, 5% budget: at most BURST + 50 hedges."""
    clock = ManualClock()
    cfg = HedgeConfig(enabled=True)
    b = RetryBudget(cfg.budget, 0.0, clock.now(), cap=BURST)
    hedges = 0
    for _ in range(1000):
        clock.advance(0.01)
        b.deposit(clock.now())
        hedges += b.try_withdraw(clock.now())
    assert 45 <= hedges <= BURST + 50


def _req(doc: dict[str, object], api: str = "chat", stream: bool = True) -> ProxyRequest:
    return ProxyRequest("/v1/chat/completions", api, b"{}", doc, "m", stream, None, (), 5.0, ())


def test_what_is_never_hedged() -> None:
    """n > 1, tools, constrained decoding, non-streams and the Responses API: refused."""
    assert refusal(_req({"messages": []})) is None
    assert refusal(_req({"n": 2})) is not None
    assert refusal(_req({"tools": [{"type": "function"}]})) is not None
    assert refusal(_req({"response_format": {"type": "json_object"}})) is not None
    assert refusal(_req({}, stream=False)) is not None
    assert refusal(_req({}, api="responses")) is not None
