"""The per-key limiter: token buckets per minute, in flight, reload carry-over. Time by hand."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsegate.front.limits import Bucket, KeyState, LocalLimits, Quota


def test_the_worked_example_rpm_60() -> None:
    """rpm 60: 60 at once, the 61st waits 0.5 s at t=0.5, 30 are back at t=30."""
    s = KeyState(Quota(rpm=60), now=0.0)
    assert all(s.admit(0, 0.0).ok for _ in range(60))
    g = s.admit(0, 0.5)
    assert not g.ok and g.reason == "rpm"
    assert g.retry_after == pytest.approx(0.5)
    assert g.requests < 1.0
    assert s.admit(0, 1.0).ok
    for _ in range(60):
        s.settle(0, 1.0)
    got = sum(s.admit(0, 31.0).ok for _ in range(40))
    assert got == 30


def test_the_level_after_an_admission() -> None:
    """After 3 of rpm 60 the requests bucket holds 57, and 1 more a second later."""
    s = KeyState(Quota(rpm=60), now=0.0)
    for _ in range(3):
        g = s.admit(0, 0.0)
    assert g.requests == pytest.approx(57.0)
    assert s.admit(0, 1.0).requests == pytest.approx(57.0)


def test_a_bucket_never_holds_more_than_a_minute() -> None:
    """An hour idle refills to capacity, not beyond."""
    b = Bucket(100, now=0.0)
    b.level = 0.0
    assert b.refill(3600.0) == 100.0


def test_tokens_are_estimated_then_corrected() -> None:
    """tpm 1000: an estimate of 400 taken, the answer used 100: 300 come back at settle."""
    s = KeyState(Quota(tpm=1000), now=0.0)
    g = s.admit(400, 0.0)
    assert g.ok and g.tokens == 600
    s.settle(100 - 400, 0.0)
    assert s.admit(0, 0.0).tokens == 900


def test_a_debt_blocks_until_it_is_paid_back() -> None:
    """tpm 600 (10 a second): an answer 300 over leaves the bucket at -300, refused for 30 s."""
    s = KeyState(Quota(tpm=600), now=0.0)
    assert s.admit(600, 0.0).ok
    s.settle(300, 0.0)  # used 900, estimated 600
    g = s.admit(0, 0.0)
    assert not g.ok and g.reason == "tpm"
    assert g.retry_after == pytest.approx(30.0)
    assert not s.admit(0, 29.9).ok
    assert s.admit(0, 30.0).ok


def test_a_request_larger_than_the_minute_needs_a_full_bucket() -> None:
    """tpm 100, an estimate of 250: admitted from full, then nothing until the debt is repaid."""
    s = KeyState(Quota(tpm=100), now=0.0)
    assert s.admit(250, 0.0).ok
    g = s.admit(250, 60.0)
    assert not g.ok
    # -150 after the first; at t=60 it is back to -50, and 150 more at 100/60 a second is 90 s.
    assert g.retry_after == pytest.approx(90.0)


def test_refusal_takes_nothing() -> None:
    """A request refused on tokens does not use up a request (both limits are checked first)."""
    s2 = KeyState(Quota(rpm=2, tpm=10), now=0.0)
    assert s2.admit(10, 0.0).ok
    assert not s2.admit(10, 0.0).ok
    assert s2.admit(0, 0.0).requests == 0  # the refused one took no request


def test_concurrency_counts_until_settled() -> None:
    """concurrency 2: a third in flight is refused, and admitted once one settles."""
    s = KeyState(Quota(concurrency=2), now=0.0)
    assert s.admit(0, 0.0).ok and s.admit(0, 0.0).ok
    g = s.admit(0, 0.0)
    assert not g.ok and g.reason == "concurrency" and g.retry_after == 1.0
    s.settle(0, 0.1)
    assert s.admit(0, 0.1).ok


def test_the_longest_wait_is_the_retry_after() -> None:
    """Over both rpm and tpm: Retry-After is the later of the two waits."""
    s = KeyState(Quota(rpm=60, tpm=60), now=0.0)
    assert s.admit(60, 0.0).ok
    s.requests.level = 0.0  # type: ignore[union-attr]
    g = s.admit(30, 0.0)
    assert not g.ok
    assert g.retry_after == pytest.approx(30.0)  # tokens: 30 at 1/s; requests: 1 s


def test_share_splits_rounding_up() -> None:
    """A quota split over 4 workers: ceil(limit / 4), a limit of 1 stays 1, 0 stays none."""
    assert Quota(rpm=10, tpm=1, concurrency=0).share(4) == Quota(3, 1, 0)
    assert Quota(rpm=10).share(1) == Quota(rpm=10)


def test_a_reload_keeps_unchanged_counters() -> None:
    """retune: same quota keeps its buckets, a changed one starts full, a removed one goes."""
    store = LocalLimits({"a": Quota(rpm=2), "b": Quota(rpm=2), "c": Quota(rpm=2)}, now=0.0)
    for k in "abc":
        store.admit(k, Quota(rpm=2), 0, 0.0)
        store.admit(k, Quota(rpm=2), 0, 0.0)
    store.retune({"a": Quota(rpm=2), "b": Quota(rpm=5)}, now=0.0)
    assert not store.admit("a", Quota(rpm=2), 0, 0.0).ok
    assert store.admit("b", Quota(rpm=5), 0, 0.0).requests == 4
    assert "c" not in store.states


def test_settle_under_a_replaced_quota_touches_nothing() -> None:
    """A request admitted before its key's limits changed settles nothing in the new state."""
    store = LocalLimits({"a": Quota(concurrency=1)}, now=0.0)
    assert store.admit("a", Quota(concurrency=1), 0, 0.0).ok
    store.retune({"a": Quota(concurrency=2)}, now=0.0)
    assert store.admit("a", Quota(concurrency=2), 0, 0.0).ok
    store.settle("a", Quota(concurrency=1), 0, 0.0)  # the old request ends
    assert store.states["a"].inflight == 1


@settings(max_examples=200, deadline=None)
@given(
    rpm=st.integers(1, 120),
    gaps=st.lists(st.floats(0.0, 5.0, allow_nan=False), min_size=1, max_size=300),
)
def test_no_window_admits_more_than_the_bucket_allows(rpm: int, gaps: list[float]) -> None:
    """Any arrivals: within any span of T seconds at most rpm + rpm x T / 60 are admitted,
    and a refusal's Retry-After is exactly when the next one would be admitted."""
    s = KeyState(Quota(rpm=rpm), now=0.0)
    t = 0.0
    admitted: list[float] = []
    for gap in gaps:
        t += gap
        g = s.admit(0, t)
        if g.ok:
            admitted.append(t)
        else:
            probe = KeyState(Quota(rpm=rpm), now=0.0)
            probe.requests.level, probe.requests.at = s.requests.level, t  # type: ignore[union-attr]
            assert not probe.admit(0, t + g.retry_after * 0.999).ok or g.retry_after == 0
            assert probe.admit(0, t + g.retry_after + 1e-9).ok
    for i, start in enumerate(admitted):
        for j in range(i, len(admitted)):
            span = admitted[j] - start
            assert j - i + 1 <= rpm + rpm * span / 60.0 + 1e-6
