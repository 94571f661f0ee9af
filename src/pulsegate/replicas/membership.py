"""Membership with leases: who is in the set of replicas right now.

Each replica renews its lease every `RENEW_S` (0.5 s) for `LEASE_S` (3 s): one Lua script,
one round trip, atomic. The lease is a member of a sorted set scored by its expiry on the
Redis server's own clock (`TIME`), so replicas on hosts whose clocks disagree still agree on
who is live; the script first drops the expired, then renews, then returns the live set.
A replica that stops renewing (killed, partitioned, stopped) is gone for every other replica
within 3 s; one that shuts down cleanly leaves at once (`ttl_ms` 0).

    renew: now = TIME; drop score <= now; ZADD me now+3000; HSETNX joined me now
    reply: [now, id1, expiry1, joined1, id2, ...]

`Members` is the pure side: the last reply, read into ids, lease ages and replica ages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

LEASE_S = 3.0
RENEW_S = 0.5

KEY_PREFIX = "pulsegate:cluster:"
LEASES_KEY = KEY_PREFIX + "leases"  # sorted set: replica id -> lease expiry (ms, server clock)
JOINED_KEY = KEY_PREFIX + "joined"  # hash: replica id -> first lease (ms, server clock)
CHANNEL = KEY_PREFIX + "evidence"  # pub/sub: codec messages

RENEW_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #gone > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  redis.call('HDEL', KEYS[2], unpack(gone))
end
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
  redis.call('HSETNX', KEYS[2], ARGV[1], now)
else
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
end
local out = {now}
local live = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
for i = 1, #live, 2 do
  out[#out + 1] = live[i]
  out[#out + 1] = live[i + 1]
  out[#out + 1] = redis.call('HGET', KEYS[2], live[i]) or tostring(now)
end
return out
"""


@dataclass(frozen=True, slots=True)
class Member:
    replica: str
    lease_age_s: float  # since its last renewal
    age_s: float  # since it joined


@dataclass(frozen=True, slots=True)
class Members:
    """The live set as of one renewal (`read`), ids sorted."""

    members: tuple[Member, ...] = ()

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(m.replica for m in self.members)

    @staticmethod
    def read(reply: Sequence[object], lease_s: float = LEASE_S) -> Members:
        """Parse the script's reply; raises ValueError on a reply of another shape."""
        if not reply or (len(reply) - 1) % 3:
            raise ValueError("lease reply of unexpected length")
        now = float(_text(reply[0]))
        out = []
        for i in range(1, len(reply), 3):
            rid, expiry, joined = _text(reply[i]), float(_text(reply[i + 1])), reply[i + 2]
            renewed = expiry - lease_s * 1000
            out.append(
                Member(
                    rid,
                    max(0.0, (now - renewed) / 1000),
                    max(0.0, (now - float(_text(joined))) / 1000),
                )
            )
        return Members(tuple(sorted(out, key=lambda m: m.replica)))


def _text(v: object) -> str:
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, str | int | float):
        return str(v)
    raise ValueError(f"lease reply holds {type(v).__name__}")
