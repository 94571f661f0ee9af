"""The per-key limiter: token buckets per minute, in flight, reload carry-over. Time by hand."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsegate.front.limits import Bucket, KeyState, LocalLimits, Quota


def level(b: Bucket | None) -> float:
    assert b is not None
    return b.level


def test_the_worked_example_rpm_60() -> None:
    """rpm 60: 60 at once, the 61st waits 0.5 s at t=0.5, 30 are back at t=30."""
    s = KeyState(Quota(rpm=60), now=0.0)
    assert all(s.take(0, 0.0) == "" for _ in range(60))
    assert s.take(0, 0.5) == "rpm"
    assert s.retry_after == pytest.approx(0.5)
    assert level(s.requests) < 1.0
    assert s.take(0, 1.0) == ""
    for _ in range(60):
        s.settle(0, 1.0)
    got = sum(s.take(0, 31.0) == "" for _ in range(40))
    assert got == 30


def test_the_level_after_an_admission() -> None:
    """After 3 of rpm 60 the requests bucket holds 57, and 1 more a second later."""
    s = KeyState(Quota(rpm=60), now=0.0)
    for _ in range(3):
        assert s.take(0, 0.0) == ""
    assert level(s.requests) == pytest.approx(57.0)
    assert s.take(0, 1.0) == "" and level(s.requests) == pytest.approx(57.0)


def test_a_bucket_never_holds_more_than_a_minute() -> None:
    """An hour idle refills to capacity, not beyond."""
    b = Bucket(100, now=0.0)
    b.level = 0.0
    assert b.refill(3600.0) == 100.0


def test_tokens_are_estimated_then_corrected() -> None:
    """tpm 1000: an estimate of 400 taken, the answer used 100: 300 come back at settle."""
    s = KeyState(Quota(tpm=1000), now=0.0)
    assert s.take(400, 0.0) == "" and level(s.tokens) == 600
    s.settle(100 - 400, 0.0)
    assert s.take(0, 0.0) == "" and level(s.tokens) == 900


def test_a_debt_blocks_until_it_is_paid_back() -> None:
    """tpm 600 (10 a second): an answer 300 over leaves the bucket at -300, refused for 30 s."""
    s = KeyState(Quota(tpm=600), now=0.0)
    assert s.take(600, 0.0) == ""
    s.settle(300, 0.0)  # used 900, estimated 600
    assert s.take(0, 0.0) == "tpm"
    assert s.retry_after == pytest.approx(30.0)
    assert s.take(0, 29.9) == "tpm"
    assert s.take(0, 30.0) == ""


def test_a_request_larger_than_the_minute_needs_a_full_bucket() -> None:
    """tpm 100, an estimate of 250: admitted from full, then nothing until the debt is repaid."""
    s = KeyState(Quota(tpm=100), now=0.0)
    assert s.take(250, 0.0) == ""
    assert s.take(250, 60.0) == "tpm"
    # -150 after the first; at t=60 it is back to -50, and 150 more at 100/60 a second is 90 s.
    assert s.retry_after == pytest.approx(90.0)


def test_refusal_takes_nothing() -> None:
    """A request refused on tokens does not use up a request (both limits are checked first)."""
    s2 = KeyState(Quota(rpm=2, tpm=10), now=0.0)
    assert s2.take(10, 0.0) == ""
    assert s2.take(10, 0.0) == "tpm"
    assert s2.take(0, 0.0) == "" and level(s2.requests) == 0  # the refused one took none


def test_concurrency_counts_until_settled() -> None:
    """concurrency 2: a third in flight is refused, and admitted once one settles."""
    s = KeyState(Quota(concurrency=2), now=0.0)
    assert s.take(0, 0.0) == "" and s.take(0, 0.0) == ""
    assert s.take(0, 0.0) == "concurrency" and s.retry_after == 1.0
    s.settle(0, 0.1)
    assert s.take(0, 0.1) == ""


def test_the_longest_wait_is_the_retry_after() -> None:
    """Over both rpm and tpm: Retry-After is the later of the two waits."""
    s = KeyState(Quota(rpm=60, tpm=60), now=0.0)
    assert s.take(60, 0.0) == ""
    s.requests.level = 0.0  # type: ignore[union-attr]
    assert s.take(30, 0.0) != ""
    assert s.retry_after == pytest.approx(30.0)  # tokens: 30 at 1/s; requests: 1 s


def test_share_splits_rounding_up() -> None:
    """A quota split over 4 workers: ceil(limit / 4), a limit of 1 stays 1, 0 stays none."""
    assert Quota(rpm=10, tpm=1, concurrency=0).share(4) == Quota(3, 1, 0)
    assert Quota(rpm=10).share(1) == Quota(rpm=10)


def test_a_reload_keeps_unchanged_counters() -> None:
    """retune: same quota keeps its buckets, a changed one starts full, a removed one goes."""
    store = LocalLimits({"a": Quota(rpm=2), "b": Quota(rpm=2), "c": Quota(rpm=2)}, now=0.0)
    for k in "abc":
        assert store.account(k).take(0, 0.0) == store.account(k).take(0, 0.0) == ""
    store.retune({"a": Quota(rpm=2), "b": Quota(rpm=5)}, now=0.0)
    assert store.account("a").take(0, 0.0) == "rpm"
    b = store.account("b")
    assert b.take(0, 0.0) == "" and level(b.requests) == 4
    assert "c" not in store.states


def test_settle_under_a_replaced_quota_touches_nothing() -> None:
    """A request admitted before its key's limits changed settles on the replaced account,
    not the new one."""
    store = LocalLimits({"a": Quota(concurrency=1)}, now=0.0)
    old = store.account("a")
    assert old.take(0, 0.0) == ""
    store.retune({"a": Quota(concurrency=2)}, now=0.0)
    assert store.account("a").take(0, 0.0) == ""
    old.settle(0, 0.0)  # the old request ends
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
        if s.take(0, t) == "":
            admitted.append(t)
        else:
            wait = s.retry_after
            probe = KeyState(Quota(rpm=rpm), now=0.0)
            probe.requests.level, probe.requests.at = s.requests.level, t  # type: ignore[union-attr]
            assert probe.take(0, t + wait * 0.999) != "" or wait == 0
            assert probe.take(0, t + wait + 1e-9) == ""
    for i, start in enumerate(admitted):
        for j in range(i, len(admitted)):
            span = admitted[j] - start
            assert j - i + 1 <= rpm + rpm * span / 60.0 + 1e-6
