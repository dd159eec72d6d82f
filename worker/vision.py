"""Image preprocessing for image-text samples: decode (Pillow), resize to fit a pixel budget keeping
the aspect ratio, cut into square patches.

Sides are rounded down to whole patches (at least one), so the image the model sees is at most
`max_pixels` and its patches tile it exactly. Patches are uint8 rows of patch_size*patch_size*3
values (RGB, row-major within the patch), in raster order over the image.
"""

from __future__ import annotations

import io
import math
from typing import Callable

import numpy as np


from msd_common.formats.limits import (DEFAULT_CAPTION_KEY, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_PIXELS,
                                       DEFAULT_PATCH_SIZE)

__all__ = ["DEFAULT_CAPTION_KEY", "DEFAULT_MAX_PIXELS", "DEFAULT_PATCH_SIZE", "ImageError", "fit", "to_patches",
           "patches_of_array"]


class ImageError(ValueError):
    """The bytes do not decode as an image."""


def fit(width: int, height: int, max_pixels: int, patch_size: int) -> tuple[int, int]:
    """Target (width, height): scaled down to at most max_pixels, sides multiples of patch_size."""
    scale = min(1.0, math.sqrt(max_pixels / (width * height)))
    w = max(patch_size, int(width * scale) // patch_size * patch_size)
    h = max(patch_size, int(height * scale) // patch_size * patch_size)
    return w, h


def _check_default_size(width: int, height: int) -> None:
    if width * height > DEFAULT_MAX_IMAGE_PIXELS:
        raise ImageError(f"image of {width}x{height} pixels is over {DEFAULT_MAX_IMAGE_PIXELS} pixels")


def to_patches(data: bytes, max_pixels: int, patch_size: int,
               check_size: Callable[[int, int], None] | None = None) -> np.ndarray:
    """uint8 [n_patches, patch_size*patch_size*3] of an encoded image (JPEG, PNG, WebP).
    check_size(width, height) sees the size the header declares, before any pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    # The size limit is ours, per source (check_size); Pillow's is one global that raises its own
    # error at open, before we could see the size.
    Image.MAX_IMAGE_PIXELS = None
    try:
        with Image.open(io.BytesIO(data)) as img:  # reads the header only
            (check_size or _check_default_size)(*img.size)
            img.load()
            rgb = img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:  # Pillow's decode errors
        raise ImageError(f"image does not decode ({e})") from None
    return _patches(rgb, max_pixels, patch_size)


def patches_of_array(pixels: np.ndarray, max_pixels: int, patch_size: int) -> np.ndarray:
    """The patches of an HxWx3 uint8 image a transform returned, scaled as decoded images are."""
    from PIL import Image

    if pixels.ndim != 3 or pixels.shape[2] != 3 or pixels.dtype != np.uint8 or min(pixels.shape[:2]) < 1:
        raise ImageError(f"expected an HxWx3 uint8 image, got {pixels.dtype} {pixels.shape}")
    return _patches(Image.fromarray(pixels, "RGB"), max_pixels, patch_size)


def _patches(rgb, max_pixels: int, patch_size: int) -> np.ndarray:
    from PIL import Image

    w, h = fit(rgb.width, rgb.height, max_pixels, patch_size)
    if (w, h) != rgb.size:
        rgb = rgb.resize((w, h), Image.Resampling.BICUBIC)
    p = patch_size
    pixels = np.asarray(rgb, dtype=np.uint8)  # [h, w, 3]
    patches = pixels.reshape(h // p, p, w // p, p, 3).transpose(0, 2, 1, 3, 4)
    return np.ascontiguousarray(patches.reshape(-1, p * p * 3))
