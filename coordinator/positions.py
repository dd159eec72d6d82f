"""What the coordinator knows about one source's stream positions, as flat arrays.

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


def by_source(sources: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(source, indices of its rows) for each source in a column of source numbers: one sort,
    where a mask per source made a step O(sources x pieces) at hundreds of sources."""
    if not len(sources):
        return []
    order = np.argsort(sources, kind="stable")
    ordered = sources[order]
    bounds = [0, *(np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist(), len(order)]
    return [(int(ordered[lo]), order[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])]


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


class PositionTable:
    def __init__(self, held: HeldCounts | None = None) -> None:
        """held: a counter of copies per worker that this table keeps up to date (shared by the
        tables of memory-mapped sources)."""
        self.held = held
        self.base = 0  # positions below were forgotten
        self.end = 0  # next position to issue
        self._record = np.zeros(0, dtype=np.int64)
        self._length = np.zeros(0, dtype=np.int64)
        self._holder = np.zeros(0, dtype=np.int64)
        self._patches = np.zeros(0, dtype=np.int64)

    def reset(self, start: int) -> None:
        """Forget everything; the next position issued is `start` (after the plan was rewound)."""
        if self.held is not None:
            self.held.change(self._holder[:self.end - self.base], -1)
        self.base = self.end = start

    def __len__(self) -> int:
        return self.end - self.base

    def issue(self, records: np.ndarray) -> np.ndarray:
        """Positions for the next records of the stream (their lengths still unknown)."""
        n = len(records)
        size = self.end - self.base
        if size + n > len(self._record):
            cap = max(1024, 2 * (size + n))
            for name in ("_record", "_length", "_holder", "_patches"):
                old = getattr(self, name)
                new = np.full(cap, UNKNOWN, dtype=np.int64)
                new[:size] = old[:size]
                setattr(self, name, new)
        self._record[size:size + n] = records
        self._length[size:size + n] = UNKNOWN
        self._holder[size:size + n] = NOBODY
        self._patches[size:size + n] = 0
        positions = np.arange(self.end, self.end + n, dtype=np.int64)
        self.end += n
        return positions

    def _index(self, positions: np.ndarray) -> np.ndarray:
        i = np.asarray(positions, dtype=np.int64) - self.base
        if i.size and (_smallest(i) < 0 or _largest(i) >= self.end - self.base):
            raise KeyError(f"positions outside the live window [{self.base}, {self.end})")
        return i

    def records(self, positions: np.ndarray) -> np.ndarray:
        return self._record[self._index(positions)]

    def holders(self, positions: np.ndarray) -> np.ndarray:
        return self._holder[self._index(positions)]

    def patches(self, positions: np.ndarray) -> np.ndarray:
        return self._patches[self._index(positions)]

    def set_prepared(self, positions: np.ndarray, lengths: np.ndarray, worker: int | np.ndarray,
                     patches: np.ndarray | None = None) -> np.ndarray:
        """Record what a worker (or each position's worker, an array) prepared; returns the
        lengths known before (-1 where none)."""
        i = self._index(positions)
        before = self._length[i].copy()
        self._length[i] = lengths
        if patches is not None and len(patches):
            self._patches[i] = patches
        holders = np.where(np.asarray(lengths) > 0, worker, NOBODY)
        if self.held is not None:
            self.held.change(self._holder[i], -1)
            self.held.change(holders, 1)
        self._holder[i] = holders
        return before

    def release(self, positions: np.ndarray, count: bool = True) -> np.ndarray:
        """The prepared copies at these positions are used up (their delivery was acknowledged);
        returns their holders. count=False leaves the shared HeldCounts to the caller (one change
        for the releases of many tables: a delivery releases records of hundreds of sources)."""
        i = self._index(positions)
        holders = self._holder[i]
        if self.held is not None and count:
            self.held.change(holders, -1)
        self._holder[i] = NOBODY
        return holders

    def count_held(self, worker: int) -> int:
        return int(np.count_nonzero(self._holder[:self.end - self.base] == worker))

    def held_counts(self, workers: int) -> np.ndarray:
        """Prepared copies each worker id in [0, workers) holds."""
        holders = self._holder[:self.end - self.base]
        return np.bincount(holders[holders >= 0], minlength=workers)[:workers]

    def held_by(self, worker: int) -> np.ndarray:
        """Positions whose prepared copy the worker holds, dropping its claim on them."""
        size = self.end - self.base
        i = np.flatnonzero(self._holder[:size] == worker)
        if self.held is not None:
            self.held.change(self._holder[i], -1)
        self._holder[i] = NOBODY
        return i + self.base

    def window(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(records, lengths) of positions [start, start+count); -1 for positions not issued."""
        records = np.full(count, UNKNOWN, dtype=np.int64)
        lengths = np.full(count, UNKNOWN, dtype=np.int64)
        lo, hi = max(start, self.base), min(start + count, self.end)
        if lo < hi:
            records[lo - start:hi - start] = self._record[lo - self.base:hi - self.base]
            lengths[lo - start:hi - start] = self._length[lo - self.base:hi - self.base]
        return records, lengths

    def forget_before(self, position: int) -> None:
        """Drop positions below `position` (nothing refers to them any more). Copies only when
        the dropped prefix is large, so the cost is amortised."""
        position = min(position, self.end)
        if position - self.base < max(1024, (self.end - self.base) // 2):
            return
        keep = self.end - position
        shift = position - self.base
        if self.held is not None:
            self.held.change(self._holder[:shift], -1)
        for a in (self._record, self._length, self._holder, self._patches):
            a[:keep] = a[shift:shift + keep]
        self.base = position
