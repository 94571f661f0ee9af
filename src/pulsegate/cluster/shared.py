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
"""

from __future__ import annotations

import asyncio
import mmap
import os
from collections.abc import Iterator, MutableMapping, Sequence

_CELL = 8  # bytes per counter (int64)


class InflightTable:
    """`rows` x `len(names)` int64 counters in shared memory."""

    def __init__(self, fd: int, rows: int, names: Sequence[str]) -> None:
        self.fd = fd
        self.rows = rows
        self.names = tuple(names)
        self.cols = {n: i for i, n in enumerate(self.names)}
        self._width = len(self.names)
        size = max(1, rows * self._width) * _CELL
        self._mm = mmap.mmap(fd, size)
        self.cells = memoryview(self._mm).cast("q")

    @classmethod
    def create(cls, rows: int, names: Sequence[str]) -> InflightTable:
        """A zeroed table in a new memfd (closed on exec unless passed on explicitly)."""
        fd = os.memfd_create("pulsegate-inflight", os.MFD_CLOEXEC)
        os.ftruncate(fd, max(1, rows * len(names)) * _CELL)
        return cls(fd, rows, names)

    def total(self, name: str) -> int:
        """Requests in flight to backend `name` across every worker (0 for an unknown name)."""
        col = self.cols.get(name)
        if col is None:
            return 0
        cells, width = self.cells, self._width
        return sum(cells[r * width + col] for r in range(self.rows))

    def others(self, row: int) -> list[int]:
        """Per backend: in flight from every row but `row` (a worker watching remote releases)."""
        cells, width = self.cells, self._width
        out = [0] * width
        for r in range(self.rows):
            if r != row:
                base = r * width
                for c in range(width):
                    out[c] += cells[base + c]
        return out

    def clear_row(self, row: int) -> None:
        """Forget a dead worker's requests (its connections died with it)."""
        base = row * self._width
        for c in range(self._width):
            self.cells[base + c] = 0

    def close(self) -> None:
        self.cells.release()
        self._mm.close()
        os.close(self.fd)


class Totals(MutableMapping[str, int]):
    """The gateway-wide in-flight count per backend, read from the table (the balancer's
    `inflight.get`, the admin view and the in-flight gauge). Read-only."""

    __slots__ = ("_cells", "_names", "_pair", "_where")

    def __init__(self, table: InflightTable) -> None:
        self._cells = table.cells
        self._names = table.names
        width = len(table.names)
        # Per backend, the cells to add up: the balancer reads two backends per pick.
        self._where = {
            n: tuple(r * width + c for r in range(table.rows)) for n, c in table.cols.items()
        }
        self._pair = table.rows == 2

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
    reservations described in the module docstring."""

    __slots__ = ("_cell", "_cells", "_clear_scheduled", "_reserved", "_table")

    def __init__(self, table: InflightTable, row: int) -> None:
        super().__init__(dict.fromkeys(table.names, 0))
        self._table = table
        self._cells = table.cells
        base = row * len(table.names)
        self._cell = {n: base + c for n, c in table.cols.items()}  # this row's cell per backend
        self._reserved: dict[str, int] = {}
        self._clear_scheduled = False
        table.clear_row(row)

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
