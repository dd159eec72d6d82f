"""One source = an ordered list of shards addressed by a single record index.

`record_index` counts the source's records from 0 across its shards in sorted path order
(JSONL: one line is one record; Megatron: one document of the .idx).
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np
import orjson

from ..tokenizer import make_tokenizer
from .errors import RecordError, SourceFormatError
from .jsonl import JsonlShard
from .megatron import MegatronIndex


class SourceReader:
    """Reads records of one source. `spec` is the source's entry of the job description that the
    coordinator sends to workers: {name, format, files, text_key, tokenizer, eod_id}."""

    def __init__(self, spec: dict[str, Any], cache_dir: str | None = None) -> None:
        self.name: str = spec["name"]
        self.format: str = spec["format"]
        self.text_key: str = spec.get("text_key", "text")
        if self.format == "megatron":
            self.shards: list[Any] = [MegatronIndex(p) for p in spec["files"]]
            self.tokenizer = None
            dtypes = {s.dtype for s in self.shards}
            self.dtype = np.result_type(*dtypes) if dtypes else np.dtype("<u2")
        elif self.format == "jsonl":
            self.shards = [JsonlShard(p, cache_dir) for p in spec["files"]]
            self.tokenizer = make_tokenizer(spec.get("tokenizer", "byte"), spec.get("eod_id"), spec.get("pad_id"))
            self.dtype = self.tokenizer.dtype
        else:
            raise SourceFormatError(f"source {self.name!r}: unknown format {self.format!r}")
        counts = [len(s) for s in self.shards]
        self._starts = [0]
        for c in counts:
            self._starts.append(self._starts[-1] + c)

    @property
    def num_records(self) -> int:
        return self._starts[-1]

    def locate(self, record_index: int) -> tuple[int, int]:
        """(shard number, index within shard) of a record."""
        if not 0 <= record_index < self.num_records:
            raise IndexError(f"source {self.name!r}: record {record_index} out of range")
        shard = bisect.bisect_right(self._starts, record_index) - 1
        return shard, record_index - self._starts[shard]

    def lengths(self, records: np.ndarray) -> np.ndarray:
        """Tokens per record, from the index alone (Megatron sources only), vectorised."""
        if self.format != "megatron":
            raise TypeError(f"source {self.name!r}: lengths need tokenizing; use read()")
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
        """Tokens [offset, offset+length) of each record, concatenated (Megatron sources only)."""
        if self.format != "megatron":
            raise TypeError(f"source {self.name!r}: gather reads memory-mapped sources only")
        records = np.asarray(records, dtype=np.int64)
        shard_of = np.searchsorted(self._starts, records, side="right") - 1
        # one gather per run of consecutive pieces from the same shard (callers sort by record)
        cuts = np.flatnonzero(np.diff(shard_of)) + 1
        parts = []
        for lo, hi in zip(np.concatenate([[0], cuts]).tolist(), np.concatenate([cuts, [len(records)]]).tolist()):
            shard = int(shard_of[lo])
            parts.append(self.shards[shard].gather(records[lo:hi] - self._starts[shard], offsets[lo:hi],
                                                   lengths[lo:hi]))
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)

    def read(self, record_index: int) -> np.ndarray:
        """The record's tokens. Raises RecordError (naming file and line) for a record to skip."""
        shard_no, i = self.locate(record_index)
        shard = self.shards[shard_no]
        if self.format == "megatron":
            return shard.document(i)
        raw = shard.line(i)
        where = f"{shard.shard}:{i + 1}"
        try:
            obj = orjson.loads(raw)  # also rejects invalid UTF-8
        except orjson.JSONDecodeError as e:
            raise RecordError(f"{where}: corrupt JSON line ({e})") from None
        if not isinstance(obj, dict):
            raise RecordError(f"{where}: line is not a JSON object")
        text = obj.get(self.text_key)
        if not isinstance(text, str):
            raise RecordError(f"{where}: key {self.text_key!r} missing or not a string")
        return self.tokenizer.encode(text)


def open_source(spec: dict[str, Any], cache_dir: str | None = None) -> SourceReader:
    return SourceReader(spec, cache_dir)
