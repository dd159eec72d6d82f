"""Arrow files as Hugging Face `datasets` writes them (`save_to_disk`, and its cache): one row is
one record; a text column to tokenize, or a list-of-int column of token ids used as stored.

The file is memory-mapped and its record batches are read without copying (pyarrow's IPC
reader over a memory map), so opening a shard costs its schema and batch offsets, not its bytes;
a record's value is converted to Python only when it is read. `datasets` writes the IPC stream
format; the IPC file format is read too.
"""

from __future__ import annotations

import bisect

from .errors import RecordError, SourceFormatError


class ArrowShard:
    def __init__(self, path: str, column: str) -> None:
        import pyarrow as pa

        try:
            source = pa.memory_map(path)
            try:
                table = pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                table = pa.ipc.open_file(source).read_all()
        except (OSError, ValueError) as e:  # ArrowInvalid is a ValueError
            raise SourceFormatError(f"{path}: not a readable Arrow file ({e})") from None
        if column not in table.column_names:
            raise SourceFormatError(f"{path}: no column {column!r} (columns: {', '.join(table.column_names)})")
        self.path, self.column = path, column
        self._chunks = table.column(column).chunks
        self._starts = [0]
        for chunk in self._chunks:
            self._starts.append(self._starts[-1] + len(chunk))

    def __len__(self) -> int:
        return self._starts[-1]

    def value(self, i: int):
        """The column's value in row i (a str, a list of ints, or None)."""
        c = bisect.bisect_right(self._starts, i) - 1
        try:
            return self._chunks[c][i - self._starts[c]].as_py()
        except (IndexError, ValueError) as e:
            raise RecordError(f"{self.path}: row {i} unreadable ({e})") from None
