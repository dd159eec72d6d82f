"""msd_common.mrope against the models' own get_rope_index (transformers' Qwen2.5-VL and Qwen3-VL
code, run on CPU without weights), on samples of text and images of assorted grids."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest

from msd_common.mrope import IMAGE, TEXT, VIDEO, mrope_position_ids

torch = pytest.importorskip("torch")


def _sample(rng: np.random.Generator, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Token types and grids: text runs with images between, as a chat template lays them out."""
    types, grids = [TEXT] * int(rng.integers(1, 20)), []
    for _ in range(int(rng.integers(0, 4))):
        t, h, w = 1, merge * int(rng.integers(1, 9)), merge * int(rng.integers(1, 9))
        grids.append((t, h, w))
        types += [IMAGE] * (t * h * w // merge ** 2) + [TEXT] * int(rng.integers(1, 12))
    return np.array(types), np.array(grids, dtype=np.int64).reshape(-1, 3)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_equal_to_the_models_get_rope_index(family):
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel as Model
    else:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel as Model
    merge = 2
    model = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge,
                                                                                 tokens_per_second=2)))
    model.get_vision_position_ids = functools.partial(Model.get_vision_position_ids, model)
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(60):
        types, grids = _sample(rng, merge)
        ids = torch.zeros((1, len(types)), dtype=torch.long)
        theirs, _ = Model.get_rope_index(model, ids, torch.from_numpy(types[None]).int(),
                                         image_grid_thw=torch.from_numpy(grids) if len(grids) else None)
        ours = mrope_position_ids(types, grids, merge)
        np.testing.assert_array_equal(ours, theirs[:, 0].numpy())
        checked += len(grids)
    assert checked > 50  # images of many grids were compared, not only text


def test_grids_that_disagree_with_the_tokens_are_refused():
    types = np.array([TEXT, IMAGE, IMAGE, IMAGE, IMAGE, TEXT])
    np.testing.assert_array_equal(mrope_position_ids(types, np.array([[1, 4, 4]]), 2),
                                  [[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]])
    with pytest.raises(ValueError, match="makes 9"):
        mrope_position_ids(types, np.array([[1, 6, 6]]), 2)
    with pytest.raises(ValueError, match="grids given"):
        mrope_position_ids(types, np.zeros((0, 3)), 2)
    with pytest.raises(ValueError, match="2 image grids"):
        mrope_position_ids(types, np.array([[1, 4, 4], [1, 2, 2]]), 2)


def _video_sample(rng: np.random.Generator, merge: int, split: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token types, image grids and video grids of text with images and videos between; `split`:
    each video's temporal patches as runs apart (Qwen3-VL's timestamps between them)."""
    types, images, videos = [TEXT] * int(rng.integers(1, 9)), [], []
    for _ in range(int(rng.integers(1, 4))):
        t, h, w = int(rng.integers(1, 6)), merge * int(rng.integers(1, 5)), merge * int(rng.integers(1, 5))
        if rng.random() < 0.3:
            images.append((1, h, w))
            types += [IMAGE] * (h * w // merge ** 2)
        else:
            videos.append((t, h, w))
            for _ in range(t if split else 1):
                types += [VIDEO] * ((1 if split else t) * h * w // merge ** 2) + ([TEXT] * 3 if split else [])
        types += [TEXT] * int(rng.integers(1, 6))
    return (np.array(types), np.array(images, np.int64).reshape(-1, 3), np.array(videos, np.int64).reshape(-1, 3))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_videos_equal_to_the_models_get_rope_index(family):
    """Qwen2.5-VL spaces a video's temporal patches by tokens_per_second x second_per_grid_ts (in
    float32); Qwen3-VL gives each temporal patch its own run of (1, h, w)."""
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel as Model
    else:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel as Model
    merge, tokens_per_second = 2, 2
    model = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(
        spatial_merge_size=merge, tokens_per_second=tokens_per_second)))
    model.get_vision_position_ids = functools.partial(Model.get_vision_position_ids, model)
    rng = np.random.default_rng(11)
    videos_seen = 0
    for _ in range(40):
        types, images, videos = _video_sample(rng, merge, split=family == "qwen3_vl")
        seconds = rng.choice([0.5, 1.0, 1.3333334, 2.0 / 3.0, 0.4], len(videos)).astype(np.float32)
        kwargs = {"image_grid_thw": torch.from_numpy(images) if len(images) else None,
                  "video_grid_thw": torch.from_numpy(videos.copy()) if len(videos) else None}
        if family == "qwen2_5_vl":
            kwargs["second_per_grid_ts"] = torch.from_numpy(seconds)
            runs, spacing = videos, np.float32(tokens_per_second) * seconds
        else:
            runs = np.repeat(videos, videos[:, 0], axis=0)
            runs[:, 0] = 1
            spacing = None
        theirs, _ = Model.get_rope_index(model, torch.zeros((1, len(types)), dtype=torch.long),
                                         torch.from_numpy(types[None]).int(), **kwargs)
        ours = mrope_position_ids(types, images, merge, runs, spacing)
        np.testing.assert_array_equal(ours, theirs[:, 0].numpy())
        videos_seen += len(videos)
    assert videos_seen > 40
