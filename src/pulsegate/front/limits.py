"""Per-key limits: requests per minute, tokens per minute, requests in flight. Pure.

Each per-minute limit is a token bucket: it holds up to one minute's worth (`rpm` requests,
`tpm` tokens) and refills continuously at limit / 60 per second; a request takes one from
the requests bucket and its tokens from the tokens bucket. Worked example, `rpm: 60`:
the bucket holds 60 and refills 1 a second. 60 requests at t = 0 are all admitted; the
61st at t = 0.5 s is refused with `Retry-After: 1` (0.5 s until one is back, rounded up to
whole seconds); at t = 30 s there are 30 again, and at t = 60 s a full minute's worth.

Why a bucket and not a window: a fixed one-minute window lets a client send 2 x rpm across
a boundary (60 at 0:59, 60 at 1:00); a sliding log is exact but keeps one timestamp per
request (60,000 per key at rpm 60,000); a bucket is two floats per limit, O(1) per
request, never admits more than rpm + (elapsed minutes x rpm), and its "time until full" is
what OpenAI's `x-ratelimit-reset-*` headers mean (the time until the limit is back to its
initial state).

Tokens are charged twice: an estimate at admission (the caller's, from the body size), and
the difference to the answer's `usage` when the request ends (`settle`), which may be a
refund or a debt. A bucket in debt (below zero) admits nothing until it refills, so a key
that under-estimated pays it back within the minute. A request whose estimate exceeds the
whole `tpm` is admitted from a full bucket (it could never be admitted otherwise) and
leaves it that far in debt.

`LimitStore` is the seam: `LocalLimits` keeps the buckets in this process; a store shared
between gateway replicas (#17, Redis) hands out `Account`s with the same two calls.
Nothing here reads the clock: every call takes `now` (monotonic seconds).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

# Retry-After for a refusal on `concurrency`: when a slot frees is not knowable here.
CONCURRENCY_RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class Quota:
    """One key's limits; 0: no limit on that dimension."""

    rpm: int = 0
    tpm: int = 0
    concurrency: int = 0

    def share(self, n: int) -> Quota:
        """This quota split between `n` processes that each enforce their own share:
        ceil(limit / n), so a limit of 1 stays 1 (the gateway-wide total may exceed the
        limit by at most n - 1)."""
        if n <= 1:
            return self
        return Quota(-(-self.rpm // n), -(-self.tpm // n), -(-self.concurrency // n))


class Bucket:
    """A token bucket of `capacity`, refilled at capacity / 60 per second."""

    __slots__ = ("at", "capacity", "level", "rate")

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = float(capacity)
        self.rate = capacity / 60.0
        self.level = self.capacity
        self.at = now

    def refill(self, now: float) -> float:
        if now > self.at:
            level = self.level + (now - self.at) * self.rate
            self.level = level if level < self.capacity else self.capacity
            self.at = now
        return self.level

    def wait(self, need: float) -> float:
        """Seconds until the (refilled) level reaches `need`."""
        return max(0.0, (need - self.level) / self.rate)


class KeyState:
    """One key's buckets and its requests in flight, under one `Quota`: the `Account` a
    `LocalLimits` store hands the door for that key."""

    __slots__ = ("inflight", "quota", "requests", "retry_after", "tokens")

    def __init__(self, quota: Quota, now: float) -> None:
        self.quota = quota
        self.requests = Bucket(quota.rpm, now) if quota.rpm else None
        self.tokens = Bucket(quota.tpm, now) if quota.tpm else None
        self.inflight = 0
        self.retry_after = 0.0

    def take(self, tokens: int, now: float) -> str:
        """Take one request and `tokens` if every limit allows both and answer "", else
        take nothing and answer the reason ("concurrency", "rpm" or "tpm"), with
        `retry_after` the seconds until the longest wait is over. The buckets' levels
        after it are what the `x-ratelimit-remaining-*` headers show."""
        reason = ""
        wait = 0.0
        limit = self.quota.concurrency
        if limit and self.inflight >= limit:
            reason, wait = "concurrency", CONCURRENCY_RETRY_S
        # Bucket.refill, inlined: a method call is a fifth of the cost of an admission.
        r = self.requests
        rl = 0.0
        if r is not None:
            rl = r.level
            if now > r.at:
                rl = rl + (now - r.at) * r.rate
                if rl > r.capacity:
                    rl = r.capacity
                r.level, r.at = rl, now
            if rl < 1.0:
                reason, wait = "rpm", max(wait, r.wait(1.0))
        t = self.tokens
        tl = 0.0
        if t is not None:
            tl = t.level
            if now > t.at:
                tl = tl + (now - t.at) * t.rate
                if tl > t.capacity:
                    tl = t.capacity
                t.level, t.at = tl, now
            need = float(tokens) if tokens < t.capacity else t.capacity
            if tl < need or tl < 0.0:
                reason, wait = "tpm", max(wait, t.wait(max(need, 0.0)))
        if reason:
            self.retry_after = wait
            return reason
        if r is not None:
            r.level = rl - 1.0
        if t is not None:
            t.level = tl - tokens
        self.inflight += 1
        return ""

    def settle(self, tokens: int, now: float) -> None:
        """An admitted request ended; `tokens` corrects what `take` took (the answer's
        usage minus the estimate: negative is a refund)."""
        if self.inflight > 0:
            self.inflight -= 1
        t = self.tokens
        if t is not None and tokens:
            t.refill(now)
            level = t.level - tokens
            t.level = level if level < t.capacity else t.capacity


class Account(Protocol):
    """One key's counters as the door uses them (`KeyState` in this process)."""

    requests: Bucket | None
    tokens: Bucket | None
    retry_after: float

    def take(self, tokens: int, now: float) -> str: ...

    def settle(self, tokens: int, now: float) -> None: ...


class LimitStore(Protocol):
    """Where the keys' counters live: this process (`LocalLimits`) or a store the gateway
    replicas share (#17). Keys are the key *names*. The door binds each key's `Account`
    once (when its ring is made), so a request costs no lookup here."""

    def account(self, key: str) -> Account:
        """The counters of `key`, one of the keys in force."""
        ...

    def retune(self, quotas: Mapping[str, Quota], now: float) -> None:
        """A reload: the keys now in force and their quotas. A key whose quota is unchanged
        keeps its counters (a reload must not hand everyone a fresh minute); a changed one
        starts full under its new quota; a removed one is forgotten. A request admitted
        before settles on the account it was admitted on: a replaced one, which nobody
        reads any more."""
        ...


class LocalLimits:
    """The buckets of every key, in this process."""

    def __init__(self, quotas: Mapping[str, Quota], now: float) -> None:
        self.states: dict[str, KeyState] = {k: KeyState(q, now) for k, q in quotas.items()}

    def account(self, key: str) -> KeyState:
        return self.states[key]

    def retune(self, quotas: Mapping[str, Quota], now: float) -> None:
        old = self.states
        states: dict[str, KeyState] = {}
        for k, q in quotas.items():
            s = old.get(k)
            if s is None or s.quota != q:
                s = KeyState(q, now)
            states[k] = s
        self.states = states


__all__ = ["Account", "Bucket", "KeyState", "LimitStore", "LocalLimits", "Quota"]
