"""One source's records, by format: an ordered list of shards addressed by one record index.

`record_index` counts the source's records from 0 across its shards in sorted path order
(JSONL: one line is one record; Megatron: one document of the .idx; Parquet and Arrow: one row;
WebDataset: one sample, i.e. one run of tar entries sharing a key).

This is the first of two stages: it finds a record and reads what is stored (fields, text,
token ids, image bytes), checking the poison limits before anything is decoded. Turning a record
into a sample (tokenizing, chat templates, the user's transform, images) is the worker's second
stage (worker/samples.py). The coordinator uses this stage alone: record counts, and the lengths
and pieces of memory-mapped Megatron documents.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np
import orjson

from .arrow import ArrowShard
from .errors import RecordError, SourceFormatError
from .jsonl import JsonlShard
from .limits import DEFAULT_CAPTION_KEY, DEFAULT_MAX_RECORD_BYTES, check_bytes
from .megatron import MegatronIndex
from .parquet import ParquetShard, token_ids
from .storage import is_url
from .webdataset import WebDatasetShard

TABLES = {"parquet": ParquetShard, "arrow": ArrowShard}  # a row per record, a text or token-id column
FORMATS = ("jsonl", "megatron", "parquet", "arrow", "webdataset")


def is_memory_mapped(fmt: str, files: Any, transformed: bool = False) -> bool:
    """Whether a source is memory-mapped (read by the coordinator's index, its tokens by piece at
    delivery): a local Megatron source whose lengths are the index's (not transformed)."""
    return fmt == "megatron" and not transformed and not any(is_url(f) for f in files)


class SourceRecords:
    """The records of one source. `whole_records`: every field of a record is read (a transform
    or a chat template gets them), not only the text or token-id column."""

    def __init__(self, name: str, fmt: str, files: Any, *, text_key: str | None = None,
                 tokens_key: str | None = None, whole_records: bool = False,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES, storage: dict[str, Any] | None = None,
                 cache_dir: str | None = None, cache_bytes: int | None = None, copies: str = "plain") -> None:
        self.name = name
        self.format = fmt
        self.text_key: str = text_key or (DEFAULT_CAPTION_KEY if fmt == "webdataset" else "text")
        self.tokens_key = tokens_key
        self.whole_records = whole_records
        self.max_record_bytes = int(max_record_bytes or DEFAULT_MAX_RECORD_BYTES)
        if fmt == "megatron":
            self.shards: list[Any] = [MegatronIndex(p, storage, cache_dir, cache_bytes) for p in files]
        elif fmt == "jsonl":
            self.shards = [JsonlShard(p, cache_dir, storage, cache_bytes, copies=copies) for p in files]
        elif fmt in TABLES:
            column = None if whole_records else (tokens_key or self.text_key)
            self.shards = [ArrowShard(p, column, storage, cache_dir) if fmt == "arrow" else ParquetShard(p, column,
                                                                                                         storage)
                           for p in files]
        elif fmt == "webdataset":
            self.shards = [WebDatasetShard(p, cache_dir, storage) for p in files]
        else:
            raise SourceFormatError(f"source {name!r}: unknown format {fmt!r}")
        self._prefetched_shards: list[int] = []
        self._starts = [0]
        for shard in self.shards:
            self._starts.append(self._starts[-1] + len(shard))

    @classmethod
    def of(cls, spec: Any, cache_dir: str | None = None) -> "SourceRecords":
        """The records of a source spec (msd_common.spec.SourceSpec)."""
        return cls(spec.name, spec.format, spec.files, text_key=spec.text_key, tokens_key=spec.tokens_key,
                   whole_records=spec.whole_records, max_record_bytes=spec.max_record_bytes, storage=spec.storage,
                   cache_dir=cache_dir or spec.cache_dir, cache_bytes=spec.cache_bytes, copies=spec.copies)

    @property
    def stored_dtype(self) -> np.dtype | None:
        """The dtype token ids are stored in (Megatron: the shards'; token-id columns: int32); None
        where records hold text."""
        if self.format == "megatron":
            dtypes = {s.dtype for s in self.shards}
            return np.result_type(*dtypes) if dtypes else np.dtype("<u2")
        if self.format in TABLES and self.tokens_key and not self.whole_records:
            return np.dtype("<i4")
        return None

    @property
    def dtype(self) -> np.dtype:
        """Of a Megatron source's tokens (memory-mapped sources are read by piece)."""
        return self.stored_dtype if self.stored_dtype is not None else np.dtype("<i4")

    @property
    def num_records(self) -> int:
        return self._starts[-1]

    @property
    def memory_mapped(self) -> bool:
        """Tokens read straight from local memory maps at delivery, lengths from the index: the
        coordinator prepares such a source itself. A Megatron source in object storage is not:
        workers prepare it like any other (a task's documents fetched together, ahead of use)."""
        return self.format == "megatron" and is_memory_mapped(self.format, [s.prefix for s in self.shards],
                                                              self.whole_records)

    def locate(self, record_index: int) -> tuple[int, int]:
        """(shard number, index within shard) of a record."""
        if not 0 <= record_index < self.num_records:
            raise IndexError(f"source {self.name!r}: record {record_index} out of range")
        shard = bisect.bisect_right(self._starts, record_index) - 1
        return shard, record_index - self._starts[shard]

    def where(self, record_index: int) -> str:
        """Where a record lies, for log lines: `file:line`, `file: row N`, `file: sample 'key'`."""
        try:
            shard_no, i = self.locate(record_index)
        except IndexError:
            return f"source {self.name!r}: record {record_index}"
        shard = self.shards[shard_no]
        if self.format == "jsonl":
            return f"{shard.shard}:{i + 1}"
        if self.format in TABLES:
            return f"{shard.path}: row {i}"
        if self.format == "webdataset":
            return f"{shard.shard}: sample {shard.key(i)!r}"
        return f"{shard.prefix}: document {i}"

    def prefetch(self, records: np.ndarray) -> None:
        """Fetch the stored bytes of these records together where their shards are remote (a
        prepare task's records: nearby ranges in one request); a no-op for local shards."""
        if not hasattr(self.shards[0] if self.shards else None, "prefetch"):
            return
        records = np.asarray(records, dtype=np.int64)
        shard_of = np.searchsorted(self._starts, records, side="right") - 1
        touched = np.unique(shard_of).tolist()
        for shard_no in set(self._prefetched_shards) - set(touched):  # what the last task left unread
            self.shards[shard_no].prefetch([])
        for shard_no in touched:
            mine = records[shard_of == shard_no] - self._starts[shard_no]
            if self.format == "webdataset":
                self.shards[shard_no].prefetch(mine.tolist(), every_entry=self.whole_records)
            else:
                self.shards[shard_no].prefetch(mine.tolist())
        self._prefetched_shards = touched

    # -- Megatron documents, by index ------------------------------------------------------------

    def lengths(self, records: np.ndarray) -> np.ndarray:
        """Tokens per record, from the index alone (Megatron sources only), vectorised."""
        if self.format != "megatron":
            raise TypeError(f"source {self.name!r}: lengths need tokenizing; read the samples")
        records = np.asarray(records, dtype=np.int64)
        if records.size and (records.min() < 0 or records.max() >= self.num_records):
            raise IndexError(f"source {self.name!r}: record index out of range")
        shard_of = np.searchsorted(self._starts, records, side="right") - 1
        out = np.empty(len(records), dtype=np.int64)
        for shard_no in np.unique(shard_of).tolist():
            mask = shard_of == shard_no
            out[mask] = self.shards[shard_no].lengths_of(records[mask] - self._starts[shard_no])
        return out

    def gather(self, records: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Tokens [offset, offset+length) of each record, concatenated in the order given
        (Megatron sources only)."""
        parts = self.pieces(records, offsets, lengths)
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)

    def pieces(self, records: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        """Tokens [offset, offset+length) of each record, in the order given, as views into the
        memory maps (Megatron sources only): a caller joining them with other parts copies once."""
        if self.format != "megatron":
            raise TypeError(f"source {self.name!r}: only memory-mapped sources are read by piece")
        records = np.asarray(records, dtype=np.int64)
        shard_of = np.searchsorted(self._starts, records, side="right") - 1
        parts: list = [None] * len(records)
        for shard_no in np.unique(shard_of).tolist():  # one vectorised lookup per shard
            mine = np.flatnonzero(shard_of == shard_no)
            views = self.shards[shard_no].pieces(records[mine] - self._starts[shard_no], offsets[mine], lengths[mine])
            if len(mine) == len(records):
                parts = views
            else:
                for i, view in zip(mine.tolist(), views):
                    parts[i] = view
        return parts

    # -- what a record holds ---------------------------------------------------------------------

    def document(self, record_index: int) -> np.ndarray:
        """A Megatron document's stored token ids."""
        shard_no, i = self.locate(record_index)
        shard = self.shards[shard_no]
        check_bytes(shard.lengths_of(np.array([i]))[0] * shard.dtype.itemsize, self.max_record_bytes,
                    f"{shard.prefix}: document {i}")
        return shard.document(i)

    def fields(self, record_index: int) -> dict[str, Any]:
        """The record as a transform gets it: a dict of its fields (JSONL, Parquet, Arrow), of
        entry suffix -> bytes and `__key__` (WebDataset), or {"tokens": array} (Megatron)."""
        if self.format == "megatron":
            return {"tokens": np.asarray(self.document(record_index))}
        shard_no, i = self.locate(record_index)
        shard = self.shards[shard_no]
        if self.format in TABLES:
            row = shard.value(i)
            if not isinstance(row, dict):
                raise RecordError(f"{shard.path}: row {i} is not a record of fields")
            return row
        if self.format == "webdataset":
            check_bytes(shard.stored_bytes(i, every_entry=True), self.max_record_bytes, self.where(record_index))
            return {"__key__": shard.key(i), **shard.all_entries(i)}
        return self._json_line(shard, i)

    def column(self, record_index: int) -> Any:
        """A table row's text or token-id column (text_key or tokens_key), its stored size checked."""
        shard_no, i = self.locate(record_index)
        shard = self.shards[shard_no]
        where = f"{shard.path}: row {i}"
        value = shard.value(i)
        if isinstance(value, str) and 4 * len(value) > self.max_record_bytes:  # exact size only when it may matter
            check_bytes(len(value.encode("utf-8", "surrogatepass")), self.max_record_bytes, where)
        elif isinstance(value, list):
            check_bytes(4 * len(value), self.max_record_bytes, where)
        if self.tokens_key:
            return token_ids(value, f"{where}, column {self.tokens_key!r}")
        if not isinstance(value, str):
            raise RecordError(f"{where}: column {self.text_key!r} is not a string ({type(value).__name__})")
        return value

    def text(self, record_index: int) -> str:
        """A JSONL record's text (its text_key) or a table row's text column."""
        if self.format in TABLES:
            return self.column(record_index)
        shard_no, i = self.locate(record_index)
        shard = self.shards[shard_no]
        text = self._json_line(shard, i).get(self.text_key)
        if not isinstance(text, str):
            raise RecordError(f"{shard.shard}:{i + 1}: key {self.text_key!r} missing or not a string")
        return text

    def image_and_caption(self, record_index: int) -> tuple[bytes, str, str]:
        """A WebDataset sample's image bytes, caption text and where it lies."""
        shard_no, i = self.locate(record_index)
        shard = self.shards[shard_no]
        where = f"{shard.shard}: sample {shard.key(i)!r}"
        check_bytes(shard.stored_bytes(i), self.max_record_bytes, where)
        image, _, caption, caption_ext = shard.entries(i)
        try:
            text = caption.decode("utf-8")
            if caption_ext == "json":
                obj = orjson.loads(caption)
                text = obj.get(self.text_key) if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    raise RecordError(f"{where}: caption JSON has no string {self.text_key!r}")
        except (UnicodeDecodeError, orjson.JSONDecodeError) as e:
            raise RecordError(f"{where}: caption is not valid UTF-8 text or JSON ({e})") from None
        return image, text, where

    def _json_line(self, shard: JsonlShard, i: int) -> dict[str, Any]:
        where = f"{shard.shard}:{i + 1}"
        check_bytes(int(shard.offsets[i + 1] - shard.offsets[i]), self.max_record_bytes, where)
        try:
            obj = orjson.loads(shard.line(i))  # also rejects invalid UTF-8
        except orjson.JSONDecodeError as e:
            raise RecordError(f"{where}: corrupt JSON line ({e})") from None
        if not isinstance(obj, dict):
            raise RecordError(f"{where}: line is not a JSON object")
        return obj
