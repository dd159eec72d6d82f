"""The second stage of reading: a source's records made into samples (tokens, and image patches and
a loss mask where the source has them).

The first stage, finding and reading a record by format, is msd_common/formats/records.py. This
one owns what turns a record into a sample, each concern once: the built-in tokenizing of a
text field or caption, the image patches of image-text samples, chat rendering with the
tokenizer's template (worker/chat.py), and the user's transform (worker/transforms.py), whose
exceptions become skips of their record.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from msd_common import protocol as P
from msd_common.formats.errors import RecordError
from msd_common.formats.limits import check_pixels
from msd_common.formats.records import SourceRecords
from msd_common.worker_job import SourceSpec
from msd_common.tokenizer import make_tokenizer

from .vision import ImageError, to_patches

if TYPE_CHECKING:
    from .processor import ProcessedSample


class Prepared(NamedTuple):
    """What a worker prepares of a record (SourceReader.read_prepared)."""

    tokens: np.ndarray
    patches: "np.ndarray | None"  # built-in image patches (their placeholders are the first tokens)
    loss_mask: "np.ndarray | None"  # uint8 per token, from a transform or chat rendering
    processed: "ProcessedSample | None"  # a processor's arrays (sources with `processor`)
    image_patches: tuple = ()  # per built-in image, its patches (a transform may return several)

    @property
    def patch_count(self) -> int:
        """Image patches of the record, as PREPARED reports them."""
        if self.processed is not None:
            return self.processed.patches
        return len(self.patches) if self.patches is not None else 0

    @property
    def patch_squares(self) -> int:
        """Its images' patches squared, summed: the encoder attends within each image."""
        if self.processed is not None:
            return self.processed.patch_squares
        return sum(p * p for p in self.image_patches)


class SourceReader:
    """The samples of one source, read by record index. `spec` is the source's SourceSpec (a plain
    dict of its fields is accepted too, and checked the same way)."""

    def __init__(self, spec: SourceSpec | dict[str, Any], cache_dir: str | None = None) -> None:
        spec = spec if isinstance(spec, SourceSpec) else SourceSpec.from_wire(spec)
        self.spec = spec
        self.records = SourceRecords.of(spec, cache_dir)
        self.name, self.format, self.index, self.seed = spec.name, spec.format, spec.index, spec.seed
        self.whole_records = spec.whole_records
        self._transform = None
        self._chat = None
        self._processor = None  # worker/processor.py's ProcessorChat, made on first use
        # the tokenizer: for text, and the ctx.tokenizer of a transform; stored token ids need none
        self.tokenizer = None
        if self.records.stored_dtype is None or self.whole_records:
            self.tokenizer = make_tokenizer(spec.tokenizer or "byte", spec.eod_id)
        self.dtype = self.records.stored_dtype if self.records.stored_dtype is not None else self.tokenizer.dtype
        # image placeholders and patches: webdataset sources, and transforms that return images
        self.image_token_id = spec.image_token_id
        if self.image_token_id is not None and self.image_token_id > np.iinfo(self.dtype).max:
            self.dtype = np.dtype("<i4")
        if self.whole_records:
            self.dtype = np.dtype("<i4")  # what a transform or a chat template returns

    # what the first stage answers
    @property
    def shards(self) -> list[Any]:
        return self.records.shards

    @property
    def num_records(self) -> int:
        return self.records.num_records

    @property
    def memory_mapped(self) -> bool:
        return self.records.memory_mapped

    def locate(self, record_index: int) -> tuple[int, int]:
        return self.records.locate(record_index)

    def where(self, record_index: int) -> str:
        return self.records.where(record_index)

    def prefetch(self, records: np.ndarray) -> None:
        self.records.prefetch(records)

    def lengths(self, records: np.ndarray) -> np.ndarray:
        return self.records.lengths(records)

    def gather(self, records: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        return self.records.gather(records, offsets, lengths)

    def pieces(self, records: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        return self.records.pieces(records, offsets, lengths)

    def record(self, record_index: int) -> Any:
        """The record as a transform gets it (SourceRecords.fields)."""
        return self.records.fields(record_index)

    @property
    def has_images(self) -> bool:
        return (self.format == "webdataset" and self.spec.processor is None) or self.image_token_id is not None

    @property
    def has_encoder_cost(self) -> bool:
        """Its samples' image patches are reported with their lengths (the vision encoder's cost)."""
        return self.has_images or self.spec.processor is not None

    @property
    def patch_bytes(self) -> int:
        return self.spec.patch_size * self.spec.patch_size * 3 if self.has_images else 0

    def read(self, record_index: int) -> np.ndarray:
        """The record's tokens. Raises RecordError (naming file and line) for a record to skip."""
        return self.read_sample(record_index)[0]

    def read_sample(self, record_index: int, epoch: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
        """(tokens, image patches or None). An image-text sample's tokens are one image_token_id
        placeholder per patch, then the caption's tokens (ending with end-of-document).
        Raises RecordError for a record to skip (corrupt, or over a limit: checked before decoding)."""
        return self.read_full(record_index, epoch)[:2]

    def read_full(self, record_index: int, epoch: int = 0) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """(tokens, image patches or None, loss mask or None): what a worker prepares. A source
        with a transform or chat rendering returns what they make of the record; the loss mask
        (uint8, 1 where a token is trained on) comes only from them."""
        return tuple(self.read_prepared(record_index, epoch)[:3])

    def read_prepared(self, record_index: int, epoch: int = 0) -> Prepared:
        """read_full's three, and for a source with a processor the whole ProcessedSample (its
        per-token and image arrays), else None; then each built-in image's patches."""
        if self.spec.processor is not None:
            sample = self._transformed_processed(record_index, epoch) if self.spec.transform else \
                self._processed(record_index)
            if not sample.loss_mask.any():
                raise RecordError(f"{self.where(record_index)}: nothing to train on (every loss_mask entry is 0)",
                                  "no_trainable_tokens")
            for name, nbytes in sample.array_bytes.items():
                if nbytes > P.MAX_FRAME_BYTES:  # one frame of PIECES: skip it here, not lose it at delivery
                    raise RecordError(f"{self.where(record_index)}: the processor's {name} is {nbytes:,} bytes, "
                                      f"more than a message frame holds ({P.MAX_FRAME_BYTES:,}); lower the image "
                                      "processor's max_pixels or the source's max_image_pixels", "over_limit")
            return Prepared(sample.tokens, None, sample.loss_mask, sample)
        if self.whole_records:
            tokens, patches, mask, image_patches = self._transformed(record_index, epoch)
            return Prepared(tokens, patches, mask, None, image_patches)
        tokens, patches = self._read_plain(record_index)
        return Prepared(tokens, patches, None, None, () if patches is None else (len(patches),))

    def finish(self, sample: ProcessedSample, record_index: int) -> tuple[str, str] | None:
        """Make a prepared processor sample's pending image arrays (its image pass runs at
        delivery; worker/image_plan.py). None, or (reason, kind): the sample then goes with blank
        images and nothing to train on."""
        return self._processor_chat().finish(sample, self.where(record_index))

    def _processor_chat(self) -> Any:
        from .processor import ProcessorChat

        if self._processor is None:
            chat = self.spec.chat or {}
            self._processor = ProcessorChat(self.spec.processor, self.spec.image_backend,
                                            chat.get("train_on", "assistant"), chat.get("messages_key", "messages"),
                                            chat.get("tools_key", "tools"), self.spec.max_image_pixels,
                                            chat.get("template"), self.spec.image_pass == "delivery",
                                            self.spec.video_fps, self.spec.max_video_s)
        return self._processor

    def _processed(self, record_index: int) -> ProcessedSample:
        from .processor import ImageRecordError, ProcessorRecordError

        where = self.where(record_index)
        chat = self._processor_chat()
        record = self.record(record_index)
        shard = self.shards[self.locate(record_index)[0]]
        base = os.path.dirname(str(getattr(shard, "shard", shard)))
        try:
            return chat.render(record, base)
        except ImageRecordError as e:
            raise RecordError(f"{where}: {e}", e.kind) from None
        except ProcessorRecordError as e:
            raise RecordError(f"{where}: {e}", "corrupt") from None

    def _transformed(self, record_index: int, epoch: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None,
                                                                   tuple]:
        record = self.record(record_index)
        where = self.where(record_index)
        if self.spec.chat is not None:
            sample = self._chat_sample(record, where)
        else:
            sample = self._user_sample(record, where, record_index, epoch)
        if sample.processed is not None:
            raise RecordError(f"{where}: the transform returned processor outputs, but the source has no "
                              "processor", "transform_error")
        tokens, mask, patches, image_patches = sample.tokens, sample.loss_mask, None, ()
        if sample.images:
            tokens, mask, patches, image_patches = self._with_images(sample, where)
        if not len(tokens):
            raise RecordError(f"{where}: the transform returned no tokens", "skipped")
        if mask is not None and not mask.any():
            raise RecordError(f"{where}: nothing to train on (every loss_mask entry is 0)", "no_trainable_tokens")
        return tokens.astype(self.dtype, copy=False), patches, mask, image_patches

    def _user_sample(self, record: Any, where: str, record_index: int, epoch: int, processor: Any = None) -> Any:
        """The transform's checked Sample of a record; RecordError (skipped, or its error) otherwise."""
        from .transforms import Context, Skip, as_sample, load, record_rng

        if self._transform is None:
            self._transform = load(self.spec.transform)
        ctx = Context(record_rng(self.seed, self.index, record_index, epoch), self.tokenizer, self.name,
                      record_index, epoch, processor=processor)
        try:
            result = self._transform(record, ctx, **(self.spec.transform_args or {}))
        except Skip as e:
            raise RecordError(f"{where}: skipped by the transform: {e.reason}", "skipped") from None
        except Exception as e:  # noqa: BLE001 - the user's code: the record is skipped, the job goes on
            first = (str(e).splitlines() or [""])[0]
            err = RecordError(f"{where}: transform {self.spec.transform} raised {type(e).__name__}: {first}",
                              "transform_error")
            err.traceback = _traceback(e)
            raise err from None
        try:
            sample = as_sample(result, where)
        except ValueError as e:
            raise RecordError(str(e), "transform_error") from None
        if sample is None:
            raise RecordError(f"{where}: skipped by the transform (it returned None)", "skipped")
        return sample

    def _transformed_processed(self, record_index: int, epoch: int) -> ProcessedSample:
        """A transform's sample made with the source's processor (ctx.processor): its tokens,
        mask and the processor's outputs it returned, laid out as a processor source's."""
        from .processor import ProcessorRecordError

        where = self.where(record_index)
        chat = self._processor_chat()
        sample = self._user_sample(self.record(record_index), where, record_index, epoch, chat.processor)
        arrays = sample.processed or {}
        grids, pixels = arrays.get("image_grid_thw"), arrays.get("pixel_values")
        images = len(grids) if grids is not None else (len(pixels) if pixels is not None and pixels.ndim == 4 else
                                                       int(pixels is not None))
        try:
            return chat.sample_of({"input_ids": sample.tokens, **arrays}, images, sample.loss_mask)
        except ProcessorRecordError as e:
            raise RecordError(f"{where}: the transform's processor outputs: {e}", "transform_error") from None

    def _chat_sample(self, record: dict[str, Any], where: str) -> Any:
        from .chat import ChatError, ChatTemplate
        from .transforms import Sample

        if self._chat is None:
            self._chat = ChatTemplate(self.tokenizer.path, self.tokenizer.raw,
                                      self.spec.chat.get("train_on", "assistant"), self.spec.chat.get("template"))
        key = self.spec.chat.get("messages_key", "messages")
        if key not in record:
            raise RecordError(f"{where}: no {key!r} field")
        try:
            rendered = self._chat.render(record[key], record.get(self.spec.chat.get("tools_key", "tools")))
        except ChatError as e:
            raise RecordError(f"{where}: {e}", "corrupt") from None
        return Sample(rendered.tokens, rendered.loss_mask)

    def _with_images(self, sample: Any, where: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, tuple]:
        """A transform's images as patches, their placeholders before its tokens (the image-text
        layout: a record's first tokens are its patches' placeholders), and each image's patches."""
        if self.image_token_id is None:
            raise RecordError(f"{where}: the transform returned images, but the source has no image_token_id",
                              "transform_error")
        from .vision import patches_of_array

        parts = []
        for image in sample.images:
            try:
                parts.append(patches_of_array(image, self.spec.max_pixels, self.spec.patch_size))
            except ImageError as e:
                raise RecordError(f"{where}: {e}", "transform_error") from None
        patches = np.concatenate(parts)
        tokens = np.empty(len(patches) + len(sample.tokens), dtype=np.int32)
        tokens[:len(patches)] = self.image_token_id
        tokens[len(patches):] = sample.tokens
        mask = None
        if sample.loss_mask is not None:
            mask = np.concatenate([np.zeros(len(patches), np.uint8), sample.loss_mask])
        return tokens, mask, patches, tuple(len(part) for part in parts)

    def _read_plain(self, record_index: int) -> tuple[np.ndarray, np.ndarray | None]:
        if self.format == "megatron":  # (remote: workers prepare it; memory-mapped: only tests read it here)
            return self.records.document(record_index), None
        if self.format == "webdataset":
            return self._image_text(record_index)
        if self.spec.tokens_key:
            return self.records.column(record_index), None
        return self.tokenizer.encode(self.records.text(record_index)), None

    def _image_text(self, record_index: int) -> tuple[np.ndarray, np.ndarray]:
        image, text, where = self.records.image_and_caption(record_index)
        try:
            patches = to_patches(image, self.spec.max_pixels, self.spec.patch_size,
                                 lambda w, h: check_pixels(w, h, self.spec.max_image_pixels, where))
        except ImageError as e:
            raise RecordError(f"{where}: {e}") from None
        words = self.tokenizer.encode(text)
        tokens = np.empty(len(patches) + len(words), dtype=self.dtype)
        tokens[:len(patches)] = self.image_token_id
        tokens[len(patches):] = words
        return tokens, patches


def is_memory_mapped(spec: SourceSpec | dict[str, Any]) -> bool:
    """Whether a source is memory-mapped (SourceReader.memory_mapped), without opening it."""
    return (spec if isinstance(spec, SourceSpec) else SourceSpec.from_wire(spec)).memory_mapped


def _traceback(e: BaseException) -> str:
    import traceback

    return "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]


def open_source(spec: SourceSpec | dict[str, Any], cache_dir: str | None = None) -> SourceReader:
    return SourceReader(spec, cache_dir)
