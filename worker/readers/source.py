"""One source = an ordered list of shards addressed by a single record index.

`record_index` counts the source's records from 0 across its shards in sorted path order
(JSONL: one line is one record; Megatron: one document of the .idx; Parquet: one row;
WebDataset: one sample, i.e. one run of tar entries sharing a key).
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np
import orjson

from .limits import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_RECORD_BYTES, check_bytes, check_pixels
from ..tokenizer import make_tokenizer
from ..vision import DEFAULT_CAPTION_KEY, DEFAULT_MAX_PIXELS, DEFAULT_PATCH_SIZE, ImageError, to_patches
from .errors import RecordError, SourceFormatError
from .jsonl import JsonlShard
from .megatron import MegatronIndex
from .arrow import ArrowShard
from .parquet import ParquetShard, token_ids
from .storage import is_url
from .webdataset import WebDatasetShard


TABLES = {"parquet": ParquetShard, "arrow": ArrowShard}  # a row per record, a text or token-id column


class SourceReader:
    """Reads records of one source. `spec` is the source's entry of the job description that the
    coordinator sends to workers: {name, format, files, text_key, tokens_key, tokenizer, eod_id,
    image_token_id, max_pixels, patch_size, cache_dir, cache_bytes, copies, storage}. Files may be URLs of
    object stores, read with the source's `storage` options (storage.py)."""

    def __init__(self, spec: dict[str, Any], cache_dir: str | None = None) -> None:
        cache_dir = cache_dir or spec.get("cache_dir")  # the job's runtime.cache_dir, if it names one
        self.name: str = spec["name"]
        self.format: str = spec["format"]
        self.index: int = int(spec.get("index") or 0)
        self.seed: int = int(spec.get("seed") or 0)
        # a transform of the user's own, or chat rendering: the record is read whole (every field)
        self.transform_name: str | None = spec.get("transform")
        self.transform_args: dict[str, Any] = dict(spec.get("transform_args") or {})
        self.chat_spec: dict[str, Any] | None = spec.get("chat")
        self.whole_records = bool(self.transform_name or self.chat_spec)
        self._transform = None
        self._chat = None
        self.text_key: str = spec.get("text_key") or (DEFAULT_CAPTION_KEY if self.format == "webdataset" else "text")
        self.tokens_key: str | None = spec.get("tokens_key")
        self.max_record_bytes = int(spec.get("max_record_bytes") or DEFAULT_MAX_RECORD_BYTES)
        self.max_image_pixels = int(spec.get("max_image_pixels") or DEFAULT_MAX_IMAGE_PIXELS)
        self.tokenizer = None
        storage, cache_bytes = spec.get("storage"), spec.get("cache_bytes")
        if self.format == "megatron":
            self.shards: list[Any] = [MegatronIndex(p, storage, cache_dir, cache_bytes) for p in spec["files"]]
            if self.whole_records:  # ctx.tokenizer of a transform
                self.tokenizer = make_tokenizer(spec.get("tokenizer") or "byte", spec.get("eod_id"), spec.get("pad_id"))
            dtypes = {s.dtype for s in self.shards}
            self.dtype = np.result_type(*dtypes) if dtypes else np.dtype("<u2")
        elif self.format in ("jsonl", "webdataset") or (self.format in TABLES and not self.tokens_key) or \
                self.whole_records:
            self.tokenizer = make_tokenizer(spec.get("tokenizer", "byte"), spec.get("eod_id"), spec.get("pad_id"))
            self.dtype = self.tokenizer.dtype
            if self.format == "jsonl":
                copies = spec.get("copies", "plain")
                self.shards = [JsonlShard(p, cache_dir, storage, cache_bytes, copies=copies) for p in spec["files"]]
            elif self.format in TABLES:
                column = None if self.whole_records else self.text_key
                self.shards = [self._table(p, column, storage, cache_dir) for p in spec["files"]]
            else:
                self.shards = [WebDatasetShard(p, cache_dir, storage) for p in spec["files"]]
        elif self.format in TABLES:  # pre-tokenized rows
            self.shards = [self._table(p, self.tokens_key, storage, cache_dir) for p in spec["files"]]
            self.dtype = np.dtype("<i4")
        else:
            raise SourceFormatError(f"source {self.name!r}: unknown format {self.format!r}")
        # image placeholders and patches: webdataset sources, and transforms that return images
        self.image_token_id = int(spec["image_token_id"]) if spec.get("image_token_id") is not None else None
        self.max_pixels = int(spec.get("max_pixels") or DEFAULT_MAX_PIXELS)
        self.patch_size = int(spec.get("patch_size") or DEFAULT_PATCH_SIZE)
        if self.image_token_id is not None and self.image_token_id > np.iinfo(self.dtype).max:
            self.dtype = np.dtype("<i4")
        if self.whole_records:
            self.dtype = np.dtype("<i4")  # what a transform or a chat template returns
        self._prefetched_shards: list[int] = []
        counts = [len(s) for s in self.shards]
        self._starts = [0]
        for c in counts:
            self._starts.append(self._starts[-1] + c)

    @property
    def memory_mapped(self) -> bool:
        """Tokens read straight from local memory maps at delivery, lengths from the index: the
        coordinator prepares such a source itself. A Megatron source in object storage is not:
        workers prepare it like any other (a task's documents fetched together, ahead of use)."""
        return is_memory_mapped({"format": self.format, "files": [s.prefix for s in self.shards],
                                 "transform": self.transform_name}) if self.format == "megatron" else False

    def _table(self, path: str, column: str, storage: dict[str, Any] | None, cache_dir: str | None) -> Any:
        if self.format == "arrow":
            return ArrowShard(path, column, storage, cache_dir)
        return ParquetShard(path, column, storage)

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

    @property
    def has_images(self) -> bool:
        return self.format == "webdataset" or self.image_token_id is not None

    @property
    def patch_bytes(self) -> int:
        return self.patch_size * self.patch_size * 3 if self.has_images else 0

    def read(self, record_index: int) -> np.ndarray:
        """The record's tokens. Raises RecordError (naming file and line) for a record to skip."""
        return self.read_sample(record_index)[0]

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

    def read_sample(self, record_index: int, epoch: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
        """(tokens, image patches or None). An image-text sample's tokens are one image_token_id
        placeholder per patch, then the caption's tokens (ending with end-of-document).
        Raises RecordError for a record to skip (corrupt, or over a limit: checked before decoding)."""
        return self.read_full(record_index, epoch)[:2]

    def read_full(self, record_index: int, epoch: int = 0) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """(tokens, image patches or None, loss mask or None): what a worker prepares. A source
        with a transform or chat rendering returns what they make of the record; the loss mask
        (uint8, 1 where a token is trained on) comes only from them."""
        if self.whole_records:
            return self._transformed(record_index, epoch)
        tokens, patches = self._read_plain(record_index)
        return tokens, patches, None

    def record(self, record_index: int) -> Any:
        """The record as a transform gets it: a dict of its fields (JSONL, Parquet, Arrow), of
        entry suffix -> bytes and `__key__` (WebDataset), or {"tokens": array} (Megatron)."""
        shard_no, i = self.locate(record_index)
        shard = self.shards[shard_no]
        if self.format == "megatron":
            check_bytes(shard.lengths_of(np.array([i]))[0] * shard.dtype.itemsize, self.max_record_bytes,
                        f"{shard.prefix}: document {i}")
            return {"tokens": np.asarray(shard.document(i))}
        if self.format in TABLES:
            row = shard.value(i)
            if not isinstance(row, dict):
                raise RecordError(f"{shard.path}: row {i} is not a record of fields")
            return row
        if self.format == "webdataset":
            check_bytes(shard.stored_bytes(i, every_entry=True), self.max_record_bytes, self.where(record_index))
            return {"__key__": shard.key(i), **shard.all_entries(i)}
        where = f"{shard.shard}:{i + 1}"
        check_bytes(int(shard.offsets[i + 1] - shard.offsets[i]), self.max_record_bytes, where)
        try:
            obj = orjson.loads(shard.line(i))
        except orjson.JSONDecodeError as e:
            raise RecordError(f"{where}: corrupt JSON line ({e})") from None
        if not isinstance(obj, dict):
            raise RecordError(f"{where}: line is not a JSON object")
        return obj

    def _transformed(self, record_index: int, epoch: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        from ..transforms import Context, Skip, as_sample, load, record_rng

        record = self.record(record_index)
        where = self.where(record_index)
        if self.chat_spec is not None:
            sample = self._chat_sample(record, where)
        else:
            if self._transform is None:
                self._transform = load(self.transform_name)
            ctx = Context(record_rng(self.seed, self.index, record_index, epoch), self.tokenizer, self.name,
                          record_index, epoch)
            try:
                result = self._transform(record, ctx, **self.transform_args)
            except Skip as e:
                raise RecordError(f"{where}: skipped by the transform: {e.reason}", "skipped") from None
            except Exception as e:  # noqa: BLE001 - the user's code: the record is skipped, the job goes on
                first = (str(e).splitlines() or [""])[0]
                err = RecordError(f"{where}: transform {self.transform_name} raised {type(e).__name__}: {first}",
                                  "transform_error")
                err.traceback = _traceback(e)
                raise err from None
            try:
                sample = as_sample(result, where)
            except ValueError as e:
                raise RecordError(str(e), "transform_error") from None
            if sample is None:
                raise RecordError(f"{where}: skipped by the transform (it returned None)", "skipped")
        tokens, mask, patches = sample.tokens, sample.loss_mask, None
        if sample.images:
            tokens, mask, patches = self._with_images(sample, where)
        if not len(tokens):
            raise RecordError(f"{where}: the transform returned no tokens", "skipped")
        if mask is not None and not mask.any():
            raise RecordError(f"{where}: nothing to train on (every loss_mask entry is 0)", "no_trainable_tokens")
        return tokens.astype(self.dtype, copy=False), patches, mask

    def _chat_sample(self, record: dict[str, Any], where: str) -> Any:
        from ..chat import ChatError, ChatTemplate
        from ..transforms import Sample

        if self._chat is None:
            self._chat = ChatTemplate(self.tokenizer.path, self.tokenizer.raw,
                                      self.chat_spec.get("train_on", "assistant"))
        key = self.chat_spec.get("messages_key", "messages")
        if key not in record:
            raise RecordError(f"{where}: no {key!r} field")
        try:
            rendered = self._chat.render(record[key], record.get(self.chat_spec.get("tools_key", "tools")))
        except ChatError as e:
            raise RecordError(f"{where}: {e}", "corrupt") from None
        return Sample(rendered.tokens, rendered.loss_mask)

    def _with_images(self, sample: Any, where: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """A transform's images as patches, their placeholders before its tokens (the image-text
        layout: a record's first tokens are its patches' placeholders)."""
        if self.image_token_id is None:
            raise RecordError(f"{where}: the transform returned images, but the source has no image_token_id",
                              "transform_error")
        from ..vision import patches_of_array

        parts = []
        for image in sample.images:
            try:
                parts.append(patches_of_array(image, self.max_pixels, self.patch_size))
            except ImageError as e:
                raise RecordError(f"{where}: {e}", "transform_error") from None
        patches = np.concatenate(parts)
        tokens = np.empty(len(patches) + len(sample.tokens), dtype=np.int32)
        tokens[:len(patches)] = self.image_token_id
        tokens[len(patches):] = sample.tokens
        mask = None
        if sample.loss_mask is not None:
            mask = np.concatenate([np.zeros(len(patches), np.uint8), sample.loss_mask])
        return tokens, mask, patches

    def _read_plain(self, record_index: int) -> tuple[np.ndarray, np.ndarray | None]:
        shard_no, i = self.locate(record_index)
        shard = self.shards[shard_no]
        if self.format == "megatron":  # (remote: workers prepare it; memory-mapped: only tests read it here)
            check_bytes(shard.lengths_of(np.array([i]))[0] * self.dtype.itemsize, self.max_record_bytes,
                        f"{shard.prefix}: document {i}")
            return shard.document(i), None
        if self.format in TABLES:
            where = f"{shard.path}: row {i}"
            value = shard.value(i)
            if isinstance(value, str) and 4 * len(value) > self.max_record_bytes:  # exact size only when it may matter
                check_bytes(len(value.encode("utf-8", "surrogatepass")), self.max_record_bytes, where)
            elif isinstance(value, list):
                check_bytes(4 * len(value), self.max_record_bytes, where)
            if self.tokens_key:
                return token_ids(value, f"{where}, column {self.tokens_key!r}"), None
            if not isinstance(value, str):
                raise RecordError(f"{where}: column {self.text_key!r} is not a string ({type(value).__name__})")
            return self.tokenizer.encode(value), None
        if self.format == "webdataset":
            return self._image_text(shard, i)
        where = f"{shard.shard}:{i + 1}"
        check_bytes(int(shard.offsets[i + 1] - shard.offsets[i]), self.max_record_bytes, where)
        raw = shard.line(i)
        try:
            obj = orjson.loads(raw)  # also rejects invalid UTF-8
        except orjson.JSONDecodeError as e:
            raise RecordError(f"{where}: corrupt JSON line ({e})") from None
        if not isinstance(obj, dict):
            raise RecordError(f"{where}: line is not a JSON object")
        text = obj.get(self.text_key)
        if not isinstance(text, str):
            raise RecordError(f"{where}: key {self.text_key!r} missing or not a string")
        return self.tokenizer.encode(text), None

    def _image_text(self, shard: WebDatasetShard, i: int) -> tuple[np.ndarray, np.ndarray]:
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
        try:
            patches = to_patches(image, self.max_pixels, self.patch_size,
                                 lambda w, h: check_pixels(w, h, self.max_image_pixels, where))
        except ImageError as e:
            raise RecordError(f"{where}: {e}") from None
        words = self.tokenizer.encode(text)
        tokens = np.empty(len(patches) + len(words), dtype=self.dtype)
        tokens[:len(patches)] = self.image_token_id
        tokens[len(patches):] = words
        return tokens, patches


def is_memory_mapped(spec: dict[str, Any]) -> bool:
    """Whether a source spec is a memory-mapped one (SourceReader.memory_mapped), without opening
    it. A Megatron source with a transform is not: its lengths are no longer the index's."""
    return spec.get("format") == "megatron" and not spec.get("transform") and \
        not any(is_url(f) for f in spec.get("files", ()))


def _traceback(e: BaseException) -> str:
    import traceback

    return "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]


def open_source(spec: dict[str, Any], cache_dir: str | None = None) -> SourceReader:
    return SourceReader(spec, cache_dir)
