"""Arrow files as Hugging Face `datasets` writes them (`save_to_disk`, and its cache): one row is
one record; a text column to tokenize, or a list-of-int column of token ids used as stored.

The file is memory-mapped and its record batches are read without copying (pyarrow's IPC
reader over a memory map), so opening a shard costs its schema and batch offsets, not its bytes;
a record's value is converted to Python only when it is read. `datasets` writes the IPC stream
format; the IPC file format is read too. The stream format has no index of its batches, so a
shard at a URL (storage.py) is copied whole into the cache dir once and mapped from there.
"""

from __future__ import annotations

import bisect
import os
from typing import Any

from msd_common.files import atomic_write

from .errors import RecordError, SourceFormatError
from .storage import is_url, local_name, store_for


def _local_copy(url: str, storage: dict[str, Any] | None, cache_dir: str | None) -> str:
    from .jsonl import default_cache_dir

    store = store_for(url, storage)
    try:
        tag = store.stamp(url)[1]
    except FileNotFoundError:
        raise SourceFormatError(f"{url}: object not found") from None
    path = os.path.join(cache_dir or default_cache_dir(), local_name(url, "", tag))
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, lambda out: store.download(url, out))
    return path


class ArrowShard:
    def __init__(self, path: str, column: str | None, storage: dict[str, Any] | None = None,
                 cache_dir: str | None = None) -> None:
        import pyarrow as pa

        try:
            source = pa.memory_map(_local_copy(path, storage, cache_dir) if is_url(path) else path)
            try:
                table = pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                table = pa.ipc.open_file(source).read_all()
        except (OSError, ValueError) as e:  # ArrowInvalid is a ValueError
            raise SourceFormatError(f"{path}: not a readable Arrow file ({e})") from None
        if column is not None and column not in table.column_names:
            raise SourceFormatError(f"{path}: no column {column!r} (columns: {', '.join(table.column_names)})")
        self.path, self.column = path, column
        self._table = table if column is None else None  # every column: a row read as a dict
        self._chunks = table.column(column or 0).chunks
        self._starts = [0]
        for chunk in self._chunks:
            self._starts.append(self._starts[-1] + len(chunk))

    def __len__(self) -> int:
        return self._starts[-1]

    def value(self, i: int):
        """The column's value in row i (a str, a list of ints, or None)."""
        c = bisect.bisect_right(self._starts, i) - 1
        if self._table is not None:
            try:
                return self._table.slice(i, 1).to_pylist()[0]
            except (IndexError, ValueError) as e:
                raise RecordError(f"{self.path}: row {i} unreadable ({e})") from None
        try:
            return self._chunks[c][i - self._starts[c]].as_py()
        except (IndexError, ValueError) as e:
            raise RecordError(f"{self.path}: row {i} unreadable ({e})") from None
