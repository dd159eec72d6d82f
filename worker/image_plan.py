"""A processor sample planned from its images' sizes at prepare time; its image pass run at delivery.

The coordinator plans a step from each record's length and patches, which a worker reports when it
prepares the record; it delivers the record when a planned step takes it. A processor's image pass
(resize, normalise, patchify) is most of a sample's cost, and its float32 pixel values are tens of
times the image file: made at prepare time, they waited in the worker's memory for the whole
prepare window. For the families below the length needs only each image's size: at prepare time
the processor's text pass runs (chat template, each image token expanded by the processor's own
`replace_image_token`, tokenizer, assistant mask) with the image outputs that expansion reads
computed from the size by transformers' own functions, and the image file's bytes are kept. At
delivery the image pass runs on those bytes, and its outputs are checked against the plan: the same
expansion text and the same arrays, so the tokens already sent to the plan are the processor's.

- Qwen2-VL, Qwen2.5-VL, Qwen3-VL: `image_grid_thw` of an image from transformers' `smart_resize`
  (the image processor module's own) over the image processor's patch, merge and pixel limits;
- Gemma 3 without pan-and-scan: `num_crops` 0 for every image (256 tokens each).

Any other processor (or Gemma 3 with pan-and-scan) runs whole at prepare time, as a transform's
processor call does.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

QWEN_VL_PROCESSORS = frozenset({"Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor", "Qwen3VLMoeProcessor"})
FLOAT32_BYTES = 4


@dataclass(frozen=True)
class ImagePlan:
    """What the text pass reads of a conversation's images, computed from their sizes."""

    arrays: dict[str, np.ndarray]  # the image pass's outputs the expansion reads (image_grid_thw, num_crops)
    pixel_bytes: int  # of the pixel values the image pass will make (the frame limit is checked at prepare)


@dataclass(frozen=True)
class PendingImages:
    """A planned sample's images until delivery: their files' bytes and what the plan assumed."""

    files: list[bytes]
    sizes: list[tuple[int, int]]  # (width, height) as the processor sees each image (EXIF orientation applied)
    plan: ImagePlan
    replacements: list[str]  # each image token's expansion in the planned text

    @property
    def nbytes(self) -> int:
        return sum(len(f) for f in self.files)


Planner = Callable[[list[tuple[int, int]]], ImagePlan]


def planner_of(processor: Any) -> Planner | None:
    """How a processor's image outputs follow from image sizes, or None where they do not (here)."""
    name = type(processor).__name__
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None:
        return None
    if name in QWEN_VL_PROCESSORS and _has(image_processor, "patch_size", "merge_size", "temporal_patch_size", "size"):
        resize = getattr(sys.modules.get(type(image_processor).__module__), "smart_resize", None)
        if resize is not None:
            return lambda sizes: _qwen_plan(image_processor, resize, sizes)
    if name == "Gemma3Processor" and not getattr(image_processor, "do_pan_and_scan", False):
        size = getattr(image_processor, "size", None) or {}
        try:
            pixels_per_image = 3 * int(size["height"]) * int(size["width"]) * FLOAT32_BYTES
        except (KeyError, TypeError, ValueError):
            return None
        return lambda sizes: ImagePlan({"num_crops": np.zeros(len(sizes), np.int64)}, pixels_per_image * len(sizes))
    return None


def _has(obj: Any, *names: str) -> bool:
    return all(getattr(obj, n, None) is not None for n in names)


def _qwen_plan(image_processor: Any, resize: Callable[..., tuple[int, int]], sizes: list[tuple[int, int]]) -> ImagePlan:
    patch, merge = int(image_processor.patch_size), int(image_processor.merge_size)
    size = image_processor.size
    grids = []
    for width, height in sizes:
        # the image processor's resize: smart_resize over its size's shortest and longest edge (in pixels)
        h, w = resize(height, width, factor=patch * merge, min_pixels=size["shortest_edge"],
                      max_pixels=size["longest_edge"])
        grids.append((1, h // patch, w // patch))
    grid = np.array(grids, np.int64).reshape(-1, 3)
    row = 3 * int(image_processor.temporal_patch_size) * patch * patch * FLOAT32_BYTES
    return ImagePlan({"image_grid_thw": grid}, int(grid.prod(axis=1).sum()) * row)


def disagreement(pending: PendingImages, made: dict[str, Any], replacements: list[str]) -> str | None:
    """Why the image pass's outputs differ from the plan's, or None when they agree."""
    if replacements != pending.replacements:
        return "its image tokens differ from the planned ones"
    for name, planned in pending.plan.arrays.items():
        if name not in made:
            return f"the image pass gave no {name}"
        got = np.asarray(made[name])
        if got.shape != planned.shape or not np.array_equal(got, planned):
            return f"its {name} {got.tolist()} differs from the planned {planned.tolist()}"
    return None
