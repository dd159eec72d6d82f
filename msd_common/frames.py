"""Images on the wire as uint8 frames, finished into the processor's pixel values by the trainer client.

A processor's image pass is resize, rescale, normalise and (Qwen-VL) patchify with each still image
repeated in the temporal slot. Only the resize needs the image; the rest is arithmetic on the
resized frame, 4 bytes a value (Qwen-VL: 8, with the temporal repeat) where the frame has 1. So a
worker runs the processor's own resize (the image processor called with `do_rescale` and
`do_normalize` off, as vLLM's device path does) and sends the frame; the client finishes it at
`next()` with the processor's arithmetic, in the same order and precision, so that
`batch["pixel_values"]` is bit for bit what the processor gives on the workers' backend:

- the PIL backend (transformers' numpy functions): rescale in float64 then cast to float32
  (`image_transforms.rescale`), normalise in float32 (`image_transforms.normalize`); the client
  rescales by a float32 division where that gives the same value for each of the 256 bytes
  (`exact_divisor`: for 1/255, every processor here), with no float64 array;
- the torchvision backend: rescale fused into normalise (`_fuse_mean_std_and_rescale_factor`:
  mean and std, as float32, times 1/rescale_factor), then `(x - mean) / std` in float32.

Each sample carries its recipe (`pixel_recipe`, a few float64 values) beside its frames
(`pixel_frames`, every image's [3, H, W] uint8 flattened, image after image): two sources with
different processors may share a micro-batch.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

FRAMES = "pixel_frames"
RECIPE = "pixel_recipe"
VIDEO_FRAMES = "video_frames"  # a sample's videos: every video's [T, 3, H, W] uint8, video after video
VIDEO_RECIPE = "video_recipe"
# what each frame array becomes: (recipe, grids, the processor's name for it)
FINISHED = ((FRAMES, RECIPE, "image_grid_thw", "pixel_values"),
            (VIDEO_FRAMES, VIDEO_RECIPE, "video_grid_thw", "pixel_values_videos"))
# patchified with a temporal repeat (Qwen-VL images), [images, 3, H, W], patchified over frames (Qwen-VL videos),
# [1, tiles, 3, S, S] (Idefics3: a batch of one, every sample's tiles along the second axis)
# [images, most patches, 3, S, S] (LLaVA-NeXT: each image's patches, as many as pixel_patch_counts says, padded)
LAYOUTS = ("qwen_patches", "frames", "qwen_video", "tiles", "anyres")
PATCH_COUNTS = "pixel_patch_counts"  # the anyres layout's: each image's patches
PIXEL_MASK = "pixel_attention_mask"  # the tiled layout's: which pixels of each tile are the image's (all: none padded)
BACKENDS = ("pil", "torchvision")
RECIPE_VERSION = 1.0
CHANNELS = 3


@functools.lru_cache(maxsize=16)
def exact_divisor(rescale_factor: float) -> float | None:
    """A float32 d such that every uint8 value v divided by d in float32 (one correctly rounded
    division) equals transformers' PIL rescale of v: v times rescale_factor in float64, cast to
    float32. Checked on all 256 values, so exact where it is returned (1/255: d = 255); None where
    the division gives another value for some byte."""
    if not rescale_factor:
        return None
    d = np.float32(1.0 / rescale_factor)
    v = np.arange(256)
    wide = (v.astype(np.float64) * rescale_factor).astype(np.float32)
    return float(d) if np.array_equal(wide, v.astype(np.float32) / d) else None


def per_channel(value: Any) -> tuple[float, float, float]:
    """A processor's mean or std (one number, or one per channel) as three floats."""
    values = [float(v) for v in (value if isinstance(value, (list, tuple)) else [value] * CHANNELS)]
    return tuple(values)  # type: ignore[return-value]


@dataclass(frozen=True)
class FrameRecipe:
    """How a sample's uint8 frames become the processor's pixel values."""

    layout: str
    backend: str
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    patch: int = 0  # qwen_patches: patch size, merge size, temporal patch size
    merge: int = 0
    temporal: int = 0
    height: int = 0  # frames: every image's size (the processor resizes every image to it)
    width: int = 0

    def to_array(self) -> np.ndarray:
        return np.array([RECIPE_VERSION, LAYOUTS.index(self.layout), BACKENDS.index(self.backend),
                         float(self.do_rescale), self.rescale_factor, float(self.do_normalize), *self.mean,
                         *self.std, self.patch, self.merge, self.temporal, self.height, self.width], np.float64)

    @classmethod
    def from_array(cls, a: np.ndarray) -> "FrameRecipe":
        v = np.asarray(a, np.float64).reshape(-1)
        if len(v) != 17 or v[0] != RECIPE_VERSION:
            raise ValueError(f"{RECIPE}: expected version {RECIPE_VERSION} with 17 values, got {v.tolist()}")
        return cls(LAYOUTS[int(v[1])], BACKENDS[int(v[2])], bool(v[3]), float(v[4]), bool(v[5]),
                   tuple(float(x) for x in v[6:9]), tuple(float(x) for x in v[9:12]),  # type: ignore[arg-type]
                   int(v[12]), int(v[13]), int(v[14]), int(v[15]), int(v[16]))

    def shapes(self, frames: int, grids: np.ndarray | None) -> list[tuple[int, ...]]:
        """Each image's frame shape [3, H, W] (a video's [T, 3, H, W]): from its patch grid, or the
        processor's one size."""
        if self.layout == "qwen_video":
            if grids is None:
                raise ValueError(f"{VIDEO_FRAMES}: a qwen_video recipe needs video_grid_thw")
            return [(int(t) * self.temporal, CHANNELS, int(h) * self.patch, int(w) * self.patch)
                    for t, h, w in np.asarray(grids).tolist()]
        if self.layout == "qwen_patches":
            if grids is None:
                raise ValueError(f"{FRAMES}: a qwen_patches recipe needs image_grid_thw")
            return [(CHANNELS, int(h) * self.patch, int(w) * self.patch) for _, h, w in np.asarray(grids).tolist()]
        per = CHANNELS * self.height * self.width
        if per == 0 or frames % per:
            raise ValueError(f"{FRAMES}: {frames} bytes are not whole {self.height}x{self.width} frames")
        return [(CHANNELS, self.height, self.width)] * (frames // per)

    def rows(self, shapes: list[tuple[int, ...]]) -> int:
        """Rows of the pixel values of images (videos) of these frame shapes."""
        if self.layout == "qwen_video":
            return sum((t // self.temporal) * (h // self.patch) * (w // self.patch) for t, _, h, w in shapes)
        if self.layout == "qwen_patches":
            return sum((h // self.patch) * (w // self.patch) for _, h, w in shapes)
        return len(shapes)

    def finish(self, frames: np.ndarray, grids: np.ndarray | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
        """The pixel values of one sample's frames (numpy, on this host's CPU), written into `out`
        (rows of a micro-batch's array) where given: no array per image, no concatenation.
        anyres: `grids` holds each image's patches."""
        if self.layout == "anyres":
            return self._finish_anyres(frames, np.asarray(grids, np.int64), out)
        shapes = self.shapes(len(frames), grids)
        if out is None:
            out = np.empty((self.rows(shapes), *self._row_shape()), np.float32)
        constants = self._constants(lambda v: np.array(v, np.float32)[:, None, None])
        at = row = 0
        for shape in shapes:
            n = int(np.prod(shape))
            frame = frames[at:at + n].reshape(shape)
            if self.layout == "qwen_patches":
                k = (shape[1] // self.patch) * (shape[2] // self.patch)
                self._patchify_into(frame, constants, out[row:row + k])
            elif self.layout == "qwen_video":
                k = self.rows([shape])
                self._patchify_video_into(frame, constants, out[row:row + k])
            else:
                k = 1
                out[row] = self._values(frame, *constants, _astype)
            at, row = at + n, row + k
        if at != len(frames):
            raise ValueError(f"{FRAMES}: {len(frames)} bytes where the images' frames take {at}")
        return out

    def _finish_anyres(self, frames: np.ndarray, patches: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """LLaVA-NeXT's [images, most patches, 3, S, S]: each image's patches, written in place, then zeros."""
        if out is None:
            out = np.empty((len(patches), int(patches.max(initial=0)), *self._row_shape()), np.float32)
        each, per = dataclasses.replace(self, layout="frames"), CHANNELS * self.height * self.width
        at = 0
        for image, n in enumerate(patches.tolist()):
            each.finish(frames[at:at + n * per], out=out[image, :n])
            out[image, n:] = 0.0
            at += n * per
        if at != len(frames):
            raise ValueError(f"{FRAMES}: {len(frames)} bytes where the images' {patches.tolist()} patches take {at}")
        return out

    def _row_shape(self) -> tuple[int, ...]:
        if self.layout in ("qwen_patches", "qwen_video"):
            return (CHANNELS * self.temporal * self.patch * self.patch,)
        return (CHANNELS, self.height, self.width)

    def _constants(self, make: Callable[[Any], Any]) -> tuple[Any, Any, Any]:
        """The mean, the std and (the PIL backend's rescale, where float32 division gives its values,
        exact_divisor) the divisor, each a float32 [3, 1, 1] array or tensor by `make(3 floats)`: a
        divisor of one element would be a scalar to torch, which divides by multiplying by its reciprocal."""
        divisor = exact_divisor(self.rescale_factor) if self.backend == "pil" and self.do_rescale else None
        return make(self.mean), make(self.std), None if divisor is None else make([divisor] * CHANNELS)

    def _values(self, frame: Any, mean: Any, std: Any, divisor: Any, cast: Callable[[Any, str], Any]) -> Any:
        """One frame [3, H, W] rescaled and normalised as the backend does it, by the same
        operations on a numpy array or a torch tensor (`cast(x, "float32" | "float64")`; mean, std
        and divisor as _constants makes them; a python float times a float32 array stays float32 in both)."""
        if self.backend == "torchvision":
            x = cast(frame, "float32")
            if self.do_rescale and self.do_normalize:  # fused: float32 mean and std times 1/rescale_factor
                scale = 1.0 / self.rescale_factor
                return (x - mean * scale) / (std * scale)
            if self.do_normalize:
                return (x - mean) / std
            return x * self.rescale_factor if self.do_rescale else x
        if self.do_rescale and divisor is not None:  # transformers' rescale's values, with no float64 array
            x = cast(frame, "float32")
            x /= divisor
        elif self.do_rescale:  # transformers' rescale: upcast to float64 first, then down to float32
            wide = cast(frame, "float64")
            wide *= self.rescale_factor
            x = cast(wide, "float32")
        else:
            x = cast(frame, "float32")
        if self.do_normalize:  # in place: the same float32 operations, no array more
            x -= mean
            x /= std
        return x

    def _patchify_into(self, frame: np.ndarray, constants: tuple[Any, Any, Any], out: np.ndarray) -> None:
        """One uint8 image finished into its rows of `out`: Qwen-VL's patchify (merge windows, the
        frame repeated in the temporal slot). One band of merge windows at a time, whose values are
        made while they are in the cache: each byte read once and each value written once to memory."""
        c, h, w = frame.shape
        p, m, t = self.patch, self.merge, self.temporal
        gw, band = w // p, p * m
        rows = gw * m  # of `out`, a band's
        for b in range(h // band):
            x = self._values(frame[:, b * band:(b + 1) * band], *constants, _astype)
            x = x.reshape(c, m, p, gw // m, m, p).transpose(3, 1, 4, 0, 2, 5)
            out[b * rows:(b + 1) * rows].reshape(gw // m, m, m, c, t, p, p)[...] = x[:, :, :, :, None]

    def _patchify_video_into(self, video: np.ndarray, constants: tuple[Any, Any, Any], out: np.ndarray) -> None:
        """One uint8 video [T, 3, H, W] (T whole temporal patches) finished into its rows of `out`:
        Qwen-VL's patchify, one temporal patch (its `temporal` frames) at a time. The values of a
        whole video at once took three times its pixel values beside them (the float32 cast, the
        normalisation's temporaries): 331 MB more for a 110 MB micro-batch, at the trainer's peak."""
        frames, c, h, w = video.shape
        t = self.temporal
        rows, split, axes = self._video_patch_layout(c, h, w)
        for g in range(frames // t):
            x = self._values(video[g * t:(g + 1) * t], *constants, _astype).reshape(split).transpose(axes)
            out[g * rows:(g + 1) * rows].reshape(x.shape)[...] = x

    def _video_patch_layout(self, c: int, h: int, w: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """Qwen-VL's patchify of one temporal patch of a video's frames [temporal, c, h, w]: its rows,
        the shape its values are split into, and the axes that order them as the rows' values
        (numpy's transpose and torch's permute alike)."""
        p, m, t = self.patch, self.merge, self.temporal
        return ((h // p) * (w // p), (1, t, c, h // p // m, m, p, w // p // m, m, p), (0, 3, 6, 4, 7, 2, 1, 5, 8))

    def finish_torch(self, frames: Any, grids: np.ndarray | None = None) -> Any:
        """The same on a torch tensor of uint8 frames, on its device (the trainer's GPU)."""
        import torch

        shapes = self.shapes(int(frames.numel()), grids)
        constants = self._constants(lambda v: torch.tensor(v, dtype=torch.float32, device=frames.device)[:, None, None])

        def cast(a: Any, dtype: str) -> Any:
            return a.to(getattr(torch, dtype))

        if self.layout == "qwen_video":
            return self._finish_videos_torch(frames, shapes, constants, cast)
        out, at = [], 0
        for shape in shapes:
            n = int(np.prod(shape))
            x = self._values(frames[at:at + n].reshape(shape), *constants, cast)
            at += n
            if self.layout == "qwen_patches":
                c, h, w = shape
                p, m, t = self.patch, self.merge, self.temporal
                gh, gw = h // p, w // p
                x = x.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
                x = x.unsqueeze(5).expand(*x.shape[:5], t, *x.shape[5:]).reshape(gh * gw, c * t * p * p)
            out.append(x)
        if not out:
            return torch.zeros((0, *self._row_shape()), dtype=torch.float32, device=frames.device)
        return torch.stack(out) if self.layout in ("frames", "tiles") else torch.cat(out)

    def _finish_videos_torch(self, frames: Any, shapes: list[tuple[int, ...]], constants: tuple[Any, Any, Any],
                             cast: Callable[[Any, str], Any]) -> Any:
        """Videos on the device, as finish makes them: into one tensor, a temporal patch at a time
        (the values of a whole video at once took three times its pixel values of the device's memory)."""
        import torch

        out = torch.empty((self.rows(shapes), *self._row_shape()), dtype=torch.float32, device=frames.device)
        t = self.temporal
        at = row = 0
        for f, c, h, w in shapes:
            video = frames[at:at + f * c * h * w].reshape(f, c, h, w)
            rows, split, axes = self._video_patch_layout(c, h, w)
            for g in range(f // t):
                x = self._values(video[g * t:(g + 1) * t], *constants, cast).reshape(split).permute(axes)
                out[row:row + rows].view(x.shape).copy_(x)
                row += rows
            at += f * c * h * w
        return out


def _astype(a: np.ndarray, dtype: str) -> np.ndarray:
    return a.astype(dtype)


class PendingPixels:
    """A micro-batch's pixel values, to be made where the trainer wants them: each piece's own
    float array, or its (uint8 frames, recipe, image_grid_thw), in packing order."""

    def __init__(self, parts: list[Any], tiled: bool = False) -> None:
        """tiled: the pieces' own arrays (made whole at prepare time) are tiles too."""
        self.parts = parts
        layouts = {p[1].layout == "tiles" for p in parts if isinstance(p, tuple)}
        if len(layouts) > 1 or (tiled and False in layouts):
            raise ValueError("pixel values of tiled (Idefics3) and other processors in one micro-batch")
        self.tiled = tiled or layouts == {True}  # [1, tiles, 3, S, S]: one batch of every piece's tiles

    def _sizes(self) -> list[tuple[int, tuple[int, ...]]]:
        """Each piece's (rows, row shape) in the micro-batch's pixel values."""
        sizes = []
        for p in self.parts:
            if isinstance(p, tuple) and p[1].layout == "anyres":  # images of patches (p[2]: each image's)
                sizes.append((len(p[2]), (int(np.max(p[2], initial=0)), *p[1]._row_shape())))
            elif isinstance(p, tuple):
                recipe = p[1]
                sizes.append((recipe.rows(recipe.shapes(len(p[0]), p[2])), recipe._row_shape()))
            else:
                sizes.append((len(p), tuple(np.shape(p)[1:])))
        return sizes

    def finish(self) -> np.ndarray:
        """On this host's CPU (numpy): one array, each piece's rows written into it in turn."""
        sizes = self._sizes()
        if len({shape for _, shape in sizes}) != 1:  # arrays of different shapes: as the processors made them
            if self.tiled:
                raise ValueError(f"tiles of different sizes in one micro-batch: {sorted({s for _, s in sizes})}")
            return concat_padded([p[1].finish(p[0], p[2]) if isinstance(p, tuple) else np.asarray(p)
                                  for p in self.parts])
        out = np.empty((sum(n for n, _ in sizes), *sizes[0][1]), np.float32)
        row = 0
        for p, (n, _) in zip(self.parts, sizes):
            if isinstance(p, tuple):
                p[1].finish(p[0], p[2], out[row:row + n])
            else:
                out[row:row + n] = p
            row += n
        return out[None] if self.tiled else out

    def finish_on(self, device: Any) -> Any:
        """On `device` (a torch device): the uint8 frames are copied there, and the float work
        happens there."""
        import torch

        padded = len({shape for _, shape in self._sizes()}) > 1
        if padded or any(isinstance(p, tuple) and p[1].layout == "anyres" for p in self.parts):  # (on the CPU)
            return torch.from_numpy(self.finish()).to(device)
        made = []
        for p in self.parts:
            if isinstance(p, tuple):
                frames = torch.from_numpy(np.ascontiguousarray(p[0])).to(device, non_blocking=True)
                made.append(p[1].finish_torch(frames, p[2]))
            else:
                made.append(torch.from_numpy(np.asarray(p)).to(device, non_blocking=True))
        out = made[0] if len(made) == 1 else torch.cat(made)
        return out[None] if self.tiled else out


def concat_padded(arrays: list[np.ndarray]) -> np.ndarray:
    """Arrays concatenated along the first axis, each padded with zeros at the end of its other axes
    to the widest: a processor's arrays whose shape differs from sample to sample (a batch of one,
    LLaVA-NeXT's patches padded per sample), padded as transformers pads a batch of them."""
    shapes = {a.shape[1:] for a in arrays}
    if len(shapes) == 1:
        return np.concatenate(arrays)
    if len({len(s) for s in shapes}) != 1:
        raise ValueError(f"arrays of {sorted(len(s) + 1 for s in shapes)} dimensions cannot be batched")
    widest = tuple(max(sizes) for sizes in zip(*shapes))
    out = np.zeros((sum(len(a) for a in arrays), *widest), np.result_type(*arrays))
    row = 0
    for a in arrays:
        out[(slice(row, row + len(a)), *(slice(0, n) for n in a.shape[1:]))] = a
        row += len(a)
    return out


def finished(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A sample's image arrays as its processor run whole gives them to the trainer: its frames (if
    any) finished into pixel_values, its videos' into pixel_values_videos (tiles: the sample's own
    [tiles, 3, S, S] and its pixel mask [tiles, S, S], which the client batches along a leading axis)."""
    out = dict(arrays)
    for frames, recipe, grids, name in FINISHED:
        if frames in out:
            sent, how = out.pop(frames), FrameRecipe.from_array(out.pop(recipe))
            out[name] = how.finish(sent, out.pop(PATCH_COUNTS) if how.layout == "anyres" else out.get(grids))
            if how.layout == "tiles":  # the sample's own [tiles, ...], as its processor run whole gives them
                out[PIXEL_MASK] = tile_mask(sent, how)
    return out


def tile_mask(frames: np.ndarray, recipe: FrameRecipe) -> np.ndarray:
    """The pixel_attention_mask [tiles, S, S] of one sample's tiles: every pixel (the image
    processor pads no tile within a sample)."""
    return np.ones((recipe.rows(recipe.shapes(len(frames), None)), recipe.height, recipe.width), bool)
