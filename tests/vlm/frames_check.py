"""Run in the reference environment (.venv-vlm: transformers with torch and torchvision):
`python frames_check.py BACKEND PROCESSOR_DIR...`. For images of several sizes (in an order where the
torchvision backend groups them), the worker's frames (worker/image_plan.FrameCapture, the image
processor called with rescale and normalise off) finished by the client (PendingPixels), with numpy
and with torch, against the image processor run whole; for Idefics3 also its pixel mask, and its
tiles planned from image sizes against its image pass. Prints one JSON line a directory, in order."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402, F401  (loaded before transformers, as the trainer does)
from PIL import Image  # noqa: E402
from transformers import AutoImageProcessor  # noqa: E402

from msd_common.frames import FrameRecipe, PendingPixels, tile_mask  # noqa: E402
from worker.image_plan import FrameCapture, _anyres_plan, _tiles_plan  # noqa: E402


def plan_equal(ip) -> bool:
    """Idefics3's tile rows and columns planned from sizes (worker/image_plan.py) equal its image
    pass's, with and without splitting and at another longest edge, over sizes from one pixel to past
    the longest edge and aspects up to 1:2000 (the image pass run on blank images of each size)."""
    module = sys.modules[type(ip).__module__]
    rng = np.random.default_rng(1)
    sizes = [(1, 1), (364, 364), (365, 364), (364, 365), (1000, 364), (729, 728), (4000, 3000), (3000, 17), (14, 5),
             (1456, 1), (1, 2000), *[tuple(int(v) for v in rng.integers(1, 2500, 2)) for _ in range(12)]]
    # (a longest edge of whole tiles, as published, and one of no whole tiles: the edge rounded up to tiles)
    for kwargs in ({}, {"do_image_splitting": False}, {"size": {"longest_edge": 1000}}):
        for size in sizes:
            made = ip([Image.new("RGB", size)], do_rescale=False, do_normalize=False, return_row_col_info=True,
                      **kwargs)
            plan = _tiles_plan(ip, module, [size], kwargs)
            if not (np.array_equal(plan.arrays["rows"], np.asarray(made["rows"]))
                    and np.array_equal(plan.arrays["cols"], np.asarray(made["cols"]))
                    and plan.pixel_bytes == np.asarray(made["pixel_values"])[0].size):
                print(f"plan differs at {size} {kwargs}: {plan} against rows {made['rows']} cols {made['cols']}",
                      file=sys.stderr)
                return False
    return True


def main(path: str, backend: str) -> None:
    ip = AutoImageProcessor.from_pretrained(path, backend=backend)
    assert ip.backend == backend, ip.backend
    rng = np.random.default_rng(5)
    sizes = [(300, 500), (123, 77), (640, 480), (300, 500), (56, 900)]  # two of one size, apart
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    whole = ip(images, return_tensors="np")
    qwen, tiled = hasattr(ip, "temporal_patch_size"), hasattr(ip, "max_image_size")
    anyres, patches = hasattr(ip, "image_grid_pinpoints"), None
    common = dict(backend=backend, do_rescale=True, rescale_factor=float(ip.rescale_factor), do_normalize=True,
                  mean=tuple(float(v) for v in ip.image_mean), std=tuple(float(v) for v in ip.image_std))
    if qwen:
        recipe = FrameRecipe("qwen_patches", **common, patch=ip.patch_size, merge=ip.merge_size,
                             temporal=ip.temporal_patch_size)
        with FrameCapture(ip) as capture:
            made = ip(images, do_rescale=False, do_normalize=False, return_tensors="np")
        grids = np.asarray(made["image_grid_thw"])
        frames = capture.in_order(grids, ip.patch_size)
    elif anyres:  # LLaVA-NeXT, -OneVision: [images, most patches, 3, S, S]; each image's patches as planned
        crop = ip.crop_size or ip.size  # (images given apart: each is a sample of one image, cut into patches)
        recipe = FrameRecipe("anyres", **common, height=crop["height"], width=crop["width"])
        patches = _anyres_plan(ip, [(w, h) for h, w in sizes], {}).patches
        made = ip(images, do_rescale=False, do_normalize=False, return_tensors="np")
        pixels = np.asarray(made["pixel_values"])
        assert np.array_equal(pixels.astype(np.uint8), pixels) and pixels.shape[1] == patches.max()
        grids = patches
        frames = [pixels.astype(np.uint8)[i, :n] for i, n in enumerate(patches.tolist())]
    elif tiled:  # Idefics3: [1, tiles, 3, S, S], the torchvision backend's in float32 (whole values)
        tile = ip.max_image_size["longest_edge"]
        recipe = FrameRecipe("tiles", **common, height=tile, width=tile)
        made = ip(images, do_rescale=False, do_normalize=False, return_tensors="np")
        pixels = np.asarray(made["pixel_values"])
        assert np.array_equal(pixels.astype(np.uint8), pixels)
        grids, frames = None, list(pixels.astype(np.uint8)[0])
    else:
        recipe = FrameRecipe("frames", **common, height=ip.size["height"], width=ip.size["width"])
        made = ip(images, do_rescale=False, do_normalize=False, return_tensors="np")
        grids, frames = None, list(np.asarray(made["pixel_values"]))
    flat = np.concatenate([np.ascontiguousarray(f).reshape(-1) for f in frames])
    expected = np.asarray(whole["pixel_values"])
    pending = PendingPixels([(flat, recipe, grids)])  # (anyres: grids holds each image's patches)
    by_numpy = pending.finish()
    by_torch = pending.finish_on("cpu").numpy()
    print(json.dumps({
        "plan_equal": plan_equal(ip) if tiled else None,
        "mask_equal": bool(np.array_equal(tile_mask(flat, recipe)[None], np.asarray(whole["pixel_attention_mask"])))
        if tiled else None,
        "frame_dtype": str(flat.dtype), "frame_bytes": int(flat.nbytes), "pixel_bytes": int(expected.nbytes),
        "numpy_equal": bool(by_numpy.dtype == expected.dtype and np.array_equal(by_numpy, expected)),
        "torch_equal": bool(by_torch.dtype == expected.dtype and np.array_equal(by_torch, expected)),
        "max_diff": float(np.abs(by_numpy.astype(np.float64) - expected).max()) if by_numpy.shape == expected.shape
        else None}))


if __name__ == "__main__":
    for processor_dir in sys.argv[2:]:  # one process for every family: its start-up (torch, transformers) once
        main(processor_dir, sys.argv[1])
