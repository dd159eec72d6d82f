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

The image pass at delivery stops at the resized uint8 frame (the image processor called with
`do_rescale` and `do_normalize` off, and for Qwen-VL its patchify deferred): the frames go on the
wire with their `FrameRecipe`, and the trainer client finishes them (msd_common/frames.py).

- Qwen2-VL, Qwen2.5-VL, Qwen3-VL: `image_grid_thw` of an image from transformers' `smart_resize`
  (the image processor module's own) over the image processor's patch, merge and pixel limits;
- Gemma 3: `num_crops` of each image, 0 without pan-and-scan, else the image processor's own
  `pan_and_scan` run on a view of the image's shape that holds no pixels (256 tokens an image or crop);
- Idefics3 (SmolVLM's first models ship its processor): each image's tile `rows` and `cols` (0 and
  0: no split), from its size resized as the image processor resizes it: its longest edge to `size`
  (the module's own `get_resize_output_image_size`, on a view that holds no pixels), then up to
  whole tiles of `max_image_size` (`resize_for_vision_encoder`'s arithmetic); rows x cols tiles and
  a global view an image, `image_seq_len` tokens each. The processor's own call drops rows and
  cols: they shape the text only, and are not sent (`PendingImages.plan_only`);
- LLaVA-NeXT, LLaVA-OneVision: `image_sizes` (and OneVision's `batch_num_images`), and each image's
  patches from its best grid pinpoint (transformers' `select_best_resolution`; OneVision cuts a
  conversation's one image only); the expansion also reads the patch size off `pixel_values`,
  planned as a stand-in that holds no pixels (`SHAPE_ONLY`, not compared);
- InternVL: `num_patches` of each image, the tiles of the canvas its module's
  `get_optimal_tiled_canvas` picks and a thumbnail where there are several; its call slices a
  stand-in `pixel_values` of a row a patch and no pixels by them.

Any other processor runs whole at prepare time, as a transform's processor call does.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from msd_common.frames import CHANNELS, FrameRecipe, per_channel

QWEN_VL_PROCESSORS = frozenset({"Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor", "Qwen3VLMoeProcessor"})
# square tiles and a global view (SmolVLM's first models ship Idefics3's processor, SmolVLM2 its own with the
# same image processor)
TILED_PROCESSORS = frozenset({"Idefics3Processor", "SmolVLMProcessor"})
# patches of a grid pinpoint, padded to a sample's most image (LLaVA-OneVision: a sample's one image only)
ANYRES_PROCESSORS = frozenset({"LlavaNextProcessor", "LlavaOnevisionProcessor"})
INTERNVL_PROCESSORS = frozenset({"InternVLProcessor"})  # the tiles of a canvas of closest aspect, and a thumbnail
# a planned stand-in whose shape the text pass reads (LLaVA-NeXT's patch size; InternVL's patches, sliced by its call)
SHAPE_ONLY = "pixel_values"


@dataclass(frozen=True)
class ImagePlan:
    """What the text pass reads of a conversation's images, computed from their sizes."""

    arrays: dict[str, np.ndarray]  # the image pass's outputs the expansion reads (image_grid_thw, num_crops)
    pixel_bytes: int  # of the uint8 frames the image pass will make (the frame limit is checked at prepare)
    patches: np.ndarray | None = None  # LLaVA-NeXT: each image's patches (its pixel values pad them to the most)


@dataclass(frozen=True)
class PendingImages:
    """A planned sample's images until delivery: their files' bytes and what the plan assumed."""

    files: list[bytes]
    sizes: list[tuple[int, int]]  # (width, height) as the processor sees each image (EXIF orientation applied)
    plan: ImagePlan
    replacements: list[str]  # each image token's expansion in the planned text
    plan_only: frozenset[str] = frozenset()  # planned arrays the processor's call drops (Idefics3's rows, cols)

    @property
    def nbytes(self) -> int:
        return sum(len(f) for f in self.files)


Planner = Callable[[list[tuple[int, int]], dict[str, Any]], ImagePlan]  # (sizes, the image pass's arguments)


def planner_of(processor: Any) -> Planner | None:
    """How a processor's image outputs follow from image sizes, or None where they do not (here)."""
    name = type(processor).__name__
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None:
        return None
    if name in QWEN_VL_PROCESSORS and _has(image_processor, "patch_size", "merge_size", "temporal_patch_size", "size"):
        resize = getattr(sys.modules.get(type(image_processor).__module__), "smart_resize", None)
        if resize is not None:
            return lambda sizes, kwargs: _qwen_plan(image_processor, resize, sizes)
    if name == "Gemma3Processor":
        size = getattr(image_processor, "size", None) or {}
        try:
            frame = CHANNELS * int(size["height"]) * int(size["width"])
        except (KeyError, TypeError, ValueError):
            return None

        def gemma3_plan(sizes: list[tuple[int, int]], kwargs: dict[str, Any]) -> ImagePlan:
            crops = np.array([_gemma3_crops(image_processor, kwargs, w, h) for w, h in sizes], np.int64)
            return ImagePlan({"num_crops": crops}, frame * int(len(sizes) + crops.sum()))

        return gemma3_plan
    if name in INTERNVL_PROCESSORS and _has(image_processor, "size"):
        module = sys.modules.get(type(image_processor).__module__)
        if hasattr(module, "get_optimal_tiled_canvas"):
            return lambda sizes, kwargs: _internvl_plan(image_processor, module, sizes, kwargs)
    if name in ANYRES_PROCESSORS and _has(image_processor, "image_grid_pinpoints"):
        onevision = name == "LlavaOnevisionProcessor"
        return lambda sizes, kwargs: _anyres_plan(image_processor, sizes, kwargs, onevision)
    if name in TILED_PROCESSORS and _has(image_processor, "max_image_size"):
        module = sys.modules.get(type(image_processor).__module__)
        if hasattr(module, "get_resize_output_image_size"):
            return lambda sizes, kwargs: _tiles_plan(image_processor, module, sizes, kwargs)
    return None


def _gemma3_crops(image_processor: Any, kwargs: dict[str, Any], width: int, height: int) -> int:
    """Gemma 3's pan-and-scan crops of an image this size (with the arguments the processor passes,
    else the image processor's own), by the image processor's own method on an image of that shape
    that holds no pixels (a zero-stride view: it reads the shape only)."""

    arg = functools.partial(_argument, image_processor, kwargs)

    if not arg("do_pan_and_scan"):
        return 0
    args = (arg("pan_and_scan_min_crop_size"), arg("pan_and_scan_max_num_crops"),
            arg("pan_and_scan_min_ratio_to_activate"))
    if hasattr(image_processor, "pan_and_scan"):  # the PIL backend: one image, channels first
        return len(image_processor.pan_and_scan(np.broadcast_to(np.zeros((1, 1, 1), np.uint8),
                                                                (CHANNELS, height, width)), *args))
    import torch  # the torchvision backend: a stack of images of one size

    return len(image_processor.pan_and_scan_batched(torch.zeros(1, 1, 1, 1, dtype=torch.uint8)
                                                    .expand(1, CHANNELS, height, width), *args))


def _tiles_plan(image_processor: Any, module: Any, sizes: list[tuple[int, int]], kwargs: dict[str, Any]) -> ImagePlan:
    """Idefics3's (SmolVLM's) tile rows and columns of images of these sizes, with the arguments
    the processor passes, else the image processor's own."""

    arg = functools.partial(_argument, image_processor, kwargs)

    tile, size = _edge(arg("max_image_size"), "longest_edge"), arg("size")
    rows, cols, tiles = [], [], 0
    for width, height in sizes:
        if arg("do_resize"):
            if _edge(size, "longest_edge"):  # the longest edge to size, the module's own arithmetic
                view = np.broadcast_to(np.zeros((1, 1, 1), np.uint8), (CHANNELS, height, width))
                height, width = module.get_resize_output_image_size(view,
                                                                    resolution_max_side=_edge(size, "longest_edge"))
            else:
                height, width = _edge(size, "height"), _edge(size, "width")
        r = c = 0
        if arg("do_image_splitting"):
            height, width = _whole_tiles(int(height), int(width), tile)
            if height > tile or width > tile:  # split_images: whole tiles, then the global view
                r, c = (height - tile) // tile + 1, (width - tile) // tile + 1
        rows.append(r)
        cols.append(c)
        tiles += r * c + 1
    return ImagePlan({"rows": np.array([rows], np.int64), "cols": np.array([cols], np.int64)},
                     CHANNELS * tile * tile * tiles)


def _anyres_plan(image_processor: Any, sizes: list[tuple[int, int]], kwargs: dict[str, Any],
                 onevision: bool = False) -> ImagePlan:
    """LLaVA-NeXT's (LLaVA-OneVision's) images of these sizes: `image_sizes`, and a stand-in
    `pixel_values` of the patch size, which the expansion reads for the patch grid; each image is
    cut into the patches of its best grid pinpoint (transformers' `select_best_resolution`) and
    resized whole as one more. LLaVA-OneVision: only a sample's one image is cut (several are each
    resized whole), and `batch_num_images` says how many the sample holds."""
    from transformers.image_processing_utils import select_best_resolution

    arg = functools.partial(_argument, image_processor, kwargs)

    crop = arg("crop_size") or arg("size")  # (LLaVA-OneVision's patches are its size)
    height, width = _edge(crop, "height"), _edge(crop, "width")
    patches = []
    for w, h in sizes:
        if onevision and len(sizes) > 1:
            patches.append(1)
            continue
        best_height, best_width = select_best_resolution((h, w), arg("image_grid_pinpoints"))
        patches.append((best_height // height) * (best_width // width) + 1)
    stand_in = np.broadcast_to(np.zeros((), np.uint8), (len(sizes), 1, CHANNELS, height, width))
    arrays = {"image_sizes": np.array([[h, w] for w, h in sizes], np.int64).reshape(-1, 2), SHAPE_ONLY: stand_in}
    if onevision:
        arrays["batch_num_images"] = np.array([len(sizes)], np.int64)
    return ImagePlan(arrays, CHANNELS * height * width * sum(patches), np.array(patches, np.int64))


def _internvl_plan(image_processor: Any, module: Any, sizes: list[tuple[int, int]],
                   kwargs: dict[str, Any]) -> ImagePlan:
    """InternVL's `num_patches` of images of these sizes (its image processor's crop_image_to_patches:
    the patches of the canvas its module's `get_optimal_tiled_canvas` picks, and a thumbnail where
    there are several), and a stand-in `pixel_values` of a row a patch and no pixels, which its call
    slices by them."""
    arg = functools.partial(_argument, image_processor, kwargs)
    height, width = _edge(arg("size"), "height"), _edge(arg("size"), "width")
    patches = []
    for w, h in sizes:
        n = 1
        if arg("crop_to_patches") and arg("max_patches") > 1:
            columns, rows = module.get_optimal_tiled_canvas((h, w), (height, width), arg("min_patches"),
                                                            arg("max_patches"))
            n = columns * rows + (1 if columns * rows != 1 else 0)
        patches.append(n)
    return ImagePlan({"num_patches": np.array(patches, np.int64), SHAPE_ONLY: np.zeros((sum(patches), 0), np.uint8)},
                     CHANNELS * height * width * sum(patches))


def _whole_tiles(height: int, width: int, tile: int) -> tuple[int, int]:
    """The size Idefics3's `resize_for_vision_encoder` resizes an image of this size to:
    its longest edge up to whole tiles, the other edge from the aspect ratio, then up to whole tiles."""
    aspect_ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect_ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect_ratio) / tile) * tile
    return height, width


def _edge(size: Any, key: str) -> int | None:
    """`size[key]` of a processor's size (a dict, or transformers' SizeDict), None where unset."""
    value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
    return int(value) if value else None


def _argument(image_processor: Any, kwargs: dict[str, Any], name: str) -> Any:
    """An argument of the image pass: as the processor passes it, else the image processor's own."""
    value = kwargs.get(name)
    return getattr(image_processor, name, None) if value is None else value


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
    return ImagePlan({"image_grid_thw": grid}, int(grid.prod(axis=1).sum()) * CHANNELS * patch * patch)


def frame_recipe(processor: Any, kwargs: dict[str, Any]) -> FrameRecipe:
    """How the trainer client finishes this processor's frames: its image processor's rescale and
    normalisation (as the call's `kwargs` set them, else its own), on its backend."""
    ip = processor.image_processor

    arg = functools.partial(_argument, ip, kwargs)

    common = dict(backend=getattr(ip, "backend", "pil"), do_rescale=bool(arg("do_rescale")),
                  rescale_factor=float(arg("rescale_factor")), do_normalize=bool(arg("do_normalize")),
                  mean=per_channel(arg("image_mean")), std=per_channel(arg("image_std")))
    if type(processor).__name__ in QWEN_VL_PROCESSORS:
        return FrameRecipe("qwen_patches", **common, patch=int(ip.patch_size), merge=int(ip.merge_size),
                           temporal=int(ip.temporal_patch_size))
    if type(processor).__name__ in TILED_PROCESSORS:
        tile = _edge(arg("max_image_size"), "longest_edge")
        return FrameRecipe("tiles", **common, height=tile, width=tile)
    if type(processor).__name__ in ANYRES_PROCESSORS:
        crop = arg("crop_size") or arg("size")
        return FrameRecipe("anyres", **common, height=_edge(crop, "height"), width=_edge(crop, "width"))
    size = ip.size
    return FrameRecipe("frames", **common, height=int(size["height"]), width=int(size["width"]))


class FrameCapture:
    """While active, a Qwen-VL image processor's patchify keeps each resized frame (uint8, as its
    resize made it) instead of patchifying it; the trainer client patchifies (FrameRecipe)."""

    def __init__(self, image_processor: Any) -> None:
        self.image_processor = image_processor
        self.frames: list[np.ndarray] = []

    def __enter__(self) -> "FrameCapture":
        def keep(images: Any, patch_size: int, merge_size: int, temporal_patch_size: int) -> tuple[Any, int, int]:
            row = CHANNELS * temporal_patch_size * patch_size * patch_size
            if hasattr(images, "numpy"):  # torchvision: a stack of frames of one size
                self.frames.extend(np.ascontiguousarray(f.numpy()) for f in images.cpu())
                return images.new_zeros((images.shape[0], 0, row)), images.shape[-2] // patch_size, \
                    images.shape[-1] // patch_size
            self.frames.append(np.ascontiguousarray(images))
            return np.zeros((0, row), np.float32), images.shape[-2] // patch_size, images.shape[-1] // patch_size

        self.image_processor.patchify = keep  # this instance only, for this call
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.image_processor.patchify

    def in_order(self, grids: np.ndarray, patch: int) -> list[np.ndarray]:
        """The frames in image order: the torchvision backend patchifies images grouped by size
        (in order within a size), so each image takes the next frame of its grid's size."""
        by_shape: dict[tuple[int, int], list[np.ndarray]] = {}
        for f in self.frames:
            by_shape.setdefault(f.shape[-2:], []).append(f)
        out = []
        for _, h, w in np.asarray(grids).tolist():
            waiting = by_shape.get((int(h) * patch, int(w) * patch))
            if not waiting:
                raise ValueError(f"no resized frame of {int(h) * patch}x{int(w) * patch} for an image")
            out.append(waiting.pop(0))
        return out


def disagreement(pending: PendingImages, made: dict[str, Any], replacements: list[str]) -> str | None:
    """Why the image pass's outputs differ from the plan's, or None when they agree."""
    if replacements != pending.replacements:
        return "its image tokens differ from the planned ones"
    for name, planned in pending.plan.arrays.items():
        if name == SHAPE_ONLY:
            continue
        if name not in made:
            return f"the image pass gave no {name}"
        got = np.asarray(made[name])
        if got.shape != planned.shape or not np.array_equal(got, planned):
            return f"its {name} {got.tolist()} differs from the planned {planned.tolist()}"
    return None
