"""Requests in flight per backend, shared by every process of a multi-worker gateway.

One shared-memory table of 64-bit counters: a row per worker slot, a column per backend.
Each worker writes only its own row (so there are no lost updates without any lock) and a
reader sums the column: `max_inflight` is a limit on the whole gateway, and
`/admin/backends` shows the total. The table lives in an anonymous memfd that the primary
creates and hands to each worker as an inherited file descriptor: nothing on the file system.

The limit is held exactly by reserving before acquiring: a worker that picked a backend
with a limit first adds one to its own row, then reads the column; over the limit, it takes
the reservation back and picks again. Two workers racing for the last slot both write
before they read, so at least one of them sees the other (the write and the read are
hundreds of interpreter instructions apart; x86 store buffers drain in nanoseconds).
Reservations not turned into an acquire in the same run of the event loop (the retry
budget said no) are dropped on the loop's next turn.

Columns and reloads. The memfd is sized once, for `capacity` columns (the backends at start
plus spare ones), and never remapped. Only the primary hands out columns (`assign`); a
worker takes the primary's map as told (`adopt`, or the map given to its constructor). A
backend keeps its column while it stays configured; a new one gets a column never used
before; a removed backend's column is retired for the table's life, so a request to it that
ends after the reload releases into a cell no other backend will ever read. `Totals` and
`RowCounts` made from a table follow every `assign` and `adopt` (the table calls their
`refresh`).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import weakref
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Protocol, TypeVar, overload

_CELL = 8  # bytes per counter (int64)
# Spare columns when `create` is not told: every backend a reload adds takes a column for
# good (retired ones are not reused), so this is how many additions a gateway absorbs
# before it must restart. 64 covers a fleet of a few backends reconfigured every day for
# two months; 4 x the fleet lets a large one be replaced whole four times. The cost is
# 8 bytes x rows per column (64 x 64 workers = 32 KiB), and nothing on the request path:
# readers use precomputed cell indexes, whatever the width.
_MIN_SPARE = 64
_SPARE_PER_BACKEND = 4

_T = TypeVar("_T")


class TableFull(ValueError):
    """`assign` was given more new backends than the table has never-used columns."""


class _View(Protocol):
    def refresh(self) -> None: ...


class InflightTable:
    """`rows` x `capacity` int64 counters in shared memory, `len(names)` of the columns in use.

    `names` are the backends with a column, in the order of the map `cols` (name -> column).
    Built by a worker from the inherited fd, `names` is either the names in column order (as
    `create` laid them out) or a name -> column map from the primary's `assign`; `capacity`
    must be the primary's `table.capacity` (None: read from the memfd's size).
    """

    def __init__(
        self,
        fd: int,
        rows: int,
        names: Sequence[str] | Mapping[str, int],
        capacity: int | None = None,
    ) -> None:
        size = os.fstat(fd).st_size
        if capacity is None:
            capacity = size // (rows * _CELL)
        elif max(1, rows * capacity) * _CELL != size:
            raise ValueError(
                f"in-flight memfd holds {size} bytes; {rows} rows x {capacity} columns need "
                f"{max(1, rows * capacity) * _CELL}"
            )
        self.fd = fd
        self.rows = rows
        self.capacity = capacity
        self._mm = mmap.mmap(fd, max(1, rows * capacity) * _CELL)
        self.cells = memoryview(self._mm).cast("q")
        self.names: tuple[str, ...] = ()
        self.cols: Mapping[str, int] = {}
        self._idx: tuple[int, ...] = ()  # the columns of `names`, in order
        self._next = 0  # the first column never used
        self._retired: dict[str, int] = {}  # removed backend -> the column it had
        self._views: list[weakref.ref[_View]] = []
        if isinstance(names, Mapping):
            self.adopt(names)
        else:
            self.adopt({n: i for i, n in enumerate(names)})

    @classmethod
    def create(cls, rows: int, names: Sequence[str], spare: int | None = None) -> InflightTable:
        """A zeroed table in a new memfd (closed on exec unless passed on explicitly), with
        `spare` columns beyond `names` for backends added later (default: see `_MIN_SPARE`)."""
        if spare is None:
            spare = max(_MIN_SPARE, _SPARE_PER_BACKEND * len(names))
        if spare < 0:
            raise ValueError(f"spare columns must be >= 0, not {spare}")
        capacity = len(names) + spare
        fd = os.memfd_create("pulsegate-inflight", os.MFD_CLOEXEC)
        os.ftruncate(fd, max(1, rows * capacity) * _CELL)
        return cls(fd, rows, names, capacity)

    # -- columns --------------------------------------------------------------------------------

    def assign(self, names: Sequence[str]) -> dict[str, int]:
        """The primary's reload: a column for every name in `names` (the one it has, or one
        never used), returned as the full name -> column map to send to the workers. Raises
        `TableFull`, changing nothing, when the never-used columns are too few."""
        _check_unique(names)
        fresh = [n for n in names if n not in self.cols]
        left = self.capacity - self._next
        if len(fresh) > left:
            raise TableFull(
                f"in-flight table full: {len(fresh)} new backends need a column, {left} of "
                f"{self.capacity} are left (removed backends' columns are never reused); "
                "restart the gateway to lay the table out afresh"
            )
        given = dict(zip(fresh, range(self._next, self._next + len(fresh)), strict=True))
        cols = {n: self.cols[n] if n in self.cols else given[n] for n in names}
        self._set(cols)
        return dict(cols)

    def adopt(self, cols: Mapping[str, int]) -> None:
        """A worker's reload: take the name -> column map the primary's `assign` made."""
        _check_unique(list(cols.values()))
        for name, c in cols.items():
            if not 0 <= c < self.capacity:
                raise ValueError(f"column {c} of {name!r} is outside 0..{self.capacity - 1}")
        self._set(dict(cols))

    def _set(self, cols: dict[str, int]) -> None:
        for name, c in self.cols.items():
            if name not in cols:
                self._retired[name] = c
        for name in cols:
            self._retired.pop(name, None)
        self.cols = cols
        self.names = tuple(cols)
        self._idx = tuple(cols.values())
        self._next = max(self._next, *(c + 1 for c in self._idx), 0)
        live = []
        for ref in self._views:
            view = ref()
            if view is not None:
                view.refresh()
                live.append(ref)
        self._views = live

    def _follow(self, view: _View) -> None:
        """Call `view.refresh()` after every `assign` and `adopt`, while `view` lives."""
        self._views.append(weakref.ref(view))

    # -- counts ---------------------------------------------------------------------------------

    def total(self, name: str) -> int:
        """Requests in flight to backend `name` across every worker: a removed backend's
        still read from its retired column; 0 for a name never given a column."""
        col = self.cols.get(name)
        if col is None:
            col = self._retired.get(name)
            if col is None:
                return 0
        cells, width = self.cells, self.capacity
        return sum(cells[r * width + col] for r in range(self.rows))

    def row(self, row: int) -> list[int]:
        """Row `row`'s counts, one per backend of `names` (the admin's per-worker view)."""
        cells, base = self.cells, row * self.capacity
        return [cells[base + c] for c in self._idx]

    def others(self, row: int) -> list[int]:
        """Per backend of `names`: in flight from every row but `row` (a worker watching
        remote releases)."""
        cells, width, idx = self.cells, self.capacity, self._idx
        out = [0] * len(idx)
        for r in range(self.rows):
            if r != row:
                base = r * width
                for i, c in enumerate(idx):
                    out[i] += cells[base + c]
        return out

    def clear_row(self, row: int) -> None:
        """Forget a dead worker's requests (its connections died with it), retired columns
        included."""
        base = row * self.capacity
        for c in range(self.capacity):
            self.cells[base + c] = 0

    def close(self) -> None:
        self.cells.release()
        self._mm.close()
        os.close(self.fd)


def _check_unique(items: Sequence[object]) -> None:
    if len(set(items)) != len(items):
        dup = sorted({repr(x) for x in items if items.count(x) > 1})
        raise ValueError(f"in-flight table columns must be distinct, repeated: {', '.join(dup)}")


class Totals(MutableMapping[str, int]):
    """The gateway-wide in-flight count per backend, read from the table (the balancer's
    `inflight.get`, the admin view and the in-flight gauge). Read-only. Holds the table's
    current backends; a removed one reads as absent (`table.total` still sums it)."""

    __slots__ = ("__weakref__", "_cells", "_names", "_pair", "_table", "_where")

    def __init__(self, table: InflightTable) -> None:
        self._table = table
        self._cells = table.cells
        self._pair = table.rows == 2
        self.refresh()
        table._follow(self)

    def refresh(self) -> None:
        """Take up the table's columns after an `assign` or `adopt` (the table calls this)."""
        table = self._table
        width = table.capacity
        # Per backend, the cells to add up: the balancer reads two backends per pick.
        self._where = {
            n: tuple(r * width + c for r in range(table.rows)) for n, c in table.cols.items()
        }
        self._names = table.names

    def get(self, name: str, default: int | None = 0) -> int | None:  # type: ignore[override]
        where = self._where.get(name)
        if where is None:
            return default
        cells = self._cells
        if self._pair:
            return cells[where[0]] + cells[where[1]]
        return sum([cells[i] for i in where])

    def __getitem__(self, name: str) -> int:
        n = self.get(name, None)
        if n is None:
            raise KeyError(name)
        return n

    def __setitem__(self, name: str, value: int) -> None:
        raise TypeError("gateway-wide in-flight counts are written by each worker's own row")

    def __delitem__(self, name: str) -> None:
        raise TypeError("gateway-wide in-flight counts are fixed per backend")

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class RowCounts(dict[str, int]):
    """A worker's own in-flight counts: a plain dict (what `Gateway.acquire` and `release`
    update) whose every write is mirrored into the worker's row of the table, plus the
    reservations described in the module docstring.

    After a reload (the table's `assign` or `adopt`, which calls `refresh`):
    - a backend still configured keeps its count and its cell;
    - a new backend is a key at 0 in its new column;
    - a removed backend stays a key, read and written as before in its retired column (its
      requests still end and are released), until it is popped or deleted, as the proxy
      does at its last release: that zeroes its cell and forgets it. `reserve` on it works
      but nothing should call it (the router no longer names it);
    - a removed backend configured again before it was popped keeps its count, moved to the
      new column (this row only: each worker moves its own).
    """

    __slots__ = ("__weakref__", "_cell", "_cells", "_clear_scheduled", "_reserved", "_row",
                 "_table")  # fmt: skip

    def __init__(self, table: InflightTable, row: int) -> None:
        super().__init__(dict.fromkeys(table.names, 0))
        self._table = table
        self._row = row
        self._cells = table.cells
        base = row * table.capacity
        self._cell = {n: base + c for n, c in table.cols.items()}  # this row's cell per backend
        self._reserved: dict[str, int] = {}
        self._clear_scheduled = False
        table.clear_row(row)
        table._follow(self)

    def refresh(self) -> None:
        """Take up the table's columns after an `assign` or `adopt` (the table calls this)."""
        table, cells = self._table, self._cells
        base = self._row * table.capacity
        for name, c in table.cols.items():
            cell, old = base + c, self._cell.get(name)
            if old == cell:
                if name not in self:
                    dict.__setitem__(self, name, 0)
                continue
            n = dict.get(self, name, 0)
            dict.__setitem__(self, name, n)
            cells[cell] = n + self._reserved.get(name, 0)
            self._cell[name] = cell
            if old is not None:
                cells[old] = 0
        for name in [n for n in self._cell if n not in table.cols and n not in self]:
            del self._cell[name]  # popped before its backend was removed

    def __setitem__(self, name: str, n: int) -> None:
        reserved = self._reserved
        if reserved:
            if n > dict.__getitem__(self, name) and reserved.get(name):
                reserved[name] -= 1  # this acquire takes up the reservation made by `reserve`
            dict.__setitem__(self, name, n)
            self._cells[self._cell[name]] = n + reserved.get(name, 0)
        else:
            dict.__setitem__(self, name, n)
            self._cells[self._cell[name]] = n

    def __delitem__(self, name: str) -> None:
        dict.__delitem__(self, name)
        self._forget(name)

    @overload
    def pop(self, name: str, /) -> int: ...
    @overload
    def pop(self, name: str, default: int, /) -> int: ...
    @overload
    def pop(self, name: str, default: _T, /) -> int | _T: ...
    def pop(self, name: str, *default: object) -> object:
        """Like `dict.pop`; a name popped has no count left in the table either."""
        if name not in self:
            return dict.pop(self, name, *default)
        n = dict.pop(self, name)
        self._forget(name)
        return n

    def _forget(self, name: str) -> None:
        self._reserved.pop(name, None)
        cell = self._cell.get(name)
        if cell is not None:
            self._cells[cell] = 0
            if name not in self._table.cols:
                del self._cell[name]

    def reserve(self, name: str, cap: int) -> bool:
        """Claim one of backend `name`'s `cap` gateway-wide slots for the acquire that
        follows in this run of the loop; False (nothing claimed) when another worker got
        there first."""
        cell = self._cell[name]
        r = self._reserved
        r[name] = r.get(name, 0) + 1
        self._cells[cell] = dict.__getitem__(self, name) + r[name]
        if not self._clear_scheduled:
            self._clear_scheduled = True
            asyncio.get_running_loop().call_soon(self._drop_reservations)
        if self._table.total(name) <= cap:
            return True
        r[name] -= 1
        self._cells[cell] = dict.__getitem__(self, name) + r[name]
        return False

    def _drop_reservations(self) -> None:
        self._clear_scheduled = False
        for name, n in self._reserved.items():
            if n:
                self._cells[self._cell[name]] = dict.__getitem__(self, name)
        self._reserved.clear()
