"""Fleet-wide limits, pure: participants trade reports by hand, time is passed in."""

from __future__ import annotations

import orjson
import pytest

from pulsegate.front.fleet import ALONE_AFTER_S, PEER_TTL_S, SYNC_S, FleetLimits
from pulsegate.front.limits import Quota


def fleet(n: int, quota: Quota, min_peers: int = 1) -> list[FleetLimits]:
    return [FleetLimits({"k": quota}, 0.0, f"p{i}", min_peers) for i in range(n)]


def sync(parts: list[FleetLimits], now: float) -> None:
    """Every participant reports; every report reaches every participant (the channel)."""
    reports = [p.outbox(now) for p in parts]
    for p in parts:
        p.delivered(now)
    for r in reports:
        if r is not None:
            for p in parts:
                p.fold(r, now)


def test_steady_load_spread_over_three_is_held_to_the_fleet_limit() -> None:
    """rpm 60 over 3 participants, 4 requests a second offered round robin for 60 s with a
    report every 50 ms: the fleet admits the minute's 60 plus 60 s of refill (60), as one
    bucket would; each alone would have admitted all 240."""
    parts = fleet(3, Quota(rpm=60))
    admitted = 0
    t = 0.0
    for i in range(240):
        t = i * 0.25
        admitted += parts[i % 3].account("k").take(0, t) == ""
        # the reports of the 0.25 s until the next request (5 sync intervals)
        for j in range(1, 6):
            sync(parts, t + j * SYNC_S)
    assert 119 <= admitted <= 121


def test_one_connection_on_one_replica_gets_the_whole_limit() -> None:
    """All of a client's requests on one participant: the whole rpm, not a third."""
    parts = fleet(3, Quota(rpm=30))
    got = sum(parts[0].account("k").take(0, 0.0) == "" for _ in range(100))
    assert got == 30
    sync(parts, SYNC_S)
    assert parts[1].account("k").take(0, SYNC_S) == "rpm"  # the others know it is spent


def test_tokens_reported_with_their_corrections() -> None:
    """tpm: the estimate taken on one participant, its correction at settle: both reach
    the others' buckets."""
    a, b = fleet(2, Quota(tpm=1000))
    acc = a.account("k")
    assert acc.take(400, 0.0) == ""
    acc.settle(-300, 0.0)  # used 100
    sync([a, b], SYNC_S)
    t = b.account("k").tokens
    assert t is not None and t.level == pytest.approx(900.0, abs=1.0)


def test_concurrency_counts_the_others_in_flight() -> None:
    """concurrency 2: two in flight on p0 refuse a third on p1 once reported; settled and
    reported, p1 admits again."""
    a, b = fleet(2, Quota(concurrency=2))
    assert a.account("k").take(0, 0.0) == a.account("k").take(0, 0.0) == ""
    sync([a, b], SYNC_S)
    assert b.account("k").take(0, SYNC_S) == "concurrency"
    a.account("k").settle(0, SYNC_S)
    sync([a, b], 2 * SYNC_S)
    assert b.account("k").take(0, 2 * SYNC_S) == ""


def test_a_silent_participant_is_forgotten_with_its_requests_in_flight() -> None:
    a, b = fleet(2, Quota(concurrency=1))
    assert a.account("k").take(0, 0.0) == ""
    sync([a, b], SYNC_S)
    assert b.account("k").take(0, SYNC_S) == "concurrency"
    later = SYNC_S + PEER_TTL_S + 0.1
    b.delivered(later)  # b's own reports still get out: it is not alone
    b.tick(later)
    assert b.peers == {} and b.account("k").take(0, later) == ""


def test_alone_each_keeps_its_share_and_rejoining_moves_nothing() -> None:
    """Reports stop getting out: after ALONE_AFTER_S each of 3 refills at a third of the rate
    and allows ceil(concurrency / 3); back together, the full rate, the buckets untouched."""
    parts = fleet(3, Quota(rpm=60, concurrency=4))
    sync(parts, 0.0)  # everyone has heard everyone
    p = parts[0]
    acc = p.account("k")
    r = acc.requests
    assert r is not None
    r.level, r.at = 0.0, ALONE_AFTER_S
    others = parts[1].account("k").requests
    assert others is not None and others.level == 60.0
    parts[1].tick(ALONE_AFTER_S + 0.01)
    assert others.level == pytest.approx(20.0)  # a third of what the fleet had left
    p.tick(ALONE_AFTER_S + 0.01)
    assert p.view()["alone"] and p.alone_n == 3
    assert r.rate == pytest.approx(1.0 / 3) and acc.conc == 2
    level = r.refill(ALONE_AFTER_S + 3.01)
    assert level == pytest.approx(0.01 / 3 + 1.0)  # 0.01 s at 1/s (its third kept), 3 s at 1/3
    # Alone, its reports are bare heartbeats: what it took is never charged to others.
    assert acc.take(0, ALONE_AFTER_S + 3.02) == ""
    beat = p.outbox(ALONE_AFTER_S + 3.05)
    assert beat is not None and orjson.loads(beat)["keys"] == {}
    p.delivered(ALONE_AFTER_S + 3.05)
    assert not p.view()["alone"] and r.rate == pytest.approx(1.0) and acc.conc == 4
    assert r.level == pytest.approx(0.0, abs=0.05)  # no reset on rejoining


def test_alone_just_after_start_divides_by_redis_count() -> None:
    """A participant that has heard nobody yet, Redis having counted 3 subscribers: a third."""
    (p,) = fleet(1, Quota(rpm=60))
    p.subscribers = 3
    p.tick(ALONE_AFTER_S + 0.01)
    assert p.alone_n == 3


def test_alone_from_the_start_divides_by_the_workers() -> None:
    """Never heard anyone (Redis down at start) with 4 workers: a quarter each."""
    (p,) = fleet(1, Quota(rpm=60), min_peers=4)
    p.tick(ALONE_AFTER_S + 0.01)
    r = p.account("k").requests
    assert p.alone_n == 4 and r is not None and r.rate == pytest.approx(0.25)


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[]",
        b'{"from": 3, "keys": {}}',
        b'{"from": "x", "keys": []}',
        b'{"from": "x", "keys": {"k": [1, 2]}}',
        b'{"from": "x", "keys": {"k": [-5, 0, 0]}}',
        b'{"from": "x", "keys": {"k": ["1", 0, 0]}}',
        b'{"from": "x", "keys": {"k": [1.5, 0, 0]}}',
        b'{"from": "x", "keys": {"nobody": [9, 9, 9]}}',
    ],
)
def test_a_malformed_or_foreign_report_changes_nothing(data: bytes) -> None:
    (p,) = fleet(1, Quota(rpm=60, concurrency=1))
    p.fold(data, 0.0)
    acc = p.account("k")
    assert acc.requests is not None and acc.requests.level == 60.0 and acc.others == {}


def test_own_reports_are_not_charged_twice() -> None:
    (p,) = fleet(1, Quota(rpm=60))
    assert p.account("k").take(0, 0.0) == ""
    out = p.outbox(SYNC_S)
    assert out is not None
    p.fold(out, SYNC_S)
    r = p.account("k").requests
    assert r is not None and r.level == pytest.approx(59.0, abs=0.1)


def test_a_reload_keeps_unchanged_keys_and_their_peers() -> None:
    a, b = fleet(2, Quota(concurrency=1))
    assert a.account("k").take(0, 0.0) == ""
    sync([a, b], SYNC_S)
    same = b.account("k")
    b.retune({"k": Quota(concurrency=1), "new": Quota(rpm=5)}, SYNC_S)
    assert b.account("k") is same and b.account("k").take(0, SYNC_S) == "concurrency"
    b.retune({"k": Quota(concurrency=3)}, SYNC_S)
    assert b.account("k") is not same and "new" not in b.accounts
