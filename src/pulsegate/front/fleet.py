"""Client limits held for the whole fleet (`cluster.redis`): every gateway process counts
what every other one admits. Pure: the messages come and go through `front/fleet_sync.py`.

Each process that runs a front door (a gateway, or each of its workers) is a *participant*.
Its buckets are the fleet's buckets as it knows them: full limits (not a share), refilled at
the full rate, charged with what it admits itself *and* with what every other participant
reports it admitted. Every `SYNC_S` a participant publishes, per key that moved, what it took
since the last report (requests, tokens: the estimate at admission and the corrections at
settle) and its requests in flight; the others subtract it from their own levels and count
its in-flight requests against `concurrency`. Why this and not one Redis call per request:

- A request pays nothing for it: admission stays a local bucket (the door's ~4 us), where a
  Redis round trip from Python costs ~100-200 us of CPU and a loopback RTT of latency on
  every request, and makes Redis part of every request's fate.
- Steady load is held exactly, whatever the spread over replicas: each participant's levels
  lag the fleet's by at most one sync interval plus the channel's delay (~1 ms), so what
  the fleet admits beyond the limit is at most that lag's worth of the limit (50 ms of a
  minute's rate: 0.08%) plus, for a burst, see below.
- Against leased shares (each replica enforces limit / N): a client whose connections land
  on one replica (one keep-alive connection does) gets the whole limit here, not 1/N.

What it cannot hold: a burst that lands on several participants within the same interval
is admitted by each against the level it knows, so up to N x what is left in the bucket can
go through before the reports cross (a full bucket, rpm 600, 3 replicas, 1,800 requests in
the same 50 ms: up to 1,800). After that the bucket is in debt and admits nothing until the
refill has paid it back, so over a minute the fleet still admits at most about limit + the
burst's excess.

Alone (Redis unreachable, or no report delivered for `ALONE_AFTER_S`): nobody's reports
arrive, so each participant keeps 1 / N of what is left in each bucket, refills at 1 / N of
the rate and allows ceil(concurrency / N) in flight, N being the participants it last knew
of (those it heard from, or Redis's count of the channel's subscribers if larger, and at
least `gateway.workers`): the fleet as a whole keeps the limit while each works alone.
Back together, the full rate returns; nothing is replayed and no level is raised (a
participant cannot know what the others spent alone), so for up to a minute a key's burst
is smaller than its limit while the refill brings the bucket back: on the safe side, and
no key's limit jumps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from pulsegate.front.limits import Bucket, KeyState, LocalLimits, Quota

SYNC_S = 0.05
# A participant not heard from for this long has stopped: its in-flight requests no longer
# count, and it is no longer one of the N that share the fleet's limits when alone.
PEER_TTL_S = 3.0
# With nothing to report, a participant still says it is there this often (well inside
# its peers' PEER_TTL_S).
HEARTBEAT_S = 1.0
# Reports that did not get out for this long: this participant works alone.
ALONE_AFTER_S = 1.0


class FleetAccount:
    """One key's `Account` in a fleet: the local buckets (`KeyState`, full quota), what it
    took since its last report, and the other participants' requests in flight."""

    __slots__ = ("conc", "local", "others", "requests", "retry_after", "sent_inflight", "tokens",
                 "took_r", "took_t")  # fmt: skip

    def __init__(self, local: KeyState) -> None:
        self.local = local
        self.requests: Bucket | None = local.requests
        self.tokens: Bucket | None = local.tokens
        self.retry_after = 0.0
        self.conc = local.quota.concurrency  # the limit in force: ceil(limit / N) alone
        self.others: dict[str, int] = {}  # participant -> its requests in flight
        self.took_r = 0
        self.took_t = 0
        self.sent_inflight = 0

    def take(self, tokens: int, now: float) -> str:
        conc = self.conc
        s = self.local
        if conc and s.inflight + sum(self.others.values()) >= conc:
            self.retry_after = 1.0
            return "concurrency"
        reason = s.take(tokens, now)
        if reason:
            self.retry_after = s.retry_after
            return reason
        self.took_r += 1
        self.took_t += tokens
        return ""

    def settle(self, tokens: int, now: float) -> None:
        self.local.settle(tokens, now)
        if self.tokens is not None:
            self.took_t += tokens

    def charge(self, requests: float, tokens: float, now: float) -> None:
        """What another participant reported it took."""
        r, t = self.requests, self.tokens
        if r is not None and requests:
            r.refill(now)
            r.level -= requests
        if t is not None and tokens:
            t.refill(now)
            level = t.level - tokens
            t.level = level if level < t.capacity else t.capacity


class FleetLimits:
    """A `LimitStore` whose keys' buckets count the whole fleet's admissions."""

    def __init__(
        self, quotas: Mapping[str, Quota], now: float, me: str, min_peers: int = 1
    ) -> None:
        self.me = me
        self.min_peers = max(1, min_peers)  # `gateway.workers`: participants there must be
        self.local = LocalLimits(quotas, now)
        self.accounts: dict[str, FleetAccount] = {
            k: FleetAccount(s) for k, s in self.local.states.items()
        }
        self.peers: dict[str, float] = {}  # participant -> when last heard
        # Redis's own count of the channel's subscribers (every participant is one), as last
        # asked: a participant just started has not heard everyone yet.
        self.subscribers = 0
        self.alone_n = 0  # 0: together; else the N this participant divides by
        self.last_sent = -1e9
        self.last_delivered = now

    # -- LimitStore ---------------------------------------------------------------------------
    def account(self, key: str) -> FleetAccount:
        return self.accounts[key]

    def retune(self, quotas: Mapping[str, Quota], now: float) -> None:
        self.local.retune(quotas, now)
        old = self.accounts
        self.accounts = {}
        for k, s in self.local.states.items():
            a = old.get(k)
            if a is None or a.local is not s:
                a = FleetAccount(s)
                if self.alone_n:
                    _divide(a, self.alone_n, now)
            self.accounts[k] = a

    # -- the reports --------------------------------------------------------------------------
    def outbox(self, now: float) -> bytes | None:
        """The report to publish now, or None (nothing moved, no heartbeat due). Resets what
        was taken: what it reports is sent once, delivered or lost (a lost one is what
        going alone covers). Alone, every tick is a bare heartbeat that tries the channel,
        and what was taken meanwhile is never reported: the others, alone too or not, did
        not count on hearing it."""
        if self.alone_n:
            for a in self.accounts.values():
                a.took_r = a.took_t = 0
            self.last_sent = now
            return orjson.dumps({"from": self.me, "keys": {}})
        keys: dict[str, list[int]] = {}
        for name, a in self.accounts.items():
            inflight = a.local.inflight
            if a.took_r or a.took_t or inflight != a.sent_inflight:
                keys[name] = [a.took_r, a.took_t, inflight]
                a.took_r = a.took_t = 0
                a.sent_inflight = inflight
        if not keys and now - self.last_sent < HEARTBEAT_S:
            return None
        self.last_sent = now
        return orjson.dumps({"from": self.me, "keys": keys})

    def delivered(self, now: float) -> None:
        """A report got out (Redis took it): not alone."""
        self.last_delivered = now
        if self.alone_n:
            self.alone_n = 0
            for a in self.accounts.values():
                _restore(a, now)

    def fold(self, data: bytes, now: float) -> None:
        """Another participant's report: charge its admissions to the keys it names, note
        its requests in flight. Our own reports and anything malformed are ignored."""
        try:
            msg = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if not isinstance(msg, dict):
            return
        sender, keys = msg.get("from"), msg.get("keys")
        if not isinstance(sender, str) or sender == self.me or not isinstance(keys, dict):
            return
        self.peers[sender] = now
        if self.alone_n:  # a report in while ours do not get out: still alone
            return
        for name, v in keys.items():
            a = self.accounts.get(name)
            if a is None or not _is_report(v):
                continue
            a.charge(v[0], v[1], now)
            if v[2]:
                a.others[sender] = v[2]
            else:
                a.others.pop(sender, None)

    def tick(self, now: float) -> None:
        """Forget participants gone silent; go alone when our reports stopped getting out."""
        gone = [p for p, at in self.peers.items() if now - at > PEER_TTL_S]
        for p in gone:
            del self.peers[p]
            for a in self.accounts.values():
                a.others.pop(p, None)
        if not self.alone_n and now - self.last_delivered > ALONE_AFTER_S:
            self.alone_n = max(self.min_peers, len(self.peers) + 1, self.subscribers)
            for a in self.accounts.values():
                _divide(a, self.alone_n, now)

    def view(self) -> dict[str, Any]:
        return {"participant": self.me, "peers": sorted(self.peers), "alone": self.alone_n > 0,
                "alone_n": self.alone_n}  # fmt: skip


def _divide(a: FleetAccount, n: int, now: float) -> None:
    """Alone: this participant's part of the fleet's refill and in-flight limit (the refill
    up to `now` at the rate that was in force)."""
    for b in _buckets(a):
        b.refill(now)
        b.rate = b.capacity / 60.0 / n
        if b.level > 0:  # every participant knew the same fleet level: each takes its part
            b.level /= n
    q = a.local.quota.concurrency
    a.conc = -(-q // n) if q else 0
    a.others.clear()


def _restore(a: FleetAccount, now: float) -> None:
    for b in _buckets(a):
        b.refill(now)
        b.rate = b.capacity / 60.0
    a.conc = a.local.quota.concurrency


def _buckets(a: FleetAccount) -> Iterable[Bucket]:
    return [b for b in (a.requests, a.tokens) if b is not None]


def _is_report(v: object) -> bool:
    return (
        isinstance(v, list)
        and len(v) == 3
        and all(type(x) is int for x in v)
        and v[0] >= 0
        and v[2] >= 0
    )


__all__ = ["SYNC_S", "FleetAccount", "FleetLimits"]
