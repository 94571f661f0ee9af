"""Gateway-wide in-flight counts in shared memory: one row per worker, totals per backend."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from pulsegate.cluster.shared import InflightTable, RowCounts, TableFull, Totals


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


@pytest.fixture
def workers(table: InflightTable) -> Iterator[list[InflightTable]]:
    """Two workers' tables, mapped from the primary's fd as each worker does."""
    ts = [InflightTable(table.fd, table.rows, table.names, table.capacity) for _ in range(2)]
    yield ts
    for t in ts:
        t.cells.release()


def test_create_leaves_spare_columns_and_a_worker_must_agree_on_them(table: InflightTable) -> None:
    """The default table has room for 64 more backends; a worker told another capacity than
    the memfd's refuses to map it."""
    assert table.capacity == 2 + 64 and table.cols == {"a": 0, "b": 1}
    assert InflightTable.create(1, ["x"] * 20, spare=0).capacity == 20
    with pytest.raises(ValueError, match="columns need"):
        InflightTable(table.fd, table.rows, table.names, table.capacity + 1)


def test_assign_keeps_existing_columns_and_gives_new_names_fresh_ones(
    table: InflightTable,
) -> None:
    """A reload keeps every remaining backend's column and gives new ones unused columns,
    in the order of the names given."""
    assert table.assign(["c", "b", "a"]) == {"c": 2, "b": 1, "a": 0}
    assert table.names == ("c", "b", "a")
    assert table.assign(["a", "d", "b", "c"]) == {"a": 0, "d": 3, "b": 1, "c": 2}


def test_a_removed_names_column_is_never_reused(table: InflightTable) -> None:
    """Columns of removed backends stay retired: new names, and a removed name configured
    again, get columns never used before."""
    table.assign(["b"])
    assert table.assign(["b", "c"]) == {"b": 1, "c": 2}
    table.assign(["c"])
    assert table.assign(["c", "a", "b", "d"]) == {"c": 2, "a": 3, "b": 4, "d": 5}


def test_a_late_release_of_a_removed_backend_stays_in_its_own_cell(table: InflightTable) -> None:
    """A removed backend's count stays readable and writable in its retired column (the
    proxy releases it later), lands in no other backend's cell, and is gone once popped."""
    w0, w1 = RowCounts(table, 0), RowCounts(table, 1)
    totals = Totals(table)
    w0["a"] += 2
    w1["a"] += 1
    table.assign(["b", "c"])
    assert dict(totals) == {"b": 0, "c": 0} and "a" not in totals
    assert w0["a"] == 2 and table.total("a") == 3
    w0["a"] -= 1
    w1["a"] -= 1
    assert table.total("a") == 1 and dict(totals) == {"b": 0, "c": 0}
    w1.pop("a")
    assert w0.pop("a") == 1 and "a" not in w0 and table.total("a") == 0
    assert table.total("zzz") == 0


def test_a_backend_configured_again_before_its_last_release_keeps_its_count(
    table: InflightTable,
) -> None:
    """Removed then added back while still in flight: its count moves to the new column."""
    w0 = RowCounts(table, 0)
    w0["a"] += 2
    table.assign(["b"])
    assert table.assign(["b", "a"]) == {"b": 1, "a": 2}
    assert w0["a"] == 2 and Totals(table)["a"] == 2
    assert table.cells[0] == 0  # the retired column 0 holds nothing for this row


def test_table_full_when_out_of_columns() -> None:
    """More new names than never-used columns: TableFull, and the table is unchanged."""
    t = InflightTable.create(2, ["a", "b"], spare=2)
    try:
        t.assign(["a", "b", "c"])
        t.assign(["a", "b", "c", "d"])
        with pytest.raises(TableFull, match="1 new backends need a column, 0 of 4"):
            t.assign(["e"])  # "a" to "d" removed: their columns do not come back
        assert isinstance(TableFull("x"), ValueError)
        assert t.names == ("a", "b", "c", "d")
        with pytest.raises(ValueError, match="distinct"):
            t.assign(["a", "a"])
    finally:
        t.close()


def test_after_adopt_a_worker_counts_new_backends_in_the_right_cells(
    table: InflightTable, workers: list[InflightTable]
) -> None:
    """Workers that adopt the primary's map write new backends into the agreed cells, and
    the primary's and a worker's totals sum them across rows."""
    w0, w1 = RowCounts(workers[0], 0), RowCounts(workers[1], 1)
    primary_totals, worker_totals = Totals(table), Totals(workers[0])
    w0["b"] += 1
    cols = table.assign(["b", "c", "d"])
    for t in workers:
        t.adopt(cols)
    assert w0 == {"a": 0, "b": 1, "c": 0, "d": 0}  # "a" is kept until the proxy pops it
    w1.pop("a")  # what the proxy does with a removed backend that has nothing in flight
    assert w1 == {"b": 0, "c": 0, "d": 0}
    w0["d"] += 1
    w1["d"] += 2
    w1["c"] += 1
    cap = table.capacity
    assert table.cells[0 * cap + cols["d"]] == 1 and table.cells[1 * cap + cols["d"]] == 2
    assert table.cells[1 * cap + cols["c"]] == 1
    assert dict(primary_totals) == dict(worker_totals) == {"b": 1, "c": 1, "d": 3}
    assert table.row(1) == [0, 1, 2] and table.others(1) == [1, 0, 1]
    table.clear_row(1)
    assert dict(primary_totals) == {"b": 1, "c": 0, "d": 1}


def test_a_worker_started_after_a_reload_takes_the_map_given_to_it(
    table: InflightTable,
) -> None:
    """A worker built from the primary's current map (not names in order) uses its columns."""
    table.assign(["b"])
    cols = table.assign(["b", "c"])
    late = InflightTable(table.fd, table.rows, cols, table.capacity)
    RowCounts(late, 1)["c"] = 4
    assert late.cols == {"b": 1, "c": 2} and table.total("c") == 4
    late.cells.release()


def test_reservations_hold_the_limit_across_two_rows_after_a_reassignment(
    table: InflightTable, workers: list[InflightTable]
) -> None:
    """After a reload the last slot of a new backend still goes to one worker only."""

    async def scenario() -> None:
        w0, w1 = RowCounts(workers[0], 0), RowCounts(workers[1], 1)
        cols = table.assign(["b", "c"])
        for t in workers:
            t.adopt(cols)
        w1["c"] += 1
        assert w0.reserve("c", 2)
        assert not w1.reserve("c", 2)
        w0["c"] += 1
        await asyncio.sleep(0)
        assert table.total("c") == 2 and (w0["c"], w1["c"]) == (1, 1)
        assert w0.reserve("b", 1) and not w1.reserve("b", 1)
        await asyncio.sleep(0)
        assert table.total("b") == 0

    asyncio.run(scenario())
