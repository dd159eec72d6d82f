"""Run in the reference environment (.venv-vlm: transformers with torch and torchvision):
`python frames_check.py PROCESSOR_DIR BACKEND`. For images of several sizes (in an order where the
torchvision backend groups them), the worker's frames (worker/image_plan.FrameCapture, the image
processor called with rescale and normalise off) finished by the client's FrameRecipe, with numpy
and with torch, against the image processor run whole. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from transformers import AutoImageProcessor  # noqa: E402

from msd_common.frames import FrameRecipe  # noqa: E402
from worker.image_plan import FrameCapture  # noqa: E402


def main(path: str, backend: str) -> None:
    ip = AutoImageProcessor.from_pretrained(path, backend=backend)
    assert ip.backend == backend, ip.backend
    rng = np.random.default_rng(5)
    sizes = [(300, 500), (123, 77), (640, 480), (300, 500), (56, 900)]  # two of one size, apart
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    whole = ip(images, return_tensors="np")
    qwen = hasattr(ip, "temporal_patch_size")
    common = dict(backend=backend, do_rescale=True, rescale_factor=float(ip.rescale_factor), do_normalize=True,
                  mean=tuple(float(v) for v in ip.image_mean), std=tuple(float(v) for v in ip.image_std))
    if qwen:
        recipe = FrameRecipe("qwen_patches", **common, patch=ip.patch_size, merge=ip.merge_size,
                             temporal=ip.temporal_patch_size)
        with FrameCapture(ip) as capture:
            made = ip(images, do_rescale=False, do_normalize=False, return_tensors="np")
        grids = np.asarray(made["image_grid_thw"])
        frames = capture.in_order(grids, ip.patch_size)
    else:
        recipe = FrameRecipe("frames", **common, height=ip.size["height"], width=ip.size["width"])
        made = ip(images, do_rescale=False, do_normalize=False, return_tensors="np")
        grids, frames = None, list(np.asarray(made["pixel_values"]))
    flat = np.concatenate([np.ascontiguousarray(f).reshape(-1) for f in frames])
    expected = np.asarray(whole["pixel_values"])
    by_numpy = recipe.finish(flat, grids)
    by_torch = recipe.finish_torch(torch.from_numpy(flat), grids).numpy()
    print(json.dumps({
        "frame_dtype": str(flat.dtype), "frame_bytes": int(flat.nbytes), "pixel_bytes": int(expected.nbytes),
        "numpy_equal": bool(by_numpy.dtype == expected.dtype and np.array_equal(by_numpy, expected)),
        "torch_equal": bool(by_torch.dtype == expected.dtype and np.array_equal(by_torch, expected)),
        "max_diff": float(np.abs(by_numpy.astype(np.float64) - expected).max()) if by_numpy.shape == expected.shape
        else None}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
