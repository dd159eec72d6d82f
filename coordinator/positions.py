"""What the coordinator knows about each source's stream positions, as flat arrays shared by all
sources (one arena), so that lookups of many sources' rows are one gather.

Position p of a source's stream names one prepared instance of a record. For every position
handed to a worker so far and not yet forgotten, the table keeps the record index, its token
length (-1 until a worker reports it, 0 for a record skipped as corrupt), its image patches (0
for text) and the worker holding the prepared copy (-1 for none). Positions are issued in
order, so the live ones form one window [base, end): lookups are slices and fancy indexing,
never per-position Python.
"""

from __future__ import annotations

import numpy as np

UNKNOWN = -1
NOBODY = -1
# the ufuncs' reductions called directly: ndarray.min()/max() go through two Python layers,
# which cost more than the reduction on the small arrays of one source's part of a step
_smallest, _largest = np.minimum.reduce, np.maximum.reduce
# the fewest slots a table gets, and the fewest forgotten positions worth a copy: small, because
# every source has a table (1024 cost 15 MB of mostly dead slots at 306 sources); amortised
# anyway, rooms doubling and a copy only once half a table is dead
MIN_ROOM = 128


class HeldCounts:
    """Prepared copies each worker holds, over several tables, kept up to date as their holders
    change: the coordinator chooses the worker for a memory-mapped task by it, and summing every
    table's holders per task made each step O(sources^2)."""

    def __init__(self) -> None:
        self._counts = np.zeros(64, dtype=np.int64)

    def change(self, holders: np.ndarray, delta: int) -> None:
        held = holders[holders >= 0]
        if not held.size:
            return
        top = int(_largest(held))
        if top >= len(self._counts):
            grown = np.zeros(max(2 * len(self._counts), top + 1), dtype=np.int64)
            grown[:len(self._counts)] = self._counts
            self._counts = grown
        self._counts[:top + 1] += delta * np.bincount(held, minlength=top + 1)

    def counts(self, workers: int) -> np.ndarray:
        """Copies held by each worker id in [0, workers)."""
        out = np.zeros(workers, dtype=np.int64)
        n = min(workers, len(self._counts))
        out[:n] = self._counts[:n]
        return out


class _Arena:
    """The arrays of several position tables: table t's live positions [t.base, t.end) sit at
    slots [t.start, t.start + t.end - t.base) of each array, with room for t.room. A table that
    outgrows its room moves to the end; when the arrays are full they are rebuilt with every
    table packed (amortised, like a list's growth). One set of arrays lets a lookup of rows of
    many sources be one gather: a per-source step per step cost ~1 ms per 100 sources."""

    FIELDS = ("record", "length", "holder", "patches", "patch_squares", "nbytes")

    def __init__(self, n: int) -> None:
        self.tables: list[PositionTable] = []
        self.used = 0
        for f in self.FIELDS:
            setattr(self, f, np.zeros(0, dtype=np.int64))
        # per table, for vectorised lookups: base position, live size, slot of the base
        self.base = np.zeros(n, dtype=np.int64)
        self.size = np.zeros(n, dtype=np.int64)
        self.start = np.zeros(n, dtype=np.int64)

    def sync(self, t: "PositionTable") -> None:
        self.base[t.index], self.size[t.index], self.start[t.index] = t.base, t.end - t.base, t.start

    def make_room(self, t: "PositionTable", need: int) -> None:
        """Move table t to a segment with room for `need` live slots."""
        room = max(MIN_ROOM, 2 * need)
        if self.used + room > len(self.record):
            self._pack(room)
        size = t.end - t.base
        for f in self.FIELDS:
            a = getattr(self, f)
            a[self.used:self.used + size] = a[t.start:t.start + size]
        t.start, t.room = self.used, room
        self.used += room
        self.sync(t)

    def _pack(self, extra: int) -> None:
        rooms = sum(t.room for t in self.tables)
        length = max(MIN_ROOM, 2 * (rooms + extra))
        fresh = {f: np.zeros(length, dtype=np.int64) for f in self.FIELDS}
        at = 0
        for t in self.tables:
            size = t.end - t.base
            for f in self.FIELDS:
                fresh[f][at:at + size] = getattr(self, f)[t.start:t.start + size]
            t.start = at
            at += t.room
            self.sync(t)
        for f in self.FIELDS:
            setattr(self, f, fresh[f])
        self.used = at

    def slots(self, sources: np.ndarray, positions: np.ndarray) -> np.ndarray:
        i = np.asarray(positions, dtype=np.int64) - self.base[sources]
        if i.size and (_smallest(i) < 0 or np.any(i >= self.size[sources])):
            raise KeyError("positions outside their source's live window")
        return self.start[sources] + i


class PositionTable:
    def __init__(self, held: HeldCounts | None = None, arena: _Arena | None = None) -> None:
        """held: a counter of copies per worker that this table keeps up to date (shared by the
        tables of memory-mapped sources). arena: the arrays it shares with other tables
        (PositionTables); a table of its own otherwise."""
        self.held = held
        self.arena = arena if arena is not None else _Arena(1)
        self.index = len(self.arena.tables)
        self.arena.tables.append(self)
        self.base = 0  # positions below were forgotten
        self.end = 0  # next position to issue
        self.start = self.room = 0  # its slots in the arena's arrays

    def _live(self, field: str) -> np.ndarray:
        return getattr(self.arena, field)[self.start:self.start + self.end - self.base]

    def reset(self, start: int) -> None:
        """Forget everything; the next position issued is `start` (after the plan was rewound)."""
        if self.held is not None:
            self.held.change(self._live("holder"), -1)
        self.base = self.end = start
        self.arena.sync(self)

    def __len__(self) -> int:
        return self.end - self.base

    def issue(self, records: np.ndarray) -> np.ndarray:
        """Positions for the next records of the stream (their lengths still unknown)."""
        n = len(records)
        size = self.end - self.base
        if size + n > self.room:
            self.arena.make_room(self, size + n)
        a, at = self.arena, self.start + size
        a.record[at:at + n] = records
        a.length[at:at + n] = UNKNOWN
        a.holder[at:at + n] = NOBODY
        a.patches[at:at + n] = 0
        a.patch_squares[at:at + n] = 0
        a.nbytes[at:at + n] = 0
        positions = np.arange(self.end, self.end + n, dtype=np.int64)
        self.end += n
        a.size[self.index] = self.end - self.base
        return positions

    def _index(self, positions: np.ndarray) -> np.ndarray:
        i = np.asarray(positions, dtype=np.int64) - self.base
        if i.size and (_smallest(i) < 0 or _largest(i) >= self.end - self.base):
            raise KeyError(f"positions outside the live window [{self.base}, {self.end})")
        return i + self.start

    def records(self, positions: np.ndarray) -> np.ndarray:
        return self.arena.record[self._index(positions)]

    def holders(self, positions: np.ndarray) -> np.ndarray:
        return self.arena.holder[self._index(positions)]

    def patches(self, positions: np.ndarray) -> np.ndarray:
        return self.arena.patches[self._index(positions)]

    def patch_squares(self, positions: np.ndarray) -> np.ndarray:
        """Per record, its images' patches squared, summed (its patches squared where not reported)."""
        return self.arena.patch_squares[self._index(positions)]

    def nbytes(self, positions: np.ndarray) -> np.ndarray:
        """Per prepared record, the bytes of its arrays beside its tokens (Prepared.array_bytes)."""
        return self.arena.nbytes[self._index(positions)]

    def lengths(self, positions: np.ndarray) -> np.ndarray:
        """Prepared lengths (UNKNOWN where not prepared yet)."""
        return self.arena.length[self._index(positions)]

    def set_prepared(self, positions: np.ndarray, lengths: np.ndarray, worker: int | np.ndarray,
                     patches: np.ndarray | None = None, patch_squares: np.ndarray | None = None,
                     array_bytes: np.ndarray | None = None) -> np.ndarray:
        """Record what a worker (or each position's worker, an array) prepared; returns the
        lengths known before (-1 where none)."""
        i, a = self._index(positions), self.arena
        before = a.length[i].copy()
        a.length[i] = lengths
        if array_bytes is not None and len(array_bytes) == len(i):
            a.nbytes[i] = array_bytes
        if patches is not None and len(patches):
            a.patches[i] = patches
            squares = np.asarray(patches, dtype=np.int64) ** 2  # one image a record, unless told otherwise
            if patch_squares is not None and len(patch_squares) == len(patches):
                squares = patch_squares
            a.patch_squares[i] = squares
        holders = np.where(np.asarray(lengths) > 0, worker, NOBODY)
        if self.held is not None:
            self.held.change(a.holder[i], -1)
            self.held.change(holders, 1)
        a.holder[i] = holders
        return before

    def release(self, positions: np.ndarray, count: bool = True) -> np.ndarray:
        """The prepared copies at these positions are used up (their delivery was acknowledged);
        returns their holders. count=False leaves the shared HeldCounts to the caller (one change
        for the releases of many tables: a delivery releases records of hundreds of sources)."""
        i, a = self._index(positions), self.arena
        holders = a.holder[i]
        if self.held is not None and count:
            self.held.change(holders, -1)
        a.holder[i] = NOBODY
        return holders

    def count_held(self, worker: int) -> int:
        return int(np.count_nonzero(self._live("holder") == worker))

    def held_counts(self, workers: int) -> np.ndarray:
        """Prepared copies each worker id in [0, workers) holds."""
        holders = self._live("holder")
        return np.bincount(holders[holders >= 0], minlength=workers)[:workers]

    def held_by(self, worker: int) -> np.ndarray:
        """Positions whose prepared copy the worker holds, dropping its claim on them."""
        live = self._live("holder")
        i = np.flatnonzero(live == worker)
        if self.held is not None:
            self.held.change(live[i], -1)
        live[i] = NOBODY
        return i + self.base

    def window(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(records, lengths) of positions [start, start+count); -1 for positions not issued."""
        records = np.full(count, UNKNOWN, dtype=np.int64)
        lengths = np.full(count, UNKNOWN, dtype=np.int64)
        lo, hi = max(start, self.base), min(start + count, self.end)
        if lo < hi:
            at = self.start - self.base
            records[lo - start:hi - start] = self.arena.record[lo + at:hi + at]
            lengths[lo - start:hi - start] = self.arena.length[lo + at:hi + at]
        return records, lengths

    def forget_before(self, position: int) -> None:
        """Drop positions below `position` (nothing refers to them any more). Copies only when
        the dropped prefix is large, so the cost is amortised."""
        position = min(position, self.end)
        if position - self.base < max(MIN_ROOM, (self.end - self.base) // 2):
            return
        keep = self.end - position
        shift = position - self.base
        if self.held is not None:
            self.held.change(self._live("holder")[:shift], -1)
        for f in _Arena.FIELDS:
            a = getattr(self.arena, f)
            a[self.start:self.start + keep] = a[self.start + shift:self.start + shift + keep]
        self.base = position
        self.arena.sync(self)


class PositionTables:
    """One table per source over one arena, indexed like a list, and lookups of [source,
    position] rows of many sources at once."""

    def __init__(self, held: list[HeldCounts | None]) -> None:
        self.arena = _Arena(len(held))
        self._tables = [PositionTable(h, self.arena) for h in held]

    def __getitem__(self, s: int) -> PositionTable:
        return self._tables[s]

    def __len__(self) -> int:
        return len(self._tables)

    def __iter__(self):
        return iter(self._tables)

    def holders(self, rows: np.ndarray) -> np.ndarray:
        """The holder of each [source, position] row."""
        return self.arena.holder[self.arena.slots(rows[:, 0], rows[:, 1])]

    def records(self, rows: np.ndarray) -> np.ndarray:
        """The record of each [source, position] row."""
        return self.arena.record[self.arena.slots(rows[:, 0], rows[:, 1])]

    def release(self, rows: np.ndarray) -> np.ndarray:
        """Release the copies of these [source, position] rows (as PositionTable.release with
        count=False: the caller changes the HeldCounts); returns their holders."""
        i = self.arena.slots(rows[:, 0], rows[:, 1])
        holders = self.arena.holder[i]
        self.arena.holder[i] = NOBODY
        return holders
