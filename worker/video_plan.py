"""Videos of a processor sample planned from their containers at prepare time; sampled frames decoded
and resized at delivery (the video counterpart of worker/image_plan.py).

At prepare time each video is probed (worker/video.py: frame count, frame rate, size, no frame
decoded) and the processor's text pass runs with `PlannedVideoProcessor` in place of its video
processor: the frames are chosen by the video processor's own `sample_frames` on that metadata,
with the arguments the processor passes it, and the grid follows from the frame count and size by
the video processor module's own `smart_resize`. The processor's own code then does the rest:
`replace_video_token` (Qwen3-VL's timestamps from the sampled frames), Qwen2.5-VL's
`second_per_grid_ts`. At delivery only the sampled frames are decoded, the real video processor
resizes them (rescale and normalise off, its patchify kept from running), and its grid is checked
against the plan's. The frames go on the wire as uint8, padded to whole temporal patches by
repeating the last frame as the processor's patchify does; the trainer client finishes them
(msd_common/frames.py, layout qwen_video).

Video processors of transformers are torchvision code: a worker host serving videos needs torch,
torchvision and PyAV (`msd[video]`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from msd_common.frames import CHANNELS, FrameRecipe, per_channel

from .video import VideoInfo

QWEN2_VIDEO = "Qwen2VLVideoProcessor"  # Qwen2-VL and Qwen2.5-VL
QWEN3_VIDEO = "Qwen3VLVideoProcessor"  # Qwen3-VL (and its MoE)
PLANNED_VIDEO_PROCESSORS = frozenset({QWEN2_VIDEO, QWEN3_VIDEO})
# what the video processor's preprocess takes out of its arguments before sampling
NOT_SAMPLING = ("input_data_format", "do_convert_rgb", "device", "video_metadata", "return_tensors")
# the arguments of the processor's call that decide the resize, passed again at delivery
RESIZE_ARGS = ("do_resize", "size", "min_pixels", "max_pixels", "resample", "patch_size", "temporal_patch_size",
               "merge_size", "cap_pixels_per_frame", "max_video_tokens", "do_convert_rgb")


@dataclass(frozen=True)
class PendingVideos:
    """A planned sample's videos until delivery: their files and the frames the plan sampled."""

    files: list[bytes]
    indices: list[list[int]]  # each video's sampled frame indices
    grids: np.ndarray  # int64 [videos, 3], video_grid_thw as planned
    kwargs: dict[str, Any]  # the resize's arguments the processor passed (the video processor's own otherwise)
    patch: int
    temporal: int

    @property
    def frame_bytes(self) -> int:
        """Bytes of the uint8 frames on the wire: whole temporal patches of each resized video."""
        return int(self.grids.prod(axis=1).sum()) * self.temporal * CHANNELS * self.patch * self.patch

    def blank(self) -> list[np.ndarray]:
        """Frames of the planned sizes, all zero (a video that failed at delivery)."""
        return [np.zeros((t * self.temporal, CHANNELS, h * self.patch, w * self.patch), np.uint8)
                for t, h, w in self.grids.tolist()]


class PlannedVideoProcessor:
    """Stands in for a processor's video processor during its text pass: the outputs that pass reads
    (video_grid_thw, the sampled frames' metadata), from each video's probed metadata."""

    def __init__(self, real: Any, videos: list[tuple[bytes, VideoInfo]]) -> None:
        self.real, self.videos = real, videos
        self.planned: PendingVideos | None = None  # once the processor has called it

    def __getattr__(self, name: str) -> Any:  # merge_size, temporal_patch_size, ... as the real one's
        return getattr(self.real, name)

    def __call__(self, videos: Any, **kwargs: Any) -> dict[str, Any]:
        from transformers.video_utils import VideoMetadata

        real = self.real
        given = {k: v for k, v in kwargs.items() if k in RESIZE_ARGS and v is not None}
        for name in real.valid_kwargs.__annotations__:  # the real preprocess's defaults
            kwargs.setdefault(name, getattr(real, name, None))
        call = {k: v for k, v in kwargs.items() if k not in NOT_SAMPLING}
        sample = call.pop("do_sample_frames")
        metadata, sampled = [], []
        for _, info in self.videos:
            meta = VideoMetadata(total_num_frames=info.frames, fps=info.fps, width=info.width, height=info.height,
                                 duration=info.duration, video_backend="torchcodec")
            indices = real.sample_frames(metadata=meta, **call) if sample else np.arange(info.frames)
            meta.frames_indices = indices
            metadata.append(meta)
            sampled.append([int(i) for i in np.asarray(indices).tolist()])
        settings = real._standardize_kwargs(**{k: v for k, v in call.items() if k != "return_metadata"})
        grid = np.array([video_grid(real, settings, len(indices), info.height, info.width)
                         for (_, info), indices in zip(self.videos, sampled)], np.int64).reshape(-1, 3)
        self.planned = PendingVideos([data for data, _ in self.videos], sampled, grid, given,
                                     int(settings["patch_size"]), int(settings["temporal_patch_size"]))
        return {"video_grid_thw": grid, "video_metadata": metadata}


def video_grid(real: Any, settings: dict[str, Any], frames: int, height: int, width: int) -> tuple[int, int, int]:
    """(grid_t, grid_h, grid_w) of a video of `frames` sampled frames of height x width, as the video
    processor's resize (its module's smart_resize, its per-frame cap) and patchify make them."""
    size = settings["size"]
    patch, merge = int(settings["patch_size"]), int(settings["merge_size"])
    temporal = int(settings["temporal_patch_size"])
    factor = patch * merge
    resize = sys.modules[type(real).__module__].smart_resize
    cap = bool(settings.get("cap_pixels_per_frame"))
    name = type(real).__name__
    if name == QWEN3_VIDEO:
        max_pixels = size.longest_edge
        if cap:
            frame_cap = real.max_video_tokens * factor * factor
            max_pixels = max(min(frame_cap, size.longest_edge // frames), int(size.shortest_edge * 1.05)) * frames
        h, w = resize(num_frames=frames, height=height, width=width, factor=factor, temporal_factor=temporal,
                      min_pixels=size.shortest_edge, max_pixels=max_pixels)
    elif name == QWEN2_VIDEO:
        max_pixels = size.longest_edge
        if cap:
            total = int(real.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total * temporal // frames), int(size.shortest_edge * 1.05))
        h, w = resize(height, width, factor=factor, min_pixels=size.shortest_edge, max_pixels=max_pixels)
    else:
        raise ValueError(f"videos of {name} are not planned here")
    return (frames + temporal - 1) // temporal, h // patch, w // patch


def video_recipe(video_processor: Any) -> FrameRecipe:
    """How the trainer client finishes a video processor's frames: torchvision's fused rescale and
    normalisation, Qwen-VL's video patch layout."""
    vp = video_processor

    return FrameRecipe("qwen_video", "torchvision", bool(vp.do_rescale), float(vp.rescale_factor),
                       bool(vp.do_normalize), per_channel(vp.image_mean), per_channel(vp.image_std),
                       patch=int(vp.patch_size),
                       merge=int(vp.merge_size), temporal=int(vp.temporal_patch_size))


def resized_frames(video_processor: Any, frames: list[np.ndarray], pending: PendingVideos
                   ) -> tuple[np.ndarray, list[np.ndarray]]:
    """The video processor run on decoded frames ([T, H, W, 3] uint8 each) with rescale and
    normalise off and its patchify kept from running: (video_grid_thw, each video's resized frames
    [grid_t * temporal, 3, h, w] uint8, padded with its last frame as patchify pads)."""
    kept: list[np.ndarray] = []

    def keep(videos: Any, patch_size: int, merge_size: int, temporal_patch_size: int) -> tuple[Any, int, int, int]:
        b, t, c, h, w = videos.shape
        pad = -t % temporal_patch_size
        for video in videos.cpu().numpy():
            if pad:
                video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
            kept.append(np.ascontiguousarray(video))
        row = c * temporal_patch_size * patch_size * patch_size
        return videos.new_zeros((b, 0, row)), (t + pad) // temporal_patch_size, h // patch_size, w // patch_size

    video_processor.patchify = keep  # this instance only, for this call
    try:
        made = video_processor(videos=frames, do_sample_frames=False, do_rescale=False, do_normalize=False,
                               return_metadata=False, return_tensors="np", **pending.kwargs)
    finally:
        del video_processor.patchify
    grids = np.asarray(made["video_grid_thw"], np.int64).reshape(-1, 3)
    return grids, _in_order(kept, grids, pending.patch, pending.temporal)


def _in_order(kept: list[np.ndarray], grids: np.ndarray, patch: int, temporal: int) -> list[np.ndarray]:
    """The videos' frames in video order: the processor patchifies videos grouped by shape."""
    by_shape: dict[tuple[int, ...], list[np.ndarray]] = {}
    for video in kept:
        by_shape.setdefault(video.shape, []).append(video)
    out = []
    for t, h, w in grids.tolist():
        waiting = by_shape.get((t * temporal, CHANNELS, h * patch, w * patch))
        if not waiting:
            raise ValueError(f"no resized video of {t * temporal} frames of {h * patch}x{w * patch}")
        out.append(waiting.pop(0))
    return out
