"""msd_common/frames.py's arithmetic on every byte value: the client's rescale and normalise of a
uint8 frame equal transformers' own numpy functions (the PIL backend: float64 rescale, then float32
normalise), whether the rescale runs as a float32 division (exact_divisor) or in float64."""

from __future__ import annotations

import numpy as np
import pytest

from msd_common.frames import FrameRecipe, exact_divisor

pytest.importorskip("transformers")


def _every_byte() -> np.ndarray:
    """A [3, 16, 16] frame: each channel holds every byte value once, in another order."""
    v = np.arange(256, dtype=np.uint8)
    return np.stack([v, v[::-1], np.roll(v, 85)]).reshape(3, 16, 16)


@pytest.mark.parametrize("rescale_factor", [1 / 255, 0.00392156862745098, 1 / 127.5, 0.0039, 2.0])
@pytest.mark.parametrize("normalize", [True, False])
def test_the_client_rescales_and_normalises_every_byte_as_transformers_does(rescale_factor, normalize):
    from transformers.image_transforms import normalize as hf_normalize
    from transformers.image_transforms import rescale as hf_rescale
    from transformers.image_utils import ChannelDimension

    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    frame = _every_byte()
    expected = hf_rescale(frame, rescale_factor, data_format=ChannelDimension.FIRST,
                          input_data_format=ChannelDimension.FIRST)
    if normalize:
        expected = hf_normalize(expected, mean, std, data_format=ChannelDimension.FIRST,
                                input_data_format=ChannelDimension.FIRST)
    recipe = FrameRecipe("frames", "pil", True, rescale_factor, normalize, mean, std, height=16, width=16)
    got = recipe.finish(frame.reshape(-1))[0]
    assert got.dtype == expected.dtype == np.float32
    np.testing.assert_array_equal(got, expected)
    torch = pytest.importorskip("torch")
    np.testing.assert_array_equal(recipe.finish_torch(torch.from_numpy(frame.reshape(-1)))[0].numpy(), expected)


def test_a_float32_division_serves_only_where_it_gives_every_byte_s_value():
    assert exact_divisor(0.00392156862745098) == 255.0  # the published 1/255 of every processor here
    assert exact_divisor(1 / 127.5) == 127.5
    assert exact_divisor(0.0039) is None  # no float32 divisor gives its 256 products: float64 as transformers
    assert exact_divisor(0.0) is None
