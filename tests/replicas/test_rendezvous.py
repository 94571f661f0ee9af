"""Rendezvous ownership and the split of a fleet-wide max_inflight (pure)."""

from __future__ import annotations

from pulsegate.replicas.rendezvous import owner, ranked, share

BACKENDS = [f"node-{i}" for i in range(60)]


def test_every_replica_computes_the_same_owner_whatever_the_order() -> None:
    """The owner depends on the set, not on the order it is listed in."""
    a, b = ["r1", "r2", "r3"], ["r3", "r1", "r2"]
    assert [owner(n, a) for n in BACKENDS] == [owner(n, b) for n in BACKENDS]
    assert all(owner(n, a) == ranked(n, a)[0] for n in BACKENDS)


def test_owners_spread_over_the_replicas() -> None:
    """60 backends over 3 replicas: each owns some (none idle, none with all)."""
    counts = {r: 0 for r in ("r1", "r2", "r3")}
    for n in BACKENDS:
        counts[owner(n, counts)] += 1  # type: ignore[index]
    assert all(8 <= c <= 32 for c in counts.values()), counts


def test_a_replica_leaving_moves_only_its_own_backends() -> None:
    """Backends owned by the survivors keep their owner; the leaver's go to its runner-up."""
    before = {n: owner(n, ["r1", "r2", "r3"]) for n in BACKENDS}
    after = {n: owner(n, ["r1", "r3"]) for n in BACKENDS}
    for n in BACKENDS:
        if before[n] != "r2":
            assert after[n] == before[n]
        else:
            assert after[n] == ranked(n, ["r1", "r2", "r3"])[1]


def test_no_members_no_owner() -> None:
    """An empty live set has no owner."""
    assert owner("node-1", []) is None


def test_shares_add_up_to_the_limit() -> None:
    """10 over 3 replicas: 4 + 3 + 3, whichever backend."""
    members = ["r1", "r2", "r3"]
    for n in BACKENDS:
        parts = [share(10, n, members, r) for r in members]
        assert sum(parts) == 10 and sorted(parts) == [3, 3, 4]


def test_the_extra_slot_moves_between_replicas_across_backends() -> None:
    """The remainder goes to a backend's top-ranked replica, so it is spread out."""
    members = ["r1", "r2", "r3"]
    top = {r for n in BACKENDS for r in members if share(10, n, members, r) == 4}
    assert top == set(members)


def test_a_share_is_never_zero() -> None:
    """0 would mean "no limit": with 2 slots over 3 replicas each still enforces 1."""
    assert [share(2, "n", ["a", "b", "c"], r) for r in "abc"].count(1) == 3


def test_a_replica_missing_from_the_set_still_counts_itself() -> None:
    """Just leased out, it takes a part of the limit, never the whole."""
    assert share(10, "n", ["a"], "b") == 5
