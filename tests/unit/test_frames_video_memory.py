"""A Qwen-VL video finished into its micro-batch's pixel values one temporal patch at a time: the
same values as the whole video made at once, with temporaries of a few frames beside the output.
Made whole, a video's float32 cast and its normalisation's temporaries took three times its pixel
values at the trainer's peak (331 MB beside a 110 MB micro-batch)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from msd_common.frames import CHANNELS, FrameRecipe, PendingPixels, _astype

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def _recipe(backend: str) -> FrameRecipe:
    return FrameRecipe("qwen_video", backend, True, 1 / 255, True, MEAN, STD, patch=14, merge=2, temporal=2)


def _video(frames: int, h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, frames * CHANNELS * h * w, dtype=np.uint8)


def _whole(recipe: FrameRecipe, flat: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
    """The video's values made at once, then patchified (Qwen-VL's processor's order)."""
    t, gh, gw = grid
    p, m, tp = recipe.patch, recipe.merge, recipe.temporal
    x = recipe._values(flat.reshape(t * tp, CHANNELS, gh * p, gw * p),
                       *recipe._constants(lambda v: np.array(v, np.float32)[:, None, None]), _astype)
    x = x.reshape(t, tp, CHANNELS, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * gh * gw, CHANNELS * tp * p * p)


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_two_videos_finished_by_temporal_patch_equal_each_video_made_whole(backend):
    recipe = _recipe(backend)
    grids = [(3, 4, 6), (2, 6, 2)]  # two videos of different sizes in one sample, then a second sample
    first = np.concatenate([_video(t * 2, gh * 14, gw * 14, i) for i, (t, gh, gw) in enumerate(grids)])
    second = _video(4 * 2, 2 * 14, 4 * 14, 9)
    out = PendingPixels([(first, recipe, np.array(grids)), (second, recipe, np.array([(4, 2, 4)]))]).finish()
    want = np.concatenate([_whole(recipe, first[:3 * 2 * 3 * 56 * 84], grids[0]),
                           _whole(recipe, first[3 * 2 * 3 * 56 * 84:], grids[1]),
                           _whole(recipe, second, (4, 2, 4))])
    assert out.dtype == np.float32 and out.shape == want.shape
    assert np.array_equal(out, want)


def _beside(t: int, gh: int, gw: int) -> tuple[int, int]:
    """Bytes traced at the peak of finishing one video, beyond its pixel values; and theirs."""
    parts = [(_video(t * 2, gh * 14, gw * 14, 1), _recipe("torchvision"), np.array([(t, gh, gw)]))]
    PendingPixels(parts).finish()  # warm
    tracemalloc.start()
    try:
        out = PendingPixels(parts).finish()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - out.nbytes, out.nbytes


def test_a_video_s_temporaries_stay_a_few_frames_whatever_its_length():
    short, _ = _beside(4, 16, 16)  # 8 frames of 224x224
    long, values = _beside(32, 16, 16)  # 64 frames: 37 MB of pixel values
    assert long <= short + 2**20, f"{long / 2**20:.1f} MB beside a long video, {short / 2**20:.1f} beside a short one"
    assert long < values / 4  # made whole: three times its pixel values
