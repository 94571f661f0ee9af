"""Who does what among the live replicas: rendezvous (highest random weight) hashing.

Every replica computes the same answer from the same live set, with no coordination: the
owner of a backend is the replica whose hash of (replica id, backend name) is highest. When
a replica leaves, only the backends it owned move (each to its runner-up); when one joins,
it takes about 1/N of them. Pure: no I/O, no clock.

`share` splits a fleet-wide limit between the live replicas exactly: with limit 10 over
3 replicas the backend's top-ranked replica gets 4 and the others 3 (10 in all; ranking per
backend spreads the remainders over the replicas). A share is never below 1: 0 means "no
limit" in a verdict, so with fewer slots than replicas the fleet-wide total is N, not the
limit (said in docs/replicas.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def _weight(member: str, key: str) -> int:
    digest = hashlib.blake2b(f"{member}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def ranked(key: str, members: Iterable[str]) -> list[str]:
    """`members` best first for `key` (ties, which need equal 64-bit hashes, by name)."""
    return sorted(set(members), key=lambda m: (-_weight(m, key), m))


def owner(key: str, members: Iterable[str]) -> str | None:
    """The member that owns `key`; None for no members."""
    best: tuple[int, str] | None = None
    for m in set(members):
        w = (_weight(m, key), m)
        if best is None or w > best:  # highest weight; ties to the larger name, as ranked()
            best = w
    return None if best is None else best[1]


def share(limit: int, key: str, members: Iterable[str], me: str) -> int:
    """`me`'s part of `limit` for `key` among `members` (`me` counted even if absent: a
    replica that just lost its lease still enforces a part, never the whole)."""
    order = ranked(key, {*members, me})
    n = len(order)
    base, extra = divmod(limit, n)
    return max(1, base + (1 if order.index(me) < extra else 0))
