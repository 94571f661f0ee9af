"""The retry budget bounds retries to a share of traffic plus a small floor."""

from __future__ import annotations

from pulsegate.proxy.budget import RetryBudget


def test_budget_allows_ratio_of_traffic_after_burst() -> None:
    """At steady failure, retries converge to ratio x requests + floor."""
    b = RetryBudget(ratio=0.2, min_per_s=0.0, now=0.0, cap=10.0)
    granted = 0
    now = 0.0
    for _ in range(10_000):
        now += 0.001
        b.deposit(now)
        granted += b.try_withdraw(now)
    # 10 from the initial bucket, then 20% of 10,000 requests.
    assert 2000 <= granted <= 2011


def test_floor_refills_when_quiet() -> None:
    """With no traffic the floor still grants min_per_s retries per second."""
    b = RetryBudget(ratio=0.2, min_per_s=5.0, now=0.0, cap=5.0)
    assert sum(b.try_withdraw(0.0) for _ in range(10)) == 5
    assert not b.try_withdraw(0.0)
    assert b.try_withdraw(0.2)  # 0.2 s x 5/s = 1 token
    assert not b.try_withdraw(0.2)


def test_balance_is_read_only() -> None:
    """Reading the balance does not spend or refill anything."""
    b = RetryBudget(ratio=0.5, min_per_s=1.0, now=0.0, cap=3.0)
    for _ in range(3):
        b.try_withdraw(0.0)
    assert b.balance(1.0) == 1.0
    assert b.balance(1.0) == 1.0
    assert b.try_withdraw(1.0)
    assert not b.try_withdraw(1.0)
