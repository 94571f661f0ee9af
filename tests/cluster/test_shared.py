"""Gateway-wide in-flight counts in shared memory: one row per worker, totals per backend."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from pulsegate.cluster.shared import InflightTable, RowCounts, Totals


@pytest.fixture
def table() -> Iterator[InflightTable]:
    t = InflightTable.create(2, ["a", "b"])
    yield t
    t.close()


def test_each_worker_writes_its_row_and_totals_sum_them(table: InflightTable) -> None:
    """`inflight[name] += 1` in two workers' dicts shows as the sum in the totals."""
    w0, w1 = RowCounts(table, 0), RowCounts(table, 1)
    w0["a"] += 1
    w0["a"] += 1
    w1["a"] += 1
    w1["b"] += 1
    totals = Totals(table)
    assert dict(totals) == {"a": 3, "b": 1}
    assert totals.get("a", 0) == 3 and totals.get("zzz", 0) == 0
    assert w0 == {"a": 2, "b": 0}  # a worker's own dict stays its own count
    w0["a"] -= 2
    assert totals["a"] == 1
    table.clear_row(1)
    assert dict(totals) == {"a": 0, "b": 0}


def test_a_second_table_on_the_same_fd_sees_the_same_counts(table: InflightTable) -> None:
    """What a worker maps from the inherited fd is the primary's memory, not a copy."""
    other = InflightTable(table.fd, table.rows, table.names)
    RowCounts(table, 0)["b"] = 5
    assert other.total("b") == 5
    other.cells.release()


def test_the_last_slot_goes_to_one_worker_only(table: InflightTable) -> None:
    """Two workers reserving the last of 2 slots: the first wins, the second is refused and
    leaves no trace; the winner's acquire takes its reservation up."""

    async def scenario() -> None:
        w0, w1 = RowCounts(table, 0), RowCounts(table, 1)
        w1["a"] += 1  # one slot of 2 already used elsewhere
        assert w0.reserve("a", 2)
        assert not w1.reserve("a", 2)
        assert table.total("a") == 2
        w0["a"] += 1  # the acquire that follows the pick
        assert table.total("a") == 2
        await asyncio.sleep(0)  # the loop's next turn: no reservation left behind
        assert table.total("a") == 2 and w0["a"] == 1

    asyncio.run(scenario())


def test_an_unused_reservation_is_dropped_on_the_next_loop_turn(table: InflightTable) -> None:
    """A pick that is not followed by an acquire (the retry budget said no) frees its slot."""

    async def scenario() -> None:
        w0 = RowCounts(table, 0)
        assert w0.reserve("b", 1)
        assert table.total("b") == 1
        await asyncio.sleep(0)
        assert table.total("b") == 0

    asyncio.run(scenario())
