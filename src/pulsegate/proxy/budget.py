"""Retry budget: a fleet-wide outage must not turn into a retry storm.

Token bucket. Every client request deposits `ratio` tokens and the bucket also refills at
`min_per_s` tokens per second (so a quiet gateway can still retry); each retry withdraws
one. The bucket holds at most `cap` tokens, which bounds the burst after a quiet spell.

Worked example (ratio 0.2, min_per_s 10, cap 100): at 1,000 requests/s with every backend
failing, deposits are 200 + 10 = 210 tokens/s, so at most ~21% of requests get a retry once
the initial 100-token burst is spent, instead of 200% with max_attempts 3.
"""

from __future__ import annotations


class RetryBudget:
    __slots__ = ("_balance", "_last", "cap", "min_per_s", "ratio")

    def __init__(self, ratio: float, min_per_s: float, now: float, cap: float = 100.0) -> None:
        self.ratio = ratio
        self.min_per_s = min_per_s
        self.cap = cap
        self._balance = cap
        self._last = now

    def _refill(self, now: float) -> None:
        dt = now - self._last
        if dt > 0:
            self._balance = min(self.cap, self._balance + dt * self.min_per_s)
            self._last = now

    def deposit(self, now: float) -> None:
        """One client request arrived."""
        self._refill(now)
        self._balance = min(self.cap, self._balance + self.ratio)

    def try_withdraw(self, now: float) -> bool:
        """Take one retry if the budget allows it."""
        self._refill(now)
        if self._balance >= 1.0:
            self._balance -= 1.0
            return True
        return False

    def balance(self, now: float) -> float:
        """Tokens available at `now` (read-only: does not advance the bucket)."""
        dt = max(0.0, now - self._last)
        return min(self.cap, self._balance + dt * self.min_per_s)
