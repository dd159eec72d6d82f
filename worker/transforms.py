"""Transforms of the user's own: a function a source names, called by workers on every record.

    sources:
      docs:
        format: jsonl
        paths: ["docs/*.jsonl"]
        transform: "mypackage.prep:crop"        # module:function, importable on every worker host
        transform_args: {max_tokens: 2048}      # keyword arguments

    def crop(record, ctx, max_tokens):
        tokens = ctx.tokenizer.encode(record["text"])
        start = ctx.rng.integers(0, max(1, len(tokens) - max_tokens + 1))
        return Sample(tokens[start:start + max_tokens])

`record` is what the source's reader holds (a dict of fields for JSONL, Parquet and Arrow; entry
suffix -> bytes and `__key__` for WebDataset; `{"tokens": array}` for Megatron). The function
returns a `Sample`, or `None` (or raises `Skip`) to skip the record; any other exception skips it
too, counted as `transform_error`. Its randomness must come from `ctx.rng`: seeded from the job's
seed, the source, the record and the epoch, and nothing else, so the stream does not depend on
which worker ran it, how many there are, or a retry.

This module imports without torch (worker hosts need not have it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from msd_common.usercode import TransformImportError, code_hash, load  # noqa: F401 - their old home


@dataclass
class Sample:
    """What a transform returns. tokens: 1-D integer ids (msd adds nothing to them); loss_mask:
    optional, same length, 1 where that token is predicted (trained on); images: optional list
    of HxWx3 uint8 arrays, whose patches take the first tokens' places as for image-text sources
    (one `image_token_id` placeholder per patch is put before the tokens). processed: for a
    source with a `processor` (the transform gets it as `ctx.processor`), the processor's other
    outputs for these tokens, as it returns them (`pixel_values`, `image_grid_thw`,
    `mm_token_type_ids`, ...); without loss_mask every token but the image tokens is trained on."""

    tokens: Any
    loss_mask: Any = None
    images: list | None = None
    processed: dict | None = None


class Skip(Exception):
    """Raised by a transform to skip a record, with the reason (logged and counted, kind `skipped`)."""

    def __init__(self, reason: str = "skipped by the transform") -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Context:
    """What a transform knows besides the record."""

    rng: np.random.Generator  # seeded from (job seed, source index, record index, epoch) only
    tokenizer: Any  # the source's: encode(text) -> ids ending with the end-of-document id
    source: str  # the source's name
    record: int  # the record's index in its source
    epoch: int  # passes over the source before this one
    extra: dict[str, Any] = field(default_factory=dict)
    processor: Any = None  # the source's Hugging Face processor (sources with `processor`), else None


def record_rng(seed: int, source_index: int, record: int, epoch: int) -> np.random.Generator:
    """The generator a record's transform gets: a pure function of its four arguments."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed & (2**64 - 1), source_index, record,
                                                                        epoch])))


def as_sample(result: Any, where: str) -> Sample | None:
    """Check what a transform returned; raise ValueError naming what is wrong."""
    if result is None:
        return None
    if not isinstance(result, Sample):
        raise ValueError(f"{where}: the transform returned {type(result).__name__}, not worker.transforms.Sample "
                         "or None")
    tokens = np.asarray(result.tokens)
    if tokens.ndim != 1 or not (np.issubdtype(tokens.dtype, np.integer) or tokens.size == 0):
        raise ValueError(f"{where}: Sample.tokens must be a 1-D integer array, got {tokens.dtype} of shape "
                         f"{tokens.shape}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= 2**31):
        raise ValueError(f"{where}: Sample.tokens must lie in [0, 2^31)")
    mask = None
    if result.loss_mask is not None:
        mask = np.asarray(result.loss_mask)
        if mask.shape != tokens.shape:
            raise ValueError(f"{where}: Sample.loss_mask has shape {mask.shape}, tokens {tokens.shape}")
        mask = (mask != 0).astype(np.uint8)
    images = None
    if result.images:
        images = []
        for i, image in enumerate(result.images):
            image = np.asarray(image)
            if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
                raise ValueError(f"{where}: Sample.images[{i}] must be an HxWx3 uint8 array, got {image.dtype} "
                                 f"{image.shape}")
            images.append(image)
    processed = None
    if result.processed is not None:
        if not isinstance(result.processed, dict) or not all(isinstance(k, str) for k in result.processed):
            raise ValueError(f"{where}: Sample.processed must be a dict of the processor's outputs by name")
        if images:
            raise ValueError(f"{where}: Sample.images (built-in patches) and Sample.processed do not go together")
        processed = {k: np.asarray(v) for k, v in result.processed.items() if k not in ("input_ids", "attention_mask")}
    return Sample(tokens.astype(np.int32, copy=False), mask, images, processed)
