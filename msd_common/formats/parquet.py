"""Parquet shards (pyarrow): one row is one record; a text column to tokenize, or a list-of-int
column of token ids used as stored.

Rows are read by row group, one column only, never the whole file: a record index maps to (row
group, row) from the file's metadata, and a few decoded row groups are kept (records of one
prepare task are read grouped by row group, so each group is decoded once per task at most).
A shard at a URL (storage.py) is read the same way, by byte range: the footer once, then the
one column chunk of each row group read.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from typing import Any

import numpy as np

from .errors import RecordError, SourceFormatError
from .storage import is_url, store_for, waited

ROW_GROUPS_KEPT = 4  # decoded row groups kept per shard (one column each)


class ParquetShard:
    def __init__(self, path: str, column: str | None, storage: dict[str, Any] | None = None) -> None:
        """column None: every column, a row read as a dict (a source with a transform or chat)."""
        self._store = store_for(path, storage) if is_url(path) else None
        self.path = path
        try:
            self.file = self._open() if self._store is None else self._store.retry(path, lambda: waited(self._open))
        except FileNotFoundError:
            raise SourceFormatError(f"{path}: {'object' if self._store else 'file'} not found") from None
        except (OSError, ValueError) as e:  # pyarrow raises ArrowInvalid (a ValueError) for foreign bytes
            raise SourceFormatError(f"{path}: not a readable Parquet file ({e})") from None
        names = self.file.schema_arrow.names
        if column is not None and column not in names:
            raise SourceFormatError(f"{path}: no column {column!r} (columns: {', '.join(names)})")
        self.path, self.column = path, column
        meta = self.file.metadata
        self._starts = [0]
        for g in range(meta.num_row_groups):
            self._starts.append(self._starts[-1] + meta.row_group(g).num_rows)
        self._groups: OrderedDict[int, list] = OrderedDict()

    @property
    def _columns(self) -> list[str] | None:
        return None if self.column is None else [self.column]

    def _open(self):
        import pyarrow.parquet as pq

        if self._store is None:
            return pq.ParquetFile(self.path)
        # no read-ahead cache: pyarrow asks for the footer and column chunks by range itself
        return pq.ParquetFile(self._store.fs.open(self.path, "rb", cache_type="none"))

    def _read_group(self, g: int):
        if self._store is None:
            return self.file.read_row_group(g, columns=self._columns)

        def attempt():
            try:  # on a thread of its own: the worker's heartbeat goes on while pyarrow waits for the store
                return waited(lambda: self.file.read_row_group(g, columns=self._columns))
            except OSError:
                self.file = waited(self._open)  # the failed read may have left the file object anywhere
                raise
        return self._store.retry(f"{self.path}: row group {g}", attempt)

    def __len__(self) -> int:
        return self._starts[-1]

    def row_group_of(self, i: int) -> int:
        return bisect.bisect_right(self._starts, i) - 1

    def value(self, i: int):
        """The column's value in row i (a str, a list of ints, or None); every column's, as a
        dict, for a shard opened with column None."""
        g = self.row_group_of(i)
        rows = self._groups.get(g)
        if rows is None:
            try:
                table = self._read_group(g)
            except (OSError, ValueError) as e:
                raise RecordError(f"{self.path}: row group {g} unreadable ({e})") from None
            rows = self._groups[g] = table.column(0).to_pylist() if self.column else table.to_pylist()
            if len(self._groups) > ROW_GROUPS_KEPT:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(g)
        return rows[i - self._starts[g]]


def token_ids(value, where: str) -> np.ndarray:
    """A list-of-int cell as int32 token ids (checked: a list, of ints in [0, 2^31))."""
    if not isinstance(value, list) or not value:
        raise RecordError(f"{where}: expected a non-empty list of token ids, got {type(value).__name__}")
    try:
        ids = np.asarray(value, dtype=np.int64)
    except (TypeError, ValueError):
        raise RecordError(f"{where}: token ids are not all integers") from None
    if ids.ndim != 1 or ids.min() < 0 or ids.max() >= 1 << 31:
        raise RecordError(f"{where}: token ids must be integers in [0, 2^31)")
    return ids.astype("<i4")
