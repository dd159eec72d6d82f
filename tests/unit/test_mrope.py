"""msd_common.mrope against the models' own get_rope_index (transformers' Qwen2.5-VL and Qwen3-VL
code, run on CPU without weights), on samples of text and images of assorted grids."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest

from msd_common.mrope import IMAGE, TEXT, mrope_position_ids

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
